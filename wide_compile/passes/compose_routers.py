"""Pass 8 (default; optimize(..., compose_routers=False) keeps the two layers): the method's pair router as the
one linear map it is.

A pair router (routing/router_fns.pair_router_mask: hidden -> rank r -> one (skip, execute) logit pair per group,
execute iff the margin z_exec - z_skip > 0) has no nonlinearity between its layers, so its margin is
h @ W^T + c with W = (w_up[1::2] - w_up[0::2]) @ w_down [G, D] (norm_router.compose_pair, built in float64 and
stored fp32 once at compile time). Run as traced it is two fp32 GEMMs (no tensor cores: cuBLAS dot / reduce
kernels at decode, SIMT GEMMs at prefill), a view and a difference. Composed it is one GEMM of G outputs and a
threshold, whose logits differ from the two-layer form's by rounding only (the freedom any compiled fp32 GEMM
has: a decision within fp32 rounding of 0 may flip).

Which routers: a rewritten block's unfused pair router with float32 weights whose layers the graph holds as
static weights (fuse_norm_router.match_router). It runs after the rewrites (they hold the mask nodes it replaces)
and before fuse_norm_router and sum_routers, which then see a linear router.
"""
from __future__ import annotations

from ..routing import router_fns as fns
from .base import Pass, PassContext, log
from .fuse_norm_router import match_router, pair_as_linear, replace_router, unfused_routers


class ComposeRouters(Pass):
    name = "compose_routers"

    def __call__(self, ctx: PassContext) -> None:
        for blk in unfused_routers(ctx):
            r, _ = match_router(blk.mask)
            if r is None or r[0] != "pair":
                continue
            _, h, tensors, nodes = r
            composed = pair_as_linear(ctx, tensors, blk.mask)
            if composed is None:
                log.info("wide: layer %d: pair router kept as two layers: its weights are not static", blk.layer)
                continue
            replace_router(ctx, blk, fns.linear_router_mask, h, *composed, nodes)
            blk.router_forms.append("composed")
            ctx.count("compose_routers.composed")
            log.info("wide: layer %d: pair router composed into one linear map", blk.layer)
