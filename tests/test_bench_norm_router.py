"""benchmarks/bench_norm_router.py runs end to end on the CPU in --dry-run mode (the fused kernel through the Triton
interpreter, each split checked against the reference inside the script) and writes its records."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_dry_run_writes_every_split(tmp_path):
    import bench_norm_router

    rows = bench_norm_router.main(["--dry-run", "--out", str(tmp_path), "--tokens", "1", "3", "130"])
    data = json.loads((tmp_path / "norm-router.json").read_text())
    assert data["rows"] == rows and "bench_norm_router.py" in data["command"]
    for T in (1, 3):
        got = [r["variant"] for r in rows if r["T"] == T]
        assert got == ["norm", "norm+router", "fused S=1", "fused S=2", "fused S=3"]
        assert sum(r["default"] for r in rows if r["T"] == T) == 1
    # a prefill size: the unfused split router, the fused kernel's rows and tiles forms (the tiles its default)
    got = [r["variant"] for r in rows if r["T"] == 130]
    assert got == ["norm", "norm+router", "norm+split router", "fused rows", "fused tiles"]  # G = 3: no other tile
    assert [r["variant"] for r in rows if r["T"] == 130 and r["default"]] == ["fused tiles"]
    assert "| tiny | 3 | fused S=3" in (tmp_path / "norm-router.md").read_text()


def test_swept_tiles_at_the_model_shapes():
    import torch

    import bench_norm_router as B

    smol = B.swept_tiles(2048, 576, 24, torch.bfloat16)      # default 16 x 32 x 64, 4 warps: two passes
    assert list(smol) == ["fused tiles 16x32x1024 w4", "fused tiles 16x32x1024 w8", "fused tiles 32x32x1024 w8",
                          "fused tiles 16x32x256 w4", "fused tiles 32x32x64 w4",
                          "fused tiles 16x32x128 w4"]
    assert all(v["tile"][1] == 32 for v in smol.values())
    big = B.swept_tiles(2048, 4096, 224, torch.bfloat16)     # default 32 x 64
    assert "fused tiles 32x64" not in big and "fused tiles 32x128" in big and len(big) == len(B.TILE_SWEEP) - 1
    assert all(v["tiles"] and v["tile"] for v in big.values())
