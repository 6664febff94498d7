"""The fused residual add + RMSNorm + router (kernels/norm_router.py) beside what it replaces, at decode and prefill
sizes.

    python benchmarks/bench_norm_router.py --out DIR
    python benchmarks/bench_norm_router.py --out DIR --dry-run    # tiny shapes, CPU, Triton interpreter

Per model shape (SmolLM2-135M, Llama-3.1-8B; bf16 activations, fp32 routers as trained) and token count T, each
captured 20 times in one CUDA graph and timed per call (bench_gemv.timed: median over replays, CUDA events):

  norm          a + b, then the RMSNorm, compiled by Inductor (one launch): what a dense block runs
  norm+router   the same plus the linear router's logits > 0 in fp32, compiled by Inductor: WIDE unfused
  fused S=k     wide.add_rmsnorm_router (one launch) with k programs per token row, each computing a slice of
                the router's rows over the whole width; "default" marks row_splits' choice
  from T = TILE_MIN_T (prefill sizes), instead of the row splits:
  norm+split router  the norm compiled by Inductor, then the router as split_routers runs it by default (one bf16
                tensor-core GEMM over the weight as a bf16 pair, fp32 output, the threshold): WIDE unfused
  fused rows    the fused kernel, one program per token row
  fused tiles   the fused kernel's tiles form (rows in tiles, the router's dots on tensor cores): its default here
  fused tiles BTxBG  the same with BT rows and BG router rows per program (TILE_SWEEP, the ones that differ from
                the default and do not exceed the router)
  fused tiles BTxBGxBD wW  at a narrow model's width: BT rows, BD columns per step (the whole row: one pass, the
                ONE_PASS form; fewer: two passes in column steps) and W warps per program (NARROW_SWEEP)

Writes DIR/norm-router.json and DIR/norm-router.md (command, GPU, date). --dry-run runs every row once on the CPU
through the interpreter and checks the fused outputs against the reference: a check that the script runs, not a
measurement.
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# (name, D, G): linear routers, one logit per group (a pair router runs as one: norm_router.compose_pair)
SHAPES = [("smollm2-135m ffn (24 groups)", 576, 24), ("smollm2-135m attention (9 groups)", 576, 9),
          ("llama-3.1-8b ffn (112 groups)", 4096, 112)]
SHAPES_DRY = [("tiny", 300, 3)]  # splits 1 to 3
SPLITS = (1, 2, 3, 4, 8, 16, 32, 64, 112)
TILE_SWEEP = ((16, 16), (16, 32), (16, 64), (32, 32), (32, 64), (32, 128), (64, 64))
NARROW_SWEEP = ((16, 1024, 4), (16, 1024, 8), (32, 1024, 8), (16, 256, 4), (16, 64, 4), (32, 64, 4), (16, 128, 4))


def swept_tiles(T: int, D: int, G: int, dtype) -> dict:
    """{label: launch options} of the tiles form's sweep rows at a prefill size: TILE_SWEEP's (rows, router rows)
    other than the default's, with router tiles no wider than the router needs (16, or up to twice G); at a width
    the one-pass form can take (bf16 rows of at most ONE_PASS_D columns), NARROW_SWEEP's (rows, column step, warps)
    at the default router tile instead: the one pass at several rows and warps, and two passes in other steps."""
    import torch
    import triton

    from wide_compile.kernels import norm_router as NR

    bt0, bg0, bd0 = NR.tile_sizes(T, D, G, dtype)
    if dtype in (torch.bfloat16, torch.float16) and triton.next_power_of_2(D) <= NR.ONE_PASS_D:
        return {f"fused tiles {bt}x{bg0}x{bd} w{w}": dict(tiles=True, tile=(bt, bg0, bd, w))
                for bt, bd, w in NARROW_SWEEP if (bt, bd, w) != (bt0, bd0, NR.tile_warps(bt0, bg0, bd0))}
    return {f"fused tiles {bt}x{bg}": dict(tiles=True, tile=(bt, bg)) for bt, bg in TILE_SWEEP
            if (bt, bg) != (bt0, bg0) and bg <= max(16, 2 * G)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 2048])
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from bench_gemv import timed, write_us_table
    from wide_compile.kernels import norm_router as NR
    from wide_compile.routing import router_fns as fns
    from wide_compile.routing.routers import split_bf16

    dev = "cpu" if args.dry_run else "cuda"
    dt = torch.float32 if args.dry_run else torch.bfloat16
    eps = 1e-5
    rows = []
    for name, D, G in (SHAPES_DRY if args.dry_run else SHAPES):
        gen = torch.Generator().manual_seed(0)
        w1 = (torch.randn(G, D, generator=gen) / D ** 0.5).to(dev)
        b1 = (torch.randn(G, generator=gen) * 0.1).to(dev)
        w_norm = (1 + 0.1 * torch.randn(D, generator=gen)).to(dt).to(dev)

        def dense(a, b):
            x = a + b
            xf = x.float()
            return x, w_norm * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

        def unfused(a, b):
            x, y = dense(a, b)
            return x, y, torch.nn.functional.linear(y.float(), w1, b1) > 0

        w_split = split_bf16(w1)

        def unfused_split(a, b):
            x, y = dense(a, b)
            return x, y, fns.split_router_mask(y, w_split, b1)

        compiled = {"norm": dense, "norm+router": unfused, "norm+split router": unfused_split}
        if not args.dry_run:
            compiled = {k: torch.compile(f) for k, f in compiled.items()}
        for T in args.tokens:
            a = torch.randn(T, D, generator=gen).to(dt).to(dev)
            b = torch.randn(T, D, generator=gen).to(dt).to(dev)
            prefill = T >= NR.TILE_MIN_T
            cases = [(k, (lambda f=f: f(a, b))) for k, f in compiled.items() if prefill or k != "norm+split router"]
            if prefill:
                default = "fused tiles"
                fused = {"fused rows": dict(tiles=False), "fused tiles": dict(tiles=True)}
                fused.update(swept_tiles(T, D, G, dt))
            else:
                s0 = NR.row_splits(T, D, G)[0]
                default = f"fused S={s0}"
                fused = {f"fused S={s}": dict(split=s)  # the programs per row the row splits run
                         for s in sorted({NR.row_splits(T, D, G, k)[0] for k in SPLITS if k <= G} | {s0})}
            for label, kw in fused.items():
                cases.append((label, lambda kw=kw: NR.add_rmsnorm_router_triton(a, b, w_norm, eps, "normed",
                                                                                "linear", w1, b1, **kw)))
                if args.dry_run:
                    x, y, m = cases[-1][1]()
                    xr, yr, mr = NR.add_rmsnorm_router_ref(a, b, w_norm, eps, "normed", "linear", w1, b1)
                    assert torch.allclose(y, yr, atol=1e-5) and torch.equal(x, xr) and torch.equal(m, mr), name
            for label, fn in cases:
                ms = timed(fn, args.dry_run)
                is_default = label == default
                rows.append(dict(shape=name, D=D, G=G, T=T, variant=label, default=is_default, us=round(ms * 1e3, 2)))
                print(f"{name:40s} T={T:4d} {label:18s}{' (default)' if is_default else '':10s} {ms * 1e3:8.2f} us",
                      flush=True)
    write_us_table(args.out, "norm-router", "bench_norm_router.py",
                   "Fused add + RMSNorm + router at decode and prefill sizes", rows, args.dry_run)
    return rows



if __name__ == "__main__":
    main()
