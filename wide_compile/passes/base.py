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

import torch
from torch import fx

from ..config import GroupGeometry
from ._graph import Weights, describe, meta, static_rows

log = logging.getLogger("wide_compile.passes")

# how to get the WIDE kernels back, per reason a routed block stays on the masked reference
GROUPING_FIX = ("compile with the routers the graph was traced with (wide_compile.optimize(model, routers), or "
                "attach them and compile), made for this model (Routers.init(model, cfg))")
WEIGHTS_FIX = ("keep the projection weights as module parameters / buffers (weights computed in the forward "
               "cannot be baked into the kernels' layout)")


class WideFallbackWarning(UserWarning):
    """A routed block keeps its routing but runs the masked reference (every group computed, inactive ones
    zeroed: exact, at dense cost) instead of the WIDE kernels; the message says why and how to get the fast
    path."""


class RoutingDroppedError(ValueError):
    """Routers were given for blocks the pass cannot find in the graph: compiling on would drop their routing
    (a silently dense model), so the pass refuses, naming the layer, the block, the reason and the fix."""


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
    status: str = "detected"            # detected | routed | rewritten | fallback | dense
    reason: str = ""
    gate_src: tuple | None = None        # (linear, rows a:b of its weight or None): _graph.proj_source
    up_src: tuple | None = None
    activation: str = "silu"             # the gate's activation (kernels.reference.ACTIVATIONS)
    paths: dict = field(default_factory=dict)  # op -> cost_model.Decision of its rewritten op
    # how its router runs, as the passes after the rewrite left it: "composed" (compose_routers), "in_gemm"
    # (fuse_router_gemm), "with_norm" (fuse_norm_router), "split" (split_routers), "summed" (sum_routers),
    # "in_select" (fuse_router_select)
    router_forms: list = field(default_factory=list)
    bucket: fx.Node | None = None        # structured router: prototype id per token [...] (match_buckets)
    protos: fx.Node | None = None        # structured router: bool prototype table [P, G]
    ops: dict = field(default_factory=dict)  # "mlp" -> the wide op it runs ("mlp" / "mlp_bucket")
    bucket_reason: str = ""              # why a structured block runs the free-mask ops on protos[bucket]


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
    q_src: tuple | None = None           # (linear, rows a:b of its weight or None): q, or q's part of a fused qkv
    q_reason: str = ""
    layer: int = -1
    status: str = "detected"
    reason: str = ""
    sdpa_kind: str = ""                  # "decode" / "prefill" once sdpa runs a wide.attn_* op (rewrite_sdpa)
    sdpa_reason: str = ""                # why sdpa stayed dense in a rewritten block
    paths: dict = field(default_factory=dict)  # "q" / "o" -> cost_model.Decision of its rewritten op
    router_forms: list = field(default_factory=list)  # as MLPMatch
    bucket: fx.Node | None = None        # as MLPMatch
    protos: fx.Node | None = None
    ops: dict = field(default_factory=dict)  # "q" / "o" -> the wide op each runs ("o_proj" / "o_proj_bucket")
    bucket_reason: str = ""
    kv_fused: bool = False               # K / V run in q's wide.q_proj launch (rewrite_attention: QKV_PATHS)


DENSE_EVERYWHERE = ("every routed projection runs its dense-masked path here (the cost model finds no weight tile "
                    "that the masks of this many tokens leave unused): this graph does the dense model's work plus "
                    "routing and cannot be faster than dense at this token count")


@dataclass
class GraphReport:
    """What the passes did to one Dynamo graph."""
    nodes_before: int = 0
    nodes_after: int = 0
    mlp: list = field(default_factory=list)    # one dict per detected MLP (layer order)
    attn: list = field(default_factory=list)
    fallbacks: list = field(default_factory=list)  # routed blocks kept on the masked reference (warnings)
    unmatched: list = field(default_factory=list)  # sdpa / linears the detectors looked at and did not match
    counts: Counter = field(default_factory=Counter)
    ops_before: Counter = field(default_factory=Counter)
    ops_after: Counter = field(default_factory=Counter)
    form: str = "none"                  # masked (routers traced) | dense+routers (inserted) | none
    seconds: float = 0.0
    # every rewritten projection runs its dense-masked path at every token count this graph takes: the routed
    # graph does the dense model's work plus the routers' and cannot be faster than dense (cost_model)
    dense_everywhere: bool = False
    passes: list = field(default_factory=list)  # the passes that ran, in order (their names)

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
                 f"{len(self.mlp)} gated MLP(s), {len(self.attn)} attention block(s)"]
        if self.passes:
            lines.append("  passes: " + ", ".join(self.passes))
        for r in self.layers():
            a, m = r["attn"], r["mlp"]
            sa = "-" if a is None else f"{a['status']}" + (f" [{a['detail']}]" if a.get("detail") else "")
            sm = "-" if m is None else f"{m['status']}" + (f" [{m['detail']}]" if m.get("detail") else "")
            lines.append(f"  layer {r['layer']:3d}: attention {sa}; mlp {sm}")
        for f in self.fallbacks:
            lines.append(f"  masked reference: {f}")
        for u in self.unmatched:
            lines.append(f"  not matched: {u}")
        if self.dense_everywhere:
            lines.append("  " + DENSE_EVERYWHERE)
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


def router_fused(blk) -> bool:
    """The block's router runs inside another op (with its norm, or as columns of the projection GEMM), so no
    later pass may take it."""
    return any(f in FUSED_ROUTER_FORMS for f in blk.router_forms)


FUSED_ROUTER_FORMS = ("with_norm", "in_gemm")


class PassContext:
    def __init__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], routers=None, strict: bool = False,
                 geometry: GroupGeometry | None = None, kernel_tuning: str = "", kernel_path: str = "auto",
                 mask_stats=None):
        self.gm = gm
        self.example_inputs = example_inputs
        self.weights = Weights(gm, example_inputs)
        self.routers = routers
        self.strict = strict
        # the routers' group geometry when known (given, or read from the routers of a dense graph); else the
        # passes read the grouping off the traced mask multiply and only check that it covers the width
        self.geometry = geometry if geometry is not None or routers is None else GroupGeometry.from_routers(routers)
        self.kernel_tuning = kernel_tuning  # the kernels' tile table as JSON, "" = the device's (kernels/tuning.py)
        # which path each rewritten op runs per token count (cost_model.KERNEL_PATHS) and what is known of the
        # masks it decides with: {"attn": MaskStats | None, "ffn": ...}
        from .cost_model import KERNEL_PATHS

        if kernel_path not in KERNEL_PATHS:
            raise ValueError(f"wide_compile: kernel_path must be one of {KERNEL_PATHS}, got {kernel_path!r}")
        self.kernel_path = kernel_path
        self.mask_stats = mask_stats_by_kind(mask_stats)
        self.mlps: list[MLPMatch] = []
        self.attns: list[AttnMatch] = []
        self.report = GraphReport()
        self.unmatched_nodes: list[tuple[str, fx.Node | None, str]] = []

    def op_tuning(self, op: str, x: fx.Node, d: int, n: int, group_size: int):
        """(tuning JSON, Decision) for op ("mlp" / "q" / "o") reading x [..., width] (d = D, n = F or Nq): the
        kernels' table with the cost model's path per token count (cost_model.plan)."""
        from ..kernels.tuning import resolve
        from .cost_model import Shape, device_cost, plan

        v = meta(x)
        dev = getattr(v, "device", None)
        base = resolve(self.kernel_tuning or None, dev if dev is not None and dev.type != "meta" else None)
        elem = v.dtype.itemsize if v is not None else 2
        stats = self.mask_stats["ffn" if op == "mlp" else "attn"]
        shape = Shape(static_rows(x) or 0, d, n, group_size, elem)
        table, decision = plan(op, shape, base, device_cost(dev), stats, self.kernel_path,
                               dev if dev is not None and dev.type != "meta" else None)
        self.count(f"cost_model.{op}.{decision.path}")
        return (self.kernel_tuning if table is base else table.to_json()), decision

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

    def fallback(self, what: str, node: fx.Node | None, why: str, fix: str, match=None) -> None:
        """A routed block that keeps its routing on the masked reference (exact, dense cost): warn naming it,
        why and how to get the WIDE kernels (strict mode: raise, with a text that claims no fallback).
        `match` (an MLPMatch / AttnMatch) is marked "fallback" with `why` as its reason."""
        layer = getattr(match, "layer", -1)
        where = (f"layer {layer}: " if layer is not None and layer >= 0 else "") + f"{what} at {describe(node)}"
        if match is not None:
            match.status, match.reason = "fallback", why
        self.count("fallback")
        if self.strict:
            raise ValueError(f"wide_compile (strict=True): {where} cannot run on the WIDE kernels: {why}. "
                             f"To rewrite it: {fix}")
        msg = (f"wide_compile: {where} keeps its routing but runs the masked reference (every group computed, "
               f"inactive ones zeroed: exact, not faster): {why}. For the WIDE kernels: {fix}")
        self.report.fallbacks.append(msg)
        warnings.warn(msg, WideFallbackWarning, stacklevel=2)
        log.warning(msg)

    def unmatched(self, what: str, node: fx.Node | None, why: str) -> None:
        """A candidate the detectors looked at and did not match (no warning by itself: a graph may hold sdpa
        calls that are no routed block). InsertRouters turns these into the RoutingDroppedError of a dense graph
        given routers; the leftover check names them for traced routed linears nobody consumed."""
        self.report.unmatched.append(f"{what} at {describe(node)}: {why}")
        self.unmatched_nodes.append((what, node, why))


def mask_stats_by_kind(spec) -> dict:
    """{"attn": MaskStats | None, "ffn": ...} from what the user gives: None, one density or MaskStats for both,
    or {"attn": ..., "ffn": ...}."""
    from .cost_model import MaskStats

    if isinstance(spec, dict):
        bad = [k for k in spec if k not in ("attn", "ffn")]
        if bad:
            raise ValueError(f"mask_stats: keys must be 'attn' / 'ffn', got {bad}")
        return {k: None if spec.get(k) is None else MaskStats.of(spec[k]) for k in ("attn", "ffn")}
    st = None if spec is None else MaskStats.of(spec)
    return {"attn": st, "ffn": st}


def keep_routing(ctx: PassContext, consumer: fx.Node, inner: fx.Node, match) -> None:
    """A block of a dense graph (routers inserted by the pass) that cannot be rewritten: multiply its router
    mask into `consumer`'s input `inner` (down_proj's / o_proj's), the eager reference's semantics, so the
    block stays routed and exact. A traced graph (routers attached) holds that multiply already."""
    if match.form != "dense" or match.mask is None:
        return
    from ._ops import group_masked_nd

    with ctx.gm.graph.inserting_before(consumer):
        masked = ctx.weights.call(group_masked_nd, (inner, match.mask))
    consumer.replace_input_with(inner, masked)


class Pass:
    name = "pass"

    def __call__(self, ctx: PassContext) -> None:  # pragma: no cover - interface
        raise NotImplementedError


# the paths whose reduction runs the K-skipping tile kernel, which reads the transposed weight's rows
KSKIP_PATHS = ("gather+kskip", "sorted+kskip", "kskip")


def reduction_weight(ctx: "PassContext", w, decision, name: str, before):
    """The reduction-side weight a free op reads as w_t [K, N] (down_proj / o_proj). Where no token count the graph
    runs takes a K-skipping tile kernel, the Linear's own weight [N, K] through a transposed view: the one-token
    GEMV reads its rows whole (one launch, no split sum), cuBLAS takes it in the Linear's own layout, and the
    model holds no second copy. Else a contiguous transposed copy, made once now (the tile kernel reads w_t's
    rows)."""
    W = ctx.weights
    paths = [decision.path] if decision.T is not None else [p for _, p in decision.rows]
    if not any(p in KSKIP_PATHS for p in paths):
        ctx.count("rewrite.weight_view")
        return W.call(torch.t, (w,))
    return W.transposed(W.tensor(w), name, before=before)
