"""Pass 12 (opt-in: optimize(..., fuse_router_select=True)): where a block's split-bf16 router
(split_routers) feeds one dense-masked op only, the router runs inside that op's select
(kernels/routed_select.py): the MLP's act(g) * u select (wide.routed_gated_select) or the select of o_proj's input
(wide.routed_select). The routing then adds no launch to the block.

On the dense-masked path (cost_model: every column is computed, the inactive groups selected away before the
reduction GEMM) the mask has one reader, an elementwise select that Inductor generates. Unfused, the router is a
cuBLAS GEMM launch of its own whose fp32 logits that select reads: at a small model's prefill (SmolLM2, T = 2048) a
few microseconds per router, against a dense step of a few microseconds per projection
(benchmarks/results/lean-h100/, the prefill profiles). The fused select computes its rows' logits on tensor cores
from the router input the block already holds.

Which blocks: a rewritten block whose mask is a split_router_mask node (split_routers ran: bf16, more than DECODE_T
tokens, static weights) read by exactly one node, that block's wide.mlp or wide.o_proj on the dense-masked path at
a static token count. A mask read elsewhere (a masked q, attention over the active heads, a structured router's
ops) stays a node of its own: computing it twice would cost what the fusion saves.
"""
from __future__ import annotations

from ..routing import router_fns as fns
from ._graph import dense_masked_at_static_rows, erase_unused
from ._ops import dense_masked_mlp_args, wide_o_proj_nd, wide_routed_mlp_nd, wide_routed_o_proj_nd
from .base import Pass, PassContext, log


class FuseRouterSelect(Pass):
    name = "fuse_router_select"

    def __call__(self, ctx: PassContext) -> None:
        for blk in (*ctx.attns, *ctx.mlps):
            mask = blk.mask
            if blk.status != "rewritten" or mask is None or mask.op != "call_function" or \
                    mask.target is not fns.split_router_mask or len(mask.users) != 1:
                continue
            (user,) = mask.users
            h, w2, b = mask.args
            if not dense_masked_at_static_rows(user):
                continue
            mlp = dense_masked_mlp_args(user, mask)
            if user.target is wide_o_proj_nd and user.args[3] is mask:
                a, wot, bo, _, gs = user.args[:5]
                fn, args, op = wide_routed_o_proj_nd, (a, wot, bo, h, w2, b, gs), "o"
            elif mlp is not None:
                x, wg, wu, wdt, gs, act = mlp
                fn, args, op = wide_routed_mlp_nd, (x, wg, wu, wdt, h, w2, b, gs, act), "mlp"
            else:
                continue
            with ctx.gm.graph.inserting_before(user):
                new = ctx.weights.call(fn, args)
            new.meta["wide_path"] = user.meta["wide_path"]
            user.replace_all_uses_with(new)
            erase_unused(ctx.gm, [user, mask])  # the mask's one reader is gone: so is the mask
            blk.mask = None
            blk.ops[op] = "routed_select" if op == "o" else "routed_gated_select" + (
                " (gate and up in one GEMM)" if args[2] is None else "")
            blk.router_forms.append("in_select")
            ctx.count("fuse_router_select.fused")
            log.info("wide: layer %d: router computed in %s's select (wide.%s)", blk.layer, op, blk.ops[op])
