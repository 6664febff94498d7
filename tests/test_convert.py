"""Structured routers converted from free ones (routing/convert.py).

The converted scorer against the agreement computed by hand in float64; the exactness property (a token
whose free mask is in the table gets exactly that mask); the prototype fit's objective; nested orders and
prefixes; the end-to-end conversion with calibration on a tiny model; the CLI; clear errors."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import wide_compile as wc
from wide_compile.models import tiny_model
from wide_compile.routing import convert as cv
from wide_compile.routing.attach import record_masks, routed
from wide_compile.routing.routers import CodebookRouter, GroupRouter, NestedRouter, PairRouter

FREE_WIDE = wc.WideConfig(ffn_group_size=16, head_group_size=1, router_init="random", router_recipe="wide",
                          router_rank=8, router_input="residual")
FREE_LIN = wc.WideConfig(ffn_group_size=16, head_group_size=1, router_init="random")


def _random_free(model, cfg, seed=0):
    r = wc.Routers.init(model, cfg, seed=seed)
    with torch.no_grad():  # nonzero biases everywhere, so the folded down bias is exercised
        for x in list(r.attn) + list(r.ffn):
            for p in x.parameters():
                if p.dim() == 1:
                    p.normal_(0.0, 0.5)
    return r


def _margins_by_hand(router, h):
    # float64 margins of a free router
    if isinstance(router, PairRouter):
        z = torch.nn.functional.linear(torch.nn.functional.linear(h, router.down.weight.double(),
                                                                  router.down.bias.double()),
                                       router.up.weight.double(), router.up.bias.double()).unflatten(-1, (-1, 2))
        return z[..., 1] - z[..., 0]
    return torch.nn.functional.linear(h, router.proj.weight.double(), router.proj.bias.double())


@pytest.mark.parametrize("cfg", [FREE_WIDE, FREE_LIN], ids=["pair", "linear"])
def test_converted_scores_are_the_agreement_with_the_free_margins(cfg):
    model = tiny_model("llama", seed=3)
    free = _random_free(model, cfg)
    for r in (free.attn[1], free.ffn[0]):
        h = torch.randn(257, r.dim, dtype=torch.float64)
        m = _margins_by_hand(r, h)
        table = (torch.rand(6, r.groups, generator=torch.Generator().manual_seed(1)) > 0.5).float()
        cb = cv.codebook_from_router(r, m.float(), 6)
        with torch.no_grad():
            cb.prototypes.copy_(torch.where(table > 0, 3.0, -3.0))
            cv._load_scorer(cb, r, table)
        want = m @ (2 * table.double() - 1).t()
        got = copy.deepcopy(cb).double().scores(h)
        # float64 against float64: the scorer's weights are the products rounded once to fp32
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(cb.scores(h.float()), want.float(), rtol=1e-4, atol=1e-4)  # as routers run


@pytest.mark.parametrize("cfg", [FREE_WIDE, FREE_LIN], ids=["pair", "linear"])
def test_a_token_whose_free_mask_is_a_prototype_gets_exactly_it(cfg):
    model = tiny_model("llama", seed=4)
    free = _random_free(model, cfg)
    r = free.ffn[1]
    h = torch.randn(300, r.dim)
    m = r(h).float()
    distinct = (m > 0).unique(dim=0)
    # a table of every free mask present (plus one all-off row): each token's own mask is its unique best
    table = torch.cat([distinct.float(), torch.zeros(1, r.groups)])
    cb = cv.codebook_from_router(r, m, len(table))
    with torch.no_grad():
        cb.prototypes.copy_(torch.where(table > 0, 3.0, -3.0))
        cv._load_scorer(cb, r, table)
    torch.testing.assert_close(cb(h) > 0, m > 0, rtol=0, atol=0)
    # and a nested router whose levels include each token's free mask as a prefix reproduces it too
    order = torch.argsort((m > 0).float().mean(0), descending=True, stable=True)
    nr = cv.nested_from_router(r, m, r.groups, order)
    prefix_ok = ((m > 0) == (nr.pos[None, :] < (m > 0).sum(1, keepdim=True))).all(1)
    assert prefix_ok.any()
    torch.testing.assert_close(nr(h)[prefix_ok] > 0, (m > 0)[prefix_ok], rtol=0, atol=0)


def test_fit_prototypes_finds_planted_masks_and_never_lowers_the_objective():
    g = torch.Generator().manual_seed(0)
    planted = (torch.rand(4, 20, generator=g) > 0.5).float()
    which = torch.randint(0, 4, (2000,), generator=g)
    m = (2 * planted[which] - 1) * (0.5 + torch.rand(2000, 20, generator=g))  # margins agreeing with a plant
    table = cv.fit_prototypes(m, 4, seed=0)
    assert sorted(map(tuple, table.tolist())) == sorted(map(tuple, planted.tolist()))

    def objective(t):
        return float(cv.agreement(m.double(), t.double()).max(1).values.sum())

    noisy = m + 2.0 * torch.randn(m.shape, generator=g)
    obj = [objective(cv.fit_prototypes(noisy, 4, iters=k, seed=1)) for k in (0, 1, 2, 5, 50)]
    assert obj == sorted(obj) and obj[-1] > obj[0]
    # more prototypes than distinct masks: still a valid 0/1 table, every token served by its own mask
    few = cv.fit_prototypes(m, 9, seed=2)
    assert few.shape == (9, 20) and set(few.unique().tolist()) <= {0.0, 1.0}
    assert objective(few) == pytest.approx(float(m.abs().sum()), rel=1e-6)
    with pytest.raises(ValueError, match="prototypes must be >= 1"):
        cv.fit_prototypes(m, 0)


def test_nested_order_is_by_on_rate_and_levels_are_prefixes():
    model = tiny_model("llama", seed=5)
    free = _random_free(model, FREE_WIDE)
    r = free.ffn[0]
    h = torch.randn(500, r.dim)
    m = r(h).float()
    nr = cv.nested_from_router(r, m, 4)
    assert isinstance(nr, NestedRouter) and nr.levels == 4
    rate = (m > 0).float().mean(0)[nr.order]
    assert (rate[:-1] >= rate[1:]).all()
    # the pick is the level of best agreement, computed by hand
    lv = nr.level_masks().float()
    want = (m.double() @ (2 * lv.double() - 1).t()).argmax(1)
    got_mask = nr(h) > 0
    torch.testing.assert_close(got_mask, lv.bool()[want], rtol=0, atol=0)


def test_non_affine_and_structured_sources_are_errors():
    model = tiny_model("llama", seed=6)
    hid = wc.Routers.init(model, dataclasses.replace(FREE_LIN, router_hidden=8))
    with pytest.raises(ValueError, match="SiLU hidden layer"):
        cv.codebook_from_router(hid.ffn[0], torch.randn(10, hid.ffn[0].groups), 2)
    cb = wc.Routers.init(model, wc.WideConfig(ffn_group_size=16, structure="codebook", codebook_size=3))
    with pytest.raises(ValueError, match="must be free"):
        cv.structured_from_free(cb, {}, "codebook", 4)
    free = _random_free(model, FREE_WIDE)
    with pytest.raises(ValueError, match="'codebook' or 'nested'"):
        cv.structured_from_free(free, {}, "free", 4)
    # more levels than a router has groups: the same error as for fresh nested routers, never a silent clamp
    groups = free.attn[0].groups
    margins = {k: [torch.randn(20, r.groups) for r in getattr(free, k)] for k in ("attn", "ffn")}
    with pytest.raises(ValueError, match=f"must be in \\[2, {groups}\\]"):
        cv.structured_from_free(free, margins, "nested", groups + 1)


@pytest.mark.parametrize("structure,size", [("codebook", 6), ("nested", 4)])
def test_convert_routers_end_to_end_matches_free_capacity(structure, size, monkeypatch, tmp_path):
    from wide_compile.routing import calibrate as cal_mod
    seen = []
    real = cal_mod.calibrate_offset_
    monkeypatch.setattr(cal_mod, "calibrate_offset_", lambda *a, **k: seen.append(k) or real(*a, **k))
    model = tiny_model("smollm2", seed=7)
    free = _random_free(model, FREE_WIDE)
    g = torch.Generator().manual_seed(0)
    fit = torch.randint(0, 128, (6, 32), generator=g)
    cal = torch.randint(0, 128, (4, 32), generator=g)
    free.calibrate_(model, cal, capacity=0.6)  # a free set at a middling capacity
    out, caps = cv.convert_routers(model, free, structure, size, fit, cal, log=lambda *_: None)
    assert out.cfg.structure == structure
    assert [k.get("coarse") for k in seen] == [False]  # the prototypes stay what the scorers were built for
    # calibration moved only the tilt: the tables are the fitted ones the scorers were built for
    raw = cv.structured_from_free(free, cv.record_margins(model, free, fit), structure, size)
    for a, b in zip(list(raw.attn) + list(raw.ffn), list(out.attn) + list(out.ffn)):
        ta, tb = (a.prototypes, b.prototypes) if structure == "codebook" else (a.level_masks(), b.level_masks())
        assert torch.equal(ta, tb) and torch.equal(a.scorer.weight, b.scorer.weight)
    kind = CodebookRouter if structure == "codebook" else NestedRouter
    assert all(isinstance(x, kind) for x in list(out.attn) + list(out.ffn))
    for k in ("attn", "ffn"):  # a token-level step is 1 / (tokens * groups): the targets are met closely
        assert caps["converted"][k] == pytest.approx(caps["free"][k], abs=0.03)
    # the converted routers attach, and their masks are table rows
    ids = cal[:2]
    with routed(model, out), record_masks(model) as rec:
        model(input_ids=ids)
    r0 = out.ffn[0]
    rows = (r0.prototypes > 0) if structure == "codebook" else r0.level_masks()
    m0 = rec["ffn"][0][0].reshape(-1, r0.groups)
    assert (m0[:, None, :] == rows[None]).all(-1).any(1).all()
    # the file round-trips: the same decisions after save / load
    out.save(tmp_path / "r.safetensors")
    back = wc.Routers.load(tmp_path / "r.safetensors", model, structure=structure)
    with routed(model, back), record_masks(model) as rec2:
        model(input_ids=ids)
    for k in ("attn", "ffn"):
        for i in range(out.spec.num_layers):
            assert torch.equal(rec[k][i][0], rec2[k][i][0])


def _converted_codebook(model_seed, data_seed, prototypes):
    """(model, uncalibrated codebook routers converted from random free ones, calibration blocks, generator)"""
    model = tiny_model("llama", seed=model_seed)
    free = _random_free(model, FREE_WIDE)
    g = torch.Generator().manual_seed(data_seed)
    fit = torch.randint(0, 128, (4, 32), generator=g)
    cal = torch.randint(0, 128, (4, 32), generator=g)
    return model, cv.structured_from_free(free, cv.record_margins(model, free, fit), "codebook", prototypes), cal, g


def test_convert_keeps_prototypes_and_moves_the_tilt_only():
    model, out, cal, _ = _converted_codebook(8, 1, 5)
    before = [x.prototypes.detach().clone() for x in out.ffn]
    from wide_compile.routing.calibrate import calibrate_offset_
    calibrate_offset_(model, out, cal, target=0.3, coarse=False, log=lambda *_: None)
    assert all(torch.equal(b, x.prototypes) for b, x in zip(before, out.ffn))
    assert any(float(x.tilt) != 0.0 for x in out.ffn)


def test_record_margins_are_the_routers_logits():
    model = tiny_model("llama", seed=9)
    free = _random_free(model, FREE_WIDE)
    ids = torch.randint(0, 128, (3, 11))
    margins = cv.record_margins(model, free, ids, batch_size=2)
    assert margins["ffn"][0].shape == (33, free.ffn[0].groups)
    with routed(model, free), record_masks(model) as rec:
        model(input_ids=ids)
    for k in ("attn", "ffn"):
        for i in range(free.spec.num_layers):
            torch.testing.assert_close(margins[k][i] > 0, rec[k][i][0].reshape(-1, margins[k][i].shape[1]),
                                       rtol=0, atol=0)
    assert isinstance(free.ffn[0], PairRouter) and not isinstance(free.ffn[0], GroupRouter)


def test_cli_errors_before_loading_a_model(tmp_path, capsys):
    from wide_compile.training import convert as cli
    out = str(tmp_path / "r.safetensors")
    with pytest.raises(SystemExit, match="neither a shipped router set"):
        cli.main(["--routers", "no-such-set", "--structure", "codebook", "--size", "8", "--out", out])
    with pytest.raises(SystemExit, match="no such file"):
        cli.main(["--routers", "smollm2-135m-c50", "--lora", str(tmp_path / "x"), "--structure", "codebook",
                  "--size", "8", "--out", out])
    for bad, says in ((["--size", "1"], "--size must be >= 2"),
                      (["--size", "8", "--fit-tokens", "100"], "must each hold at least one block")):
        with pytest.raises(SystemExit):
            cli.main(["--routers", "smollm2-135m-c50", "--structure", "nested", "--out", out, *bad])
        assert says in capsys.readouterr().err


def test_convert_table_reads_records_and_plots(tmp_path):
    import json
    import sys
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "benchmarks"))
    import convert_table

    def ppl(ratio, cap):
        c = {"overall": cap, "attn": cap, "ffn": cap, "tokens": 99}
        return {"command": "x", "result": {"ppl_ratio": ratio, "dense": {"ppl": 20.0},
                                           "wide": {"tokens": 99, "ctx": 64, "stride": 32, "capacity": c}}}

    study = tmp_path / "s"
    (study / "free").mkdir(parents=True)
    (study / "free" / "ppl.json").write_text(json.dumps(ppl(2.0, 0.5)))
    for name, ratio in (("codebook16", 3.0), ("codebook64", 2.5), ("nested8", 9.0)):
        (study / name).mkdir()
        (study / name / "ppl.json").write_text(json.dumps(ppl(ratio, 0.49)))
        cap = {"overall": 0.5, "attn": 0.5, "ffn": 0.5}
        (study / name / "convert.json").write_text(json.dumps({"capacity": {"free": cap, "converted": cap}}))
    (study / "notes").mkdir()  # other folders are not rows
    assert convert_table.main([str(study)]) == 0
    t = (study / "table.md").read_text()
    assert "| codebook 64 | 2.500 | 1.250 |" in t and "| nested 8 | 9.000 | 4.500 |" in t and "notes" not in t
    assert t.index("codebook 16") < t.index("codebook 64") < t.index("nested 8")
    assert (tmp_path / "convert-ppl-vs-size.png").stat().st_size > 1000


def test_codebook_calibration_tries_the_tilt_before_shifting_prototypes():
    from wide_compile.routing.calibrate import calibrate_offset_, deterministic_capacity
    model, out, cal, g = _converted_codebook(10, 2, 6)
    with torch.no_grad():  # logits of many sizes: small prototype shifts flip groups, so a shift could land too
        for x in list(out.attn) + list(out.ffn):
            x.prototypes.mul_(torch.rand(x.prototypes.shape, generator=g) + 0.05)
    before = [x.prototypes.detach().clone() for x in list(out.attn) + list(out.ffn)]
    target = deterministic_capacity(model, out, cal)["overall"] + 0.04  # within the tilt's reach
    calibrate_offset_(model, out, cal, target=target, tol=0.02, log=lambda *_: None)  # coarse allowed
    assert deterministic_capacity(model, out, cal)["overall"] == pytest.approx(target, abs=0.02)
    assert all(torch.equal(b, x.prototypes) for b, x in zip(before, list(out.attn) + list(out.ffn)))


def test_recalibrate_capacity_script_moves_a_free_set_to_the_target(monkeypatch, tmp_path):
    """benchmarks/recalibrate_capacity.py on a tiny model: the saved routers' deterministic capacity on the
    calibration blocks is the target (before: the set's own), and the record says both."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import recalibrate_capacity

    from wide_compile.routing.calibrate import deterministic_capacity
    from wide_compile.training import convert as tconv

    model = tiny_model("smollm2", seed=3)
    free = _random_free(model, FREE_WIDE)
    cal = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(1))
    free.calibrate_(model, cal, capacity=0.5)
    monkeypatch.setattr(tconv, "free_routers_on_text", lambda *a, **k: (model, free, cal, "src.safetensors", None))
    out = tmp_path / "moved.safetensors"
    rec = recalibrate_capacity.main(["--routers", "x", "--capacity", "0.8", "--out", str(out), "--calib-tokens", "128",
                                     "--seq-len", "32"])
    assert rec["capacity_before"]["overall"] == pytest.approx(0.5, abs=0.03)
    assert rec["capacity_after"]["overall"] == pytest.approx(0.8, abs=0.01)
    assert json.loads(out.with_suffix(".json").read_text())["target"] == 0.8
    back = wc.Routers.load(out, model)
    assert deterministic_capacity(model, back, cal)["overall"] == pytest.approx(rec["capacity_after"]["overall"])
    with pytest.raises(SystemExit):
        recalibrate_capacity.main(["--routers", "x", "--capacity", "1.5", "--out", str(out)])
    # --attn-capacity: the attention capacity first, then the overall one through the FFN routers
    split = recalibrate_capacity.main(["--routers", "x", "--capacity", "0.6", "--attn-capacity", "0.9", "--out",
                                       str(tmp_path / "split.safetensors"), "--calib-tokens", "128", "--seq-len", "32"])
    assert split["capacity_after"]["overall"] == pytest.approx(0.6, abs=0.01)
    assert split["capacity_after"]["attn"] == pytest.approx(0.9, abs=0.05) and set(split["offset"]) == {"attn", "ffn"}


def fake_set_on_text(monkeypatch, n_blocks: int, seq_len: int = 32):
    """A tiny SmolLM2-shaped model, random free routers calibrated to capacity 0.5 on its first two blocks, and
    random blocks, served by a stand-in for training.convert.free_routers_on_text (what the benchmark scripts on a
    trained set load). Returns (model, routers, blocks, what the scripts asked for, the routers' state before)."""
    from wide_compile.training import convert as tconv

    model = tiny_model("smollm2", seed=3)
    free = _random_free(model, FREE_WIDE)
    blocks = torch.randint(0, 128, (n_blocks, seq_len), generator=torch.Generator().manual_seed(2))
    free.calibrate_(model, blocks[:2], capacity=0.5)
    before = {k: v.clone() for k, v in free.state_dict().items()}
    asked = {}

    def fake(routers, lora, n, s, *a, **k):
        asked.update(n_blocks=n, seq_len=s, text_file=k.get("text_file"))
        return model, free, blocks, "src.safetensors", None

    monkeypatch.setattr(tconv, "free_routers_on_text", fake)
    return model, free, blocks, asked, before


def test_capacity_split_script_rows(monkeypatch, tmp_path):
    """benchmarks/capacity_split.py on a tiny model: every row keeps the overall capacity on the calibration
    blocks, a split row sets the attention capacity, each row is scored on the evaluation blocks only (disjoint
    from the calibration ones), the dense NLL is the model's own LM loss, and the shipped routers are not moved."""
    import json
    import math
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import capacity_split

    model, free, blocks, asked, before = fake_set_on_text(monkeypatch, 6)
    out = tmp_path / "split.json"
    rec = capacity_split.main(["--routers", "x", "--capacity", "0.6", "--attn-targets", "0.3", "0.9",
                               "--calib-tokens", "64", "--eval-tokens", "128", "--seq-len", "32",
                               "--text-file", "t.raw", "--out", str(out)])
    assert asked == {"n_blocks": 6, "seq_len": 32, "text_file": "t.raw"}
    assert [r["attn_target"] for r in rec["rows"]] == [None, 0.3, 0.9]
    for r in rec["rows"]:
        assert r["capacity_calib"]["overall"] == pytest.approx(0.6, abs=0.01)
        assert math.isfinite(r["nll"]) and r["nll"] > 0
    assert rec["rows"][1]["capacity_calib"]["attn"] == pytest.approx(0.3, abs=0.05)
    assert rec["rows"][2]["capacity_calib"]["attn"] == pytest.approx(0.9, abs=0.05)
    with torch.no_grad():
        dense = model(input_ids=blocks[2:], labels=blocks[2:]).loss.item()
    assert rec["dense_nll"] == pytest.approx(dense, rel=1e-5) and rec["eval_tokens"] == 128
    assert all(torch.equal(v, before[k]) for k, v in free.state_dict().items())
    assert json.loads(out.read_text())["rows"] and "| 0.3 |" in out.with_suffix(".md").read_text()
    with pytest.raises(SystemExit):
        capacity_split.main(["--routers", "x", "--capacity", "0.6", "--attn-targets", "1.5", "--out", str(out)])


def test_free_routers_on_text_reads_blocks_from_a_raw_text_file(monkeypatch, tmp_path):
    """text_file (recalibrate_capacity --calib-file): the blocks are the file's tokens in order, cut to
    [n_blocks, seq_len]; a file too short for the blocks is one clear error."""
    import wide_compile.models as models
    from wide_compile.training import convert as tconv

    model = tiny_model("smollm2", seed=3)
    path = tmp_path / "routers.safetensors"
    _random_free(model, FREE_WIDE).save(path)

    class CharTokenizer:  # token id = byte value mod 128: the expected blocks follow from the text alone
        def __call__(self, text, add_special_tokens=True):
            assert add_special_tokens is False  # the perplexity protocol's tokenization: no special tokens
            return {"input_ids": [b % 128 for b in text.encode()]}

    monkeypatch.setattr(models, "load_smollm2", lambda **k: (model, CharTokenizer()))
    text = "".join(chr(97 + (i * 7) % 26) for i in range(100))
    (tmp_path / "valid.raw").write_text(text)
    _, free, blocks, src, lora = tconv.free_routers_on_text(str(path), "none", 3, 16, "cpu", None, None, None,
                                                           text_file=tmp_path / "valid.raw")
    assert blocks.shape == (3, 16) and lora is None
    assert blocks.flatten().tolist() == [ord(c) for c in text[:48]]
    with pytest.raises(SystemExit, match="only 100 tokens"):
        tconv.free_routers_on_text(str(path), "none", 7, 16, "cpu", None, None, None, text_file=tmp_path / "valid.raw")
