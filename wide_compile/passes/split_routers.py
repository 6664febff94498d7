"""Pass 10 (default; optimize(..., split_routers=False) turns it off): in bf16 graphs of prefill size, each unfused
linear router (a linear one, or a pair router compose_routers made linear) runs on tensor cores over its weight as
a bf16 pair.

An fp32 router GEMM runs without tensor cores: at a prefill, cuBLAS runs it as SIMT GEMMs, a visible share of a
small model's step (benchmarks/results/lean-h100, the fifth run's prefill profile). router_fns.split_router_mask
runs one bf16 GEMM h @ [hi; lo]^T with fp32 accumulation and output over the weight held as a bf16 pair
(routers.split_bf16: about 16 mantissa bits), then hi + lo, the bias and the threshold. A product of two bf16
values is exact in fp32, so with bf16 inputs the decisions are the fp32 ones up to rounding. How many flip, and
what the same GEMM form (router_dtype="bf16x2") measured against fp32 routers: benchmarks/results/router-dtype/.

Which blocks: a rewritten block whose router is unfused, linear (fuse_norm_router.match_router; float32 weights
held in the graph) and reads a bf16 input, in a graph of more than DECODE_T tokens. Smaller graphs keep the fp32
weight, which sum_routers sums; routers the Routers object split already (Routers.split_bf16_) arrive split.
"""
from __future__ import annotations

import torch

from ..kernels.tuning import DECODE_T
from ..routing import router_fns as fns
from ._graph import meta, static_rows
from .base import Pass, PassContext, log
from .fuse_norm_router import match_router, replace_router, unfused_routers

PAD_GROUPS = 4


class SplitRouters(Pass):
    name = "split_routers"

    def __call__(self, ctx: PassContext) -> None:
        from ..routing.routers import split_bf16

        for blk in unfused_routers(ctx):
            r, _ = match_router(blk.mask)
            if r is None or r[0] != "linear" or not _splits(r[1]):
                continue
            _, h, (w, b), nodes = r
            if not ctx.weights.is_static_weight(w):
                log.info("wide: layer %d: router kept in fp32: its weight is not static", blk.layer)
                continue
            real = ctx.weights.tensor(w)
            with torch.no_grad():
                # each half padded to a multiple of PAD_GROUPS rows, so the GEMM's N (2 Gp) is a multiple of 8 as
                # cuBLAS's tensor-core kernels want: SmolLM2's 9 head groups give N = 18, which cuBLAS runs on an
                # unaligned cutlass kernel (the SmolLM2 prefill profile in benchmarks/results/lean-h100/run6/). The
                # bias's length says G to split_logits, so a router without one keeps its halves unpadded
                pad = PAD_GROUPS if b is not None else 1
                w2 = ctx.weights.constant(("split_router", id(real)), "router_w2",
                                          lambda: split_bf16(real, pad_to=pad), before=blk.mask)
            replace_router(ctx, blk, fns.split_router_mask, h, w2, b, nodes)
            ctx.weights.drop_constant(w)  # a composed router's fp32 weight, a constant of its own, is read no more
            blk.router_forms.append("split")
            ctx.count("split_routers.split")
            log.info("wide: layer %d: router on tensor cores over a bf16 pair", blk.layer)


def _splits(h) -> bool:
    """The router input is bf16 (the pair's products are exact in fp32) in a graph of more than DECODE_T tokens."""
    v, rows = meta(h), static_rows(h)
    return v is not None and v.dtype == torch.bfloat16 and rows is not None and rows > DECODE_T
