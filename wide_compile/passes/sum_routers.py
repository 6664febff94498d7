"""Pass 8 (opt-in: optimize(..., sum_routers=True)): each unfused router in the fewest launches its size allows.
At decode sizes a linear or pair router computes its logits as a multiply-and-sum over the width
(router_fns.summed_linear_router_mask) instead of an fp32 GEMM; in larger graphs a pair router runs as the one
linear map it is (router_fns.linear_router_mask over the composed weights): one GEMM where it ran two.

At a few tokens an fp32 router GEMM runs on cuBLAS as a dot kernel and a reduce kernel, then Inductor's threshold
kernel: three launches for a few kilobytes of weights, a visible share of a small model's decode step
(benchmarks/results/lean-h100, the fourth run's profile). Written as a multiply-and-sum, the router is a
reduction Inductor generates itself, with the bias and the threshold fused: one launch. At prefill the method's
pair router (hidden -> rank -> two logits per group) is two fp32 GEMMs without tensor cores, each a launch or
two of its own per block (the same results' SmolLM2 prefill profile); it has no nonlinearity between its layers,
so it is composed into one linear map at compile time (fuse_norm_router.pair_as_linear, as fuse_norm_router
does) and runs as one GEMM of G outputs.

Which blocks: a rewritten block whose router was not fused into its norm, and a linear or pair router with
float32 weights (fuse_norm_router.match_router): summed where the graph's token count is static and at most
DECODE_T (larger graphs keep a GEMM, which wins once the rows fill tiles), composed where it is a pair router in
any other graph. The products are the same fp32 products, summed in another order: the same freedom any compiled
fp32 GEMM has. The pass never changes what else a block computes.
"""
from __future__ import annotations

from ..kernels.tuning import DECODE_T
from ..routing import router_fns as fns
from ._graph import erase_unused, static_rows
from .base import Pass, PassContext, log
from .fuse_norm_router import match_router, pair_as_linear


class SumRouters(Pass):
    name = "sum_routers"

    def __call__(self, ctx: PassContext) -> None:
        for blk in [*ctx.attns, *ctx.mlps]:
            if blk.status != "rewritten" or blk.mask is None or blk.mask.op == "get_attr" or blk.router_fused:
                continue
            T = static_rows(blk.x)
            summed = T is not None and T <= DECODE_T
            r, why = match_router(blk.mask)
            if r is None:
                log.info("wide: layer %d: router kept as it is: %s", blk.layer, why)
                continue
            kind, h, tensors, nodes = r
            # an "mlp" router has a SiLU between its layers (neither one reduction nor one GEMM); a linear router
            # above decode size is one GEMM already
            if kind == "mlp" or (kind == "linear" and not summed):
                continue
            at = blk.mask
            if kind == "pair":
                tensors = pair_as_linear(ctx, tensors, at)
            fn = fns.summed_linear_router_mask if summed else fns.linear_router_mask
            with ctx.gm.graph.inserting_before(at):
                new = ctx.weights.call(fn, (h, *tensors[:2]))
            blk.mask.replace_all_uses_with(new)
            blk.mask = new
            erase_unused(ctx.gm, nodes)
            ctx.count("sum_routers.summed" if summed else "sum_routers.composed")
            log.info("wide: layer %d: %s router %s (%s tokens)", blk.layer, kind,
                     "summed over the width" if summed else "composed into one GEMM", T if T is not None else "dynamic")
