"""The `wide` torch.compile backend.

    torch.compile(model, backend="wide")                       # routers attached (wide_compile.attach)
    torch.compile(fn, backend=functools.partial(wide_backend, routers=routers))   # dense graph + routers

Runs the WIDE pass manager on the Dynamo FX graph (before AOT autograd: detect gated MLP / attention
blocks, insert routers if needed, rewrite into torch.ops.wide.*), then hands the graph to Inductor's
`compile_fx`, so everything else is standard Inductor (on the CPU too).

Options (keyword arguments, or torch.compile(..., options={...})):
    routers        wide_compile.Routers for a dense graph (form B); ignored when the graph holds traced routers
    geometry       wide_compile.config.GroupGeometry of the routers (optimize passes it): the grouping read off a
                   traced graph must be this one; default: the routers' geometry, or whatever the graph holds
    kernel_config  the WIDE kernels' tile table: a wide_compile.kernels.tuning.KernelTuning (or its JSON / dict), or
                   per-phase overrides {"decode": {...}, "prefill": {...}} on the device's table; default: the
                   device's shipped table (wide_compile/kernels/configs/)
    kernel_path    which path each routed projection runs per token count (passes/cost_model.py): "auto" (default)
                   the cost model's estimate of the fastest correct one, "table" the tuning table's rows as they are,
                   "dense" every op on its dense-masked path, "compact" every op on its compact kernels
    mask_stats     what the cost model assumes of the masks: a density (share of active groups), a
                   passes.cost_model.MaskStats (measured: MaskStats.measure(recorded masks)), or
                   {"attn": ..., "ffn": ...}; default the target capacity of the routers (given here, or passed
                   by optimize). Without it "auto" keeps the tuning table's paths
    fuse_norm_router  True: each rewritten block's RMSNorm and its router (linear / SiLU-MLP / pair, float32)
                   run as one wide.rmsnorm_router launch (passes/fuse_norm_router.py); "prefill": only in graphs of
                   more than DECODE_T tokens (decode-size routers stay with sum_routers); default False
    sum_routers    True (default): in graphs of at most DECODE_T tokens, each unfused linear / pair router's logits as
                   one Inductor reduction instead of an fp32 GEMM (passes/sum_routers.py); False keeps the GEMM
    compose_routers  True (default): each pair router runs as the one linear map it is, one fp32 GEMM where its two
                   layers ran two (passes/compose_routers.py); False keeps the two layers
    split_routers  True (default): in bf16 graphs of more than DECODE_T tokens each linear router (composed pair
                   routers too) runs as one bf16 tensor-core GEMM over its weight as a bf16 pair
                   (passes/split_routers.py); False keeps the fp32 GEMM
    fuse_router_select  True: a split router whose one reader is a dense-masked op's select (the MLP's act(g) * u,
                   o_proj's input) is computed in that select's launch (passes/fuse_router_select.py); default False
                   (its own GEMM), opt-in: benchmarks/results/lean-h100/README.md has its timings
    fuse_gate_up   True: where the MLP's path is dense-masked at a static token count, gate and up run as one GEMM
                   over a concatenated copy of their weights (made when the graph compiles); default False
    fuse_router_gemm  True (default): in graphs of more than DECODE_T tokens, a linear router on the residual stream runs
                   as extra output columns of the GEMM that reads its block's RMSNorm output, the mask then computed in
                   the select that reads it (passes/fuse_router_gemm.py); decisions as the router's up to rounding in
                   the model's dtype; False keeps the router's own GEMM
    fuse_qkv       True (default): where q's path at the graph's token count is the one-token GEMV or the dense-masked
                   GEMM, K and V run in q's launch over a concatenated weight (passes/rewrite_attention.py); False
                   keeps them as their own linears
    strict         raise instead of warning when a routed block cannot use the WIDE kernels (default False: it keeps
                   its routing on the masked reference, with a warning)
    inductor       False: return the rewritten graph's Python forward (no Inductor; debugging / explain)
    report         callable receiving the GraphReport of every compiled graph
    mode           torch.compile mode for Inductor ("default", "reduce-overhead", "max-autotune", ...)
    anything else  Inductor config patches (e.g. {"triton.cudagraphs": True})
"""
from __future__ import annotations

import logging
import warnings
from typing import Any, Sequence

import torch
from torch import fx

from .passes import PassManager, counters
from .passes._ops import missing_ops

log = logging.getLogger("wide_compile.backend")

_OWN = ("routers", "geometry", "kernel_config", "strict", "inductor", "report", "mode", "sparse_attention",
        "kernel_path", "mask_stats", "fuse_norm_router", "sum_routers", "fuse_qkv", "compose_routers",
        "split_routers", "fuse_router_select", "fuse_gate_up", "fuse_router_gemm")


def _split_options(options: dict) -> tuple[dict, dict]:
    opts = dict(options)
    nested = opts.pop("options", None) or {}
    opts = {**nested, **opts}
    own = {k: opts.pop(k) for k in _OWN if k in opts}
    return own, opts


def _mask_stats(own: dict):
    """What the cost model assumes of the masks: the option, else the given routers' target capacity (a graph
    whose routers are traced in names none: the tuning table's paths, unless mask_stats is given)."""
    if own.get("mask_stats") is None and own.get("routers") is not None:
        return own["routers"].cfg.capacity
    return own.get("mask_stats")


def _fuse_norm_router(value):
    """The option as the pass manager takes it: "prefill" as it is, anything else as a bool."""
    return value if value == "prefill" else bool(value)


def wide_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], **options):
    own, inductor_patches = _split_options(options)
    missing = missing_ops()
    if missing and own.get("kernel_config") is not None:
        raise RuntimeError(f"wide_compile: kernel_config was given but the WIDE kernel ops {missing} are not available")
    if missing:
        msg = (f"wide_compile: the WIDE kernel ops {missing} are not available from wide_compile.kernels; "
               "the graph is compiled without the WIDE rewrite")
        if own.get("routers") is not None:  # a dense graph would silently lose its routing: refuse
            raise RuntimeError(msg + " (and a dense graph cannot be routed without them)")
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
    else:
        from .kernels.tuning import as_arg

        passes = PassManager(sparse_attention=own.get("sparse_attention", "auto"),
                             fuse_norm_router=_fuse_norm_router(own.get("fuse_norm_router", False)),
                             sum_routers=bool(own.get("sum_routers", True)),
                             fuse_qkv=bool(own.get("fuse_qkv", True)),
                             compose_routers=bool(own.get("compose_routers", True)),
                             split_routers=bool(own.get("split_routers", True)),
                             fuse_router_select=bool(own.get("fuse_router_select", False)),
                             fuse_gate_up=bool(own.get("fuse_gate_up", False)),
                             fuse_router_gemm=bool(own.get("fuse_router_gemm", True)))
        ctx = passes.run(gm, example_inputs, routers=own.get("routers"), strict=bool(own.get("strict")),
                         geometry=own.get("geometry"), kernel_tuning=as_arg(own.get("kernel_config")),
                         kernel_path=own.get("kernel_path") or "auto", mask_stats=_mask_stats(own))
        if own.get("report") is not None:
            own["report"](ctx.report)
    counters()["compiled_graphs"] += 1
    if own.get("inductor", True) is False:
        return gm.forward
    from torch._inductor.compile_fx import compile_fx

    mode = own.get("mode")
    if mode and "reduce-overhead" in mode and any(getattr(t, "is_cuda", False) for t in example_inputs):
        warnings.warn("wide_compile: mode='reduce-overhead' (Inductor CUDA graphs) is not verified with the WIDE ops: "
                      "generate() with a lazily allocated static cache can crash the process (the pattern of "
                      "pytorch/pytorch#192748: a buffer allocated inside the compiled region fed back as a mutated "
                      "input). Pass an early-allocated cache, wide_compile.static_cache(model, "
                      "batch, max_len), to generate(), or use the default mode captured in a torch.cuda.CUDAGraph (the verified "
                      "decode path, benchmarks/e2e/timing.py: cuda_graph_step).", RuntimeWarning, stacklevel=2)
    if mode and mode != "default":
        from torch._inductor import list_mode_options

        inductor_patches = {**list_mode_options(mode), **inductor_patches}
    return compile_fx(gm, example_inputs, config_patches=inductor_patches or None)


def _register() -> None:
    from torch._dynamo.backends import registry

    # When the entry point is being loaded by lookup_backend("wide"), that call registers the function
    # itself; registering here too would be a duplicate.
    if "wide" in registry._COMPILER_FNS or registry._BACKENDS.get("wide") is not None:
        return
    torch._dynamo.register_backend(compiler_fn=wide_backend, name="wide")


_register()
