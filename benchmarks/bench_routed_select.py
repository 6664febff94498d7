"""The router inside the select (kernels/routed_select.py, optimize(..., fuse_router_select=True)) beside what it
replaces, at prefill sizes.

    python benchmarks/bench_routed_select.py --out DIR
    python benchmarks/bench_routed_select.py --out DIR --dry-run    # tiny shapes, CPU, Triton interpreter

Per shape (bf16 tensors, the router's fp32 weight held as a bf16 pair, as split_routers gives it) and token count T,
each captured 20 times in one CUDA graph and timed per call (bench_gemv.timed: median over replays, CUDA events):

  router GEMM + select  split_router_mask (one bf16 GEMM with fp32 output), then the select (the MLP's act(g) * u,
                or o_proj's input), compiled by Inductor: what a dense-masked block runs without the option
  select alone  the same select on a mask computed beforehand, compiled by Inductor: the unfused select's share
  fused         wide.routed_(gated_)select's kernel at its default tile ("default"), and at each tile of SWEEP
                (rows x columns per program / columns per step, warps)

GB/s is the fused rows' bytes (the routed tensor(s) read, the output written, the router input read once) over
the time. Writes DIR/routed-select.json and DIR/routed-select.md (command, GPU, date). --dry-run runs every row
once on the CPU through the interpreter and checks the fused outputs against the reference: a check that the script
runs, not a measurement.
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# (name, D: router input width, G groups, GS columns per group, gated: the MLP's act(g) * u, else o_proj's input)
SHAPES = [("smollm2-135m ffn (24 x 64)", 576, 24, 64, True), ("smollm2-135m attention (9 x 64)", 576, 9, 64, False),
          ("llama-3.1-8b o (8 x 512)", 4096, 8, 512, False), ("llama-3.1-8b ffn (112 x 128)", 4096, 112, 128, True)]
SHAPES_DRY = [("tiny ffn", 40, 5, 12, True), ("tiny o", 40, 3, 16, False)]
# (rows, columns per program, columns per step, warps)
SWEEP = ((16, 512, 128, 4), (32, 512, 128, 8), (64, 512, 128, 8), (32, 256, 64, 4), (32, 1024, 128, 8),
         (64, 1024, 256, 8), (16, 256, 128, 4))
SWEEP_DRY = ((16, 16, 16, 4), (32, 64, 32, 4))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, nargs="+", default=[2048])
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from bench_gemv import timed, write_us_table
    from wide_compile.kernels import routed_select as RS
    from wide_compile.kernels.dense_masked import _select, gated_select_ref
    from wide_compile.routing import router_fns as fns
    from wide_compile.routing.routers import split_bf16

    dev = "cpu" if args.dry_run else "cuda"
    rows = []
    default = (RS.ROWS, RS.COLS, RS.SUB_COLS, 4)
    for name, D, G, GS, gated in (SHAPES_DRY if args.dry_run else SHAPES):
        gen = torch.Generator().manual_seed(0)
        w2 = split_bf16(torch.randn(G, D, generator=gen) / D ** 0.5, pad_to=4).to(dev)
        b = (torch.randn(G, generator=gen) * 0.3).to(dev)

        def unfused(a, u, h):
            m = fns.split_router_mask(h, w2, b)
            return gated_select_ref(a, u, m, GS) if gated else _select(a, m, GS)

        def select(a, u, m):
            return gated_select_ref(a, u, m, GS) if gated else _select(a, m, GS)

        if not args.dry_run:
            unfused, select = torch.compile(unfused), torch.compile(select)
        for T in args.tokens:
            N = G * GS
            h = torch.randn(T, D, generator=gen).to(torch.bfloat16).to(dev)
            a = torch.randn(T, N, generator=gen).to(torch.bfloat16).to(dev)
            u = torch.randn(T, N, generator=gen).to(torch.bfloat16).to(dev) if gated else None
            m = fns.split_router_mask(h, w2, b)
            nbytes = (T * N * 2) * (3 if gated else 2) + T * D * 2
            cases = [("router GEMM + select", lambda: unfused(a, u, h), None),
                     ("select alone", lambda: select(a, u, m), None)]
            for tile in (default, *[t for t in (SWEEP_DRY if args.dry_run else SWEEP) if t != default]):
                bt, bn, bns, w = tile
                label = "fused" if tile == default else f"fused {bt}x{bn}/{bns} w{w}"
                cases.append((label, lambda bt=bt, bn=bn, bns=bns, w=w: RS.routed_select_triton(
                    a, h, w2, b, GS, u, rows=bt, cols=bn, sub_cols=bns, num_warps=w), nbytes))
                if args.dry_run:  # act(g) * u within one bf16 ulp (the sigmoid's rounding), the select exactly
                    torch.testing.assert_close(cases[-1][1](), RS.routed_select_ref(a, h, w2, b, GS, u), atol=1e-6,
                                               rtol=2.0 ** -7 if gated else 0, msg=f"{name} {tile}")
            for label, fn, nb in cases:
                ms = timed(fn, args.dry_run)
                row = dict(shape=name, D=D, G=G, group_size=GS, T=T, variant=label, default=label == "fused",
                           us=round(ms * 1e3, 2), gbps=round(nb / ms / 1e6, 1) if nb else None)
                rows.append(row)
                print(f"{name:34s} T={T:5d} {label:26s} {row['us']:9.2f} us" + (f" {row['gbps']:8.1f} GB/s" if nb else ""),
                      flush=True)
    write_us_table(args.out, "routed-select", "bench_routed_select.py",
                   "The router inside the select against the router GEMM + select", rows, args.dry_run,
                   extra=[("GB/s", "gbps")])
    return rows



if __name__ == "__main__":
    main()
