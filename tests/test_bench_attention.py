"""benchmarks/bench_attention.py runs end to end on the CPU in --dry-run mode (tiny shapes, the Triton
interpreter) and writes the rows the kernel tables need. CPU speed numbers are not asserted."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

ROW_KEYS = ("what", "variant", "T", "batch", "Hq", "Hkv", "d", "capacity", "masks", "ms", "speedup", "device",
            "torch", "triton", "date", "command")
WIDE_KEYS = ("group_size", "config", "rel_l2_active_vs_sdpa", "active_fraction", "flop_fraction")


def test_prefill_dry_run_writes_rows(tmp_path):
    import bench_attention

    out = tmp_path / "attn.json"
    data = bench_attention.main(["--what", "prefill", "--dry-run", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(data))
    rows = data["rows"]
    assert {(r["T"], r["variant"]) for r in rows} == {(T, v) for T in (17, 33)
                                                      for v in ("sdpa_flash", "wide_gs2", "wide_gs1")}
    for r in rows:
        assert all(k in r for k in ROW_KEYS), [k for k in ROW_KEYS if k not in r]
        assert set(r["ms"]) == {"median", "q25", "q75", "min", "max", "n"} and r["ms"]["median"] > 0
        if r["variant"] != "sdpa_flash":
            assert all(k in r for k in WIDE_KEYS)
            assert r["rel_l2_active_vs_sdpa"] <= bench_attention.TOL_ACTIVE
            assert 0 < r["flop_fraction"] < 1


def test_sweep_and_the_active_row_check(tmp_path, monkeypatch):
    import bench_attention
    import pytest
    import torch
    from wide_compile.kernels import attn_prefill

    unfit = dict(BLOCK_M=8, BLOCK_N=16, num_warps=1, num_stages=1)  # a candidate the launcher rejects
    monkeypatch.setattr(attn_prefill, "SWEEP", attn_prefill.SWEEP + (unfit,))
    data = bench_attention.main(["--what", "prefill", "--dry-run", "--sweep", "--ts", "5", "--out",
                                 str(tmp_path / "a.json")])
    rows = data["rows"]
    assert len(rows) == 1 + 2 * (1 + len(attn_prefill.SWEEP))
    failed = [r for r in rows if "error" in r]
    assert [r["config"] for r in failed] == [unfit, unfit] and "power of two" in failed[0]["error"]
    # the check before timing fails on a wrong active row and on a nonzero inactive row
    mask = torch.tensor([[[True, False]]])
    ref = torch.ones(1, 2, 1, 4)
    with pytest.raises(AssertionError, match="active rows"):
        bench_attention.check_active_rows(torch.tensor([[[[1.0] * 4]], [[[0.0] * 4]]]).view(1, 2, 1, 4) * 2, ref,
                                          mask, 1)
    with pytest.raises(AssertionError, match="inactive row"):
        bench_attention.check_active_rows(ref.clone(), ref, mask, 1)
    good = torch.cat([ref[:, :1], torch.zeros(1, 1, 1, 4)], dim=1)
    assert bench_attention.check_active_rows(good, ref, mask, 1) == 0


def test_tuned_file_from_a_sweep_record(tmp_path):
    """--config-from SWEEP --write-config: each swept shape's fastest config, with its time and source; the
    file round-trips through attn_decode's check and picks the recorded best per shape. A row without a best
    (a CPU dry run) is refused."""
    import attention_decode

    from wide_compile.kernels import attn_decode as AD

    cfg = lambda n: json.dumps({"block_n": n, "num_stages": 2, "num_warps": 4, "programs_per_sm": 8},
                               sort_keys=True)
    rows = [{"B": B, "ctx": ctx, "best": cfg(best),
             "times": {cfg(64): {"median_ms": 0.02 if best == 128 else 0.01},
                       cfg(128): {"median_ms": 0.01 if best == 128 else 0.02}}}
            for B, ctx, best in [(1, 4096, 64), (8, 16384, 128)]]
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"machine": {"device": "GPU X"}, "rows": rows, "command": "c", "date": "d"}))
    out = tmp_path / "GPU_X.json"
    attention_decode.main(["--config-from", str(sweep), "--write-config", str(out)])
    tuned = json.loads(out.read_text())
    assert tuned["device"] == "GPU X" and tuned["source"] == str(sweep)
    assert [(r["B"], r["Hkv"], r["ctx"], r["config"]["block_n"], r["median_us"]) for r in tuned["rows"]] == [
        (1, 8, 4096, 64, 10.0), (8, 8, 16384, 128, 10.0)]
    assert AD.nearest_config(AD.check_tuned(tuned, "t"), 8, 8, 8192)["block_n"] == 128
    rows[0]["best"] = None
    sweep.write_text(json.dumps({"machine": {"device": "cpu"}, "rows": rows}))
    with pytest.raises(SystemExit, match="no best config"):
        attention_decode.main(["--config-from", str(sweep), "--write-config", str(out)])
    with pytest.raises(SystemExit, match="--write-config takes"):
        attention_decode.main(["--config-from", str(sweep)])


def test_decode_dry_run_writes_checked_rows(tmp_path):
    """--what decode: the rows of attention_decode.decode_row (KV-aligned and 1-head groups), each checked
    against the float64 reference before timing; the KV heads a KV-aligned row reads follow its capacity."""
    import bench_attention

    data = bench_attention.main(["--what", "decode", "--dry-run", "--out", str(tmp_path / "d.json")])
    rows = data["rows"]
    assert [r["group_size"] for r in rows] == [4, 1] and all(r["what"] == "decode" for r in rows)
    for r in rows:
        assert r["rel_err"] <= 1e-4 and set(r["times"]) >= {"wide", "wide_all_on", "sdpa"}
    assert rows[0]["kv_heads_read"] == 0.5
