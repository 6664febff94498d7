"""Pass 11 (default; optimize(..., sum_routers=False) turns it off): at decode sizes, each unfused linear or pair
router computes its logits as a multiply-and-sum over the width (router_fns.summed_linear_router_mask) instead of
an fp32 GEMM. Measured against the GEMM in the same rows: benchmarks/results/lean-h100/README.md (fifth run).

At a few tokens an fp32 router GEMM runs on cuBLAS as a dot kernel and a reduce kernel, then Inductor's threshold
kernel: three launches for a few kilobytes of weights, a visible share of a small model's decode step
(benchmarks/results/lean-h100, the fourth run's profile). Written as a multiply-and-sum, the router is a
reduction Inductor generates itself, with the bias and the threshold fused: one launch. A pair router has no
nonlinearity between its layers, so it is composed into one linear map at compile time first
(fuse_norm_router.pair_as_linear, as compose_routers and fuse_norm_router do; with compose_routers on, the default,
it arrives here composed already).

Which blocks: a rewritten block whose router was not fused into its norm, with a static token count of at most
DECODE_T (larger graphs keep the GEMM, which wins once the rows fill tiles), and a linear or pair router with
float32 weights (fuse_norm_router.match_router). The products are the same fp32 products, summed in another
order: the same freedom any compiled fp32 GEMM has. The pass never changes what else a block computes.
"""
from __future__ import annotations

from ..kernels.tuning import DECODE_T
from ..routing import router_fns as fns
from ._graph import static_rows
from .base import Pass, PassContext, log
from .fuse_norm_router import match_router, pair_as_linear, replace_router, unfused_routers


class SumRouters(Pass):
    name = "sum_routers"

    def __call__(self, ctx: PassContext) -> None:
        for blk in unfused_routers(ctx):
            T = static_rows(blk.x)
            if T is None or T > DECODE_T:
                continue
            r, why = match_router(blk.mask)
            if r is None:
                log.info("wide: layer %d: router kept as a GEMM: %s", blk.layer, why)
                continue
            kind, h, tensors, nodes = r
            if kind == "mlp":  # a SiLU between its layers: two reductions and a pointwise, not one launch
                continue
            if kind == "pair":
                tensors = pair_as_linear(ctx, tensors, blk.mask)
                if tensors is None:
                    log.info("wide: layer %d: router kept as a GEMM: its weights are not static", blk.layer)
                    continue
            replace_router(ctx, blk, fns.summed_linear_router_mask, h, *tensors[:2], nodes)
            blk.router_forms.append("summed")
            ctx.count("sum_routers.summed")
            log.info("wide: layer %d: %s router summed over the width (%d tokens)", blk.layer, kind, T)
