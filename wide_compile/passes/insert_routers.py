"""Pass 3: insert router nodes into a dense graph (form B).

Graphs traced from a model with routers attached (form A) already hold the router computation and the
mask multiplies: nothing to insert. A dense graph (e.g. a gpt-fast-style model compiled with
`wide_backend(..., routers=routers)`) gets, per detected layer in graph order, the attention router on
q's input and the FFN router on gate's input; router weights become graph constants (get_attr).
The number of detected layers must equal routers.spec.num_layers, otherwise routing would be ambiguous:
ValueError.
"""
from __future__ import annotations

import torch.nn.functional as F

from ._graph import last_dim, meta, static_rows
from .manager import Pass, PassContext, log


def linear_router_mask(h, w, b):
    return F.linear(h.to(w.dtype), w, b) > 0


def split_router_mask(h, w2, b):
    from ..routing.routers import split_logits

    return split_logits(h, w2, b) > 0


def mlp_router_mask(h, w1, b1, w2, b2):
    return F.linear(F.silu(F.linear(h.to(w1.dtype), w1, b1)), w2, b2) > 0


def constant_router_mask(h, mask):
    return mask.expand(*h.shape[:-1], mask.shape[-1])


def replay_router_mask(h, mask):
    return mask.view(*h.shape[:-1], mask.shape[-1])


class NoRoutersError(ValueError):
    pass


def _router_node(ctx: PassContext, router, x, tag: str):
    from ..routing.routers import ConstantRouter, GroupRouter, ReplayRouter

    dev = getattr(meta(x), "device", None)

    def const(t, name):
        return ctx.weights.constant(("router", id(t)), f"{tag}_{name}",
                                    lambda: t.detach().to(dev) if dev is not None and dev.type != "meta"
                                    else t.detach(), before=x)

    if isinstance(router, ConstantRouter):
        return ctx.weights.call(constant_router_mask, (x, const(router.mask, "mask")))
    if isinstance(router, ReplayRouter):  # recorded masks: a check tool (see ReplayRouter)
        return ctx.weights.call(replay_router_mask, (x, const(router.mask, "mask")))
    if isinstance(router, GroupRouter):
        if router.hidden:
            args = (x, const(router.proj_in.weight, "w1"), const(router.proj_in.bias, "b1"),
                    const(router.proj.weight, "w2"), const(router.proj.bias, "b2"))
            return ctx.weights.call(mlp_router_mask, args)
        w2 = router.split_for(meta(x).dtype, static_rows(x)) if meta(x) is not None else None
        if w2 is not None:
            return ctx.weights.call(split_router_mask, (x, const(w2, "w2"), const(router.proj.bias, "b")))
        return ctx.weights.call(linear_router_mask, (x, const(router.proj.weight, "w"), const(router.proj.bias, "b")))
    raise ValueError(f"wide_compile: cannot insert a router of type {type(router).__name__} into the graph "
                     "(supported: GroupRouter, ConstantRouter, ReplayRouter)")


class InsertRouters(Pass):
    name = "insert_routers"

    def __call__(self, ctx: PassContext) -> None:
        subs = [*ctx.mlps, *ctx.attns]
        live = [s for s in subs if s.status != "fallback"]
        if not live:
            return
        masked = [s for s in live if s.form == "masked"]
        if masked:  # form A; a dense block next to routed ones has no router: keep it dense, say so
            for s in live:
                if s.form == "dense":
                    s.status = "fallback"
                    s.reason = "no router mask traced for this block"
                    what = "SwiGLU MLP" if hasattr(s, "gate") else "attention"
                    ctx.fallback(what, getattr(s, "down", None) or getattr(s, "o"),
                                 "no router mask was traced for it (are routers attached to every layer?)")
            return
        routers = ctx.routers
        if routers is None:
            raise NoRoutersError(
                "wide_compile: the graph has Llama-style attention/MLP blocks but no WIDE routers: attach them "
                "first (wide_compile.attach(model, routers)), use wide_compile.optimize(model, routers), or pass "
                "routers=... to the wide backend")
        L = routers.spec.num_layers
        if len(ctx.mlps) != L or len(ctx.attns) != L:
            raise ValueError(
                f"wide_compile: found {len(ctx.attns)} attention blocks and {len(ctx.mlps)} SwiGLU MLPs in the "
                f"graph but the routers are for {L} layers; routing by graph order needs one full graph "
                "(compile with fullgraph=True, or attach routers to an HF model instead)")
        spec, cfg = routers.spec, routers.cfg
        for a, m in zip(ctx.attns, ctx.mlps):
            nq, d = last_dim(a.q), last_dim(a.x)
            if (nq is not None and nq != spec.q_size) or (d is not None and d != spec.hidden_size):
                raise ValueError(f"wide_compile: attention block {a.layer} has q width {nq} / hidden {d}, "
                                 f"routers expect {spec.q_size} / {spec.hidden_size}")
            f = last_dim(m.gate)
            if f is not None and f != spec.intermediate_size:
                raise ValueError(f"wide_compile: MLP {m.layer} has width {f}, routers expect {spec.intermediate_size}")
        for i, (a, m) in enumerate(zip(ctx.attns, ctx.mlps)):
            with ctx.gm.graph.inserting_before(a.q):
                a.mask = _router_node(ctx, routers.attn[i], a.x, f"router_attn{i}")
            a.groups, a.group_size = cfg.num_head_groups(spec), cfg.head_group_size * spec.head_dim
            with ctx.gm.graph.inserting_before(m.gate):
                m.mask = _router_node(ctx, routers.ffn[i], m.x, f"router_ffn{i}")
            m.groups, m.group_size = cfg.num_ffn_groups(spec), cfg.ffn_group_size
            a.status = m.status = "routed"
            log.info("wide: layer %d: routers inserted (attention on %%%s, mlp on %%%s)", i, a.x.name, m.x.name)
        ctx.count("insert_routers.inserted", 2 * L)
