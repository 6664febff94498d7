"""Pass 9b (default; optimize(..., fuse_router_gemm=False) turns it off): a linear router on the residual stream runs as
extra output columns of the GEMM that reads the block's normalized input, so routing adds no GEMM launch to the block.

The method's routers read the residual h before the block's RMSNorm; the projection after the norm reads
n = g * (h * r), with r = rsqrt(mean(h^2) + eps) > 0 per token. For a linear router (the pair router once
compose_routers made it one), W h + c > 0 exactly when (W / g) n + c r > 0. So the rows W / g appended to the
projection's weight give r (W h) as columns of its output, and the mask is those columns plus c r, thresholded
(router_fns.normed_router_mask); Inductor fuses that into the select that reads the mask. At a small model's prefill
the router GEMMs are launches of a few microseconds each against projections of a few microseconds
(benchmarks/results/lean-h100/, the SmolLM2 prefill profiles); appended, they cost a few more output columns.

What it changes: the decisions, within rounding. The router then reads n in the model's dtype (rounded twice, as the
norm rounds it) and its columns leave the GEMM in that dtype; split_routers' bf16 pair keeps the fp32 router's
decisions up to 2^-16. Where a margin lies within that rounding of 0 the decision may flip
(benchmarks/results/fuse-router-gemm/ has the share on SmolLM2's shipped routers).

Which blocks: a rewritten block, in a graph of a static count of more than DECODE_T tokens, whose router is linear
(composed) with static float32 weights and reads the residual h, and whose normalized input RMSNorm(h)
(fuse_norm_router.match_rmsnorm) feeds
  * attention: a plain linear over n (q unmasked on the dense-masked path: the fused [q; k; v] or q alone), every
    reader of the mask coming after it;
  * MLP: the dense-masked MLP (wide.mlp or gate / up in one GEMM) at a static token count, whose GEMM becomes one over
    [gate; up; W / g] (a copy of the weights made at compile time, as fuse_gate_up's).
The norm weight must have no zero (W / g finite in the model's dtype). Anything else keeps its router, with the
reason in the report.
"""
from __future__ import annotations

import operator

import torch

from ..kernels.tuning import DECODE_T
from ..routing import router_fns as fns
from ._graph import dense_masked_at_static_rows, erase_unused, is_linear, linear_parts, meta, node_index, static_rows
from ._ops import dense_masked_mlp_args, wide_mlp_down_nd
from .base import Pass, PassContext, log
from .fuse_norm_router import match_rmsnorm_scale, match_router, unfused_routers
from .insert_routers import _strip_casts

PAD_COLUMNS = 8  # the router's rows padded so the GEMM's N stays a multiple of 8, as cuBLAS's tensor-core kernels want


class FuseRouterGemm(Pass):
    name = "fuse_router_gemm"

    def __call__(self, ctx: PassContext) -> None:
        for blk in unfused_routers(ctx):
            what = "attention" if hasattr(blk, "q") else "mlp"
            why = self._fuse(ctx, blk, what)
            if why:
                ctx.report.unmatched.append(f"layer {blk.layer} {what}: router not in the projection GEMM: {why}")
                log.info("wide: layer %d %s: router not in the projection GEMM: %s", blk.layer, what, why)

    def _fuse(self, ctx: PassContext, blk, what: str) -> str:
        rows = static_rows(blk.x)
        if rows is None or rows <= DECODE_T:
            return f"not a graph of a static count of more than {DECODE_T} tokens"
        r, why = match_router(blk.mask)
        if r is None:
            return why
        kind, h, (w_r, c), nodes = r
        if kind != "linear":
            return f"its router is a {kind} router, not a linear one"
        got = match_rmsnorm_scale(blk.x)
        if got is None:
            return "the block's input is not an RMSNorm of the form the pass reads"
        h_norm, g, _, rsqrt = got
        if _strip_casts(h) is not h_norm:
            return "its router does not read the norm's input (the residual stream)"
        W = ctx.weights
        if not all(W.is_static_weight(t) for t in (w_r, g, *((c,) if c is not None else ()))):
            return "the norm's or the router's weights are not model parameters"
        proj = self._projection(ctx, blk, what)
        if isinstance(proj, str):
            return proj
        order = node_index(ctx.gm)
        if any(u is not proj and order[u] <= order[proj] for u in blk.mask.users):
            return "the mask is read before the projection"
        x_dtype = meta(blk.x).dtype
        wr, gn = W.tensor(w_r), W.tensor(g)
        with torch.no_grad():
            scaled = (wr.double() / gn.double().reshape(1, -1)).to(x_dtype)
        if not torch.isfinite(scaled).all():
            return "W / g is not finite in the model's dtype (the norm's weight has zeros or tiny entries)"
        G = wr.shape[0]
        gp = -(-G // PAD_COLUMNS) * PAD_COLUMNS
        rows_r = torch.cat([scaled, scaled.new_zeros(gp - G, scaled.shape[1])])
        with ctx.gm.graph.inserting_before(proj):
            if what == "attention":
                y, n_cols = self._extend_linear(ctx, blk, proj, rows_r)
            else:
                y, n_cols = self._extend_mlp(ctx, blk, proj, rows_r)
        with ctx.gm.graph.inserting_after(y):
            z = W.call(operator.getitem, (y, (Ellipsis, slice(n_cols, n_cols + G))))
        with ctx.gm.graph.inserting_after(z):
            mask = W.call(fns.normed_router_mask, (z, c, rsqrt))
        old = blk.mask
        old.replace_all_uses_with(mask)
        blk.mask = mask
        erase_unused(ctx.gm, [old, *nodes])
        W.drop_constant(w_r)
        blk.router_forms.append("in_gemm")
        ctx.count("fuse_router_gemm.fused")
        log.info("wide: layer %d %s: router (residual) as %d output columns of the projection GEMM", blk.layer,
                 what, G)
        return ""

    @staticmethod
    def _projection(ctx: PassContext, blk, what: str):
        """The node computing the block's projection from its normalized input: a linear over n with a static
        weight (attention), or the dense-masked MLP op reading the block's mask (MLP); else why not."""
        if what == "attention":
            lins = [u for u in blk.x.users if is_linear(u) and linear_parts(u)[0] is blk.x]
            lins = [u for u in lins if ctx.weights.is_static_weight(linear_parts(u)[1])]
            if not lins:
                return "no linear with a static weight reads the block's normalized input (q is masked)"
            return min(lins, key=node_index(ctx.gm).__getitem__)
        for u in blk.x.users:
            if dense_masked_mlp_args(u, blk.mask) is not None and dense_masked_at_static_rows(u):
                return u
        return "its MLP is not on the dense-masked path at a static token count"

    @staticmethod
    def _extend_linear(ctx: PassContext, blk, lin, rows_r):
        """linear(n, [w; rows_r], [b; 0]); the old linear's readers read its first N columns."""
        W = ctx.weights
        _, w, b = linear_parts(lin)
        tw, tb = W.tensor(w), W.tensor(b) if b is not None else None
        wx = W.constant(("router_rows", id(tw), id(rows_r)), f"L{blk.layer}_w_proj_router",
                        lambda: torch.cat([tw.detach(), rows_r.to(tw.dtype)]), lin)
        bx = None if tb is None else W.constant(("router_rows_b", id(tb), id(rows_r)), f"L{blk.layer}_b_proj_router",
                                                lambda: torch.cat([tb.detach(), tb.new_zeros(rows_r.shape[0])]), lin)
        y = W.call(torch.nn.functional.linear, (blk.x, wx, bx))
        y.meta["wide_path"] = lin.meta.get("wide_path")
        n = tw.shape[0]
        with ctx.gm.graph.inserting_after(y):
            out = W.call(operator.getitem, (y, (Ellipsis, slice(0, n))))
        lin.replace_all_uses_with(out)
        erase_unused(ctx.gm, [lin])
        for t in (w, b):
            if t is not None:
                W.drop_constant(t)  # the fused [q; k; v] copy, read no more (a model parameter stays)
        return y, n

    @staticmethod
    def _extend_mlp(ctx: PassContext, blk, op, rows_r):
        """The dense-masked MLP as one GEMM over [gate; up; rows_r] and wide_mlp_down_nd on its first 2F columns."""
        W = ctx.weights
        x, wg, wu, wdt, gs, act = dense_masked_mlp_args(op, blk.mask)
        parts = [W.tensor(wg)] + ([W.tensor(wu)] if wu is not None else [])  # [gate; up] as one weight, or two
        n = sum(t.shape[0] for t in parts)
        wx = W.constant(("router_rows", *map(id, parts), id(rows_r)), f"L{blk.layer}_w_gate_up_router",
                        lambda: torch.cat([*(t.detach() for t in parts), rows_r.to(parts[0].dtype)]), op)
        y = W.call(torch.nn.functional.linear, (x, wx))
        new = W.call(wide_mlp_down_nd, (W.call(operator.getitem, (y, (Ellipsis, slice(0, n)))), wdt, blk.mask, gs,
                                        act))
        new.meta["wide_path"] = op.meta["wide_path"]
        op.replace_all_uses_with(new)
        erase_unused(ctx.gm, [op])
        if wu is None:
            W.drop_constant(wg)  # fuse_gate_up's [gate; up] copy, read no more
        blk.ops["mlp"] = "mlp (gate, up and router in one GEMM)"
        return y, n
