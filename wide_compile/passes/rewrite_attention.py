"""Pass 5: rewrite the routed attention projections: o -> wide.o_proj (weight transposed once, now, into
a graph constant w_o_t [Nq, D]), q -> wide.q_proj (inactive head groups' columns exactly 0; only when the
q -> sdpa path keeps heads apart, see detect_attention). K and V stay dense linears."""
from __future__ import annotations

from ._graph import erase_unused, last_dim, linear_parts, node_index
from ._ops import wide_o_proj_nd, wide_q_proj_nd
from .base import Pass, PassContext, log


class RewriteAttention(Pass):
    name = "rewrite_attention"

    def __call__(self, ctx: PassContext) -> None:
        W = ctx.weights
        order = node_index(ctx.gm)
        for a in ctx.attns:
            if a.status == "fallback" or a.mask is None:
                continue
            _, wq, bq = linear_parts(a.q)
            _, wo, bo = linear_parts(a.o)
            nq = last_dim(a.o_in)
            why = None
            if not (W.is_static_weight(wo) and W.is_static_weight(wq)):
                why = "q/o weights are not model parameters"
            elif last_dim(a.q) is not None and last_dim(a.q) != nq:
                why = f"q width {last_dim(a.q)} != o input width {nq}"
            else:
                why = ctx.group_mismatch("attn", a.groups, a.group_size, nq)
            if why:
                ctx.fallback("attention", a.o, why, match=a)
                continue
            with ctx.gm.graph.inserting_before(a.o):
                wot = W.transposed(W.tensor(wo), f"L{a.layer}_w_o_t", before=a.o)
                new_o = W.call(wide_o_proj_nd, (a.o_in, wot, bo, a.mask, a.group_size, ctx.kernel_tuning))
            a.o.replace_all_uses_with(new_o)
            erase_unused(ctx.gm, [a.o, *a.expand_nodes])
            ctx.count("rewrite_attention.o_rewritten")
            if a.q_ok and order.get(a.mask, -1) > order.get(a.q, 0) and a.mask.op != "get_attr":
                a.q_ok, a.q_reason = False, "router mask is computed after q"
            if a.q_ok:
                with ctx.gm.graph.inserting_before(a.q):
                    new_q = W.call(wide_q_proj_nd, (a.x, wq, bq, a.mask, a.group_size, ctx.kernel_tuning))
                a.q.replace_all_uses_with(new_q)
                erase_unused(ctx.gm, [a.q])
                ctx.count("rewrite_attention.q_rewritten")
            a.status = "rewritten"
            log.info("wide: layer %d: attention -> wide.o_proj%s (%d head groups of %d columns), K/V dense",
                     a.layer, " + wide.q_proj" if a.q_ok else "", a.groups, a.group_size)
