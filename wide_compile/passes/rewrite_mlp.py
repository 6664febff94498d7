"""Pass 4: rewrite each routed SwiGLU MLP (gate, up, silu, mul, [mask multiply], down) into one
wide.mlp call. The down weight is transposed once, now, into a graph constant (w_down_t [F, D])."""
from __future__ import annotations

import operator

from ._graph import erase_unused, last_dim, linear_parts
from ._ops import wide_mlp_nd
from .base import Pass, PassContext, log


class RewriteMLP(Pass):
    name = "rewrite_mlp"

    def __call__(self, ctx: PassContext) -> None:
        W = ctx.weights
        for m in ctx.mlps:
            if m.status == "fallback" or m.mask is None:
                continue
            _, wg, bg = linear_parts(m.gate)
            _, wu, bu = linear_parts(m.up)
            _, wd, bd = linear_parts(m.down)
            why = None
            if bg is not None or bu is not None:
                why = "gate/up projections carry a bias (wide.mlp has none)"
            elif not all(W.is_static_weight(w) for w in (wg, wu, wd)):
                why = "gate/up/down weights are not model parameters"
            else:
                why = ctx.group_mismatch("ffn", m.groups, m.group_size, last_dim(m.gate))
            if why:
                ctx.fallback("SwiGLU MLP", m.down, why, match=m)
                continue
            with ctx.gm.graph.inserting_before(m.down):
                wdt = W.transposed(W.tensor(wd), f"L{m.layer}_w_down_t", before=m.down)
                new = W.call(wide_mlp_nd, (m.x, wg, wu, wdt, m.mask, m.group_size, ctx.kernel_tuning))
                if bd is not None:
                    new = W.call(operator.add, (new, bd))
            m.down.replace_all_uses_with(new)
            erase_unused(ctx.gm, [m.down, *m.expand_nodes, m.prod, m.act, m.gate, m.up])
            m.status = "rewritten"
            ctx.count("rewrite_mlp.rewritten")
            log.info("wide: layer %d: SwiGLU MLP -> wide.mlp (%d groups of %d channels)", m.layer, m.groups,
                     m.group_size)
