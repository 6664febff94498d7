"""benchmarks/bench_gemv.py runs end to end on the CPU in --dry-run mode (tiny shapes, the GEMV kernels through the
Triton interpreter, each kernel checked against its reference before it is timed) and writes the JSON and markdown
the GPU run writes. CPU speed numbers are not asserted."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_dry_run_writes_checked_rows(tmp_path):
    import bench_gemv

    data = bench_gemv.main(["--dry-run", "--out", str(tmp_path), "--kernels", "gate_up", "down_k", "q_proj",
                            "o_proj_d"])
    assert json.loads((tmp_path / "gemv.json").read_text()) == json.loads(json.dumps(data))
    md = (tmp_path / "gemv.md").read_text()
    assert data["command"] in md and data["device"] in md
    kinds = [(r["kernel"], r["layout"]) for r in data["rows"]]
    assert kinds == ([("cublas gate+up", "-"), ("cublas down", "k_contiguous")] + [("gate_up", "-")] * 2
                     + [("down", "k_contiguous")] * 2 + [("q_proj", "-")] * 2 + [("o_proj", "d_contiguous")] * 2)
    assert all(r["ms"] > 0 and r["bytes"] > 0 for r in data["rows"])


def test_a_wrong_kernel_fails_its_check(tmp_path, monkeypatch):
    """The check before timing can fail: a q_proj whose output is halved."""
    import bench_gemv
    from wide_compile.kernels import gemv

    real = gemv.q_proj_gemv_triton
    monkeypatch.setattr(gemv, "q_proj_gemv_triton", lambda *a, **k: real(*a, **k) * 0.5)
    import pytest

    with pytest.raises(AssertionError, match="q_proj"):
        bench_gemv.main(["--dry-run", "--out", str(tmp_path), "--kernels", "q_proj"])
