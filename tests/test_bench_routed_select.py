"""benchmarks/bench_routed_select.py runs end to end on the CPU in --dry-run mode (the fused kernel through the Triton
interpreter at every swept tile, each checked against the reference inside the script) and writes its records."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_dry_run_writes_every_row(tmp_path):
    import bench_routed_select as B

    rows = B.main(["--dry-run", "--out", str(tmp_path), "--tokens", "3", "37"])
    data = json.loads((tmp_path / "routed-select.json").read_text())
    assert data["rows"] == rows and "bench_routed_select.py" in data["command"]
    for name, *_ in B.SHAPES_DRY:
        for T in (3, 37):
            got = [r["variant"] for r in rows if r["shape"] == name and r["T"] == T]
            assert got == ["router GEMM + select", "select alone", "fused", "fused 16x16/16 w4", "fused 32x64/32 w4"]
    assert sum(r["default"] for r in rows) == 2 * len(B.SHAPES_DRY)
    assert all((r["gbps"] is None) == (not r["variant"].startswith("fused")) for r in rows)
    assert "| tiny o | 37 | fused (default)" in (tmp_path / "routed-select.md").read_text()
