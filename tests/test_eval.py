"""Evaluation pieces on tiny models and tiny fixtures (CPU, fast; no data sets copied into the repo)."""
import gzip
import json

import pytest
import torch

import wide_compile as wc
from wide_compile.eval import baselines, report, tasks
from wide_compile.eval.perplexity import perplexity
from wide_compile.models import tiny_model
from wide_compile.routing import FlopCost


def _fixture_data(root):
    """A miniature copy of ../shared/data's layout (3 items per task, invented text)."""
    (root / "arc-easy").mkdir(parents=True)
    (root / "arc-challenge").mkdir()
    (root / "piqa").mkdir()
    (root / "hellaswag").mkdir()
    (root / "boolq").mkdir()
    arc = [{"id": f"q{i}", "question": {"stem": f"What is {i}?", "choices": [
        {"text": t, "label": l} for t, l in zip(["a", "b", "c", "d"], "ABCD" if i else "1234")]},
        "answerKey": "B" if i else "3"} for i in range(3)]
    for f in ("arc-easy/ARC-Easy-Test.jsonl", "arc-challenge/ARC-Challenge-Test.jsonl"):
        (root / f).write_text("\n".join(json.dumps(d) for d in arc) + "\n")
    (root / "piqa/valid.jsonl").write_text("\n".join(json.dumps({"goal": f"g{i}", "sol1": "x", "sol2": "y"})
                                                     for i in range(3)) + "\n")
    (root / "piqa/valid-labels.lst").write_text("0\n1\n1\n")
    with gzip.open(root / "hellaswag/hellaswag_val.reconstructed.jsonl.gz", "wt") as f:
        for i in range(3):
            f.write(json.dumps({"ind": i, "activity_label": "Cooking", "ctx_a": "A man [title] cooks.",
                                "ctx_b": "he", "ctx": "", "endings": ["e1", "e2 [x]", "e3", "e4"],
                                "label": str(i)}) + "\n")
    (root / "boolq/dev.jsonl").write_text("\n".join(json.dumps({"question": "is it", "title": "t",
                                                                "answer": bool(i % 2), "passage": "p"})
                                                    for i in range(3)) + "\n")
    return root


def test_task_docs_are_normalised(tmp_path):
    root = _fixture_data(tmp_path / "data")
    arc = tasks.load_task_docs("arc_easy", root)
    assert arc[0]["label"] == 2 and arc[1]["label"] == 1 and arc[0]["choices"] == ["a", "b", "c", "d"]
    assert [d["label"] for d in tasks.load_task_docs("piqa", root)] == [0, 1, 1]
    hs = tasks.load_task_docs("hellaswag", root)
    assert hs[0]["query"] == "Cooking: A man. cooks. He" and hs[0]["choices"][1] == "e2 " and hs[2]["label"] == 2
    assert [d["label"] for d in tasks.load_task_docs("boolq", root)] == [0, 1, 0]


def test_lm_eval_configs_parse_local_files(tmp_path):
    pytest.importorskip("lm_eval")
    root = _fixture_data(tmp_path / "data")
    counts = tasks.prepare_tasks(root, tmp_path / "tasks", limit=2)
    assert counts == {t: 2 for t in tasks.TASKS}
    td = tasks.build_task_dict(tmp_path / "tasks")
    names = set()

    def walk(d):
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v)
            else:
                names.add(getattr(k, "task_name", k) if not isinstance(k, str) else k)
                task = v
                docs = list(task.test_docs())
                assert len(docs) == 2
                assert isinstance(task.doc_to_text(docs[0]), str)
                ch = task.doc_to_choice(docs[0])
                assert len(ch) >= 2 and 0 <= task.doc_to_target(docs[0]) < len(ch)
    walk(td)
    assert {tasks.PREFIX + t for t in tasks.TASKS} <= {str(n) for n in names}
    # the folder can move: YAMLs are rewritten to the new place
    import shutil
    shutil.move(tmp_path / "tasks", tmp_path / "moved")
    tasks.write_yamls(tmp_path / "moved")
    assert str(tmp_path / "moved") in (tmp_path / "moved" / "wide_piqa.yaml").read_text()


def test_static_pruning_capacity_equals_target():
    model = tiny_model("smollm2", num_hidden_layers=3)
    cfg = wc.WideConfig(ffn_group_size=16, head_group_size=1, capacity=0.5)
    blocks = torch.randint(0, 128, (4, 32))
    for alloc in ("uniform", "global"):
        r = baselines.static_pruning(model, blocks, 0.5, cfg, allocation=alloc)
        wc.attach(model, r)
        cap = wc.measure_capacity(model, blocks)["overall"]
        wc.detach(model)
        cost = FlopCost.from_routers(r)
        one_group = max(cost.qo / cfg.num_head_groups(r.spec), cost.ffn / cfg.num_ffn_groups(r.spec))
        assert 0.5 - one_group / cost.dense_layer / r.spec.num_layers - 1e-9 <= cap <= 0.5 + 1e-9
    r = baselines.static_pruning(model, blocks, 0.5, cfg, allocation="best", log=lambda *_: None)
    assert r.allocation in ("uniform", "global")


def test_static_pruning_keeps_important_groups():
    model = tiny_model("llama")
    cfg = wc.WideConfig(ffn_group_size=32, capacity=0.7)
    with torch.no_grad():  # make FFN group 0 of layer 0 carry huge weights: it must survive
        model.model.layers[0].mlp.down_proj.weight[:, :32] *= 100
    scores = baselines.group_importance(model, torch.randint(0, 128, (2, 16)), cfg)
    m = baselines.select_groups(scores, cfg, wc.models.model_spec(model), 0.7, "global")
    assert m["ffn"][0][0]


def test_skipgpt_router_capacity_accounting():
    model = tiny_model("llama")
    cfg = baselines.skipgpt_config(model, 0.5)
    spec = wc.models.model_spec(model)
    assert cfg.num_head_groups(spec) == 1 and cfg.num_ffn_groups(spec) == 1
    r = wc.Routers.init(model, cfg)
    cost = FlopCost.from_routers(r)
    wc.attach(model, r)
    ids = torch.randint(0, 128, (2, 10))
    with wc.routing.record_masks(model) as rec:
        model(input_ids=ids)
    m = wc.measure_capacity(model, ids)
    # recompute by hand: every module on or off per token; K/V and routers always count
    exp = []
    for i in range(spec.num_layers):
        a = rec["attn"][i][0].float().mean()
        f = rec["ffn"][i][0].float().mean()
        exp.append((a * cost.qo + cost.kv + cost.router_attn[i] + f * cost.ffn + cost.router_ffn[i]) / cost.dense_layer)
    assert m["overall"] == pytest.approx(float(torch.stack(exp).mean()), abs=1e-6)
    # all skipped: only K/V + routers remain
    with torch.no_grad():
        for rr in list(r.attn) + list(r.ffn):
            rr.proj.bias.fill_(-100)
    m0 = wc.measure_capacity(model, ids)["overall"]
    assert m0 == pytest.approx((cost.kv + cost.router_attn[0] + cost.router_ffn[0]) / cost.dense_layer, abs=1e-6)
    wc.detach(model)


def test_perplexity_sliding_window_scores_each_token_once():
    model = tiny_model("llama")
    ids = torch.randint(0, 128, (300,))
    a = perplexity(model, ids=ids, ctx=64, stride=32, batch_size=3)
    assert a["tokens"] == 299
    full = perplexity(model, ids=ids, ctx=300, stride=300)
    assert full["tokens"] == 299
    # with routers attached, the capacity of the scored tokens is reported
    r = wc.Routers.init(model, wc.WideConfig(ffn_group_size=32))
    wc.attach(model, r)
    b = perplexity(model, ids=ids, ctx=64, stride=32)
    wc.detach(model)
    assert b["capacity"]["tokens"] == 299 and b["capacity"]["overall"] == pytest.approx(1.0, abs=0.02)


def test_capacity_meter_excludes_padding():
    from wide_compile.eval.capacity import capacity_meter
    model = tiny_model("llama")
    r = wc.Routers.init(model, wc.WideConfig(ffn_group_size=32, router_init="random"))
    wc.attach(model, r)
    ids = torch.randint(1, 128, (2, 12))
    ref = wc.measure_capacity(model, ids)["overall"]
    padded = torch.cat([ids, torch.zeros(2, 5, dtype=torch.long)], 1)
    with capacity_meter(model) as c:
        model(input_ids=padded)
    wc.detach(model)
    assert c["tokens"] == 24 and c["overall"] == pytest.approx(ref, abs=1e-5)


def test_router_stats_and_report(tmp_path):
    model = tiny_model("llama")
    r = wc.Routers.init(model, wc.WideConfig(ffn_group_size=32, router_init="random"))

    class Tok:
        def convert_ids_to_tokens(self, t):
            return ["Ġthe", "Ġcat", "ing", "Ġ,"][t % 4]

    st = report.router_stats(model, Tok(), r, torch.randint(0, 128, (2, 16)))
    assert set(st["by_kind"]) <= {"function", "content", "other"} and len(st["attn_skip_per_layer"]) == 2
    assert 0 <= st["skipped_flops_attn_share"] <= 1
    recs = [{"method": "dense", "stage": 0, "capacity_target": 1.0, "capacity_measured": 1.0, "wikitext2_ppl": 10.0,
             "tasks": {t: {"acc": 0.6, "acc_norm": 0.6} for t in tasks.TASKS}},
            {"method": "wide", "stage": 1, "capacity_target": 0.5, "capacity_measured": 0.5, "wikitext2_ppl": 12.0,
             "tasks": {t: {"acc": 0.54, "acc_norm": 0.5} for t in tasks.TASKS}}]
    md = report.markdown_table(recs)
    assert "| wide | 1 | 0.50 |" in md and recs[1]["retention_acc"] == pytest.approx(0.9)
    res = tmp_path / "r.json"
    res.write_text(json.dumps({"records": recs, "router_stats": {"wide c50": st}}))
    report.write_report(res, tmp_path / "t.md", tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_merge_runs_keeps_first_record_and_lists_repeats():
    def rec(method, stage, cap, acc, **kw):
        return {"method": method, "stage": stage, "capacity_target": cap, "capacity_measured": cap,
                "wikitext2_ppl": 10.0, "tasks": {t: {"acc": acc, "acc_norm": acc} for t in tasks.TASKS}, **kw}

    run1 = {"command": "run one", "date": "d1", "gpu": "g", "records": [rec("dense", 0, 1.0, 0.6),
                                                                        rec("wide", 1, 0.5, 0.54)]}
    run2 = {"command": "run two", "date": "d2", "records": [rec("dense", 0, 1.0, 0.61), rec("wide", 1, 0.7, 0.57),
                                                            rec("wide", 2, 0.7, 0.58, variant="joint routers")],
            "router_stats": {"wide c70": {"x": 1}}}
    m = report.merge_runs([run1, run2])
    keys = [report.record_key(r) for r in m["records"]]
    assert keys == [("dense", 0, 1.0, ""), ("wide", 1, 0.5, ""), ("wide", 1, 0.7, ""), ("wide", 2, 0.7, "joint routers")]
    assert [r["command"] for r in m["records"]] == ["run one", "run one", "run two", "run two"]
    assert m["records"][0]["tasks"]["piqa"]["acc"] == 0.6  # the first dense record is kept
    assert len(m["repeats"]) == 1 and m["repeats"][0]["avg_acc"] == pytest.approx(0.61)
    assert m["records"][2]["retention_acc"] == pytest.approx(0.57 / 0.6)  # against the kept dense
    assert m["router_stats"] == {"wide c70": {"x": 1}} and [r["command"] for r in m["runs"]] == ["run one", "run two"]
    with pytest.raises(ValueError):
        report.merge_runs([])
    # merging into an already merged file keeps its runs and repeats (seen: its runs were lost)
    run3 = {"command": "run three", "date": "d3", "records": [rec("dense", 0, 1.0, 0.62), rec("static", 1, 0.5, 0.4)]}
    m2 = report.merge_runs([m, run3])
    assert [r["command"] for r in m2["runs"]] == ["run one", "run two", "run three"]
    assert [r["run"] for r in m2["repeats"]] == [1, 2]
    assert [r["command"] for r in m2["records"]] == ["run one", "run one", "run two", "run two", "run three"]


def test_token_kinds():
    class Tok:
        def convert_ids_to_tokens(self, t):
            return ["Ġthe", "ĠCat", "ing", "Ġ42", "Ġof"][t]
    k = report.token_kinds(Tok(), torch.tensor([0, 1, 2, 3, 4]))
    assert k.tolist() == [0, 1, 2, 2, 0]


def test_shipped_smollm2_routers_load():
    from wide_compile.models import ModelSpec
    from wide_compile.pretrained import lora_path
    names = wc.Routers.available()
    assert "smollm2-135m-c50" in names and not any(n.endswith(".lora") for n in names)
    spec = ModelSpec(num_layers=30, hidden_size=576, intermediate_size=1536, num_heads=9, num_kv_heads=3, head_dim=64)
    r = wc.Routers.pretrained("smollm2-135m-c50", spec)
    assert r.name == "smollm2-135m-c50" and len(r.attn) == 30 and r.cfg.capacity == 0.5
    assert lora_path("smollm2-135m-c50") is not None and lora_path("nope") is None
    with pytest.raises(ValueError):
        wc.Routers.pretrained("smollm2-135m-c50.lora", spec)


# -- the whole study (`wide eval pipeline`) on a tiny model: its order, records, skips and files ------
def _pipeline_on_tiny(tmp_path, monkeypatch, *args):
    import numpy as np

    import wide_compile.models as models
    from wide_compile.eval import pipeline
    from wide_compile.eval import perplexity as ppl_mod

    model = tiny_model("smollm2", seed=0)
    V = model.config.vocab_size
    ids = torch.randint(1, V, (1, 96), generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(models, "load_smollm2", lambda **kw: (model, None))
    # the real sliding-window ppl and a forward per "task", on fixed random ids (no tokenizer, no lm-eval run)
    monkeypatch.setattr(ppl_mod, "wikitext2_ppl", lambda m, tok, root, **kw: perplexity(
        m, ids=ids, ctx=kw["ctx"] // 4, stride=kw["stride"] // 4))

    def fake_tasks(m, tok, tasks_dir, batch_size):
        with torch.no_grad():
            m(input_ids=ids[:, :16])
        return {t: {"acc": 0.5, "acc_norm": 0.5, "n": 2} for t in tasks.TASKS}

    monkeypatch.setattr(tasks, "evaluate_tasks", fake_tasks)
    np.save(tmp_path / "tok.npy", np.random.default_rng(0).integers(0, V, 8000))
    root = _fixture_data(tmp_path / "data")
    (root / "wikitext-2").mkdir()
    (root / "wikitext-2" / "wiki.test.raw").write_text(" = Title = \n some text \n")  # checked, not read
    out = tmp_path / "out"
    torch.manual_seed(0)
    assert pipeline.main(["--data", str(root), "--out", str(out), "--tokens", str(tmp_path / "tok.npy"),
                          "--device", "cpu", "--smoke", "--methods", "wide,static", *args]) == 0
    return out, json.loads((out / "accuracy-smollm2.json").read_text())


def test_pipeline_runs_each_item_in_order_and_writes_its_files(tmp_path, monkeypatch):
    import tarfile

    out, res = _pipeline_on_tiny(tmp_path, monkeypatch, "--capacities", "0.5", "--joint")
    got = [(r["method"], r["stage"], r.get("variant")) for r in res["records"]]
    assert got == [("dense", 0, None), ("wide", 1, None), ("static", 1, None), ("wide", 2, None),
                   ("static", 2, None), ("wide", 2, "joint routers")]
    for r in res["records"][1:]:
        assert r["capacity_target"] == 0.5 and 0.0 < r["capacity_measured"] <= 1.0
        assert 0.0 < r["capacity_heldout"] <= 1.0 and r["wikitext2_ppl"] > 1.0
    assert res["records"][0]["capacity_measured"] == 1.0 and "wide c50 stage 1" in res["router_stats"]
    assert "skipped" not in res and res["protocol"]["tasks"]["counts"] == {t: 3 for t in tasks.TASKS}
    with tarfile.open(out / "artifacts.tar") as tf:  # routers, and only WIDE's LoRAs
        names = set(tf.getnames())
    assert {"wide-c50-s1.safetensors", "static-c50-s1.safetensors", "wide-c50-s2.lora.safetensors",
            "wide-c50-s2joint.safetensors", "wide-c50-s2joint.lora.safetensors"} == names
    assert "| wide |" in (out / "table.md").read_text() and "RECORD wide s2" in (out / "pipeline.log").read_text()


def test_pipeline_skips_what_the_deadline_leaves_no_time_for(tmp_path, monkeypatch):
    _, res = _pipeline_on_tiny(tmp_path, monkeypatch, "--capacities", "0.5,0.7", "--deadline", "0.001",
                               "--static-at-wide-capacity")
    assert [r["method"] for r in res["records"]] == ["dense"]
    assert res["skipped"] == ["wide-c50-s1", "static-c50-s1", "wide-c70-s1", "static-c70-s1"]
