"""The end-to-end benchmark harness (benchmarks/bench_e2e.py) runs on the CPU in --smoke mode and writes
a records file with the keys the issue asks for. CPU speed numbers are not asserted."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

REQUIRED = ["model", "phase", "tokens", "batch", "capacity", "masks", "dense_inductor_ms", "static_ms", "wide_ms",
            "speedup", "eager_dense_ms", "wide_eager_ms", "peak_mem_mb", "compile_s"]

_FAKE = "wide_smoke_fake"


def _register_fake_backend():
    """A stand-in for backend="wide": runs the traced graph as is (the routers' hooks are traced, so this
    is the WIDE eager semantics), so the harness plumbing is exercised without Inductor's CPU compile."""
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if _FAKE not in _BACKENDS:
        @register_backend(name=_FAKE)
        def _fake(gm, example_inputs):  # noqa: ARG001
            return gm.forward


def test_smoke_records(tmp_path):
    import bench_e2e

    _register_fake_backend()
    data = bench_e2e.main(["--smoke", "--out", str(tmp_path), "--wide-backend", _FAKE, "--prefill-batch", "1"])
    path = tmp_path / "e2e-smoke.json"
    assert path.is_file() and (tmp_path / "e2e-smoke.md").is_file() and (tmp_path / "e2e-smoke.png").is_file()
    on_disk = json.loads(path.read_text())
    assert on_disk["records"] == json.loads(json.dumps(data["records"]))
    for k in ("gpu", "torch", "triton", "transformers", "date", "command"):
        assert k in on_disk
    recs = on_disk["records"]
    # tiny: prefill 16x1 + decode 16x1, capacities 1.0 and 0.5, random + correlated masks
    assert {(r["phase"], r["capacity"], r["masks"]) for r in recs} == {
        (p, c, m) for p in ("prefill", "decode") for c in (1.0, 0.5) for m in ("random", "correlated")}
    for r in recs:
        for k in REQUIRED:
            assert k in r, (k, r)
        assert r["model"] == "tiny" and r["tokens"] == 16 and r["batch"] == 1
        assert r["command"] == on_disk["command"] and r["date"] == on_disk["date"]  # each row names its run
        assert r["dense_inductor_ms"] and r["wide_ms"] and r["wide_eager_ms"] and r["eager_dense_ms"], r
        # ratios are stored rounded to 4 decimals: a CPU ratio far below 1 needs the absolute slack
        assert r["speedup"] == pytest.approx(r["dense_inductor_ms"] / r["wide_ms"], rel=1e-3, abs=5e-5)
        fastest = min(r[k] for k in ("eager_dense_ms", "dense_inductor_ms") if r[k])
        assert r["speedup_vs_best_dense"] == pytest.approx(fastest / r["wide_ms"], rel=1e-3, abs=5e-5)
        assert r["static_ms"], r
        assert r["measured_capacity"] == pytest.approx(r["capacity"], abs=0.12)
        assert r["wide_check"]["logits_rel_err"] < 1e-4, r["wide_check"]  # fake backend == eager reference
        assert "jitter_floor_rel_err" in r["wide_check"], r["wide_check"]  # the comparison's noise floor
    half = [r for r in recs if r["capacity"] == 0.5]
    assert all(r["static_capacity"] == pytest.approx(0.5, abs=0.03) for r in half)
    assert any(r.get("mask_model") for r in half if r["masks"] == "correlated")


def test_structured_masks_run_on_free_mask_ops_and_bucket_ops(tmp_path):
    """--masks codebookP / nestedL: routers of that structure, calibrated to the capacity, compiled by the real
    wide backend: `wide` on the free-mask ops (the default), `wide_bucket_ops` on the bucketed ops (the record's path
    columns say so)."""
    import bench_e2e

    data = bench_e2e.main(["--smoke", "--out", str(tmp_path), "--phases", "prefill", "--capacities", "0.5",
                           "--prefill-batch", "1",  # one Inductor compile per structure (batch 2: test_replay_check)
                           "--masks", "codebook4", "nested3", "--variants", "inductor", "wide", "wide_bucket_ops",
                           "--no-plot"])
    assert len(data["records"]) == 2
    recs = {r["masks"]: r for r in data["records"]}
    assert set(recs) == {"codebook4", "nested3"}
    for r in recs.values():
        assert r["wide_ms"] and r["wide_bucket_ops_ms"], r
        assert r["measured_capacity"] == pytest.approx(0.5, abs=0.12), r
        assert "bucket" not in r["wide_paths"], r["wide_paths"]
        assert "mlp bucket" in r["wide_bucket_ops_paths"], r["wide_bucket_ops_paths"]


def test_skips_missing_backend(tmp_path):
    import bench_e2e

    data = bench_e2e.main(["--smoke", "--out", str(tmp_path), "--wide-backend", "no_such_backend_xyz",
                           "--phases", "prefill", "--prefill-batch", "1", "--capacities", "0.5", "--masks", "random",
                           "--variants", "inductor", "wide", "wide_eager", "--no-plot"])
    (r,) = data["records"]
    assert r["wide_ms"] is None and r["speedup"] is None
    assert "no_such_backend_xyz" in r["skipped"]["wide"]
    assert r["wide_eager_ms"] and r["dense_inductor_ms"]


def test_static_shape_capacity():
    from e2e.models import SHAPES, static_shape

    for name in ("llama-3.1-8b", "llama-3.2-3b", "smollm2-135m"):
        f = SHAPES[name]
        for cap in (0.75, 0.5, 0.3):
            st = static_shape(f["hidden_size"], f["intermediate_size"], f["num_attention_heads"],
                              f["num_key_value_heads"], f["head_dim"], cap)
            assert st.num_heads % f["num_key_value_heads"] == 0
            assert abs(st.capacity - cap) < 0.02, (name, cap, st)


def test_time_budget_stops(tmp_path):
    import bench_e2e

    data = bench_e2e.main(["--smoke", "--out", str(tmp_path), "--time-budget-s", "0", "--no-plot"])
    assert data["records"] == []
    assert any("budget" in s for s in data["skipped"])


def test_profile_mode(tmp_path):
    import bench_e2e

    _register_fake_backend()
    data = bench_e2e.main(["--smoke", "--out", str(tmp_path), "--wide-backend", _FAKE, "--phases", "prefill",
                           "--prefill-batch", "1", "--capacities", "0.5", "--masks", "random", "--variants",
                           "wide", "--profile", "--profile-steps", "1", "--no-plot"])
    (r,) = data["records"]
    assert set(r["profile"]) == {"wide"}
    assert "gemm" in r["profile"]["wide"]
    text = (tmp_path / "e2e-smoke-profile.txt").read_text()
    assert "--- wide ---" in text and "by category" in text


def test_smoke_bf16_routers(tmp_path):
    """--router-dtype model: the routers are cast to the model dtype and the records say so."""
    import bench_e2e

    _register_fake_backend()
    data = bench_e2e.main(["--smoke", "--out", str(tmp_path), "--wide-backend", _FAKE, "--prefill-batch", "1",
                           "--phases", "prefill", "--capacities", "0.5", "--masks", "random",
                           "--router-dtype", "model"])
    recs = data["records"]
    assert recs and all(r["router_dtype"] == "model" for r in recs)
    assert all(r["wide_ms"] and r["measured_capacity"] for r in recs), recs


def test_attention_option(tmp_path):
    """--attention sdpa_unpadded: every variant's model runs it, the records say so, and plot_e2e keeps such a
    row beside the default run's row of the same workload (never replaces it); the goals and the by-capacity
    table read the default rows only."""
    import bench_e2e
    import plot_e2e
    from e2e import models as MD
    from e2e import report as R

    _register_fake_backend()
    args = ["--smoke", "--wide-backend", _FAKE, "--prefill-batch", "1", "--phases", "prefill", "--capacities", "0.5",
            "--masks", "random"]
    unp = bench_e2e.main(args + ["--out", str(tmp_path / "u"), "--attention", "sdpa_unpadded"])
    assert MD.ATTENTION == "sdpa_unpadded"
    assert unp["records"] and all(r["attention"] == "sdpa_unpadded" and r["wide_ms"] for r in unp["records"])
    std = bench_e2e.main(args + ["--out", str(tmp_path / "s")])
    assert MD.ATTENTION == "sdpa" and all(r["attention"] == "sdpa" for r in std["records"])
    plot_e2e.main([str(tmp_path / "s" / "e2e-smoke.json"), str(tmp_path / "u" / "e2e-smoke.json"),
                   "--out", str(tmp_path / "m")])
    merged = json.loads((tmp_path / "m.json").read_text())["records"]
    assert sorted(r["attention"] for r in merged) == ["sdpa", "sdpa_unpadded"]
    assert "tiny (attention sdpa_unpadded)" in (tmp_path / "m.md").read_text()
    assert len(R.capacity_table(merged, layers=merged[0]["layers"])) == 3  # header, rule, the default row


def test_kernel_config_option(tmp_path):
    """--kernel-config reaches every WIDE model the run compiles as the backend's kernel_config (nothing
    process-wide changes) and every record says so; a malformed value is refused before anything runs."""
    import bench_e2e
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    seen = []
    name = "wide_smoke_fake_kc"
    if name not in _BACKENDS:
        @register_backend(name=name)
        def _fake_kc(gm, example_inputs, **kw):  # noqa: ARG001
            seen.append(kw.get("options", {}).get("kernel_config"))
            return gm.forward
    data = bench_e2e.main(["--smoke", "--out", str(tmp_path), "--wide-backend", name, "--phases", "decode",
                           "--decode-batch", "1", "--capacities", "0.5", "--masks", "random", "--variants",
                           "wide", "--no-plot", "--kernel-config", '{"decode": {"lists": "none"}}'])
    assert data["records"] and all(r["kernel_config"] == '{"decode": {"lists": "none"}}' for r in data["records"])
    assert seen and all(kc == {"decode": {"lists": "none"}} for kc in seen)
    with pytest.raises(SystemExit):
        bench_e2e.main(["--smoke", "--out", str(tmp_path), "--kernel-config", '{"decode_x": {}}'])


def test_correlated_capacities_option(tmp_path, capsys):
    """--correlated-capacities: random masks at every capacity, the other kinds only at the listed ones; a
    --resume of the same command finds every row done and compiles nothing (the resume check expects the
    same mask kinds per capacity as the run, or it would re-compile finished workloads)."""
    import bench_e2e

    _register_fake_backend()
    argv = ["--smoke", "--out", str(tmp_path), "--wide-backend", _FAKE, "--phases", "prefill",
            "--prefill-batch", "1", "--capacities", "0.75", "0.5", "--variants", "inductor", "wide", "--no-plot",
            "--correlated-capacities", "0.5"]
    data = bench_e2e.main(argv)
    assert {(r["capacity"], r["masks"]) for r in data["records"]} == {
        (0.75, "random"), (0.5, "random"), (0.5, "correlated")}
    capsys.readouterr()
    again = bench_e2e.main(argv + ["--resume", "--name", "e2e-smoke"])
    log = capsys.readouterr().out
    assert "all rows done (resume)" in log and "ready " not in log, log
    assert again["records"] == json.loads(json.dumps(data["records"]))


def test_plot_separates_depths(tmp_path):
    """Rows of one model at different depths (the 32-layer goal rows, the 4-layer table) get their own panels."""
    from e2e import report as R

    base = {"model": "llama-3.1-8b", "phase": "decode", "tokens": 1024, "batch": 1, "masks": "random"}
    recs = [dict(base, layers=L, capacity=c, speedup=s, static_speedup=s + 0.2)
            for L, c, s in ((32, 0.5, 1.19), (4, 0.5, 1.15), (4, 1.0, 0.92))]
    assert R.plot_panels(recs) == [("llama-3.1-8b", 32, "decode"), ("llama-3.1-8b", 4, "decode")]
    assert R.plot({"records": recs}, tmp_path / "p.png").is_file()


def test_missing_cells_and_merge(tmp_path):
    """plot_e2e's merge keeps each run's rows, drops time-budget skips (a later run may have filled them) and
    lists the table cells still owed."""
    import plot_e2e
    from e2e import report as R

    base = {"model": "m", "layers": 4, "phase": "decode", "tokens": 1024, "batch": 1, "masks": "random",
            "speedup": 1.0, "static_speedup": 1.2, "dense_inductor_ms": 1.0, "static_ms": 0.8}
    recs = [dict(base, capacity=c, wide_ms=1.0) for c in (1.0, 0.75, 0.5)] + [dict(base, capacity=0.3, wide_ms=None)]
    miss = R.missing_cells(recs, "m", 4)
    assert len(miss) == 10 * 4 - 3 and "m (4 layers) decode 1024x1 cap 0.3" in miss
    assert "m (4 layers) decode 1024x1 cap 0.5" not in miss
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"records": recs[:2], "command": "run a", "date": "d1",
                             "skipped": ["m decode 1024x1 cap 0.5+: time budget (5s) exceeded", "trt: not installed"]}))
    b.write_text(json.dumps({"records": recs[2:], "command": "run b", "date": "d2", "skipped": []}))
    plot_e2e.main([str(a), str(b), "--out", str(tmp_path / "m"), "--table", "m:4"])
    out = json.loads((tmp_path / "m.json").read_text())
    assert out["skipped"] == ["trt: not installed"] and out["missing"] == miss
    assert {r["command"] for r in out["records"]} == {"run a", "run b"}
    md = (tmp_path / "m.md").read_text()
    assert "Not measured yet (37 cells" in md and "time budget" not in md
    # a model timed at its routers' capacity only (SmolLM2): MODEL:LAYERS:CAPS
    plot_e2e.main([str(a), str(b), "--out", str(tmp_path / "m2"), "--table", "m:4:0.5,0.3"])
    assert json.loads((tmp_path / "m2.json").read_text())["missing"] == R.missing_cells(recs, "m", 4, (0.5, 0.3))
    assert len(R.missing_cells(recs, "m", 4, (0.5, 0.3))) == 2 * 10 - 1
    with pytest.raises(SystemExit, match="MODEL:LAYERS"):
        plot_e2e.main([str(a), "--out", str(tmp_path / "m3"), "--table", "m"])


def test_speedup_vs_best_dense(tmp_path):
    """WIDE is also compared with the fastest dense variant timed in the same run (eager can beat Inductor
    at long prefill); variants that were not timed (None) are ignored; the merge fills the field
    for older records and the table shows it."""
    import plot_e2e
    from e2e import report as R

    r = {"eager_dense_ms": 30.0, "dense_inductor_ms": 36.0, "dense_max_autotune_ms": None, "wide_ms": 34.0}
    assert R.best_dense(r) == ("eager_dense", 30.0, pytest.approx(30 / 34, rel=1e-3))
    assert R.best_dense({"dense_inductor_ms": 2.0, "dense_inductor_cg_ms": 1.0, "wide_ms": None}) == \
        ("dense_inductor_cg", 1.0, None)
    assert R.best_dense({"wide_ms": 1.0}) == (None, None, None)
    base = {"model": "m", "layers": 4, "phase": "prefill", "tokens": 8192, "batch": 1, "masks": "random",
            "capacity": 0.5, "static_ms": 20.0, "speedup": 36 / 34}
    a = tmp_path / "a.json"
    a.write_text(json.dumps({"records": [dict(base, **r)], "command": "c", "date": "d"}))
    plot_e2e.main([str(a), str(a), "--out", str(tmp_path / "m")])
    rec = json.loads((tmp_path / "m.json").read_text())["records"][0]
    assert rec["best_dense"] == "eager_dense" and rec["speedup_vs_best_dense"] == pytest.approx(0.8824, abs=1e-4)
    md = (tmp_path / "m.md").read_text()
    assert "speedup vs fastest dense" in md and "| 0.88 |" in md


def test_text_ids_rows_differ(tmp_path):
    """The real model's prompts: each batch row is its own piece of the text (identical rows would share
    their masks and flatter WIDE at batch > 1), read from --text-file."""
    from e2e.text import text_ids

    class Tok:  # one id per character
        def __call__(self, text, return_tensors=None):
            import torch

            return {"input_ids": torch.tensor([[ord(c) % 97 for c in text]])}

    f = tmp_path / "t.txt"
    f.write_text("".join(chr(33 + i % 90) for i in range(500)))
    ids = text_ids(Tok(), 64, batch=4, text_file=str(f))
    assert ids.shape == (4, 64)
    assert len({tuple(r.tolist()) for r in ids}) == 4
    assert ids[1, 0].item() == (33 + 64 % 90) % 97  # row 1 continues where row 0 ended
    long = text_ids(Tok(), 300, batch=2, text_file=str(f))  # longer than the text: wraps around
    assert long.shape == (2, 300) and not (long[0] == long[1]).all()


_BROKEN = "wide_smoke_broken"


def test_replay_check(tmp_path):
    """--check-replay compares the compiled WIDE model with its eager reference on replayed masks: exact for a
    backend that runs the traced graph as is, and it fails for one whose output is wrong (logits scaled)."""
    import bench_e2e
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    _register_fake_backend()
    if _BROKEN not in _BACKENDS:
        @register_backend(name=_BROKEN)
        def _broken(gm, example_inputs):  # noqa: ARG001
            def run(*args):
                out = gm.forward(*args)
                if isinstance(out, (tuple, list)):  # the logits are the floating outputs of the traced graph
                    return type(out)(o * 1.5 if hasattr(o, "is_floating_point") and o.is_floating_point() else o
                                     for o in out)
                return out * 1.5
            return run

    common = ["--smoke", "--capacities", "0.5", "--masks", "random", "--prefill-batch", "2",
              "--variants", "inductor", "wide", "--check-replay", "--no-plot"]
    good = bench_e2e.main(common + ["--out", str(tmp_path / "good"), "--wide-backend", _FAKE])["records"]
    assert {r["phase"] for r in good} == {"prefill", "decode"}
    for r in good:
        rc = r["wide_replay_check"]
        assert rc["ok"] and rc["logits_rel_err"] < 1e-6 and rc["argmax_agree"] == 1.0, r
    bad = bench_e2e.main(common + ["--out", str(tmp_path / "bad"), "--wide-backend", _BROKEN])["records"]
    for r in bad:
        assert not r["wide_replay_check"]["ok"] and r["wide_replay_check"]["logits_rel_err"] > 0.1, r


def test_sdpa_causal_check():
    """benchmarks/sdpa_causal_check.py sees every SDPA call of the eager and the traced model (eager, as
    transformers calls it, passes is_causal=True and no mask)."""
    import sdpa_causal_check

    out = sdpa_causal_check.main(["--tokens", "16"])
    assert len(out["eager"]) == len(out["traced"]) == 2  # the tiny Llama's two layers
    assert all(c == {"mask": False, "is_causal": True} for c in out["eager"])
    assert all(set(c) == {"mask", "is_causal"} for c in out["traced"])
    # bench_e2e --attention sdpa_unpadded: the traced prefill calls SDPA as eager does
    out = sdpa_causal_check.main(["--tokens", "16", "--attention", "sdpa_unpadded"])
    assert out["attention"] == "sdpa_unpadded" and len(out["traced"]) == 2
    assert all(c == {"mask": False, "is_causal": True} for c in out["eager"] + out["traced"])


def test_sdpa_unpadded_attention_matches_sdpa_and_is_rewritten():
    """e2e/attention.py's sdpa_unpadded: the same logits as transformers' SDPA in prefill (causal kernel, no
    mask) and in decode against a static cache (mask kept: keys outnumber queries), and the WIDE pass still
    finds and rewrites the attention (compiled == eager WIDE reference)."""
    import torch
    import wide_compile as wc
    from e2e.attention import use
    from transformers import StaticCache
    from wide_compile.models import tiny_model

    from test_passes_models import CFG

    base, unp = tiny_model("llama", seed=4), tiny_model("llama", seed=4)
    unp.config._attn_implementation = use("sdpa_unpadded")
    ids = torch.randint(0, 128, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(unp(input_ids=ids, use_cache=False).logits,
                                   base(input_ids=ids, use_cache=False).logits, atol=1e-6, rtol=1e-6)
        outs = []
        for m in (base, unp):
            cache = StaticCache(config=m.config, max_cache_len=16)
            m(input_ids=ids, past_key_values=cache, use_cache=True)
            outs.append(m(input_ids=ids[:, :1], past_key_values=cache, use_cache=True).logits)
        torch.testing.assert_close(outs[1], outs[0], atol=1e-6, rtol=1e-6)
    routers = wc.Routers.init(unp, CFG, seed=3)
    ref = tiny_model("llama", seed=4)
    ref.config._attn_implementation = "sdpa_unpadded"
    wc.attach(ref, routers)
    cm = wc.optimize(unp, routers, inductor=False)
    with torch.no_grad():
        torch.testing.assert_close(cm(input_ids=ids, use_cache=False).logits,
                                   ref(input_ids=ids, use_cache=False).logits, atol=1e-5, rtol=1e-5)
    assert all(r["attn"]["status"] == "rewritten" for r in wc.explain(cm).layers)
    with pytest.raises(ValueError, match="expected one of"):
        use("flash")
    # a sliding-window mask is kept even when queries and keys have the same length (Mistral passes the window)
    from e2e.attention import sdpa_unpadded_attention

    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    band = torch.ones(6, 6, dtype=torch.bool).tril() & ~torch.ones(6, 6, dtype=torch.bool).tril(-3)
    mod = torch.nn.Module()
    out, _ = sdpa_unpadded_attention(mod, q, k, v, band[None, None], sliding_window=3)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=band[None, None])
    torch.testing.assert_close(out, want.transpose(1, 2), atol=1e-6, rtol=1e-6)
    out, _ = sdpa_unpadded_attention(mod, q, k, v, band[None, None])  # no window: the causal kernel
    causal = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, causal.transpose(1, 2), atol=1e-6, rtol=1e-6)


def test_capacity_table_is_ratios_of_records():
    """The README's by-capacity table: each cell is dense_inductor_ms / wide_ms (or static_ms) of one record,
    a capacity that was not timed shows "–", other depths and mask kinds stay out, prefill rows come first."""
    from e2e import report as R

    base = {"model": "m", "layers": 4, "masks": "random", "batch": 1}
    recs = [dict(base, phase="decode", tokens=1024, capacity=0.5, dense_inductor_ms=2.0, wide_ms=1.6, static_ms=1.0),
            dict(base, phase="decode", tokens=1024, capacity=1.0, dense_inductor_ms=2.2, wide_ms=2.75, static_ms=None),
            dict(base, phase="prefill", tokens=512, capacity=0.3, dense_inductor_ms=3.0, wide_ms=2.0, static_ms=1.5),
            dict(base, phase="prefill", tokens=512, capacity=0.5, layers=32, dense_inductor_ms=9.0, wide_ms=1.0),
            dict(base, phase="prefill", tokens=512, capacity=0.5, masks="correlated", dense_inductor_ms=9.0,
                 wide_ms=1.0)]
    rows = R.capacity_table(recs)
    assert rows[0].startswith("| model | workload | dense Inductor | WIDE 1.0 | 0.75 | 0.5 | 0.3 | static 0.75")
    assert rows[2] == "| m | prefill 512×1 | 3.00 ms | – | – | – | 1.50× | – | – | 2.00× |"
    assert rows[3] == "| m | decode ctx 1024×1 | 2.00 ms | 0.80× | – | 1.25× | – | – | 2.00× | – |"
    assert len(rows) == 4 and R.capacity_table(recs, masks="trained") == []
    assert "by capacity" in R.markdown({"records": recs})


def test_options_match_the_parser():
    """BenchOptions' fields are argparse's dests with the same defaults (records store them as "options"),
    the presets resolve as documented, and the variant registry names each record field prefix once."""
    import dataclasses

    from e2e.options import BenchOptions, build_parser, parse_options
    from e2e.variants import VARIANTS

    ns = build_parser().parse_args([])
    fields = {f.name: f for f in dataclasses.fields(BenchOptions)}
    assert list(vars(ns)) == list(fields)
    assert vars(ns) == dataclasses.asdict(BenchOptions())
    o = parse_options(["--smoke"])
    assert (o.models, o.device, o.dtype, o.prefill_tokens, o.capacities, o.name) == \
        (["tiny"], "cpu", "fp32", [16], [1.0, 0.5], "e2e-smoke")
    q = parse_options(["--quick", "--device", "cpu"])
    assert q.layers == 8 and q.time_budget_s == 240.0 and "max_autotune" not in q.variants
    full = parse_options(["--device", "cpu"])
    assert full.variants == [v for v in VARIANTS if v not in ("wide_table", "wide_dense_masked", "wide_fused",
                                                               "wide_fused_prefill",
                                                               "wide_fused_dense",
                                                               "wide_gemm_routers", "wide_router_select", "wide_gate_up",
                                                               "wide_lean_prefill", "wide_qkv_split",
                                                               "wide_pair_routers", "wide_fp32_routers",
                                                               "wide_router_own_gemm", "wide_sparse_attn",
                                                               "wide_bucket_ops")]
    assert full.capacities == [1.0, 0.75, 0.5, 0.3]
    assert list(VARIANTS) == ["eager", "inductor", "max_autotune", "inductor_cg", "static", "wide", "wide_table",
                              "wide_dense_masked", "wide_fused", "wide_fused_prefill", "wide_fused_dense", "wide_gemm_routers", "wide_qkv_split", "wide_pair_routers",
                              "wide_fp32_routers", "wide_router_select", "wide_gate_up", "wide_lean_prefill",
                              "wide_router_own_gemm", "wide_sparse_attn", "wide_bucket_ops",
                              "wide_eager",
                              "trt"]
    assert len({s.key for s in VARIANTS.values()}) == len(VARIANTS)


@pytest.mark.parametrize("argv, words", [
    (["--capacities", "0"], "--capacities"),
    (["--capacities", "1.5"], "(0, 1]"),
    (["--models", "llama-9b"], "unknown"),
    (["--prefill-tokens", "0"], "positive"),
    (["--rounds", "0"], "--rounds"),
    (["--warmup", "-1"], "--warmup"),
    (["--target-s", "0"], "--target-s"),
    (["--device", "gpu"], "--device"),
    (["--kernel-config", "{decode"], "not JSON"),
    (["--kernel-config", '{"decode": 3}'], '"decode"'),
    (["--kernel-config", '{"decode_x": {}}'], '"decode"'),
    (["--masks", "codebook1"], "codebookP"),
    (["--masks", "blocks"], "codebookP"),
])
def test_bad_options_give_one_clear_error(argv, words, capsys):
    from e2e.options import parse_options

    with pytest.raises(SystemExit) as e:
        parse_options(["--device", "cpu"] + argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "error:" in err and words in err, err


def test_gpu_calls_use_existing_options():
    """scripts/gpu_calls.sh's steps call bench_e2e.py, bench_kernels.py, check_compiled_gpu.py and bench_bucket_mlp.py
    only with options those scripts have (a renamed option would fail on the GPU machine, where a call is expensive)."""
    import re

    from e2e.options import build_parser

    text = (ROOT / "scripts" / "gpu_calls.sh").read_text()
    body = text[text.index("step() {"):]
    steps = re.split(r"\n  (?=[a-z0-9_|]+\)\s)", body)
    e2e_flags = {s for a in build_parser()._actions for s in a.option_strings}
    scripts = {"bench_kernels.py": ROOT / "benchmarks" / "bench_kernels.py",
               "check_compiled_gpu.py": ROOT / "benchmarks" / "check_compiled_gpu.py",
               "bench_bucket_mlp.py": ROOT / "benchmarks" / "bench_bucket_mlp.py",
               "structure_table.py": ROOT / "benchmarks" / "structure_table.py"}
    known = {name: set(re.findall(r'add_argument\("(--[a-z0-9-]+)"', path.read_text())) for name, path in scripts.items()}
    seen_e2e = seen = 0
    for st in steps:
        code = "\n".join(line.split("#")[0] for line in st.splitlines()).replace("\\\n", " ")
        for cmd in re.split(r"[\n;|]", code):  # one command line each, continuations joined
            flags = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", cmd))
            if re.search(r"^\s*e2e |bench_e2e\.py", cmd):
                seen_e2e += 1
                assert flags <= e2e_flags, (st.split(")")[0], flags - e2e_flags)
            for name in scripts:
                if name in cmd:
                    seen += 1
                    assert flags <= known[name], (st.split(")")[0], name, flags - known[name])
    assert seen >= 8
    assert seen_e2e >= 8
    from e2e.variants import VARIANTS

    lean = re.search(r'^LEAN_DEFAULT_VARIANTS="([^"]*)"', text, re.M).group(1).split()
    assert lean and set(lean) <= set(VARIANTS), set(lean) - set(VARIANTS)


def test_gpu_calls_sweep_runs_parse():
    """The capacity sweep's steps (sweep1 / sweep2 in scripts/gpu_calls.sh): every one of its 12 runs is a
    command line the recipe parses (WIDE / SkipGPT-style / static x 4 capacities, one budget), and the quality
    calls use options `wide eval quality` has."""
    import argparse
    import re
    import subprocess

    from wide_compile.eval.quality import add_arguments
    from wide_compile.training import recipe

    text = (ROOT / "scripts" / "gpu_calls.sh").read_text()
    assert re.search(r"^#   sweep1, sweep2 ", text, re.M) and "  sweep1)" in text and "  sweep2)" in text
    defs = text[text.index("SWEEP_CAPS="):text.index("\n}\n", text.index("sweep_runs() {")) + 3]
    lines = subprocess.run(["bash", "-c", defs + "sweep_runs"], capture_output=True, text=True,
                           check=True).stdout.splitlines()
    methods = {}
    for line in lines:
        name, cap, *args = line.split()
        a = recipe.parse(["--capacity", cap, "--out", f"runs/{name}", *args])
        methods.setdefault(a.baseline, []).append(a.capacity)
        assert (a.batch_size, a.s1_epochs, a.s2_epochs) == (16, 0.1, 0.05), line  # one equal budget
    assert methods == {b: [0.3, 0.5, 0.7, 0.85] for b in ("none", "skipgpt", "static")}
    assert len({line.split()[0] for line in lines}) == 12
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    known = {s for act in ap._actions for s in act.option_strings}
    fn = text[text.index("one_quality() {"):text.index("\n}\n", text.index("one_quality() {"))]
    quality_args = re.search(r'^SWEEP_QUALITY_ARGS="([^"]*)"', text, re.M).group(1)
    flags = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", fn + " " + quality_args))
    assert flags and flags <= known, flags - known


def test_gpu_calls_distill_runs_parse():
    """The distill step (scripts/gpu_calls.sh): every run of DISTILL_RUNS is a stage-2 command line that parses,
    continues a shipped router set and LoRA that exist, and all runs share one budget; per capacity runs train
    on dense answers and one control on the recipe's mix of text and chat turns."""
    import re
    import subprocess

    from wide_compile.training import stage2
    from wide_compile.training.recipe import CHAT_FRAC_GPU

    text = (ROOT / "scripts" / "gpu_calls.sh").read_text()
    assert re.search(r"^#   distill ", text, re.M) and "  distill)" in text and "  answers)" in text
    defs = text[text.index("DISTILL_RUNS="):text.index("\n}\n", text.index("one_distill() {")) + 3]
    script = "C=/c; " + defs + """
    one_distill() { echo "$@"; }
    echo "$DISTILL_RUNS" | tr ';' '\\n' | while read -r e; do [ -n "$e" ] && one_distill $e $DISTILL_S2_ARGS; done"""
    lines = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout.splitlines()
    assert len(lines) >= 2
    budgets, mixes = set(), {}
    for line in lines:
        name, cap, shipped, *args = line.split()
        shipped = shipped.removesuffix(":fresh")
        for suffix in (".safetensors", ".lora.safetensors"):
            assert (ROOT / "wide_compile" / "pretrained" / (shipped + suffix)).is_file(), shipped
        a = stage2.parser().parse_args(["--routers", "r", "--out", "o", "--capacity", cap, *args])
        assert a.joint and a.amp
        budgets.add((a.epochs, a.batch_size, a.lr, a.router_lr, a.seq_len))
        mixes[name] = (cap, a.answers is not None, a.chat_frac)
    assert len(budgets) == 1
    assert {m[1] for m in mixes.values()} == {True, False}
    for cap in {m[0] for m in mixes.values()}:  # per capacity: runs with answers, one control with the recipe's mix
        runs = [m for m in mixes.values() if m[0] == cap]
        assert any(r[1] for r in runs) and [r[2] for r in runs if not r[1]] == [CHAT_FRAC_GPU]


def test_gpu_calls_distill_start_sets(tmp_path):
    """one_distill's SPEC (scripts/gpu_calls.sh): a shipped set, its routers with a fresh LoRA, its routers with a
    joined LoRA file, or a run's routers and LoRA, each handed to stage 2 as --routers / --init-lora."""
    import subprocess

    text = (ROOT / "scripts" / "gpu_calls.sh").read_text()
    defs = text[text.index("one_distill() {"):text.index("\n}\n", text.index("one_distill() {")) + 3]
    script = f"C=/c OUT={tmp_path}; " + "python3() { echo \"$@\"; }; grep() { :; }; " + defs + """
    for spec in smollm2-135m-c70 smollm2-135m-c70:fresh smollm2-135m-c70+big.safetensors runs/m70; do
      one_distill n 0.7 $spec > /dev/null; cat "$OUT/distill-n.log"; rm "$OUT/distill-n.log"
    done"""
    lines = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout.splitlines()

    def arg(line, flag):
        words = line.split()
        return words[words.index(flag) + 1] if flag in words else None

    shipped = "wide_compile/pretrained/smollm2-135m-c70"
    assert [(arg(x, "--routers"), arg(x, "--init-lora")) for x in lines] == [
        (f"{shipped}.safetensors", f"{shipped}.lora.safetensors"), (f"{shipped}.safetensors", None),
        (f"{shipped}.safetensors", "/c/big.safetensors"),
        ("/c/runs/m70/routers.safetensors", "/c/runs/m70/lora.safetensors")]
    assert all(arg(x, "--capacity") == "0.7" and arg(x, "--out") == "/c/runs/n" for x in lines)


def test_gpu_calls_wikival_step(tmp_path):
    """The wikival step (scripts/gpu_calls.sh): per WIKIVAL_RUNS entry, recalibrate_capacity.py moves run SRC's
    routers to CAP on WikiText-2 validation text into run DST (options its parser has), DST gets SRC's LoRA, and
    eval_quality scores DST's routers and LoRA."""
    import re
    import subprocess

    text = (ROOT / "scripts" / "gpu_calls.sh").read_text()
    assert re.search(r"^#   wikival ", text, re.M)
    start = text.index("  wikival)")
    body = text[text.index("\n", start) + 1:text.index(";;", start)]
    c, out = tmp_path / "c", tmp_path / "out"
    (c / "runs" / "m50").mkdir(parents=True)
    (c / "runs" / "m50" / "lora.safetensors").write_text("lora")
    script = (f"C={c} OUT={out}; " + """
    python3() { echo "python3 $*" >> "$OUT/calls"; o=; while [ $# -gt 0 ]; do [ "$1" = --out ] && o=$2; shift; done
                [ -n "$o" ] && echo '{}' > "${o%.safetensors}.json" && echo recal > "$o"; echo "moved"; }
    eval_quality() { echo "eval $*" >> "$OUT/calls"; }
    WIKIVAL_RUNS="m50 m50v 0.5; m50 m50s 0.5 0.8"
    f() { local src dst cap attn
""" + body + "\n}; f")
    subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True)
    calls = (out / "calls").read_text().splitlines()
    assert len(calls) == 4 and calls[0].startswith("python3 benchmarks/recalibrate_capacity.py")

    def args(call):
        words = call.split()[2:]
        return {words[i]: words[i + 1] for i in range(0, len(words), 2)}

    arg = args(calls[0])
    assert "--attn-capacity" not in arg and args(calls[2])["--attn-capacity"] == "0.8"
    assert arg["--routers"] == f"{c}/runs/m50/routers.safetensors" and arg["--lora"] == f"{c}/runs/m50/lora.safetensors"
    assert arg["--capacity"] == "0.5" and arg["--calib-file"] == f"{c}/data/wikitext-2/wiki.valid.raw"
    assert arg["--out"] == f"{c}/runs/m50v/routers.safetensors"
    known = set(re.findall(r'add_argument\("(--[a-z0-9-]+)"', (ROOT / "benchmarks" / "recalibrate_capacity.py").read_text()))
    assert set(arg) | set(args(calls[2])) <= known, (set(arg) | set(args(calls[2]))) - known
    assert calls[1].split() == ["eval", "m50v", f"{c}/runs/m50v/routers.safetensors",
                                f"{c}/runs/m50v/lora.safetensors", f"{c}/runs/m50v/quality", f"{out}/m50v/quality.log"]
    assert (c / "runs" / "m50v" / "lora.safetensors").read_text() == "lora"
    assert (out / "m50v" / "recalibrate.json").is_file()


def test_gqa_decode_attention_matches_sdpa_in_decode():
    """e2e/attention.py's gqa_decode: transformers' SDPA logits in prefill and in decode steps against a
    static cache (the unwritten tail masked), where it runs wide.attn_decode with every head on; the WIDE
    model of a gqa_decode run keeps sdpa_unpadded, in a config of its own (the dense model's is unchanged)."""
    import torch
    from e2e import models as MD
    from e2e.attention import use, wide_attention
    from transformers import StaticCache
    from wide_compile.models import tiny_model

    base, fd = tiny_model("llama", seed=5), tiny_model("llama", seed=5)
    fd.config._attn_implementation = use("gqa_decode")
    ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        logits = []
        for m in (base, fd):
            cache = StaticCache(config=m.config, max_cache_len=32)
            steps = [m(input_ids=ids, past_key_values=cache, use_cache=True).logits]
            for t in range(3):  # decode steps: 9, 10, 11 cached positions of 32
                steps.append(m(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True,
                               cache_position=torch.tensor([9 + t])).logits)
            logits.append(torch.cat(steps, 1))
        torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=1e-5)
    clone = MD.shared_clone(fd, wide_attention("gqa_decode"))
    assert clone.config._attn_implementation == "sdpa_unpadded" and fd.config._attn_implementation == "gqa_decode"


def test_wide_table_and_fused_variants_are_recorded(tmp_path):
    """--variants wide_table wide_fused: the other WIDE configurations timed in the same rows, as ratios."""
    import bench_e2e

    _register_fake_backend()
    data = bench_e2e.main(["--smoke", "--out", str(tmp_path), "--wide-backend", _FAKE, "--phases", "decode",
                           "--capacities", "0.5", "--masks", "random", "--no-plot",
                           "--variants", "inductor", "wide", "wide_table", "wide_fused", "wide_fused_dense"])
    r, = data["records"]
    for k in ("wide_table", "wide_fused", "wide_fused_dense"):
        assert r[f"{k}_ms"] and r[f"{k}_speedup"] == pytest.approx(r["dense_inductor_ms"] / r[f"{k}_ms"], rel=1e-3)
    assert r["kernel_path"] == "auto" and r["fuse_norm_router"] is False
    assert "speedup, fused norm+router" in (tmp_path / "e2e-smoke.md").read_text()
    assert "speedup, fused + dense-masked" in (tmp_path / "e2e-smoke.md").read_text()


def test_prefill_cuda_graphs_option_and_report_note():
    """--prefill-cuda-graphs is an option, and the report says which phases ran in CUDA graphs."""
    from e2e.options import parse_options as parse
    from e2e.report import _graphs_note

    assert parse(["--smoke", "--prefill-cuda-graphs"]).prefill_cuda_graphs
    assert not parse(["--smoke"]).prefill_cuda_graphs
    assert "for prefill and decode" in _graphs_note({"command": "bench_e2e.py --prefill-cuda-graphs"})
    assert "default mode for prefill" in _graphs_note({"command": "bench_e2e.py"})


def test_use_lora_merges_into_the_wide_model_only(tmp_path):
    """BenchModel.use_lora: the WIDE model gets the LoRA-merged weights (as peft merges them), the dense model keeps
    its own, the parameters the LoRA does not touch stay shared, and None shares the dense weights again."""
    import torch

    from e2e.bench_model import BenchModel
    from e2e.models import shared_clone
    from wide_compile.models import tiny_model
    from wide_compile.training.stage2 import apply_lora, load_lora_merged, save_lora

    pm = apply_lora(tiny_model("llama", seed=0), rank=4, alpha=8)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)  # a LoRA that changes the model
    lora = str(tmp_path / "lora.safetensors")
    save_lora(pm, lora)

    bm = BenchModel.__new__(BenchModel)  # only the two models and the merged LoRA's name
    bm.dense, bm.lora = tiny_model("llama", seed=0), None
    bm.wide_model = shared_clone(bm.dense)
    before = {n: p.clone() for n, p in bm.dense.named_parameters()}
    expected = dict(load_lora_merged(tiny_model("llama", seed=0), lora).named_parameters())

    bm.use_lora(lora)
    wide, dense = dict(bm.wide_model.named_parameters()), dict(bm.dense.named_parameters())
    changed = [n for n in dense if wide[n] is not dense[n]]
    assert changed and all(n.endswith("proj.weight") for n in changed)
    for n in dense:
        torch.testing.assert_close(wide[n], expected[n], rtol=0, atol=0)
        torch.testing.assert_close(dense[n], before[n], rtol=0, atol=0)
    assert bm.lora == lora
    bm.use_lora(None)
    assert all(p is dense[n] for n, p in bm.wide_model.named_parameters())
