"""The pass manager: runs the WIDE passes in order on a Dynamo FX graph and keeps score.

State shared by the passes lives in `PassContext` (the graph, the real tensors behind its placeholders,
the detected MLP / attention subgraphs, the routers for dense graphs). Every pass counts what it did in
`torch._dynamo.utils.counters["wide"]` (keys "<pass>.<what>") and logs one line per layer on the
"wide_compile.passes" logger; the per-graph `GraphReport` is what `wide_compile.explain` prints.
"""
from __future__ import annotations

import logging
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

from torch import fx

from ._graph import Weights

log = logging.getLogger("wide_compile.passes")


class WideFallbackWarning(UserWarning):
    """A subgraph the WIDE passes could not handle was left dense (plain Inductor)."""


def counters() -> Counter:
    from torch._dynamo.utils import counters as c

    return c["wide"]


@dataclass
class MLPMatch:
    x: fx.Node
    gate: fx.Node
    up: fx.Node
    act: fx.Node
    prod: fx.Node
    down: fx.Node
    mask: fx.Node | None = None          # [..., G] bool: traced (form A) or inserted (form B)
    groups: int | None = None
    group_size: int | None = None
    expand_nodes: list = field(default_factory=list)  # the traced mask-multiply nodes (form A)
    layer: int = -1
    status: str = "detected"            # detected | routed | rewritten | fallback
    reason: str = ""

    @property
    def form(self) -> str:
        return "masked" if self.expand_nodes else "dense"


@dataclass
class AttnMatch:
    x: fx.Node
    q: fx.Node
    kv: list
    sdpa: fx.Node
    o: fx.Node
    o_in: fx.Node                        # o_proj's input before the traced mask multiply
    mask: fx.Node | None = None
    groups: int | None = None
    group_size: int | None = None        # q columns / o rows per head group
    expand_nodes: list = field(default_factory=list)
    q_ok: bool = True                    # q -> sdpa path keeps heads separate (q may be rewritten)
    q_reason: str = ""
    layer: int = -1
    status: str = "detected"
    reason: str = ""

    @property
    def form(self) -> str:
        return "masked" if self.expand_nodes else "dense"


@dataclass
class GraphReport:
    """What the passes did to one Dynamo graph."""
    nodes_before: int = 0
    nodes_after: int = 0
    mlp: list = field(default_factory=list)    # one dict per detected MLP (layer order)
    attn: list = field(default_factory=list)
    fallbacks: list = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)
    ops_before: Counter = field(default_factory=Counter)
    ops_after: Counter = field(default_factory=Counter)
    form: str = "none"                  # masked (routers traced) | dense+routers (inserted) | none
    seconds: float = 0.0

    def layers(self) -> list[dict]:
        n = max([d["layer"] for d in self.mlp + self.attn] + [-1]) + 1
        rows = []
        for i in range(n):
            a = next((d for d in self.attn if d["layer"] == i), None)
            m = next((d for d in self.mlp if d["layer"] == i), None)
            rows.append({"layer": i, "attn": a, "mlp": m})
        return rows

    def __str__(self) -> str:
        lines = [f"WIDE graph ({self.form}): {self.nodes_before} -> {self.nodes_after} nodes, "
                 f"{len(self.mlp)} SwiGLU MLP(s), {len(self.attn)} attention block(s)"]
        for r in self.layers():
            a, m = r["attn"], r["mlp"]
            sa = "-" if a is None else f"{a['status']}" + (f" [{a['detail']}]" if a.get("detail") else "")
            sm = "-" if m is None else f"{m['status']}" + (f" [{m['detail']}]" if m.get("detail") else "")
            lines.append(f"  layer {r['layer']:3d}: attention {sa}; mlp {sm}")
        for f in self.fallbacks:
            lines.append(f"  fallback: {f}")
        return "\n".join(lines)


def op_counts(gm: fx.GraphModule) -> Counter:
    """Histogram of call targets (vLLM-style op counts for tests)."""
    c: Counter = Counter()
    for n in gm.graph.nodes:
        if n.op == "call_function":
            c[getattr(n.target, "__name__", str(n.target))] += 1
        elif n.op == "call_method":
            c["." + n.target] += 1
    return c


class PassContext:
    def __init__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], routers=None, strict: bool = False,
                 options: dict | None = None):
        self.gm = gm
        self.example_inputs = example_inputs
        self.weights = Weights(gm, example_inputs)
        self.routers = routers
        self.strict = strict
        self.options = options or {}
        self.mlps: list[MLPMatch] = []
        self.attns: list[AttnMatch] = []
        self.report = GraphReport()

    def count(self, key: str, n: int = 1) -> None:
        if n:
            counters()[key] += n
            self.report.counts[key] += n

    def fallback(self, what: str, node: fx.Node | None, why: str, match=None) -> None:
        """Leave a subgraph dense with a warning naming it (or raise in strict mode); `match` (an MLPMatch /
        AttnMatch) is marked as fallen back with `why` as its reason."""
        from ._graph import describe

        if match is not None:
            match.status, match.reason = "fallback", why

        msg = f"wide_compile: {what} at {describe(node)} left dense (plain Inductor): {why}"
        self.report.fallbacks.append(msg)
        self.count("fallback")
        if self.strict:
            raise ValueError(msg)
        warnings.warn(msg, WideFallbackWarning, stacklevel=2)
        log.warning(msg)


class Pass:
    name = "pass"

    def __call__(self, ctx: PassContext) -> None:  # pragma: no cover - interface
        raise NotImplementedError


def default_passes() -> list[Pass]:
    from .detect_attention import DetectAttention
    from .detect_mlp import DetectSwiGLU
    from .insert_routers import InsertRouters
    from .rewrite_attention import RewriteAttention
    from .rewrite_mlp import RewriteMLP

    return [DetectSwiGLU(), DetectAttention(), InsertRouters(), RewriteMLP(), RewriteAttention()]


class PassManager:
    def __init__(self, passes: Sequence[Pass] | None = None, check_leftovers: bool | None = None):
        self.passes = list(passes) if passes is not None else default_passes()
        self.check_leftovers = passes is None if check_leftovers is None else check_leftovers

    def run(self, gm: fx.GraphModule, example_inputs, routers=None, strict: bool = False,
            options: dict | None = None) -> PassContext:
        t0 = time.perf_counter()
        ctx = PassContext(gm, example_inputs, routers=routers, strict=strict, options=options)
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
    from ._graph import is_linear, linear_parts, match_group_mask

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
