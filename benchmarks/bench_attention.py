"""WIDE attention kernels against SDPA (flash backend) on a CUDA GPU.

    python benchmarks/bench_attention.py --what prefill --out X.json [--sweep] [--ts 2048 8192]
    python benchmarks/bench_attention.py --what prefill --out X.json --dry-run   # tiny, CPU, Triton interpreter
    python benchmarks/bench_attention.py --what decode --out X.json              # decode table (attention_decode.py)

prefill (bench_prefill): the query-sparse prefill kernel (wide_compile/kernels/attn_prefill.py, its mask
reordering launch included) against F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
forced to the flash backend, 8B attention shape (Hq 32, Hkv 8, d 128, bf16), batch 1, T = 2048 and 8192.
Masks: iid Bernoulli(capacity) per (token, head group), for KV-aligned groups (group_size 4: the 4 query heads
of one KV head) and 1-head groups. q is laid out as a Llama attention hands it over ([B, T, Hq, d] transposed).

Before timing, each variant's output is checked against SDPA's on the active rows (relative L2 <= 2e-2, both in
bf16) and must be exactly 0 on the inactive rows. Timing: each callable is captured once in a CUDA graph, and
the graph's replay is timed with triton.testing.do_bench (L2 cleared before each repetition); the variants
take turns for --rounds rounds (A/B interleaved) and a row reports the median, quartiles, min and max over all
repetitions, and the speedup = SDPA's median / the variant's median, both from this run.
--sweep: also times the kernel's candidate tile configs (attn_prefill.SWEEP); a candidate that fails on this GPU
(e.g. out of shared memory) becomes a row with its error.

BENCHES maps each --what to its function; each returns a list of JSON rows.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SHAPE_8B = dict(Hq=32, Hkv=8, d=128)
SHAPE_DRY = dict(Hq=4, Hkv=2, d=16)
TOL_ACTIVE = 2e-2


# ----------------------------------------------------------------------------- timing

def _stats(times_ms: list) -> dict:
    q = statistics.quantiles(times_ms, n=4) if len(times_ms) > 1 else [times_ms[0]] * 3
    return dict(median=statistics.median(times_ms), q25=q[0], q75=q[2], min=min(times_ms), max=max(times_ms),
                n=len(times_ms))


def time_interleaved(fns: dict, rounds: int, dry: bool) -> dict:
    """{name: fn} -> {name: _stats of ms per call}; the callables take turns, `rounds` times."""
    samples = {name: [] for name in fns}
    if dry:  # the interpreter: wall time of a few eager calls (smoke test of the plumbing, not a measurement)
        for _ in range(rounds):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                samples[name].append((time.perf_counter() - t0) * 1e3)
        return {name: _stats(v) for name, v in samples.items()}
    from triton.testing import do_bench

    from benchmarks.e2e.timing import cuda_graph_step

    graphs = {name: cuda_graph_step(fn, None)[1] for name, fn in fns.items()}  # one call each, warmed up first
    for _ in range(rounds):
        for name, g in graphs.items():
            samples[name] += list(do_bench(g.replay, warmup=25, rep=200, return_mode="all"))
    return {name: _stats(v) for name, v in samples.items()}


# ----------------------------------------------------------------------------- prefill

def causal_flops(T: int, d: int, heads: int, window=None) -> float:
    """FLOPs of causal attention (QK^T and PV, 2 FLOPs per multiply-add) over `heads` full rows."""
    keys = sum(min(t + 1, window or T) for t in range(T))
    return 4.0 * d * keys * heads


def active_flops(mask, group_size: int, d: int) -> float:
    """FLOPs of the active rows only (each active (token t, head) row attends to t + 1 keys)."""
    import torch

    pos = torch.arange(mask.shape[1], device=mask.device, dtype=torch.float64)[None, :, None] + 1
    return float(4.0 * d * group_size * (mask.to(torch.float64) * pos).sum())


def check_active_rows(out, ref, mask, group_size: int) -> float:
    """Relative L2 error of out vs ref on the active rows; raises when an inactive row is not exactly 0."""
    from wide_compile.kernels.attn_prefill import row_mask

    rows = row_mask(mask, group_size).expand_as(out)
    if (out[~rows] != 0).any():
        raise AssertionError("attn_prefill: an inactive row is not exactly 0")
    a, r = out[rows].double(), ref[rows].double()
    err = ((a - r).norm() / r.norm().clamp_min(1e-30)).item() if a.numel() else 0.0
    if not err <= TOL_ACTIVE:
        raise AssertionError(f"attn_prefill: relative L2 error {err:.3e} on the active rows > {TOL_ACTIVE}")
    return err


def _sdpa_call(q, k, v, dry: bool):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa():
        if dry:  # no flash backend on the CPU
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return sdpa


def bench_prefill(args) -> list:
    """Rows for the prefill table: per T, SDPA (flash) and the kernel with KV-aligned and 1-head groups."""
    import torch
    from wide_compile.kernels.attn_prefill import SWEEP, attn_prefill_triton, config_for

    dev, dtype = ("cpu", torch.float32) if args.dry_run else ("cuda", torch.bfloat16)
    shape = SHAPE_DRY if args.dry_run else SHAPE_8B
    Hq, Hkv, d = shape["Hq"], shape["Hkv"], shape["d"]
    group_sizes = (Hq // Hkv, 1)
    configs = [None] + ([dict(c) for c in SWEEP] if args.sweep else [])
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    rows = []
    for T in args.ts:
        q = torch.randn(args.batch, T, Hq, d, generator=gen).to(dev, dtype).transpose(1, 2)
        k = torch.randn(args.batch, Hkv, T, d, generator=gen).to(dev, dtype)
        v = torch.randn(args.batch, Hkv, T, d, generator=gen).to(dev, dtype)
        sdpa = _sdpa_call(q, k, v, args.dry_run)
        ref = sdpa()
        fns, meta, failed = {"sdpa": sdpa}, {}, []
        for gs in group_sizes:
            mask = (torch.rand(args.batch, T, Hq // gs, generator=gen) < args.capacity).to(dev)
            for cfg in configs:
                name = f"wide_gs{gs}" + ("" if cfg is None else
                                         "_m{BLOCK_M}n{BLOCK_N}w{num_warps}s{num_stages}".format(**cfg))
                fn = (lambda m=mask, g=gs, c=cfg: attn_prefill_triton(q, k, v, m, g, config=c))
                try:
                    err = check_active_rows(fn(), ref, mask, gs)
                except Exception as e:  # a swept tile that does not fit this GPU is a row, not the end of the run
                    if cfg is None:
                        raise
                    failed.append(dict(variant=name, T=T, group_size=gs, config=cfg, error=repr(e)[:300],
                                       **_shape_fields(args, shape)))
                    continue
                fns[name] = fn
                meta[name] = dict(group_size=gs, config=config_for(d, cfg), rel_l2_active_vs_sdpa=err,
                                  active_fraction=mask.float().mean().item(),
                                  flops=active_flops(mask, gs, d))
        times = time_interleaved(fns, args.rounds, args.dry_run)
        dense_flops = causal_flops(T, d, Hq) * args.batch
        base = times["sdpa"]["median"]
        rows.append(dict(variant="sdpa_flash", T=T, ms=times["sdpa"], speedup=1.0,
                         tflops=dense_flops / base * 1e-9, **_shape_fields(args, shape)))
        for name, info in meta.items():
            t = times[name]
            rows.append(dict(variant=name, T=T, ms=t, speedup=base / t["median"],
                             tflops=info["flops"] / t["median"] * 1e-9,
                             flop_fraction=info["flops"] / dense_flops, **info, **_shape_fields(args, shape)))
            print(f"prefill T={T:6d} {name:28s} {t['median']:8.4f} ms (sdpa {base:8.4f})  "
                  f"{base / t['median']:5.2f}x  err {info['rel_l2_active_vs_sdpa']:.1e}", flush=True)
        rows += failed
    return rows


def _shape_fields(args, shape) -> dict:
    dtype = "float32" if args.dry_run else "bfloat16"
    return dict(what="prefill", batch=args.batch, capacity=args.capacity, masks="random", dtype=dtype, causal=True,
                **shape)


def bench_decode(args) -> list:
    """The decode table of benchmarks/attention_decode.py (wide.attn_decode against SDPA, CUDA-graph replays;
    its --sweep times the kernel's configs): ctx 1024 / 4096 / 16384, batch 1 / 8, KV-aligned and 1-head groups."""
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from attention_decode import decode_row

    if args.dry_run:
        dev, dtype, shape, grid, inner = torch.device("cpu"), torch.float32, (8, 2, 16), [(2, 70)], 1
    else:
        dev, dtype, shape, inner = torch.device("cuda"), torch.bfloat16, (32, 8, 128), 20
        grid = [(b, c) for b in (1, 8) for c in (1024, 4096, 16384)]
    rows = []
    for gs in (shape[0] // shape[1], 1):
        for B, ctx in grid:
            r = decode_row(B, *shape, ctx, gs, args.capacity, dtype, dev, inner, args.rounds, seed=args.seed)
            rows.append({"what": "decode", **r})
    return rows


BENCHES = {"prefill": bench_prefill, "decode": bench_decode}


# ----------------------------------------------------------------------------- CLI

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--what", nargs="+", choices=sorted(BENCHES) + ["all"], default=["all"])
    ap.add_argument("--out", required=True, help="JSON file to write the rows to")
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny shapes on the CPU under the Triton interpreter (a smoke test of this script)")
    ap.add_argument("--ts", nargs="+", type=int, default=None, help="prefill token counts (default 2048 8192)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--capacity", type=float, default=0.5, help="share of active (token, head group) pairs")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds (default 5; dry run 1)")
    ap.add_argument("--sweep", action="store_true", help="also time the kernel's candidate tile configs")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.ts is None:
        args.ts = [17, 33] if args.dry_run else [2048, 8192]
    if args.rounds is None:
        args.rounds = 1 if args.dry_run else 5
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.dry_run:  # before anything imports triton: the kernels then run on the CPU interpreter
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import triton

    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("bench_attention.py times CUDA kernels: run it on a GPU, or pass --dry-run on a CPU")
    device = "cpu (dry run, Triton interpreter)" if args.dry_run else torch.cuda.get_device_name()
    whats = sorted(BENCHES) if "all" in args.what else args.what
    rows = []
    for what in whats:
        rows += BENCHES[what](args)
    info = dict(device=device, torch=torch.__version__, triton=triton.__version__,
                date=datetime.date.today().isoformat(), command="python " + " ".join(sys.argv if argv is None
                                                                                   else [__file__] + list(argv)),
                timing=("wall time of eager calls (dry run)" if args.dry_run else
                        "CUDA graph replay of one call, triton do_bench (L2 cleared per rep), variants interleaved "
                        f"for {args.rounds} rounds"))
    out = dict(rows=[{**r, **info} for r in rows], **info)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {len(rows)} rows to {args.out}")
    return out


if __name__ == "__main__":
    main()
