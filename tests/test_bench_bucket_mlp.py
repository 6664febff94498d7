"""benchmarks/bench_bucket_mlp.py runs end to end on the CPU in --dry-run mode (tiny shapes, the WIDE kernels
through the Triton interpreter) and writes the JSON and markdown the GPU run writes. CPU speed numbers are not
asserted."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

VARIANTS = ("dense", "static", "free", "bucket_codebook", "bucket_nested")
ONE_TOKEN = ("dense", "static", "free", "free_gemv", "bucket_codebook", "bucket_nested", "bucket_codebook_union")


def test_dry_run_writes_checked_rows(tmp_path):
    import bench_bucket_mlp

    data = bench_bucket_mlp.main(["--dry-run", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "bucket-mlp.json").read_text()) == json.loads(json.dumps(data))
    md = (tmp_path / "bucket-mlp.md").read_text()
    assert data["command"] in md and data["device"] in md and data["date"] in md
    rows = data["rows"]
    assert [(r["T"], r["variant"]) for r in rows] == ([(1, v) for v in ONE_TOKEN]
                                                     + [(17, v) for v in VARIANTS + ("bucket_codebook_unionblocks",)])
    for r in rows:
        assert set(r["ms"]) == {"median", "p10", "p90", "n", "min"} and r["ms"]["median"] > 0
        assert r["speedup_vs_dense"] > 0 and 0 <= r["capacity"] <= 1
        if r["variant"] not in ("dense", "static"):
            assert r["rel_l2"] <= bench_bucket_mlp.TOL


def test_sweep_rows_and_nested_prototypes(tmp_path):
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
    assert names == (list(ONE_TOKEN[:4]) + [f"free_gemv_{i}" for i in range(len(sw["d_contiguous"]))]
                     + list(ONE_TOKEN[4:]) + [f"bucket_codebook_gemv_{i}" for i in range(len(sw["k_contiguous"]))])
    assert all(r["rel_l2"] <= bench_bucket_mlp.TOL for r in data["rows"] if "rel_l2" in r)
    protos = bench_bucket_mlp.nested_protos(16, 224)
    assert protos.float().mean().item() == 0.5                           # mean width G / 2
    assert (protos[:, :-1] >= protos[:, 1:]).all()                       # prefixes
