"""The kernel benchmark's router-fitted masks: requested density at any T, and rho really controls how
much tokens share masks (so fitting it to the trained routers' tile coherence means something)."""
import importlib
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    os.environ["WIDE_BENCH_DRYRUN"] = "1"  # CPU tensors
    sys.path.insert(0, str(ROOT))
    try:
        yield importlib.import_module("benchmarks.bench_kernels")
    finally:
        sys.path.remove(str(ROOT))
        os.environ.pop("WIDE_BENCH_DRYRUN", None)


@pytest.mark.parametrize("density", [0.25, 0.5, 0.75])
def test_fitted_masks_have_the_requested_density(bench, density):
    g = torch.Generator().manual_seed(0)
    m = bench.make_mask(4096, 224, density, "fitted", g)
    assert m.dtype == torch.bool and m.shape == (4096, 224)
    assert abs(m.float().mean().item() - density) < 0.03
    # analytic thresholds: a single token draws from the same distribution
    singles = torch.stack([bench.make_mask(1, 224, density, "fitted", g)[0] for _ in range(64)])
    assert abs(singles.float().mean().item() - density) < 0.05


def test_rho_controls_tile_coherence(bench):
    from benchmarks.e2e.masks import tile_coherence

    g = torch.Generator().manual_seed(1)
    low = tile_coherence(bench.fitted_mask(1024, 24, 0.5, g, rho=0.0))
    high = tile_coherence(bench.fitted_mask(1024, 24, 0.5, g, rho=1.0))
    assert low < 0.15 < 0.6 < high
    assert bench.fit_fitted_rho(24, 0.5) in (0.9, 0.95, 0.98, 0.99, 1.0)


def test_recorded_router_masks_round_trip(tmp_path):
    from benchmarks.record_router_masks import pack, unpack

    m = torch.rand(37, 24) < 0.3  # a token count that is not a multiple of 8
    p = pack(m)
    assert p.dtype == torch.uint8 and p.shape == (5, 24)
    assert torch.equal(unpack(p, 37), m)


def test_recording_merges_the_routers_own_lora(tmp_path):
    """record_router_masks resolves its LoRA as `wide train convert` does: a shipped name records through its own
    stage-2 LoRA (the model its routers were trained to read); a file has none unless given; 'none' turns it off;
    a missing file is an error, not a silent no-LoRA recording."""
    from wide_compile import pretrained
    from wide_compile.training.convert import resolve_lora

    assert "resolve_lora(a.routers, a.lora)" in (ROOT / "benchmarks" / "record_router_masks.py").read_text()
    assert resolve_lora("smollm2-135m-c50", None) == pretrained.lora_path("smollm2-135m-c50") is not None
    assert resolve_lora("smollm2-135m-c50", "none") is None
    f = tmp_path / "r.safetensors"
    f.write_bytes(b"")
    assert resolve_lora(str(f), None) is None
    assert resolve_lora("smollm2-135m-c50", str(f)) == f
    with pytest.raises(SystemExit, match="no such file"):
        resolve_lora("smollm2-135m-c50", str(tmp_path / "missing.safetensors"))


def test_structure_recordings_say_what_they_hold():
    """benchmarks/data/structures/cNN-<structure><size>: one layer of the converted set named, its LoRA merged."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_bucket_mlp import masks_structure
    from record_router_masks import load_masks, read_meta

    files = sorted((ROOT / "benchmarks" / "data" / "structures").glob("*.safetensors"))
    assert len(files) == 6
    for f in files:
        meta = read_meta(f)
        structure = f.stem.split("-")[1].rstrip("0123456789")
        assert meta["structure"] == structure == masks_structure(str(f))
        assert meta["layers"] == 1 and len(meta["model_layers"]) == 1 and meta["lora"].endswith(".lora.safetensors")
        assert meta == load_masks(f)["meta"] and load_masks(f)["ffn"][0].shape == (meta["tokens"], 24)


def test_one_layer_recording_picks_the_layer_nearest_the_mean_rate():
    from benchmarks.record_router_masks import pick_layer

    ffn = [torch.zeros(8, 4, dtype=torch.bool), torch.ones(8, 4, dtype=torch.bool), torch.eye(8, 4, dtype=torch.bool)]
    ffn[2][:, :2] = True  # rates 0, 1, 0.5: the mean 0.5 is layer 2's
    assert pick_layer(ffn, "auto") == 2 and pick_layer(ffn, "1") == 1
    for bad in ("3", "-1", "mid"):
        with pytest.raises(SystemExit, match="--layer"):
            pick_layer(ffn, bad)


def test_trained_masks_come_from_the_recorded_file(bench):
    from benchmarks.record_router_masks import DEFAULT_OUT, load_masks

    rec = load_masks(DEFAULT_OUT)  # committed: benchmarks/data/, written by record_router_masks.py
    meta = rec["meta"]
    assert meta["groups"] == {"attn": 9, "ffn": 24} and meta["tokens"] == 8192 and len(rec["ffn"]) == meta["layers"]
    for i, m in enumerate(rec["ffn"]):  # the stored on-rates describe the stored bits
        assert m.shape == (8192, 24) and abs(m.float().mean().item() - meta["on_rate"]["ffn"][i]) < 1e-3
    for d in (0.25, 0.5, 0.75):
        m, layer, rate = bench.trained_mask(2048, 24, d)
        assert m.shape == (2048, 24) and torch.equal(m, rec["ffn"][layer][:2048])
        assert all(abs(rate - d) <= abs(r - d) for r in meta["on_rate"]["ffn"])  # the closest layer
        assert bench.mask_model_name("trained", 24, d).startswith(f"trained(smollm2-135m-c50, layer {layer},")
    assert bench.trained_mask(16, 224, 0.5) is None  # 8B group count: no recorded masks
    assert bench.trained_mask(8193, 24, 0.5) is None  # more tokens than recorded
    with pytest.raises(LookupError):
        bench.make_mask(4, 224, 0.5, "trained", None)


def test_reorder_helpers():
    from benchmarks.record_router_masks import greedy_order, lex_order, tile_union

    g = torch.Generator().manual_seed(0)
    pats = torch.rand(4, 12, generator=g) < 0.5  # 4 distinct masks, 32 tokens each, shuffled
    m = pats[torch.randperm(128, generator=g) % 4]
    for order in (lex_order(m), greedy_order(m, 32)):
        assert sorted(order.tolist()) == list(range(128))  # a permutation
        assert tile_union(m[order], 32) == pytest.approx(pats.float().mean().item())  # tiles = one pattern each


def test_union_report_of_recorded_masks():
    from benchmarks.record_router_masks import DEFAULT_OUT, load_masks, union_report

    rows = union_report(load_masks(DEFAULT_OUT))
    assert len(rows) == 2 * 3 * 3
    for r in rows:
        assert 0 < r["union"] <= 1 and 0 < r["independent"] <= 1
        assert r["union_greedy"] <= r["union_lex_sorted"] + 0.05  # the offline bound is the lower one
        if r["tile"] == 128:  # reordering one prefill's tokens by mask lets tiles share groups
            assert r["union_lex_sorted"] < r["union"] or r["union"] < 0.9
    by = {(r["kind"], r["tile"], round(r["on_rate"], 1)): r for r in rows}
    # a larger tile never needs fewer groups
    for kind in ("ffn", "attn"):
        for rate in {round(r["on_rate"], 1) for r in rows if r["kind"] == kind}:
            u = [by[(kind, t, rate)]["union"] for t in (4, 16, 128)]
            assert u == sorted(u)


def test_compiled_mode_times_every_op_through_inductor(bench, monkeypatch):
    """--compiled: dense, static and WIDE callables go through torch.compile (their records say so); the
    forced gather path stays eager (Triton launches only). On the CPU the dry run's times mean nothing; what
    is checked is which callables were compiled and that the rows are complete."""
    import torch._dynamo

    compiled_fns = []
    real_compile = torch.compile

    def spy(fn, **kw):
        compiled_fns.append(fn)
        return real_compile(fn, **kw)

    monkeypatch.setattr(torch, "compile", spy)
    # one recompile allowed per code object: the lambdas of one source line share one, so two token counts
    # in one run must not make Dynamo fall back to eager for the second (compiled_time resets its cache)
    # (config.patch, not monkeypatch: monkeypatch's undo would delattr the config entry, which the config
    # module serves through __getattr__, and every later compile would fail)
    torch._dynamo.reset()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(recompile_limit=1):
        recs, _ = bench.bench(True, lambda s: None, {}, kinds=("random",), ts=(5, 6), compiled=True)
    ops = [r for r in recs if r["op"] in ("mlp", "attn_q", "attn_o")]
    assert len(ops) == 6 and all(r["compiled"] is True and r["wide_ms"] > 0 and r["gather_ms"] > 0 for r in ops)
    assert len(compiled_fns) == 18  # dense, static, WIDE x (mlp, q, o) x 2 T; not the gather path, not the reorder
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 18  # every one really compiled
    eager, _ = bench.bench(True, lambda s: None, {}, kinds=("random",), ts=(1,), compiled=False)
    assert len(compiled_fns) == 18 and all(r.get("compiled") is False for r in eager if r["op"] == "mlp")


def test_write_config_picks_each_swept_t_fastest_working_variant(bench):
    from wide_compile.kernels.tuning import KernelTuning, resolve

    base = resolve(None)
    var = [dict(T=1, masks="random", config={}, wide_ms=2.0), dict(T=1, masks="random", config={"dn_split": 4}, wide_ms=1.0),
           dict(T=1, masks="random", config={"up_bk": 16}, wide_ms=0.5),
           dict(T=1, masks="corr_p0.1", config={"up_bk": 16}, wide_ms=None),  # failed for one mask kind: out
           dict(T=1, masks="corr_p0.1", config={}, wide_ms=2.0), dict(T=1, masks="corr_p0.1", config={"dn_split": 4}, wide_ms=1.0),
           dict(T=2048, masks="random", config={}, wide_ms=1.0), dict(T=2048, masks="random", config={"group_g": 4}, wide_ms=3.0)]
    t = bench.tuned_table(base, var, "GPU X")
    assert isinstance(t, KernelTuning) and t.device == "GPU X"
    assert t.row(1, 1 << 30) == {**base.row(1, 1 << 30), "dn_split": 4}
    assert t.row(2048, 1 << 30) == base.row(2048, 1 << 30)  # the table's own row stayed fastest
    assert t.row(300, 1 << 30) == base.row(300, 1 << 30)  # rows below a swept T keep their configs
    assert 2048 in dict(t.rows)
