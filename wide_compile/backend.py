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
    sparse_attention, fuse_norm_router, sum_routers, fuse_qkv, compose_routers, split_routers, fuse_router_select,
    fuse_gate_up, fuse_router_gemm, bucket_ops
                   which optional passes run: wide_compile.passes.PassOptions (each field's comment says what it does,
                   its default and where its timing is)
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

from .passes import PassManager, PassOptions, counters
from .passes._ops import missing_ops

log = logging.getLogger("wide_compile.backend")

_OWN = ("routers", "geometry", "kernel_config", "strict", "inductor", "report", "mode", "kernel_path",
        "mask_stats") + PassOptions.names()


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

        passes = PassManager(options=PassOptions.from_mapping(own))
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
