"""The pass manager: runs the WIDE passes in order on a Dynamo FX graph and keeps score (the passes and
their shared types live in base.py and one file per pass; this module only orchestrates).

Every pass counts what it did in `torch._dynamo.utils.counters["wide"]` (keys "<pass>.<what>") and logs
one line per layer on the "wide_compile.passes" logger; the per-graph `GraphReport` is what
`wide_compile.explain` prints.
"""
from __future__ import annotations

import time
from typing import Sequence

from torch import fx

from ..config import GroupGeometry
from ._graph import is_linear, linear_parts, match_group_mask
from .base import Pass, PassContext, counters, log, op_counts
from .detect_attention import DetectAttention
from .detect_mlp import DetectSwiGLU
from .insert_routers import InsertRouters
from .rewrite_attention import RewriteAttention
from .rewrite_mlp import RewriteMLP
from .rewrite_sdpa import RewriteSDPA


def default_passes() -> list[Pass]:
    return [DetectSwiGLU(), DetectAttention(), InsertRouters(), RewriteMLP(), RewriteAttention(), RewriteSDPA()]


class PassManager:
    def __init__(self, passes: Sequence[Pass] | None = None, check_leftovers: bool | None = None):
        self.passes = list(passes) if passes is not None else default_passes()
        self.check_leftovers = passes is None if check_leftovers is None else check_leftovers

    def run(self, gm: fx.GraphModule, example_inputs, routers=None, strict: bool = False,
            geometry: GroupGeometry | None = None, kernel_tuning: str = "") -> PassContext:
        t0 = time.perf_counter()
        ctx = PassContext(gm, example_inputs, routers=routers, strict=strict, geometry=geometry,
                          kernel_tuning=kernel_tuning)
        ctx.report.nodes_before = len(gm.graph.nodes)
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
    """A traced group-mask multiply that no pass consumed means a routed linear stays dense: say so."""
    for n in ctx.gm.graph.nodes:
        if is_linear(n):
            x = linear_parts(n)[0]
            if match_group_mask(x) is not None and not any(
                    s.status == "fallback" and (getattr(s, "down", None) is n or getattr(s, "o", None) is n)
                    for s in [*ctx.mlps, *ctx.attns]):
                ctx.fallback("routed linear", n, "its input is group-masked but the surrounding block was not "
                             "recognised as a SwiGLU MLP or an sdpa attention block")


def _summarise(ctx: PassContext) -> None:
    r = ctx.report
    for m in ctx.mlps:
        detail = ""
        if m.groups:
            detail = f"G={m.groups} x {m.group_size} channels, {m.form} input"
        if m.reason:
            detail += ("; " if detail else "") + m.reason
        r.mlp.append({"layer": m.layer, "status": m.status, "form": m.form, "groups": m.groups,
                      "group_size": m.group_size, "detail": detail,
                      "nodes": {k: getattr(m, k).name for k in ("gate", "up", "down")}})
    for a in ctx.attns:
        detail = ""
        if a.groups:
            detail = f"G={a.groups} x {a.group_size} q columns, {a.form} input, K/V dense"
        if not a.q_ok:
            detail += f"; q dense ({a.q_reason})"
        if a.sdpa_kind:
            detail += f"; attention: wide.attn_{a.sdpa_kind}"
        elif a.sdpa_reason:
            detail += f"; attention dense ({a.sdpa_reason})"
        if a.reason:
            detail += "; " + a.reason
        r.attn.append({"layer": a.layer, "status": a.status, "form": a.form, "groups": a.groups,
                       "group_size": a.group_size, "detail": detail, "q_rewritten": a.status == "rewritten" and a.q_ok,
                       "nodes": {"q": a.q.name, "o": a.o.name, "kv": [n.name for n in a.kv]}})
    forms = {m.form for m in ctx.mlps} | {a.form for a in ctx.attns}
    if "masked" in forms:
        r.form = "masked"
    elif ctx.routers is not None and (ctx.mlps or ctx.attns):
        r.form = "dense+routers"
    elif ctx.mlps or ctx.attns:
        r.form = "dense"
