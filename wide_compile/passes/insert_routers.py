"""Pass 3: insert router nodes into a dense graph (form B).

Graphs traced from a model with routers attached (form A) already hold the router computation and the
mask multiplies: nothing to insert. A dense graph (e.g. a gpt-fast-style model compiled with
`wide_backend(..., routers=routers)`) gets, per detected layer in graph order, the attention router on
q's input and the FFN router on gate's input (router_input "normed"), or on the input of the RMSNorm that
feeds them (router_input "residual": the residual stream before the block's norm); what is inserted is
the router's own graph form (`router.graph_form()`: the mask function of routing/router_fns and its
tensors, which become graph constants via get_attr); a structured (codebook / nested) router goes in as its
bucket form (`router.bucket_form()`: its bucket id per token, its prototype table and
router_fns.bucket_mask of the two), which match_buckets hands to the bucket ops.
The number of detected attention blocks and MLPs must each equal routers.spec.num_layers: fewer would drop
the routing of the blocks not found, more would make routing by layer order ambiguous (RoutingDroppedError,
naming the candidates the detectors did not match and what the pass needs).
"""
from __future__ import annotations

import warnings

import torch
from torch import fx

from ..routing import router_fns as fns
from ._graph import describe, is_call, is_mul, last_dim, meta, static_rows
from .base import Pass, PassContext, RoutingDroppedError, WideFallbackWarning, log

_CASTS = {"to", "float", "half", "bfloat16", "type", "type_as"}
_CAST_FNS = {torch.Tensor.to, torch.Tensor.type_as, torch.Tensor.float}
_RSQRT = {torch.rsqrt}
_RMS_NORM = {getattr(torch.nn.functional, "rms_norm", None), getattr(torch, "rms_norm", None)} - {None}


class NoRoutersError(ValueError):
    pass


def _strip_casts(n):
    while isinstance(n, fx.Node) and is_call(n, _CAST_FNS, _CASTS) and n.args:
        n = n.args[0]
    return n


def _ancestors(n, depth: int) -> set:
    seen, frontier = set(), [n]
    for _ in range(depth):
        frontier = [a for f in frontier if isinstance(f, fx.Node) for a in f.all_input_nodes if a not in seen]
        seen.update(frontier)
    return seen


def norm_input(x):
    """The input of the RMSNorm that produced x (the residual stream before the block's norm), or None.

    Recognises w * (h * rsqrt(mean(h^2) + eps)) with casts anywhere (HF LlamaRMSNorm, gpt-fast RMSNorm, in
    either operand order, with or without the weight) and F.rms_norm(h, ...)."""
    n = _strip_casts(x)
    if is_call(n, _RMS_NORM):
        return n.args[0]
    for cand in ([n] + [_strip_casts(a) for a in n.args[:2]] if is_mul(n) else []):
        if not is_mul(cand):
            continue
        for i, j in ((0, 1), (1, 0)):
            r, h = cand.args[i], cand.args[j]
            if is_call(r, _RSQRT, ("rsqrt",)):
                h0 = _strip_casts(h)
                # the statistic must be of the same tensor: h (or a cast of it) feeds the rsqrt's argument
                if any(_strip_casts(a) is h0 for a in _ancestors(r, 6)):
                    return h0
    return None


def _router_input(x, router_input: str, what: str, layer: int):
    if router_input == "normed":
        return x
    h = norm_input(x)
    if h is None:
        raise ValueError(f"wide_compile: layer {layer}: the {what} routers read the residual stream before the "
                         f"block's norm (router_input='residual'), but the input of {what}'s projection "
                         f"(%{x.name}) is not an RMSNorm the pass recognises; compile the HF model with routers "
                         "attached (form A), or use routers with router_input='normed'")
    return h


def _router_node(ctx: PassContext, router, x, h, tag: str):
    """Insert `router`'s graph form (its mask function and tensors, routers.graph_form) reading h."""
    dev = getattr(meta(x), "device", None)
    if not hasattr(router, "graph_form"):
        raise ValueError(f"wide_compile: cannot insert a router of type {type(router).__name__} into the graph "
                         "(it has no graph_form; supported: GroupRouter, PairRouter, CodebookRouter, NestedRouter, ConstantRouter, ReplayRouter)")
    m = meta(h)

    def const(t, name):
        return ctx.weights.constant(("router", id(t)), f"{tag}_{name}",
                                    lambda: t.detach().to(dev) if dev is not None and dev.type != "meta"
                                    else t.detach(), before=x)

    if hasattr(router, "bucket_form"):
        (bucket_fn, bts), (table_fn, tts) = router.bucket_form()
        bucket = ctx.weights.call(bucket_fn, (h, *(const(t, name) for name, t in bts)))
        table = [const(t, name) for name, t in tts]
        table = table[0] if table_fn is None else ctx.weights.call(table_fn, tuple(table))
        return ctx.weights.call(fns.bucket_mask, (bucket, table))
    fn, tensors = router.graph_form(m.dtype if m is not None else None, static_rows(h) if m is not None else None)
    return ctx.weights.call(fn, (h, *(const(t, name) for name, t in tensors)))


_BLOCKS_FIX = ("the pass routes attention as q/k/v linears (separate, or one fused qkv linear sliced) -> "
               "scaled_dot_product_attention -> an o linear, and MLPs as act(gate) * up -> a down linear (separate "
               "gate/up linears or one fused gate_up linear chunked; act silu or gelu); restructure the model's "
               "forward that way, or for an HF Llama-family model pass it to wide_compile.optimize(model, routers) "
               "with routers from Routers.init(model, cfg) (attached, not inserted)")


def _check_every_layer_found(ctx: PassContext, L: int) -> None:
    """A dense graph given routers for L layers must hold L attention blocks and L MLPs: routers for a block
    the pass cannot find would be silently dropped, so say which ones are missing, why, and what to do."""
    na, nm = len(ctx.attns), len(ctx.mlps)
    if na == L and nm == L:
        return
    what = "some routers would be dropped" if min(na, nm) < L else "routing by layer order is ambiguous"
    lines = [f"wide_compile: routers for {L} layers were given, but the graph holds {na} attention block(s) and "
             f"{nm} gated MLP(s) the pass can route ({what}):"]
    for kind, found in (("attention", na), ("MLP", nm)):
        if found != L:
            lines.append(f"  the {kind} blocks: {found} found for {L} layers (layers count in graph order)")
    for what, node, why in ctx.unmatched_nodes:
        lines.append(f"  not matched: {what} at {describe(node)}: {why}")
    if not ctx.unmatched_nodes:
        lines.append("  the graph holds no scaled_dot_product_attention / gated-MLP structure the pass matched")
    if 0 < min(na, nm) and max(na, nm) <= L:
        lines.append("  (a graph break splits the layers over several graphs: compile with fullgraph=True)")
    lines.append("Fix: " + _BLOCKS_FIX)
    raise RoutingDroppedError("\n".join(lines))


class InsertRouters(Pass):
    name = "insert_routers"

    def __call__(self, ctx: PassContext) -> None:
        subs = [*ctx.mlps, *ctx.attns]
        if any(s.form == "masked" for s in subs):  # form A; a dense block next to routed ones has no router
            for s in subs:
                if s.form == "dense" and s.status != "fallback":
                    s.status, s.reason = "dense", "no router mask traced for it"
                    what = "gated MLP" if hasattr(s, "gate") else "attention"
                    msg = (f"wide_compile: {what} at {describe(getattr(s, 'down', None) or s.o)} has no router "
                           "(no router mask was traced for it) and runs dense; to route it, attach routers to "
                           "every decoder layer (wide_compile.attach)")
                    ctx.report.fallbacks.append(msg)
                    warnings.warn(msg, WideFallbackWarning, stacklevel=2)
            return
        routers = ctx.routers
        if routers is None:
            if subs:
                raise NoRoutersError(
                    "wide_compile: the graph has Llama-style attention/MLP blocks but no WIDE routers: attach them "
                    "first (wide_compile.attach(model, routers)), use wide_compile.optimize(model, routers), or "
                    "pass routers=... to the wide backend")
            return
        _check_every_layer_found(ctx, routers.spec.num_layers)
        L = routers.spec.num_layers
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
            ha = _router_input(a.x, cfg.router_input, "attention", i)
            hf = _router_input(m.x, cfg.router_input, "MLP", i)
            with ctx.gm.graph.inserting_before(a.q):
                a.mask = _router_node(ctx, routers.attn[i], a.x, ha, f"router_attn{i}")
            a.groups, a.group_size = cfg.num_head_groups(spec), cfg.head_group_size * spec.head_dim
            with ctx.gm.graph.inserting_before(m.gate):
                m.mask = _router_node(ctx, routers.ffn[i], m.x, hf, f"router_ffn{i}")
            m.groups, m.group_size = cfg.num_ffn_groups(spec), cfg.ffn_group_size
            a.status = m.status = "routed"
            log.info("wide: layer %d: routers inserted (attention on %%%s, mlp on %%%s)", i, ha.name, hf.name)
        ctx.count("insert_routers.inserted", 2 * L)
