"""Pass 1: detect gated MLP subgraphs (SwiGLU, GeGLU) by structure.

    down( act(gate(x)) * up(x) )            dense graph (form B)
    down( expand(act(gate(x)) * up(x), m) ) routers traced from the attach() hooks (form A), where
                                            expand = the group-mask multiply (see _graph.match_group_mask)

act is silu (SwiGLU: Llama, ...) or gelu, exact or with the tanh approximation (GeGLU: Gemma). gate / up
are linear calls (F.linear / torch._C._nn.linear) with weights that are model parameters, or two column
ranges of one fused linear (Phi-3's gate_up_proj, split with chunk / split / slicing); gate and up share
their input x. Names are never consulted.
"""
from __future__ import annotations

import torch

from ._graph import arg, is_call, is_linear, is_mul, is_silu, last_dim, linear_parts, match_group_mask, proj_source
from .base import GROUPING_FIX, MLPMatch, Pass, PassContext, log

_GELU_FNS = {torch._C._nn.gelu, torch.nn.functional.gelu}


def activation_of(s) -> str | None:
    """The wide.mlp activation (kernels.reference.ACTIVATIONS) that node s computes, or None."""
    if is_silu(s):
        return "silu"
    if is_call(s, _GELU_FNS, ("gelu",)):
        approximate = arg(s, 1, "approximate", "none")
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(approximate)
    return None


def _gated(p):
    """p = act(gate(x)) * up(x) -> (x, gate, up, act, gate source, up source, activation) or None; a source
    is proj_source's (linear, rows or None)."""
    if not is_mul(p) or len(p.args) != 2 or p.kwargs:
        return None
    for s, u in (p.args, p.args[::-1]):
        kind = activation_of(s)
        if kind is None:
            continue
        g = s.args[0] if s.args else s.kwargs.get("input")
        gsrc, usrc = proj_source(g), proj_source(u)
        if gsrc is None or usrc is None or gsrc == usrc:
            continue
        xg, xu = linear_parts(gsrc[0])[0], linear_parts(usrc[0])[0]
        if xg is xu:
            return xg, g, u, s, gsrc, usrc, kind
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
            found = _gated(a)
            if found is None:
                continue
            x, gate, up, act, gsrc, usrc, kind = found
            m = MLPMatch(x=x, gate=gate, up=up, act=act, prod=a, down=n, mask=mask, groups=G, group_size=gs,
                         expand_nodes=expand, gate_src=gsrc, up_src=usrc, activation=kind)
            m.layer = len(ctx.mlps)
            ctx.mlps.append(m)
            why = ctx.group_mismatch("ffn", G, gs, last_dim(gate)) if G is not None else None
            if why:  # kept on the masked reference, and said so (strict mode raises)
                ctx.fallback("gated MLP", m.down, why, GROUPING_FIX, match=m)
        ctx.count("detect_mlp.matched", len(ctx.mlps))
        ctx.count("detect_mlp.masked", sum(m.form == "masked" for m in ctx.mlps))
        for m in ctx.mlps:
            log.debug("layer %d: gated MLP (%s) %s/%s/%s (%s)", m.layer, m.activation, m.gate.name, m.up.name,
                      m.down.name, m.form)
