"""The timed variants of a row: one small builder each, in a registry (`VARIANTS`, --variants name ->
VariantSpec), so adding a variant is one function and one entry (an A/B form of wide: one `_wide_ab` entry).

  eager         the HF model, eager
  inductor      torch.compile default mode (prefill) / mode="reduce-overhead" CUDA graphs (decode):
                the baseline, speedup = dense_inductor_ms / wide_ms
  max_autotune  torch.compile mode="max-autotune-no-cudagraphs" (prefill)
  inductor_cg   torch.compile default mode captured in a manual CUDA graph (decode; the capture method
                WIDE's decode step uses)
  static        a physically smaller model of the same FLOP capacity (fewer q heads, narrower FFN) under
                Inductor, same mode as `inductor`: the ceiling for dynamic routing
  wide          torch.compile(model, backend="wide") with routers attached (decode: + manual CUDA graph)
  wide_table    wide with every op on the tuning table's path (kernel_path="table"), beside wide's cost-model
                choice in the same run
  wide_dense_masked  wide with every op on its dense-masked path (kernel_path="dense"; the routers still in the
                projection GEMMs where fuse_router_gemm takes them): whether the cost model's compact picks beat it
  wide_fused    wide with each block's RMSNorm and router in one launch (fuse_norm_router=True)
  wide_fused_prefill  the same in prefill-size graphs only (fuse_norm_router="prefill"; decode keeps summed routers)
  wide_fused_dense  wide_fused with every projection on its dense-masked path (kernel_path="dense"): the fewest
                launches a routed graph can have without compact kernels, the floor the cost model's paths must beat
  wide_gemm_routers  wide with the decode-size routers as fp32 GEMMs (sum_routers=False): what summing them buys
  wide_qkv_split  wide with K / V as their own linears (fuse_qkv=False): what running them in q's launch buys
  wide_pair_routers  wide with pair routers as their two layers (compose_routers=False): what composing them buys
  wide_fp32_routers  wide with the prefill-size routers as fp32 GEMMs (split_routers=False): what running them
                over a bf16 pair on tensor cores buys
  wide_router_select  wide with each split router computed in the dense-masked select that reads it
                (fuse_router_select=True): what that fusion buys
  wide_gate_up  wide with gate and up as one GEMM on the dense-masked path (fuse_gate_up=True)
  wide_lean_prefill  both of the above
  wide_router_own_gemm  wide with each prefill-size router as its own GEMM (fuse_router_gemm=False), not as extra
                output columns of the projection GEMM after its norm: what that fusion buys
  wide_sparse_attn  wide with attention over the active head groups wherever the grouping allows it
                (sparse_attention=True, also the prefills of 1-head groups), beside wide's setting
  wide_bucket_ops  wide with structured (codebook / nested) routers on their bucket ops (bucket_ops=True), not the
                free-mask ops; with free masks it is wide again
  wide_eager    the WIDE eager reference (wide_compile.attach hooks)
  trt           torch-tensorrt (prefill), when importable

A builder takes the workload (e2e/workload.Workload: its inputs, models and compile helpers) and the row
(`Row`: capacity, routers) and returns `Built` = (step, reset, info); `step()` runs one timed step,
`reset()` runs before it outside the timed region, `info` lands in the record (mode, cuda_graph, entry) and
may hold "_keep", an object kept alive with the variant. `scope` says when it is built and timed:

  workload  built once per workload, timed in its first row, copied into the others
  row       built once per workload, timed in every row (the references each speedup is a ratio to)
  capacity  built once per capacity (the static model of that capacity)
  routers   built per row, with that row's routers attached to the WIDE model
"""
from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Callable

from .capabilities import trt_status, wide_backend_status
from .kernel_config import kernel_config

if TYPE_CHECKING:
    from .workload import Workload

Built = tuple  # (step: () -> output, reset: (() -> None) | None, info: dict)


@dataclasses.dataclass
class Row:
    """What a row-dependent builder needs: the capacity, the routers, and what the static builder found."""
    capacity: float
    routers: object | None = None
    static_shape: object | None = None  # e2e/models.StaticShape of the static model, once built


@dataclasses.dataclass(frozen=True)
class VariantSpec:
    name: str                                   # the --variants name
    key: str                                    # the record's field prefix: <key>_ms, <key>_p10, ...
    scope: str                                  # workload | row | capacity | routers (module docstring)
    build: Callable[["Workload", Row | None], Built]
    applies: Callable[["Workload"], bool] = lambda w: True        # False: not in this workload, no trace
    why_not: Callable[["Workload"], str | None] = lambda w: None  # a reason: recorded under "skipped"
    # an A/B form of wide, timed only when --variants names it; its speedup's column in the report
    ab_column: str | None = None


# -- builders -------------------------------------------------------------------------------------
def build_eager(w: "Workload", row=None) -> Built:
    return w.step_of(w.dense), w.reset, {}


def _ungraphed(w: "Workload") -> bool:
    """The dense / static step runs without CUDA graphs: on the CPU, and at prefill unless --prefill-cuda-graphs."""
    return not w.cuda or (w.phase == "prefill" and not w.options.prefill_cuda_graphs)


def build_inductor(w: "Workload", row=None) -> Built:
    if _ungraphed(w):
        return w.step_of(w.inductor(w.dense)), w.reset, {"mode": "default"}
    return w.step_of(w.inductor(w.dense, "reduce-overhead")), w.cudagraph_tree_reset(), {"mode": "reduce-overhead"}


def build_max_autotune(w: "Workload", row=None) -> Built:
    mode = "max-autotune-no-cudagraphs"
    return w.step_of(w.inductor(w.dense, mode)), w.reset, {"mode": mode}


def build_inductor_cg(w: "Workload", row=None) -> Built:
    return w.graphed(w.step_of(w.inductor(w.dense)), w.reset, {"mode": "default+cudagraph"})


def build_trt(w: "Workload", row=None) -> Built:
    import torch
    import torch_tensorrt  # noqa: F401  registers the backend

    m = torch.compile(w.dense, backend="torch_tensorrt", dynamic=False,
                      options={"enabled_precisions": {w.dtype}, "min_block_size": 1})
    return w.step_of(m), w.reset, {}


def build_static(w: "Workload", row: Row) -> Built:
    from . import models as MD

    sm, row.static_shape = MD.build_static(w.config, row.capacity, w.device, w.dtype, seed=w.options.seed + 1)
    if _ungraphed(w):
        return w.step_of(w.inductor(sm)), w.reset, {"mode": "default", "_keep": sm}
    return (w.step_of(w.inductor(sm, "reduce-overhead")), w.cudagraph_tree_reset(),
            {"mode": "reduce-overhead", "_keep": sm})


def paths_summary(reports) -> str:
    """The path each routed op runs, over the layers of the compiled graphs: "mlp gather+kskip; q gather;
    o dense_masked" (with counts where layers differ)."""
    from collections import Counter

    by_op: dict = {}
    for rep in reports:
        for d in [*rep.mlp, *rep.attn]:
            for op, path in (d.get("paths") or {}).items():
                by_op.setdefault(op, Counter())[path] += 1
    parts = []
    for op in ("mlp", "q", "o"):
        c = by_op.get(op)
        if c:
            parts.append(f"{op} " + (next(iter(c)) if len(c) == 1 else ", ".join(f"{p} x{n}" for p, n in c.items())))
    return "; ".join(parts)


# the rewrites beside the paths that a row's graphs ran, as the report counts them
REWRITE_COUNTS = (("fuse_norm_router.fused", "fused norm/router"), ("sum_routers.summed", "summed routers"),
                  ("rewrite_attention.qkv_fused", "K/V in q's launch"),
                  ("compose_routers.composed", "composed pair routers"),
                  ("split_routers.split", "split-bf16 routers"),
                  ("fuse_router_select.fused", "routers in their selects"),
                  ("rewrite_mlp.gate_up_fused", "gate and up in one GEMM"),
                  ("fuse_router_gemm.fused", "routers in the projection GEMMs"),
                  ("rewrite_sdpa.decode", "sparse decode attention"),
                  ("rewrite_sdpa.prefill", "sparse prefill attention"))


def rewrites_summary(reports) -> str:
    """" + fused norm/router + K/V in q's launch ..." for the rewrites any of the compiled graphs counted."""
    return "".join(f" + {what}" for key, what in REWRITE_COUNTS if any(rep.counts.get(key) for rep in reports))


def compile_wide(wide_model, routers, options, capacity=None, info=None, **kw):
    """The WIDE model compiled the way --wide-entry says (routers already attached for "backend"). The cost model
    assumes masks of density `capacity`; the paths it picks go to info["paths"] when the model compiles."""
    import torch

    kc = kernel_config(options)
    reports: list = []

    def report(rep):
        reports.append(rep)
        if info is not None:
            info["paths"] = paths_summary(reports) + rewrites_summary(reports)

    own = {**({"kernel_config": kc} if kc else {})}
    if options.wide_entry == "optimize" or options.wide_backend == "wide":  # the project's backend's own options
        # every option stated, so a row means the same whatever optimize's defaults are
        from wide_compile.passes.options import PassOptions

        own.update({"mask_stats": capacity} if capacity is not None else {}, kernel_path=options.kernel_path,
                   **{name: getattr(options, name) for name in PassOptions.names()})
        if options.wide_entry != "optimize":  # optimize collects the reports itself (model._wide_reports)
            own["report"] = report
    elif options.sparse_attention is True:  # another backend gets the option only when asked for
        own["sparse_attention"] = True
    if options.wide_entry == "optimize":
        import wide_compile as wc

        return wc.optimize(wide_model, routers, dynamic=False, **own, **kw)
    return torch.compile(wide_model, dynamic=False, backend=options.wide_backend,
                         **({"options": own} if own else {}), **kw)


def build_wide(w: "Workload", row: Row, **override) -> Built:
    o = dataclasses.replace(w.options, **override) if override else w.options
    graphs = w.phase == "decode" or o.prefill_cuda_graphs  # the phases timed in CUDA graphs
    inductor_graphs = graphs and w.cuda and o.wide_decode_mode == "reduce-overhead"
    info = {"entry": o.wide_entry}  # "paths" arrives when the model compiles (its first call)
    step = w.step_of(compile_wide(w.wide_model, row.routers, o, capacity=row.capacity, info=info,
                                  **({"mode": "reduce-overhead"} if inductor_graphs else {})))
    if inductor_graphs:
        info["mode"] = "reduce-overhead"
        return step, w.cudagraph_tree_reset(), info
    if graphs and o.wide_decode_mode == "manual-graph":
        try:
            return w.graphed(step, w.reset, info)
        except Exception as e:  # noqa: BLE001  time it without graphs and say why
            w.log(f"    wide: CUDA-graph capture failed ({type(e).__name__}: {str(e)[:200]}); timing without graphs")
            w.free()
            info.update(cuda_graph=False, cuda_graph_error=str(e)[:300])
            return step, w.reset, info
    return step, w.reset, info


def build_wide_eager(w: "Workload", row: Row) -> Built:
    return w.step_of(w.wide_model), w.reset, {}


# -- reasons a variant is skipped ---------------------------------------------------------------
def _cg_why_not(w: "Workload") -> str | None:
    return None if w.cuda else "CUDA graphs need a GPU"


def _trt_why_not(w: "Workload") -> str | None:
    if w.phase == "decode":
        return "torch-tensorrt decode with a mutating static KV cache is not supported by this harness"
    why = trt_status()
    return why if why or w.cuda else "torch-tensorrt needs CUDA"


def _wide_why_not(w: "Workload") -> str | None:
    return wide_backend_status(w.options.wide_backend)


def _wide_ab(name: str, column: str, **overrides) -> VariantSpec:
    """An A/B form of wide: wide built with `overrides` of the run's options (BenchOptions fields), timed in the
    same rows, its speedup in the report's `column`."""
    return VariantSpec(name, name, "routers", functools.partial(build_wide, **overrides), why_not=_wide_why_not,
                       ab_column=column)


VARIANTS: dict[str, VariantSpec] = {s.name: s for s in (
    VariantSpec("eager", "eager_dense", "workload", build_eager),
    VariantSpec("inductor", "dense_inductor", "row", build_inductor),
    VariantSpec("max_autotune", "dense_max_autotune", "workload", build_max_autotune,
                applies=lambda w: w.phase == "prefill" and not w.options.smoke),
    VariantSpec("inductor_cg", "dense_inductor_cg", "row", build_inductor_cg,
                applies=lambda w: w.phase == "decode", why_not=_cg_why_not),
    VariantSpec("static", "static", "capacity", build_static),
    VariantSpec("wide", "wide", "routers", build_wide, why_not=_wide_why_not),
    _wide_ab("wide_table", "speedup, table paths", kernel_path="table"),
    _wide_ab("wide_dense_masked", "speedup, dense-masked paths", kernel_path="dense"),
    # the fused norm + router and the router in the select take routers fuse_router_gemm would take first: off there
    _wide_ab("wide_fused", "speedup, fused norm+router", fuse_norm_router=True, fuse_router_gemm=False),
    _wide_ab("wide_fused_prefill", "speedup, fused norm+router at prefill", fuse_norm_router="prefill",
             fuse_router_gemm=False),
    _wide_ab("wide_fused_dense", "speedup, fused + dense-masked", fuse_norm_router=True, kernel_path="dense",
             fuse_router_gemm=False),
    _wide_ab("wide_gemm_routers", "speedup, GEMM routers", sum_routers=False),
    _wide_ab("wide_qkv_split", "speedup, K/V unfused", fuse_qkv=False),
    _wide_ab("wide_pair_routers", "speedup, pair routers uncomposed", compose_routers=False),
    _wide_ab("wide_fp32_routers", "speedup, fp32 prefill routers", split_routers=False, fuse_router_gemm=False),
    _wide_ab("wide_router_select", "speedup, routers in their selects", fuse_router_select=True,
             fuse_router_gemm=False),
    _wide_ab("wide_gate_up", "speedup, gate and up in one GEMM", fuse_gate_up=True),
    _wide_ab("wide_lean_prefill", "speedup, routers in selects + gate/up in one GEMM", fuse_router_select=True,
             fuse_router_gemm=False,
             fuse_gate_up=True),
    _wide_ab("wide_router_own_gemm", "speedup, routers as their own GEMMs", fuse_router_gemm=False),
    _wide_ab("wide_sparse_attn", "speedup, sparse attention", sparse_attention=True),
    _wide_ab("wide_bucket_ops", "speedup, bucket ops", bucket_ops=True),
    VariantSpec("wide_eager", "wide_eager", "routers", build_wide_eager),
    VariantSpec("trt", "trt", "workload", build_trt, why_not=_trt_why_not),
)}
# timed only when --variants names them (each is one more WIDE compile per row)
OPT_IN = tuple(name for name, spec in VARIANTS.items() if spec.ab_column)
# the order dense variants are built in (the reference first: it is re-built after a memory reset)
DENSE_ORDER = ("inductor", "eager", "max_autotune", "inductor_cg", "trt")
