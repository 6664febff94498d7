"""Pass 9 (opt-in: optimize(..., fuse_norm_router=True), or "prefill": graphs of more than DECODE_T tokens only): fuse
each rewritten block's RMSNorm and the router that reads the same row into one wide.rmsnorm_router launch
(kernels/norm_router.py; at prefill sizes it runs a linear router as tiles of rows, on tensor cores for bf16 rows).

Per block (attention: the norm feeding q; MLP: the norm feeding gate/up) the pass matches
  * the norm: w * (h32 * rsqrt(mean(h32^2, -1) + eps)).to(h.dtype), h32 = h in float32 (HF LlamaRMSNorm, and
    gpt-fast's RMSNorm for float32 inputs, where its arithmetic is the same);
  * the router producing the block's mask, reading the norm's output (router_input "normed") or its input
    (the residual stream, "residual"): a linear, SiLU-MLP or (skip, execute) pair router with float32 weights,
    traced (routers attached: linear -> gt 0, ...) or inserted (router_fns.*_router_mask calls);
and replaces both by the fused op's two outputs. A pair router has no nonlinearity between its layers: the pass
composes it into one linear map at compile time (norm_router.compose_pair), which the kernel runs in one launch
at any size. When the norm's input is the residual add of two tensors of its shape and dtype (a decoder block's
`residual + out`) whose other users all come after the block's norm, the add goes into the same launch
(wide.add_rmsnorm_router, whose first output is the sum the later users read): Inductor fuses that add into its
own norm kernel, so a fused norm without it would add a launch. Anything else (codebook / nested / constant /
replay / split-bf16 routers, routers in another dtype, a norm of another form, intermediate values used elsewhere)
is left as it is, with the reason in the report: the pass never changes what a block computes.
"""
from __future__ import annotations

import operator

import torch
from torch import fx

from ..routing import router_fns as fns
from ._graph import SILU_FNS, erase_unused, is_call, is_linear, is_mul, linear_parts, meta, node_index, static_rows
from ._ops import wide_add_rmsnorm_router_nd, wide_rmsnorm_router_nd
from .base import Pass, PassContext, log, router_fused
from .insert_routers import _strip_casts

_INSERTED = {fns.linear_router_mask: "linear", fns.mlp_router_mask: "mlp", fns.pair_router_mask: "pair"}
_GT = {operator.gt, torch.gt}
_SUB = {operator.sub, torch.sub}
_ADD = {operator.add, torch.add}


def _float_arg(n, other):
    """The float constant of add(n, c) / add(c, n) (the norm's eps), else None."""
    for a, b in (n.args[:2], n.args[1::-1]):
        if a is other and isinstance(b, float):
            return b
    return None


def match_rmsnorm(n):
    """(h, weight node, eps) when n is w * cast(h32 * rsqrt(mean(h32^2, -1, keepdim) + eps)) with the statistic
    in float32 and the normalized value rounded to h's dtype before the weight; else None."""
    got = match_rmsnorm_scale(n)
    return None if got is None else got[:3]


def match_rmsnorm_scale(n):
    """match_rmsnorm's (h, weight node, eps) and the rsqrt node r [..., 1] (float32): n = w * cast(h32 * r)."""
    if not is_mul(n) or len(n.args) != 2:
        return None
    for w, inner in (n.args, n.args[::-1]):
        core = _strip_casts(inner)
        if not (isinstance(w, fx.Node) and is_mul(core) and meta(w) is not None and meta(w).dim() == 1):
            continue
        for hf, r in (core.args, core.args[::-1]):
            if not (is_call(r, {torch.rsqrt}, ("rsqrt",)) and is_call(r.args[0], _ADD, ("add",))):
                continue
            mean = next((a for a in r.args[0].args[:2] if is_call(a, {torch.mean}, ("mean",))), None)
            eps = _float_arg(r.args[0], mean) if mean is not None else None
            if eps is None or not _is_last_dim_keepdim(mean):
                continue
            sq = mean.args[0]
            if not (is_call(sq, {torch.pow}, ("pow",)) and sq.args[1:2] == (2,)) and \
                    not (is_mul(sq) and sq.args[0] is sq.args[1]):
                continue
            h = _strip_casts(hf)
            vh, vf, vo = meta(h), meta(hf), meta(n)
            if sq.args[0] is not hf or vh is None or vf is None or vo is None:
                continue
            if vf.dtype == torch.float32 and meta(inner).dtype == vh.dtype == vo.dtype:
                return h, w, eps, r
    return None


def _is_last_dim_keepdim(mean) -> bool:
    dim = mean.args[1] if len(mean.args) > 1 else mean.kwargs.get("dim")
    keep = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
    v = meta(mean.args[0])
    return keep is True and v is not None and dim in (-1, v.dim() - 1, [-1], (-1,))


def _traced_router(mask):
    """(kind, h, tensors, nodes) of a traced router mask = gt(logits, 0), else None."""
    if not (is_call(mask, _GT, ("gt",)) and mask.args[1:2] == (0,)):
        return None
    logit = mask.args[0]
    if is_call(logit, _SUB) and all(isinstance(a, fx.Node) and a.target is operator.getitem for a in logit.args[:2]):
        (e, s) = logit.args[:2]
        u = e.args[0]
        if s.args[0] is u and e.args[1] == (Ellipsis, 1) and s.args[1] == (Ellipsis, 0) and \
                u.op == "call_method" and u.target == "unflatten" and u.args[1:] == (-1, (-1, 2)) and \
                is_linear(u.args[0]) and is_linear(linear_parts(u.args[0])[0]):
            up, down = u.args[0], linear_parts(u.args[0])[0]
            return "pair", linear_parts(down)[0], (*linear_parts(down)[1:], *linear_parts(up)[1:]), \
                [mask, logit, e, s, u, up, down]
        return None
    if not is_linear(logit):
        return None
    first = linear_parts(logit)[0]
    if is_call(first, SILU_FNS, ("silu",)) and is_linear(first.args[0]):
        inner = first.args[0]
        return "mlp", linear_parts(inner)[0], (*linear_parts(inner)[1:], *linear_parts(logit)[1:]), \
            [mask, logit, first, inner]
    return "linear", first, linear_parts(logit)[1:], [mask, logit]


def match_router(mask):
    """(kind, h before casts, (w1, b1[, w2, b2]), nodes of the router) of a fusable router, else (None, why)."""
    if is_call(mask, set(_INSERTED)):
        kind, h, tensors, nodes = _INSERTED[mask.target], mask.args[0], mask.args[1:], [mask]
    else:
        got = _traced_router(mask)
        if got is None:
            return None, "its router is not a linear / SiLU-MLP / pair router"
        kind, h, tensors, nodes = got
    ts = [t for t in tensors if t is not None]
    if not all(isinstance(t, fx.Node) and meta(t) is not None and meta(t).dtype == torch.float32 for t in ts):
        return None, "its router's weights are not float32"
    casts = []
    h0 = h
    while _strip_casts(h0) is not h0:  # the router's own cast of h to its weights' dtype
        casts.append(h0)
        h0 = h0.args[0]
    return (kind, h0, tuple(tensors), nodes + casts), ""


def pair_as_linear(ctx: PassContext, tensors, at) -> tuple | None:
    """Graph constants (W [G, D], c [G]) of a pair router's (w_down, b_down, w_up, b_up) composed into the one
    linear map it is (norm_router.compose_pair), made once at compile time and inserted before `at`; None where
    the router's weights are not model parameters (a compile-time constant can only be made of those)."""
    from ..kernels.norm_router import compose_pair  # the kernels import Triton: only when a pair router is composed

    if not all(t is None or ctx.weights.is_static_weight(t) for t in tensors):
        return None
    real = [ctx.weights.tensor(t) if t is not None else None for t in tensors]
    key = tuple(id(t) for t in real)
    with torch.no_grad():
        composed = compose_pair(*real)
    return tuple(ctx.weights.constant(("pair_linear", i, key), name, lambda t=t: t, before=at)
                 for i, (name, t) in enumerate(zip(("router_w", "router_b"), composed)))


def unfused_routers(ctx: PassContext) -> list:
    """The rewritten blocks whose router is still a graph of its own (not a constant mask, not fused into its
    norm): the routers compose_routers, split_routers and sum_routers rewrite."""
    return [b for b in (*ctx.attns, *ctx.mlps)
            if b.status == "rewritten" and b.mask is not None and b.mask.op != "get_attr" and not router_fused(b)]


def replace_router(ctx: PassContext, blk, fn, h, w, b, nodes) -> None:
    """blk's router as fn(h, w, b) inserted where its mask node was: the mask's users read the new node, and the
    old router's nodes go."""
    with ctx.gm.graph.inserting_before(blk.mask):
        new = ctx.weights.call(fn, (h, w, b))
    blk.mask.replace_all_uses_with(new)
    blk.mask = new
    erase_unused(ctx.gm, nodes)


def _private(nodes, keep) -> bool:
    """Every node's users lie within `nodes` (or are `keep`): replacing the router leaves nothing dangling."""
    inside = set(nodes)
    return all(u in inside or u is keep for n in nodes[1:] for u in n.users)


class FuseNormRouter(Pass):
    name = "fuse_norm_router"

    def __init__(self, prefill_only: bool = False):
        # prefill_only: fuse in graphs of more than DECODE_T tokens only (decode-size routers go to sum_routers)
        self.prefill_only = prefill_only

    def __call__(self, ctx: PassContext) -> None:
        for blk in [*ctx.attns, *ctx.mlps]:
            what = "attention" if hasattr(blk, "q") else "mlp"
            if blk.status != "rewritten" or blk.mask is None or blk.mask.op == "get_attr":
                continue
            if self.prefill_only and self._decode_size(blk):  # left to sum_routers
                ctx.count("fuse_norm_router.decode_kept")
                continue
            why = self._fuse(ctx, blk)
            if why:
                ctx.report.unmatched.append(f"layer {blk.layer} {what}: norm + router not fused: {why}")
                log.info("wide: layer %d %s: norm + router not fused: %s", blk.layer, what, why)
            else:
                ctx.count("fuse_norm_router.fused")

    @staticmethod
    def _decode_size(blk) -> bool:
        """The block's rows are known and at most DECODE_T (a graph of unknown rows counts as a prefill)."""
        from ..kernels.tuning import DECODE_T

        rows = static_rows(blk.x)
        return rows is not None and rows <= DECODE_T

    def _fuse(self, ctx: PassContext, blk) -> str:
        norm = blk.x
        if norm not in node_index(ctx.gm):
            return "its norm was fused with another block's router"
        got = match_rmsnorm(norm)
        if got is None:
            return "the block's input is not an RMSNorm of the form the fused kernel computes"
        h, w_norm, eps = got
        r, why = match_router(blk.mask)
        if r is None:
            return why
        kind, rh, tensors, nodes = r
        if rh is norm:
            router_input = "normed"
        elif rh is h:
            router_input = "residual"
        else:
            return "its router reads neither the norm's output nor its input"
        if not _private(nodes, None):
            return "an intermediate value of the router is used elsewhere"
        if not (ctx.weights.is_static_weight(w_norm) and all(
                t is None or ctx.weights.is_static_weight(t) for t in tensors)):
            return "the norm's or the router's weights are not model parameters"
        order = node_index(ctx.gm)
        at = min([norm, *blk.mask.users], key=order.__getitem__)
        if kind == "pair":  # one linear map (compose_pair): the fused kernel then runs in one launch at any size
            kind, tensors = "linear", pair_as_linear(ctx, tensors, at)
        norm_nodes = self._norm_nodes(norm, h)
        terms = self._residual_add(h, at, order, {norm, *nodes, *norm_nodes})
        args = (h, w_norm, eps, router_input, kind, *tensors)
        with ctx.gm.graph.inserting_before(at):
            if terms is None:
                fused = ctx.weights.call(wide_rmsnorm_router_nd, args)
            else:
                fused = ctx.weights.call(wide_add_rmsnorm_router_nd, (*terms, *args[1:]))
                total = ctx.weights.call(operator.getitem, (fused, 0))
            y = ctx.weights.call(operator.getitem, (fused, 1 if terms else 0))
            mask = ctx.weights.call(operator.getitem, (fused, 2 if terms else 1))
        norm.replace_all_uses_with(y)
        blk.mask.replace_all_uses_with(mask)
        old_mask, blk.mask, blk.x = blk.mask, mask, y
        blk.router_forms.append("with_norm")
        erase_unused(ctx.gm, [old_mask, *nodes, norm, *norm_nodes])
        if terms is not None:
            h.replace_all_uses_with(total)
            erase_unused(ctx.gm, [h])
            ctx.count("fuse_norm_router.residual_add")
        log.info("wide: layer %d: %s router (%s) fused into its RMSNorm%s", blk.layer, kind, router_input,
                 " and residual add -> wide.add_rmsnorm_router" if terms else " -> wide.rmsnorm_router")
        return ""

    @staticmethod
    def _residual_add(h, at, order, inside) -> tuple | None:
        """(a, b) when h = a + b of two tensors of h's shape and dtype and every user of h outside the norm and
        the router comes after `at` (they read the fused op's sum instead), else None."""
        if not (is_call(h, _ADD, ("add",)) and len(h.args) == 2 and not h.kwargs):
            return None
        a, b, vh = *h.args, meta(h)
        if not (isinstance(a, fx.Node) and isinstance(b, fx.Node) and vh is not None):
            return None
        va, vb = meta(a), meta(b)
        if va is None or vb is None or not (va.shape == vb.shape == vh.shape and va.dtype == vb.dtype == vh.dtype):
            return None
        if any(u not in inside and order[u] <= order[at] for u in h.users):
            return None
        return a, b

    @staticmethod
    def _norm_nodes(norm, h) -> list:
        """The nodes of a matched norm (between h and its output), for erasing once unused."""
        out, frontier = [], [norm]
        for _ in range(8):
            frontier = [a for f in frontier for a in f.all_input_nodes
                        if a is not h and a.op in ("call_function", "call_method")]
            out += frontier
        return out

