"""The pass manager: runs the WIDE passes in order on a Dynamo FX graph and keeps score (the passes and
their shared types live in base.py and one file per pass; this module only orchestrates).

Every pass counts what it did in `torch._dynamo.utils.counters["wide"]` (keys "<pass>.<what>") and logs
one line per layer on the "wide_compile.passes" logger; the per-graph `GraphReport` is what
`wide_compile.explain` prints.
"""
from __future__ import annotations

import time
from typing import Sequence

import torch
from torch import fx

from ..config import GroupGeometry
from ._graph import describe, is_call, is_linear, is_mul, linear_parts, match_group_mask
from .base import DENSE_EVERYWHERE, Pass, PassContext, counters, log, op_counts
from .compose_routers import ComposeRouters
from .detect_attention import DetectAttention
from .detect_mlp import DetectSwiGLU
from .fuse_norm_router import FuseNormRouter
from .fuse_router_gemm import FuseRouterGemm
from .fuse_router_select import FuseRouterSelect
from .insert_routers import InsertRouters
from .match_buckets import MatchBuckets
from .options import PassOptions
from .rewrite_attention import RewriteAttention
from .rewrite_mlp import RewriteMLP
from .rewrite_sdpa import RewriteSDPA
from .split_routers import SplitRouters
from .sum_routers import SumRouters


def default_passes(options: PassOptions | None = None, **kwargs) -> list[Pass]:
    """The WIDE passes in order, the optional ones as `options` (or PassOptions(**kwargs)) says (each field's
    meaning and default: options.py). The order matters: the rewrites first (detect, insert routers, match
    buckets, MLP, attention, SDPA); then compose_routers (a pair router as one linear map); then the passes that
    take routers into other launches, each leaving alone what an earlier one fused: fuse_router_gemm (prefill-size
    routers as columns of the projection GEMM), fuse_norm_router (needs the rewrites' mask nodes), split_routers
    (the prefill-size routers left), sum_routers (the decode-size routers left); fuse_router_select last, on the
    split routers."""
    if options is not None and kwargs:
        raise TypeError("default_passes takes a PassOptions or keyword options, not both")
    o = options if options is not None else PassOptions(**kwargs)
    passes = [DetectSwiGLU(), DetectAttention(), InsertRouters(), MatchBuckets(), RewriteMLP(o.fuse_gate_up, o.bucket_ops),
              RewriteAttention(fuse_qkv=o.fuse_qkv, bucket_ops=o.bucket_ops)]
    if o.sparse_attention is not False:
        passes.append(RewriteSDPA(prefill_kv_aligned_only=o.sparse_attention == "auto"))
    optional = [(o.compose_routers, ComposeRouters), (o.fuse_router_gemm, FuseRouterGemm),
                (o.fuse_norm_router, lambda: FuseNormRouter(prefill_only=o.fuse_norm_router == "prefill")),
                (o.split_routers, SplitRouters), (o.sum_routers, SumRouters),
                (o.fuse_router_select, FuseRouterSelect)]
    return passes + [make() for on, make in optional if on]


class PassManager:
    """Runs `passes` (default: default_passes of `options`, or of PassOptions(**kwargs)) on a graph."""

    def __init__(self, passes: Sequence[Pass] | None = None, check_leftovers: bool | None = None,
                 options: PassOptions | None = None, **kwargs):
        if passes is not None and (options is not None or kwargs):
            raise TypeError("PassManager takes a pass list or pass options, not both")
        self.passes = list(passes) if passes is not None else default_passes(options, **kwargs)
        self.check_leftovers = passes is None if check_leftovers is None else check_leftovers

    def run(self, gm: fx.GraphModule, example_inputs, routers=None, strict: bool = False,
            geometry: GroupGeometry | None = None, kernel_tuning: str = "", kernel_path: str = "auto",
            mask_stats=None) -> PassContext:
        t0 = time.perf_counter()
        ctx = PassContext(gm, example_inputs, routers=routers, strict=strict, geometry=geometry,
                          kernel_tuning=kernel_tuning, kernel_path=kernel_path, mask_stats=mask_stats)
        ctx.report.nodes_before = len(gm.graph.nodes)
        ctx.report.passes = [p.name for p in self.passes]
        ctx.report.ops_before = op_counts(gm)
        for p in self.passes:
            p(ctx)
            gm.graph.lint()
        if self.check_leftovers:
            _warn_leftovers(ctx)
        gm.recompile()
        ctx.report.nodes_after = len(gm.graph.nodes)
        ctx.report.ops_after = op_counts(gm)
        _summarise(ctx)
        ctx.report.seconds = time.perf_counter() - t0
        counters()["graphs"] += 1
        log.info("%s", ctx.report)
        return ctx


def _warn_leftovers(ctx: PassContext) -> None:
    """A traced group-mask multiply that no pass consumed means a routed linear runs the masked reference: say
    so, with what the block looks like and how to get the WIDE kernels for it."""
    for n in ctx.gm.graph.nodes:
        if is_linear(n):
            em = match_group_mask(linear_parts(n)[0])
            if em is not None and not any(
                    s.status == "fallback" and (getattr(s, "down", None) is n or getattr(s, "o", None) is n)
                    for s in [*ctx.mlps, *ctx.attns]):
                what, why, fix = _leftover_hint(ctx, em[0])
                ctx.fallback(what, n, why, fix)


_EAGER_ATTN = {torch.matmul, torch.bmm, torch.softmax, torch.nn.functional.softmax, torch.Tensor.softmax}


def _leftover_hint(ctx: PassContext, inner: fx.Node) -> tuple[str, str, str]:
    """(block, why, fix) for a routed linear whose input `inner` (before the mask multiply) was not matched."""
    seen, frontier = {inner}, [inner]
    for _ in range(12):  # a few ops back, within the block (never past a linear): an eager attention's matmul
        nxt = []
        for f in frontier:
            if is_call(f, _EAGER_ATTN, ("softmax", "matmul", "bmm")):
                return ("attention", "its attention is computed with matmul / softmax (eager attention), not "
                        "scaled_dot_product_attention",
                        'load the model with attn_implementation="sdpa" (where transformers offers it for the '
                        "architecture; a model it runs only with eager attention keeps the masked reference)")
            if not is_linear(f):
                nxt += [a for a in f.all_input_nodes if a not in seen]
                seen.update(f.all_input_nodes)
        frontier = nxt
    if is_mul(inner) and any(is_linear(a) or any(is_linear(b) for b in getattr(a, "all_input_nodes", ()))
                             for a in inner.args):
        acts = [a for a in inner.args if isinstance(a, fx.Node) and not is_linear(a)]
        act = f" ({getattr(acts[0].target, '__name__', acts[0].target)})" if acts else ""
        return ("gated MLP", f"its gate activation{act} is not one wide.mlp computes",
                "use a silu (SwiGLU) or gelu / gelu-tanh (GeGLU) gate: those are the activations wide.mlp supports")
    near = [u for u in ctx.unmatched_nodes if u[1] in seen] or ctx.unmatched_nodes
    notes = "; ".join(f"{w} at {describe(nd)}: {why}" for w, nd, why in near) or "no block matched"
    return ("routed linear", f"its input is group-masked but the block around it was not recognised ({notes})",
            "the pass matches q/k/v linears -> scaled_dot_product_attention -> o linear and act(gate) * up -> "
            "down linear")


def _kernel_detail(b, plural: bool) -> str:
    """The report's tail for a block (MLPMatch / AttnMatch): its ops, why a structured router is on the
    free-mask ops, the kernel paths, the router's rewrites and the fused norm + router, each as "; ..."
    (`plural`: the block has several ops)."""
    s = "s" if plural else ""
    parts = []
    if b.ops:
        parts.append(f"op{s}: " + ", ".join(f"wide.{o}" for o in b.ops.values()))
    if b.bucket_reason:
        parts.append(f"structured router on the free-mask op{s} (mask = protos[bucket]): {b.bucket_reason}")
    if b.paths:
        parts.append(f"path{s}: " + ", ".join(str(d) for d in b.paths.values()))
    if b.router_forms:
        parts.append("router: " + ", ".join({"composed": "pair composed into one linear map",
                                             "summed": "summed over the width",
                                             "split": "on tensor cores over a bf16 pair",
                                             "in_select": "computed in its dense-masked op's select",
                                             "in_gemm": "columns of the projection GEMM after its norm",
                                             "with_norm": "with its norm in one wide.rmsnorm_router launch"}[f]
                                            for f in b.router_forms))
    return "".join("; " + p for p in parts)


def _summarise(ctx: PassContext) -> None:
    r = ctx.report
    for m in ctx.mlps:
        detail = ""
        if m.groups:
            detail = f"G={m.groups} x {m.group_size} channels, {m.activation} gate, {m.form} input"
        if m.reason:
            detail += ("; " if detail else "") + m.reason
        detail += _kernel_detail(m, plural=False)
        r.mlp.append({"layer": m.layer, "status": m.status, "form": m.form, "groups": m.groups,
                      "activation": m.activation, "paths": {k: d.path for k, d in m.paths.items()},
                      "ops": dict(m.ops), "bucket_reason": m.bucket_reason,
                      "group_size": m.group_size, "detail": detail,
                      "nodes": {k: getattr(m, k).name for k in ("gate", "up", "down")}})
    for a in ctx.attns:
        detail = ""
        if a.groups:
            detail = (f"G={a.groups} x {a.group_size} q columns, {a.form} input, K/V dense"
                      + (" (in q's launch)" if a.kv_fused else ""))
        if not a.q_ok:
            detail += f"; q dense ({a.q_reason})"
        elif a.q_reason:
            detail += f"; {a.q_reason}"
        if a.sdpa_kind:
            detail += f"; attention: wide.attn_{a.sdpa_kind}"
        elif a.sdpa_reason:
            detail += f"; attention dense ({a.sdpa_reason})"
        if a.reason:
            detail += "; " + a.reason
        detail += _kernel_detail(a, plural=True)
        r.attn.append({"layer": a.layer, "status": a.status, "form": a.form, "groups": a.groups,
                       "paths": {k: d.path for k, d in a.paths.items()}, "ops": dict(a.ops),
                       "bucket_reason": a.bucket_reason,
                       "group_size": a.group_size, "detail": detail, "q_rewritten": a.status == "rewritten" and a.q_ok,
                       "kv_fused": a.kv_fused,
                       "nodes": {"q": a.q.name, "o": a.o.name, "kv": [n.name for n in a.kv]}})
    decisions = [d for b in (*ctx.mlps, *ctx.attns) for d in b.paths.values()]
    r.dense_everywhere = bool(decisions) and all(
        all(p == "dense_masked" for _, p in d.rows) if d.T is None else d.path == "dense_masked" for d in decisions)
    if r.dense_everywhere:
        log.info("wide_compile: %s", DENSE_EVERYWHERE)
    forms = {m.form for m in ctx.mlps} | {a.form for a in ctx.attns}
    if "masked" in forms:
        r.form = "masked"
    elif ctx.routers is not None and (ctx.mlps or ctx.attns):
        r.form = "dense+routers"
    elif ctx.mlps or ctx.attns:
        r.form = "dense"
