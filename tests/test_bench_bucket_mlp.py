"""benchmarks/bench_bucket_mlp.py runs end to end on the CPU in --dry-run mode (tiny shapes, the WIDE kernels
through the Triton interpreter) and writes the JSON and markdown the GPU run writes. CPU speed numbers are not
asserted."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

VARIANTS = ("dense", "static", "free", "bucket_codebook", "bucket_nested")
ONE_TOKEN = ("dense", "static", "free", "free_gemv", "free_gemv_view", "bucket_codebook", "bucket_nested", "bucket_codebook_union")


def test_dry_run_writes_checked_rows(tmp_path):
    import bench_bucket_mlp

    data = bench_bucket_mlp.main(["--dry-run", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "bucket-mlp.json").read_text()) == json.loads(json.dumps(data))
    md = (tmp_path / "bucket-mlp.md").read_text()
    assert data["command"] in md and data["device"] in md and data["date"] in md
    rows = data["rows"]
    assert [(r["T"], r["variant"]) for r in rows] == ([(1, v) for v in ONE_TOKEN]
                                                     + [(17, v) for v in VARIANTS + ("bucket_codebook_unionblocks",
                                                                                   "bucket_codebook_padded")])
    for r in rows:
        assert set(r["ms"]) == {"median", "p10", "p90", "n", "min"} and r["ms"]["median"] > 0
        assert r["speedup_vs_dense"] > 0 and 0 <= r["capacity"] <= 1
        if r["variant"] not in ("dense", "static"):
            assert r["rel_l2"] <= bench_bucket_mlp.TOL


@pytest.fixture
def warmup_timing(monkeypatch):
    """Each variant timed by its warm-up call alone (under the interpreter a kernel variant's timing loop is three
    more interpreted calls). The rows, their checks against the reference and their ms summaries are made as
    before; the timing loop itself runs in test_dry_run_writes_checked_rows."""
    import bench_bucket_mlp  # noqa: F401  (puts the repository root on sys.path)
    from benchmarks.e2e import timing

    def one_round(variants, device, rounds=1, target_s=0.0, **kw):  # noqa: ARG001
        for v in variants:
            v.times_ms.append(v.est_ms)

    monkeypatch.setattr(timing, "time_interleaved", one_round)


def test_sweep_rows_and_nested_prototypes(tmp_path, warmup_timing):
    import bench_bucket_mlp
    from wide_compile.kernels import bucket_mlp

    data = bench_bucket_mlp.main(["--dry-run", "--sweep", "--ts", "3", "--out", str(tmp_path)])
    names = [r["variant"] for r in data["rows"]]
    assert names == (list(VARIANTS) + ["bucket_codebook_dense"]
                     + [f"bucket_codebook_{i}" for i in range(len(bucket_mlp.SWEEP["decode"]))])
    from wide_compile.kernels import gemv

    data = bench_bucket_mlp.main(["--dry-run", "--sweep", "--ts", "1", "--out", str(tmp_path)])
    names = [r["variant"] for r in data["rows"]]
    sw = gemv.GEMV_SWEEP
    assert names == (list(ONE_TOKEN[:5]) + [f"free_gemv_{i}" for i in range(len(sw["d_contiguous"]))]
                     + list(ONE_TOKEN[5:]) + [f"bucket_codebook_gemv_{i}" for i in range(len(sw["k_contiguous"]))])
    assert all(r["rel_l2"] <= bench_bucket_mlp.TOL for r in data["rows"] if "rel_l2" in r)
    protos = bench_bucket_mlp.nested_protos(16, 224)
    assert protos.float().mean().item() == 0.5                           # mean width G / 2
    assert (protos[:, :-1] >= protos[:, 1:]).all()                       # prefixes
    for cap in (0.3, 0.7, 0.85):                                         # mean width capacity * G, within [0, G]
        p = bench_bucket_mlp.nested_protos(8, 224, cap)
        widths = p.sum(1)
        assert abs(p.float().mean().item() - cap) < 1 / 224 and (widths[1:] > widths[:-1]).all()
        assert (p[:, :-1] >= p[:, 1:]).all() and widths.min() > 0


MASKS = ROOT / "benchmarks" / "data" / "smollm2-cb64-router-masks.safetensors"
RECORDED = ("bucket_recorded", "bucket_recorded_unionblocks")


def test_masks_rows_time_the_recorded_buckets(tmp_path, warmup_timing):
    import bench_bucket_mlp
    from record_router_masks import load_masks

    data = bench_bucket_mlp.main(["--dry-run", "--ts", "16", "32", "--masks", str(MASKS), "--out", str(tmp_path)])
    rows = {(r["T"], r["variant"]): r for r in data["rows"]}
    assert data["args"]["capacity"] == 0.5 and data["args"]["masks"] == str(MASKS)
    assert data["masks_structure"] is None  # recorded before record_router_masks wrote the structure down
    assert not any(T == 16 and v in RECORDED for T, v in rows)           # decode-phase T: no recorded rows
    ffn = load_masks(MASKS)["ffn"]
    layer = len(ffn) // 2
    G = bench_bucket_mlp.SHAPE_DRY["F"] // bench_bucket_mlp.SHAPE_DRY["group_size"]
    window = ffn[layer][:32]                                             # [32, G_rec]
    tiled = window[:, [g % window.shape[1] for g in range(G)]]           # [32, G]: what the op is asked to compute
    for name, lists in zip(RECORDED, ("padded", "union")):
        r = rows[(32, name)]
        assert r["structure"] == "recorded" and r["config"]["prefill_lists"] == lists
        assert r["masks_layer"] == layer and r["masks_file"] == str(MASKS)
        assert r["rel_l2"] <= bench_bucket_mlp.TOL
        assert r["prototypes"] == len(window.unique(dim=0)) > 1
        assert r["capacity"] == tiled.float().mean().item()
        assert r["padding_factor"] >= 1 and r["union_block_factor"] >= 1
        assert r["ms"]["median"] > 0


def test_recorded_inputs_tile_the_window_to_the_8b_groups():
    import torch

    import bench_bucket_mlp
    from record_router_masks import load_masks

    rec = load_masks(MASKS)
    w = bench_bucket_mlp.recorded_inputs(rec, 3, 2048, 224, "cpu")
    m = rec["ffn"][3][:2048]                                             # [T, G_rec]
    protos, bucket = w["recorded"], w["recorded_bucket"]                 # [P, 224], [T]
    assert bucket.dtype == torch.int32 and protos.shape == (len(m.unique(dim=0)), 224)
    assert (protos[bucket.long()] == m[:, [g % m.shape[1] for g in range(224)]]).all()
    assert len(protos.unique(dim=0)) == protos.shape[0]                  # one bucket per distinct mask


def test_masks_errors_name_the_problem(tmp_path):
    import pytest

    import bench_bucket_mlp
    from record_router_masks import load_masks

    rec = load_masks(MASKS)
    n, L = rec["ffn"][0].shape[0], len(rec["ffn"])
    with pytest.raises(ValueError, match=f"fewer than T = {n + 1};"):       # checked before anything is timed
        bench_bucket_mlp.main(["--dry-run", "--ts", "32", str(n + 1), "--masks", str(MASKS), "--out", str(tmp_path)])
    with pytest.raises(ValueError, match=rf"layers 0\.\.{L - 1}"):
        bench_bucket_mlp.main(["--dry-run", "--ts", "32", "--masks", str(MASKS), "--masks-layer", str(L),
                               "--out", str(tmp_path)])
    short = dict(rec, ffn=[m[:20] for m in rec["ffn"]])
    with pytest.raises(ValueError, match="20 tokens per layer"):
        bench_bucket_mlp.recorded_inputs(short, 0, 32, 8, "cpu")
    with pytest.raises(ValueError, match="--masks-layer -1"):
        bench_bucket_mlp.recorded_inputs(rec, -1, 32, 8, "cpu")
    with pytest.raises(SystemExit):                                      # a layer without a recording to take it from
        bench_bucket_mlp.parse_args(["--dry-run", "--masks-layer", "3", "--out", str(tmp_path)])


def test_exact_mask_draw_puts_every_row_at_the_capacity():
    import torch

    import bench_bucket_mlp

    gen = torch.Generator().manual_seed(0)
    m = bench_bucket_mlp.draw_masks(50, 224, 0.5, "exact", gen)
    assert m.shape == (50, 224) and (m.sum(1) == 112).all()
    assert m.float().mean(0).min() > 0  # a random subset per row, not the same groups everywhere
    b = bench_bucket_mlp.draw_masks(50, 224, 0.5, "bernoulli", gen)
    assert b.shape == (50, 224) and b.sum(1).unique().numel() > 1
