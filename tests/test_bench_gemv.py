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


def test_write_config_keeps_the_fastest_tile_per_kernel(tmp_path, monkeypatch):
    """--write-config: the fastest row of each swept kernel (and layout) becomes the tuned file's entry, entries of
    kernels not swept stay, and the ops read the file back (the interpreter ignores it, so the lookup is faked)."""
    import bench_gemv
    from wide_compile.kernels import gemv

    monkeypatch.setattr(gemv, "TUNED_DIR", tmp_path / "tuned")
    rows = [dict(kernel="cublas down", layout="k_contiguous", config={}, ms=0.001),
            dict(kernel="gate_up", layout="-", config=dict(gu_bn=2), ms=0.03),
            dict(kernel="gate_up", layout="-", config=dict(gu_bn=4), ms=0.02),
            dict(kernel="gate_up", layout="-", config=dict(gu_bn=8), ms=0.05),
            dict(kernel="down", layout="k_contiguous", config=dict(gd_bn=4), ms=0.02),
            dict(kernel="down", layout="k_contiguous", config=dict(gd_bn=8), ms=0.01),
            dict(kernel="down", layout="d_contiguous", config=dict(gd_bn=64), ms=0.04)]
    assert bench_gemv.best_tiles(rows) == dict(gate_up=dict(gu_bn=4), down=dict(k_contiguous=dict(gd_bn=8),
                                                                                 d_contiguous=dict(gd_bn=64)))
    path = tmp_path / "tuned" / "X.json"
    path.parent.mkdir()
    path.write_text(json.dumps(dict(q_proj=dict(gu_bn=16), down=dict(d_contiguous=dict(gd_bn=256)))))
    (tmp_path / "out").mkdir()
    info = dict(command="cmd", date="today", out_json=str(tmp_path / "out" / "gemv.json"))
    bench_gemv.write_config(rows[:2] + rows[4:6], "X", path, info)
    got = json.loads(path.read_text())
    assert got == json.loads((tmp_path / "out" / "gemv-config.json").read_text())
    assert (got["q_proj"], got["gate_up"], got["down"]) == (dict(gu_bn=16), dict(gu_bn=2), dict(
        k_contiguous=dict(gd_bn=8), d_contiguous=dict(gd_bn=256)))

    data = bench_gemv.main(["--dry-run", "--out", str(tmp_path / "dry"), "--kernels", "gate_up", "--write-config"])
    files = list((tmp_path / "tuned").glob("*.json"))
    assert len(files) == 2 and data["device"].startswith("cpu")
    dry = json.loads(next(f for f in files if f.name != "X.json").read_text())
    assert set(dry) == {"device", "written_by", "date", "gate_up"} and dry["gate_up"] in bench_gemv.GU[:2]
