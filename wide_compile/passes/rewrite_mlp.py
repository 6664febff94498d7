"""Pass 5: rewrite each routed gated MLP (gate, up, act, mul, [mask multiply], down) into one wide.mlp call
with the gate's activation, on the path the cost model picks per token count (cost_model.py; recorded in the
node's meta["wide_path"]). The op reads the down weight as w_down_t [F, D]: a transposed view of down_proj's own
weight, or, where a token count of the graph runs the K-skipping tile kernel, a graph constant transposed once, now
(base.reduction_weight). Gate / up rows of a fused gate_up weight are passed as views of it (rows a:b, no copy).
A block whose router is structured (match_buckets found its bucket and prototype table) runs wide.mlp on the mask
protos[bucket]; with bucket_ops=True (PassOptions) it runs wide.mlp_bucket instead, on down_proj's own weight
[D, F], unless the bucket op cannot take the block (match_buckets.bucket_refusal). The report says why a structured
block runs the free-mask op."""
from __future__ import annotations

import operator

import torch

from ._graph import erase_unused, last_dim, linear_parts, static_rows
from ._ops import wide_mlp_bucket_nd, wide_mlp_gate_up_nd, wide_mlp_nd
from .base import GROUPING_FIX, WEIGHTS_FIX, MLPMatch, Pass, PassContext, keep_routing, log, reduction_weight
from .match_buckets import takes_bucket


def weight_rows(ctx: PassContext, src: tuple):
    """The weight (and bias) node of proj_source `src` = (linear, rows): the linear's own, or a view of rows
    a:b inserted at the current insertion point."""
    _, w, b = linear_parts(src[0])
    rows = src[1]
    if rows is None:
        return w, b
    sl = slice(*rows)
    return (ctx.weights.call(operator.getitem, (w, sl)),
            None if b is None else ctx.weights.call(operator.getitem, (b, sl)))


class RewriteMLP(Pass):
    name = "rewrite_mlp"

    def __init__(self, fuse_gate_up: bool = False, bucket_ops: bool = False):
        self.fuse_gate_up = fuse_gate_up
        self.bucket_ops = bucket_ops

    def __call__(self, ctx: PassContext) -> None:
        W = ctx.weights
        for m in ctx.mlps:
            if m.status == "fallback" or m.mask is None:
                continue
            bg, bu = linear_parts(m.gate_src[0])[2], linear_parts(m.up_src[0])[2]
            _, wd, bd = linear_parts(m.down)
            why = fix = None
            if bg is not None or bu is not None:
                why = "its gate/up projections carry a bias (wide.mlp adds none)"
                fix = "use bias-free gate/up projections (e.g. mlp_bias=False)"
            elif not all(W.is_static_weight(linear_parts(s[0])[1]) for s in (m.gate_src, m.up_src)) or \
                    not W.is_static_weight(wd):
                why, fix = "its gate/up/down weights are not model parameters", WEIGHTS_FIX
            else:
                why, fix = ctx.group_mismatch("ffn", m.groups, m.group_size, last_dim(m.gate)), GROUPING_FIX
            if why:
                ctx.fallback("gated MLP", m.down, why, fix, match=m)
                keep_routing(ctx, m.down, m.prod, m)
                continue
            with ctx.gm.graph.inserting_before(m.down):
                if takes_bucket(ctx, m, m.x, self.bucket_ops, "rewrite_mlp", "gated MLP"):
                    new = _bucket_mlp(ctx, m, wd)
                else:
                    new = _free_mask_mlp(ctx, m, wd, self.fuse_gate_up)
                if bd is not None:
                    new = W.call(operator.add, (new, bd))
            m.down.replace_all_uses_with(new)
            fused = [n for s in (m.gate_src, m.up_src) for n in (s[0], *((s[0].users) if s[1] else ()))]
            erase_unused(ctx.gm, [m.down, *m.expand_nodes, m.prod, m.act, m.gate, m.up, *fused])
            m.status = "rewritten"
            ctx.count("rewrite_mlp.rewritten")
            log.info("wide: layer %d: gated MLP (%s) -> wide.%s (%d groups of %d channels)", m.layer, m.activation,
                     m.ops["mlp"], m.groups, m.group_size)


def _free_mask_mlp(ctx: PassContext, m: MLPMatch, wd, fuse_gate_up: bool = False):
    W = ctx.weights
    wg, _ = weight_rows(ctx, m.gate_src)
    wu, _ = weight_rows(ctx, m.up_src)
    tuning, m.paths["mlp"] = ctx.op_tuning("mlp", m.x, W.tensor(wd).shape[0], m.groups * m.group_size, m.group_size)
    wdt = reduction_weight(ctx, wd, m.paths["mlp"], f"L{m.layer}_w_down_t", m.down)
    d = m.paths["mlp"]
    tg, tu = (W.tensor(wg), W.tensor(wu)) if fuse_gate_up else (None, None)
    if d.T is not None and d.path == "dense_masked" and tg is not None and tu is not None:
        # one GEMM over [gate; up] where the dense-masked path computes every row anyway: a copy of both weights
        # made now (a constant of the graph, as K / V's with q), one launch per block fewer
        wgu = W.constant(("gate_up", id(tg), id(tu)), f"L{m.layer}_w_gate_up",
                         lambda: torch.cat([tg.detach(), tu.detach()]), m.down)
        new = W.call(wide_mlp_gate_up_nd, (m.x, wgu, wdt, m.mask, m.group_size, m.activation))
        new.meta["wide_path"] = d
        m.ops["mlp"] = "mlp (gate and up in one GEMM)"
        ctx.count("rewrite_mlp.gate_up_fused")
        return new
    new = W.call(wide_mlp_nd, (m.x, wg, wu, wdt, m.mask, m.group_size, tuning, m.activation))
    new.meta["wide_path"] = m.paths["mlp"]
    m.ops["mlp"] = "mlp"
    return new


def _bucket_mlp(ctx: PassContext, m: MLPMatch, wd):
    wg, _ = weight_rows(ctx, m.gate_src)
    wu, _ = weight_rows(ctx, m.up_src)
    new = ctx.weights.call(wide_mlp_bucket_nd, (m.x, wg, wu, wd, m.bucket, m.protos, m.group_size, m.activation))
    m.paths["mlp"] = new.meta["wide_path"] = bucket_decision("mlp", m.x)
    m.ops["mlp"] = "mlp_bucket"
    ctx.count("rewrite_mlp.bucket")
    return new


def bucket_decision(op: str, x):
    """The cost_model.Decision a bucket op records as its path: one kernel for every token count (its tiles:
    bucket_mlp.CONFIGS)."""
    from .cost_model import Decision

    return Decision(op=op, T=static_rows(x), path="bucket", rows=[(0, "bucket")], seconds={},
                    source="structured router")
