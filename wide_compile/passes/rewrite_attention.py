"""Pass 6: rewrite the routed attention projections (each on the path the cost model picks per token count,
cost_model.py, recorded in the node's meta["wide_path"]): o -> wide.o_proj (weight as w_o_t [Nq, D]: a view of
o_proj's own weight, or a graph constant transposed once, now, where the K-skipping tile kernel runs), q ->
wide.q_proj (inactive head groups' columns exactly 0; only when the q -> sdpa path keeps heads apart, see
detect_attention). K and V stay dense linears. With a fused qkv linear
(rows [q; k; v] of one weight) q runs on a view of the q rows and K/V on one linear over a view of the rest.
A block whose router is structured (match_buckets) runs the free-mask ops on protos[bucket]; with bucket_ops=True
(PassOptions) it runs wide.o_proj_bucket (on o_proj's own weight [D, Nq]) and wide.q_proj_bucket instead, unless
the bucket ops cannot take it (match_buckets.bucket_refusal). The report says why a structured block runs the
free-mask ops.

Where q's path at the graph's token count is a one-token GEMV or the dense-masked GEMM (decode sizes, and prefill
where the masks leave no tile unused; for a structured router, one token: the bucket op's GEMV) and K / V are
separate linears on q's input, q, K and V run as one q op over a compile-time concatenation of their weights
[q; k; v]: wide.q_proj's mask (wide.q_proj_bucket's prototypes) covers q's groups, and the groups past it, K / V's,
run always on. The step reads the same bytes in one launch instead of three; the reports count it
(rewrite_attention.qkv_fused). The concatenated weight is a second copy of the three weights, made once at compile
time. fuse_qkv=False (optimize / the backend) keeps K / V as their own linears."""
from __future__ import annotations

import operator

import torch
from torch import fx

from ._graph import _rows_of_slice, erase_unused, is_linear, last_dim, linear_parts, node_index, static_rows
from ._ops import wide_o_proj_bucket_nd, wide_o_proj_nd, wide_q_proj_bucket_nd, wide_q_proj_nd
from .base import GROUPING_FIX, WEIGHTS_FIX, AttnMatch, Pass, PassContext, keep_routing, log, reduction_weight
from .match_buckets import takes_bucket
from .rewrite_mlp import bucket_decision, weight_rows


def _split_fused_kv(ctx: PassContext, a: AttnMatch) -> bool:
    """After q of a fused qkv linear (rows 0:Nq) was rewritten: compute K/V with one linear over the weight's
    rows Nq: and re-point each k/v column range at it, so no q column is computed twice. False (the fused
    linear stays, computing q's columns for nothing) when the layout is not [q; rest]."""
    lin, (q0, nq) = a.q_src
    width = last_dim(lin)
    ranges = [(u, _rows_of_slice(u.args[1], width)) for u in a.kv if u.target is operator.getitem and u.args[0] is lin]
    if q0 != 0 or len(ranges) != len(a.kv) or any(r is None or r[0] < nq for _, r in ranges):
        return False
    _, w, b = linear_parts(lin)
    order = node_index(ctx.gm)
    with ctx.gm.graph.inserting_before(min((u for u, _ in ranges), key=order.__getitem__)):
        rest = slice(nq, None)
        wkv = ctx.weights.call(operator.getitem, (w, rest))
        bkv = None if b is None else ctx.weights.call(operator.getitem, (b, rest))
        kv = ctx.weights.call(lin.target, (linear_parts(lin)[0], wkv, bkv))
        for u, (s, e) in ranges:
            new = ctx.weights.call(operator.getitem, (kv, (Ellipsis, slice(s - nq, e - nq))))
            u.replace_all_uses_with(new)
    erase_unused(ctx.gm, [u for u, _ in ranges] + [lin])
    return True


def _why_not(ctx: PassContext, a: AttnMatch, wq: fx.Node, wo: fx.Node, nq):
    """(why, fix) when the routed attention block cannot use the WIDE kernels, else (None, None)."""
    W = ctx.weights
    if not (W.is_static_weight(wo) and W.is_static_weight(wq)):
        return "its q/o weights are not model parameters", WEIGHTS_FIX
    if last_dim(a.q) is not None and last_dim(a.q) != nq:
        return (f"its q width {last_dim(a.q)} is not o_proj's input width {nq}",
                "give q_proj as many output columns as o_proj has inputs (num_heads * head_dim)")
    return ctx.group_mismatch("attn", a.groups, a.group_size, nq), GROUPING_FIX


# q's paths on which K and V join q's launch: the one-token GEMV reads each row it computes once, and the
# dense-masked GEMM computes every row anyway, so always-on K / V rows cost on them what K / V's own linears cost
QKV_PATHS = ("gemv", "dense_masked")


class RewriteAttention(Pass):
    name = "rewrite_attention"

    def __init__(self, fuse_qkv: bool = True, bucket_ops: bool = False):
        self.fuse_qkv = fuse_qkv
        self.bucket_ops = bucket_ops

    def __call__(self, ctx: PassContext) -> None:
        W = ctx.weights
        order = node_index(ctx.gm)
        for a in ctx.attns:
            if a.status == "fallback" or a.mask is None:
                continue
            q_lin, q_rows = a.q_src
            _, wo, bo = linear_parts(a.o)
            nq = last_dim(a.o_in)
            why, fix = _why_not(ctx, a, linear_parts(q_lin)[1], wo, nq)
            if why:
                ctx.fallback("attention", a.o, why, fix, match=a)
                keep_routing(ctx, a.o, a.o_in, a)
                continue
            bucket = takes_bucket(ctx, a, a.o_in, self.bucket_ops, "rewrite_attention", "attention")
            with ctx.gm.graph.inserting_before(a.o):
                new_o = _bucket_o(ctx, a, wo, bo) if bucket else _free_mask_o(ctx, a, wo, bo, nq)
            a.o.replace_all_uses_with(new_o)
            erase_unused(ctx.gm, [a.o, *a.expand_nodes])
            ctx.count("rewrite_attention.o_rewritten")
            routing = [a.mask] + ([a.bucket, a.protos] if bucket else [])
            if a.q_ok and max(order.get(n, -1) for n in routing) > order.get(a.q, 0) and a.mask.op != "get_attr":
                a.q_ok, a.q_reason = False, "router mask is computed after q"
            if a.q_ok:
                kv = _kv_to_fuse(ctx, a, order, bucket) if self.fuse_qkv else None
                with ctx.gm.graph.inserting_before(min([a.q, *(kv or [])], key=order.__getitem__)):
                    new_q = _bucket_q(ctx, a, nq, kv) if bucket else _free_mask_q(ctx, a, wo, nq, kv)
                if new_q is None:  # q stays the model's own linear (see _free_mask_q)
                    a.q_reason = "q unmasked: on the dense path o_proj's input mask alone routes the block"
                else:
                    a.q.replace_all_uses_with(new_q)
                    erase_unused(ctx.gm, [a.q, *(kv if a.kv_fused else [])])
                    if q_rows is not None and not _split_fused_kv(ctx, a):
                        a.q_reason = "fused qkv: its q columns are computed again in the fused linear"
                ctx.count("rewrite_attention.q_rewritten")
            a.status = "rewritten"
            log.info("wide: layer %d: attention -> wide.%s%s (%d head groups of %d columns), K/V dense%s",
                     a.layer, a.ops["o"], f" + wide.{a.ops['q']}" if a.q_ok else "", a.groups, a.group_size,
                     " (in q's launch)" if a.kv_fused else "")


def _free_mask_o(ctx: PassContext, a: AttnMatch, wo, bo, nq):
    W = ctx.weights
    tuning, a.paths["o"] = ctx.op_tuning("o", a.o_in, W.tensor(wo).shape[0], nq, a.group_size)
    wot = reduction_weight(ctx, wo, a.paths["o"], f"L{a.layer}_w_o_t", a.o)
    new = W.call(wide_o_proj_nd, (a.o_in, wot, bo, a.mask, a.group_size, tuning))
    new.meta["wide_path"] = a.paths["o"]
    a.ops["o"] = "o_proj"
    return new


def _free_mask_q(ctx: PassContext, a: AttnMatch, wo, nq, kv=None):
    """wide.q_proj on q's weight; or, given kv (K / V's linears) and a q path in QKV_PATHS, on [q; k; v] with
    K / V's groups always on: q is then its first nq columns and each of kv is replaced by its own columns. On the
    dense path at a static token count q is not masked: a plain linear over [q; k; v] (given kv), else None."""
    W = ctx.weights
    wq, bq = weight_rows(ctx, a.q_src)
    tuning, a.paths["q"] = ctx.op_tuning("q", a.x, W.tensor(wo).shape[0], nq, a.group_size)
    if a.paths["q"].T is not None and a.paths["q"].path == "dense_masked":
        # The dense path would compute every q column and then zero the inactive groups'. o_proj reads its input
        # through the same mask, so what an inactive group's q gives attention never reaches the block's output
        # (attention keeps heads apart; K / V do not depend on q): q runs unmasked, one mask launch fewer, and
        # K / V stay in its launch. None: q's own linear is kept as it is.
        a.ops["q"] = "linear"
        ctx.count("rewrite_attention.q_unmasked")
        if not kv:
            return None
        return _qkv(ctx, a, kv, nq, lambda w, b: W.call(torch.nn.functional.linear, (a.x, w, b)))
    a.ops["q"] = "q_proj"
    if not kv or a.paths["q"].T is None or a.paths["q"].path not in QKV_PATHS:
        new = W.call(wide_q_proj_nd, (a.x, wq, bq, a.mask, a.group_size, tuning))
        new.meta["wide_path"] = a.paths["q"]
        return new
    # the mask covers q's groups; wide.q_proj runs the groups past it (K / V's) always on
    return _qkv(ctx, a, kv, nq, lambda w, b: W.call(wide_q_proj_nd, (a.x, w, b, a.mask, a.group_size, tuning)))


def _qkv(ctx: PassContext, a: AttnMatch, kv: list, nq: int, call) -> fx.Node:
    """q's node after `call(w_qkv, b_qkv)` (the q op over [q; k; v], K / V's groups always on): each of kv is
    replaced by its columns of the result, q is its first nq columns."""
    W = ctx.weights
    lins = (a.q_src[0], *kv)
    ws = [W.tensor(linear_parts(n)[1]) for n in lins]
    bs = [W.tensor(linear_parts(n)[2]) if linear_parts(n)[2] is not None else None for n in lins]
    first = min(lins, key=node_index(ctx.gm).__getitem__)
    # w_qkv: [Nq + Nk + Nv, D]
    w = W.constant(("qkv", *map(id, ws)), f"L{a.layer}_w_qkv", lambda: torch.cat([t.detach() for t in ws]), first)
    b = None
    if any(t is not None for t in bs):
        b = W.constant(("qkv_b", *map(id, ws)), f"L{a.layer}_b_qkv", lambda: torch.cat(
            [t.detach() if t is not None else wt.new_zeros(wt.shape[0]) for t, wt in zip(bs, ws)]), first)
    qkv = call(w, b)
    qkv.meta["wide_path"] = a.paths["q"]
    start = nq
    for n, t in zip(kv, ws[1:]):
        n.replace_all_uses_with(W.call(operator.getitem, (qkv, (Ellipsis, slice(start, start + t.shape[0])))))
        start += t.shape[0]
    a.kv_fused = True
    ctx.count("rewrite_attention.qkv_fused")
    return W.call(operator.getitem, (qkv, (Ellipsis, slice(0, nq))))


def _kv_to_fuse(ctx: PassContext, a: AttnMatch, order, bucket: bool) -> list | None:
    """K / V's linears when they can join q's launch: separate linears on q's input (not a fused qkv linear's
    column ranges) with model weights of q's dtype, each a whole number of groups wide, a static token count (one
    token for a structured router: the bucket op's one-token GEMV), and the routing computed before all of them.
    None otherwise: K / V stay their own linears."""
    W = ctx.weights
    T = static_rows(a.x)
    if a.q_src[1] is not None or not a.kv or T is None or (bucket and T != 1):
        return None
    wq = W.tensor(linear_parts(a.q_src[0])[1])
    for n in a.kv:
        if not is_linear(n) or linear_parts(n)[0] is not a.x:
            return None
        _, w, b = linear_parts(n)
        t = W.tensor(w)
        if not W.is_static_weight(w) or (b is not None and not W.is_static_weight(b)):
            return None
        if t is None or wq is None or t.dtype != wq.dtype or t.dim() != 2 or t.shape[0] % a.group_size:
            return None
    routing = [a.bucket, a.protos] if bucket else [a.mask]
    first = min(order[n] for n in (a.q, *a.kv))
    if any(n.op != "get_attr" and order.get(n, first) >= first for n in routing):
        return None
    return list(a.kv)


def _bucket_o(ctx: PassContext, a: AttnMatch, wo, bo):
    new = ctx.weights.call(wide_o_proj_bucket_nd, (a.o_in, wo, bo, a.bucket, a.protos, a.group_size))
    a.paths["o"] = new.meta["wide_path"] = bucket_decision("o", a.o_in)
    a.ops["o"] = "o_proj_bucket"
    ctx.count("rewrite_attention.o_bucket")
    return new


def _bucket_q(ctx: PassContext, a: AttnMatch, nq: int, kv=None):
    """wide.q_proj_bucket on q's weight, or (kv: one token) on [q; k; v] with K / V's groups always on."""
    a.paths["q"] = bucket_decision("q", a.x)
    a.ops["q"] = "q_proj_bucket"
    ctx.count("rewrite_attention.q_bucket")

    def call(w, b):
        return ctx.weights.call(wide_q_proj_bucket_nd, (a.x, w, b, a.bucket, a.protos, a.group_size))
    if kv:
        return _qkv(ctx, a, kv, nq, call)
    new = call(*weight_rows(ctx, a.q_src))
    new.meta["wide_path"] = a.paths["q"]
    return new
