"""Pass 8 (default; optimize(..., compose_routers=False) keeps the two layers): the method's pair router as the
one linear map it is.

A pair router (routing/router_fns.pair_router_mask: hidden -> rank r -> one (skip, execute) logit pair per group,
execute iff the margin z_exec - z_skip > 0) has no nonlinearity between its layers, so its margin is
h @ W^T + c with W = (w_up[1::2] - w_up[0::2]) @ w_down [G, D] (norm_router.compose_pair, built in float64 and
stored fp32 once at compile time). Run as traced it is two fp32 GEMMs (no tensor cores: cuBLAS dot / reduce
kernels at decode, SIMT GEMMs at prefill), a view and a difference. Composed it is one GEMM of G outputs and a
threshold, whose logits differ from the two-layer form's by rounding only (the freedom any compiled fp32 GEMM
has: a decision within fp32 rounding of 0 may flip).

With `split` (optimize(..., router_dtype="bf16x2")), a composed router whose input is bf16 in a graph of more
than DECODE_T tokens runs as router_fns.split_router_mask: one bf16 tensor-core GEMM over the composed weight
held as a bf16 pair, fp32 accumulation and output, where the fp32 GEMM runs without tensor cores (a prefill's
routers as SIMT GEMMs). A product of two bf16 values is exact in fp32, and the pair holds the weight to about
2^-16, so the decisions are the fp32 ones up to rounding. Graphs of at most DECODE_T tokens keep the fp32 weight
(sum_routers sums it).

Which routers: a rewritten block's unfused pair router with float32 weights whose layers the graph holds as
static weights (fuse_norm_router.match_router). It runs after the rewrites (they hold the mask nodes it replaces)
and before fuse_norm_router and sum_routers, which then see a linear router.
"""
from __future__ import annotations

import torch

from ..kernels.tuning import DECODE_T
from ..routing import router_fns as fns
from ._graph import meta, static_rows
from .base import Pass, PassContext, log
from .fuse_norm_router import match_router, pair_as_linear, replace_router, unfused_routers


class ComposeRouters(Pass):
    name = "compose_routers"

    def __init__(self, split: bool = False):
        self.split = split

    def __call__(self, ctx: PassContext) -> None:
        for blk in unfused_routers(ctx):
            r, _ = match_router(blk.mask)
            if r is None or r[0] != "pair":
                continue
            _, h, tensors, nodes = r
            split = self.split and _splits(h)
            composed = pair_as_linear(ctx, tensors, blk.mask, split=split)
            if composed is None:
                log.info("wide: layer %d: pair router kept as two layers: its weights are not static", blk.layer)
                continue
            replace_router(ctx, blk, fns.split_router_mask if split else fns.linear_router_mask, h, *composed,
                           nodes)
            blk.router_forms.append("composed")
            ctx.count("compose_routers.composed")
            if split:
                blk.router_forms.append("split")
                ctx.count("compose_routers.split")
            log.info("wide: layer %d: pair router composed into one linear map%s", blk.layer,
                     " (a bf16 pair)" if split else "")


def _splits(h) -> bool:
    """The router input is bf16 (so the pair's products are exact in fp32) in a graph of more than DECODE_T
    tokens (fewer keep the fp32 weight, which sum_routers sums)."""
    v, rows = meta(h), static_rows(h)
    return v is not None and v.dtype == torch.bfloat16 and rows is not None and rows > DECODE_T
