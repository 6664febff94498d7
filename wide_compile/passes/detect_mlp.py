"""Pass 1: detect SwiGLU MLP subgraphs by structure.

    down( silu(gate(x)) * up(x) )            dense graph (form B)
    down( expand(silu(gate(x)) * up(x), m) ) routers traced from the attach() hooks (form A), where
                                             expand = the group-mask multiply (see _graph.match_group_mask)

gate / up / down are linear calls (F.linear / torch._C._nn.linear) with weights that are model
parameters; gate and up share their input x. Names are never consulted.
"""
from __future__ import annotations

from ._graph import is_linear, is_mul, is_silu, last_dim, linear_parts, match_group_mask
from .base import MLPMatch, Pass, PassContext, log


def _swiglu(p):
    """p = silu(gate(x)) * up(x) -> (x, gate, up, act) or None."""
    if not is_mul(p) or len(p.args) != 2 or p.kwargs:
        return None
    for s, u in (p.args, p.args[::-1]):
        if is_silu(s) and is_linear(u):
            g = s.args[0] if s.args else s.kwargs.get("input")
            if is_linear(g):
                xg, xu = linear_parts(g)[0], linear_parts(u)[0]
                if xg is xu and g is not u:
                    return xg, g, u, s
    return None


class DetectSwiGLU(Pass):
    name = "detect_mlp"

    def __call__(self, ctx: PassContext) -> None:
        for n in ctx.gm.graph.nodes:
            if not is_linear(n):
                continue
            a = linear_parts(n)[0]
            mask = G = gs = None
            expand = []
            em = match_group_mask(a)
            if em is not None:
                a, mask, G, gs, expand = em
            sw = _swiglu(a)
            if sw is None:
                continue
            x, gate, up, act = sw
            m = MLPMatch(x=x, gate=gate, up=up, act=act, prod=a, down=n, mask=mask, groups=G, group_size=gs,
                         expand_nodes=expand)
            m.layer = len(ctx.mlps)
            ctx.mlps.append(m)
            why = ctx.group_mismatch("ffn", G, gs, last_dim(gate)) if G is not None else None
            if why:  # left dense, and said so (strict mode raises)
                ctx.fallback("SwiGLU MLP", m.down, why, match=m)
        ctx.count("detect_mlp.matched", len(ctx.mlps))
        ctx.count("detect_mlp.masked", sum(m.form == "masked" for m in ctx.mlps))
        for m in ctx.mlps:
            log.debug("layer %d: SwiGLU MLP %s/%s/%s (%s)", m.layer, m.gate.name, m.up.name, m.down.name, m.form)
