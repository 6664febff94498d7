"""What every WIDE pass shares: the Pass interface, the PassContext it works on, the matched subgraphs
(MLPMatch / AttnMatch) and the per-graph GraphReport.

State shared by the passes lives in `PassContext` (the graph, the real tensors behind its placeholders,
the detected MLP / attention subgraphs, the routers for dense graphs). Every pass counts what it did in
`torch._dynamo.utils.counters["wide"]` (keys "<pass>.<what>") and logs one line per layer on the
"wide_compile.passes" logger; the per-graph `GraphReport` is what `wide_compile.explain` prints.
"""
from __future__ import annotations

import logging
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

from torch import fx

from ..config import GroupGeometry
from ._graph import Weights, describe

log = logging.getLogger("wide_compile.passes")


class WideFallbackWarning(UserWarning):
    """A subgraph the WIDE passes could not handle was left dense (plain Inductor)."""


def counters() -> Counter:
    from torch._dynamo.utils import counters as c

    return c["wide"]


class _BlockForm:
    """A detected block's form: "masked" when the traced graph holds its mask multiplies (routers attached),
    "dense" when the pass has to insert routers."""

    expand_nodes: list

    @property
    def form(self) -> str:
        return "masked" if self.expand_nodes else "dense"


@dataclass
class MLPMatch(_BlockForm):
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


@dataclass
class AttnMatch(_BlockForm):
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
    sdpa_kind: str = ""                  # "decode" / "prefill" once sdpa runs a wide.attn_* op (rewrite_sdpa)
    sdpa_reason: str = ""                # why sdpa stayed dense in a rewritten block


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
                 geometry: GroupGeometry | None = None, kernel_tuning: str = ""):
        self.gm = gm
        self.example_inputs = example_inputs
        self.weights = Weights(gm, example_inputs)
        self.routers = routers
        self.strict = strict
        # the routers' group geometry when known (given, or read from the routers of a dense graph); else the
        # passes read the grouping off the traced mask multiply and only check that it covers the width
        self.geometry = geometry if geometry is not None or routers is None else GroupGeometry.from_routers(routers)
        self.kernel_tuning = kernel_tuning  # the kernels' tile table as JSON, "" = the device's (kernels/tuning.py)
        self.mlps: list[MLPMatch] = []
        self.attns: list[AttnMatch] = []
        self.report = GraphReport()

    def count(self, key: str, n: int = 1) -> None:
        if n:
            counters()[key] += n
            self.report.counts[key] += n

    def group_mismatch(self, kind: str, groups: int, group_size: int, width: int | None) -> str | None:
        """Why `groups` x `group_size` cannot be the grouping of this "ffn" / "attn" block, or None: the groups
        must cover the block's width (when static) and be the routers' geometry (when known)."""
        what = "FFN width" if kind == "ffn" else "q width"
        if width is not None and groups * group_size != width:
            return f"{groups} groups x {group_size} do not cover the {what} {width}"
        if self.geometry is not None and (groups, group_size) != self.geometry.groups(kind):
            g, gs = self.geometry.groups(kind)
            return f"{groups} groups x {group_size} in the graph, but the routers' geometry is {g} x {gs}"
        return None

    def fallback(self, what: str, node: fx.Node | None, why: str, match=None) -> None:
        """Leave a subgraph dense with a warning naming it (or raise in strict mode); `match` (an MLPMatch /
        AttnMatch) is marked as fallen back with `why` as its reason."""
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
