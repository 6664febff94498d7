#!/usr/bin/env python
"""Efficiency of the WIDE kernels from a kernel-benchmark JSON (bench_kernels.py output):
% of the HBM copy ceiling for few tokens (bytes of the active weights read), % of the bf16 matrix ceiling for
many tokens (FLOPs of the active work only).

    python benchmarks/kernel_efficiency.py benchmarks/results/kernels-h200.json [--markdown]

The ceilings (a device-to-device copy's bandwidth, an 8192^3 bf16 matrix product's rate on random data) are
read from benchmarks/results/device-ceilings-h200.json, which says where and how they were measured.
Active bytes at T tokens need the density of the union of the T tokens' masks (`union_density`); records
without it have only the per-token density, so their few-token rows are computed for T = 1 alone (where
the two are equal).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

CEILINGS = json.loads((Path(__file__).resolve().parent / "results" / "device-ceilings-h200.json").read_text())
HBM_CEIL = CEILINGS["hbm_copy_bytes_per_s"]   # B/s
TC_CEIL = CEILINGS["bf16_matmul_flop_per_s"]  # FLOP/s
BYTES = 2           # bf16


def shapes(model: str) -> dict:
    from bench_kernels import MODELS  # noqa: E402

    key = {"llama-3.1-8b": "llama3.1-8b"}.get(model, model)
    return MODELS[key]


def work(rec: dict) -> tuple[float | None, float | None]:
    """(active weight bytes read for few tokens, useful FLOPs) of one record."""
    s = shapes(rec["model"])
    D, F, Nq = s["D"], s["F"], s["nq"] * s["hd"]
    T, d = rec["T"], rec.get("actual_density", rec["density"])
    union = rec.get("union_density", d if T == 1 else None)
    per_weight = {"mlp": 3 * F * D, "attn_q": Nq * D, "attn_o": Nq * D}[rec["op"]]
    bytes_ = None if union is None else union * per_weight * BYTES
    flops = 2 * T * d * per_weight
    return bytes_, flops


def rows(path: str) -> list[dict]:
    data = json.loads(Path(path).read_text())
    out = []
    for r in data["records"]:
        if r["op"] not in ("mlp", "attn_q", "attn_o") or not r.get("wide_ms"):
            continue
        b, f = work(r)
        t = r["wide_ms"] * 1e-3
        row = {k: r[k] for k in ("op", "model", "T", "density", "masks")}
        row["mask_model"] = r.get("mask_model") or r["masks"]
        row["wide_ms"] = r["wide_ms"]
        if r["T"] <= 16 and b is not None:
            row["hbm_pct"] = round(100 * b / t / HBM_CEIL, 1)
        if r["T"] >= 128:
            row["tc_pct"] = round(100 * f / t / TC_CEIL, 1)
        if "hbm_pct" in row or "tc_pct" in row:
            out.append(row)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json")
    p.add_argument("--markdown", action="store_true")
    a = p.parse_args(argv)
    rs = rows(a.json)
    if a.markdown:
        print("| model | op | T | density | masks | WIDE ms | % HBM copy ceiling | % bf16 matrix ceiling |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rs:
            print(f"| {r['model']} | {r['op']} | {r['T']} | {r['density']} | {r['mask_model']} | {r['wide_ms']:.4f} | "
                  f"{r.get('hbm_pct', '–')} | {r.get('tc_pct', '–')} |")
    else:
        print(json.dumps(rs, indent=1))


if __name__ == "__main__":
    main()
