"""optimize() and explain(): the user-facing side of the `wide` backend."""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from .config import GroupGeometry
from .passes import RoutingDroppedError
from .routing import Routers, attach, attached_routers


def _is_hf_llama(model: nn.Module) -> bool:
    """An HF Llama-family model (routers attach to it); raises UnsupportedModelError for any other transformers
    model (mixture of experts, GPT-2-style blocks, ...), which the pass could not route either; False for other
    modules (e.g. gpt-fast style), whose dense graph gets the routers inserted."""
    from .models.spec import UnsupportedModelError, decoder_layers

    try:
        decoder_layers(model)
        return True
    except UnsupportedModelError:
        if _is_transformers_model(model):
            raise
        return False


def _is_transformers_model(model: nn.Module) -> bool:
    m = getattr(model, "base_model", model)  # peft wrapper
    return any(getattr(getattr(x, "config", None), "model_type", None) for x in (model, m))


def optimize(model: nn.Module, routers: Routers | None = None, *, dynamic: bool | None = None,
             fullgraph: bool = False, router_dtype: str | torch.dtype | None = None, **options) -> nn.Module:
    """Compile `model` with the `wide` backend and return it (compiled in place with nn.Module.compile, so
    `model(...)` and `model.generate(...)` both run the compiled graph).

    routers: attached first when given (HF Llama-family models: the traced graph then carries the routers,
             the pass rewrites it); for other models (e.g. a gpt-fast-style Llama) the routers are inserted
             into the dense traced graph by layer order (needs one full graph: fullgraph=True is implied).
             Without routers the model must already have routers attached: otherwise ValueError.
    dynamic / fullgraph: as in torch.compile (dynamic=None: automatic dynamic shapes after the first recompile).
    router_dtype: None keeps the routers' dtype (fp32 as trained). fp32 GEMMs run without tensor cores, a visible
             share of a prefill, so in bf16 graphs of prefill size the pass runs each linear router (the
             method's pair routers once composed) over its weight as a bf16 pair (passes/split_routers.py,
             split_routers=False turns it off); "model" casts them (in place) to the model's dtype,
             or give a torch.dtype. Low-precision routers flip the decisions whose logit lies within rounding
             of 0 (how many: benchmarks/router_precision.py). The eager reference uses the same (cast) routers.
             "bf16x2" (bf16 models): keep the fp32 weights and run each linear router as one bf16 tensor-core
             GEMM over the weight split in a bf16 pair, fp32 accumulation and output (Routers.split_bf16_):
             the fp32 decisions up to rounding, at bf16 speed. A graph with a single token (batch-1 decode)
             runs the fp32 weights, where the pair does not pay (routing.routers.SPLIT_MIN_ROWS).
    options: see wide_compile.backend: kernel_path="auto" | "table" | "dense" | "compact" (the path each routed
             projection runs; default "auto", the cost model's pick per token count), mask_stats (what the cost
             model assumes of the masks; default the routers' target capacity), kernel_config (the kernels' tile
             table), strict, mode="reduce-overhead" for CUDA graphs, Inductor patches; and which optional passes
             run, wide_compile.passes.PassOptions's fields (sparse_attention, fuse_qkv, compose_routers,
             sum_routers, split_routers, fuse_router_gemm, fuse_router_select, fuse_gate_up, fuse_norm_router,
             bucket_ops).
    Weights: a compiled graph reads some weights as copies made when it compiles (K / V with q in one
    concatenated weight, pair routers composed into one linear map, the K-skipping tile kernels' transposed
    reduction weights), as Inductor's freezing
    does. Change weights (merge a LoRA, load a checkpoint) before the first call, or call
    torch._dynamo.reset() and optimize again after changing them.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"optimize expects an nn.Module, got {type(model).__name__}")
    if routers is not None and not isinstance(routers, Routers):
        raise TypeError(f"routers must be wide_compile.Routers, got {type(routers).__name__}")
    from .passes.cost_model import KERNEL_PATHS
    from .passes.options import PassOptions

    if options.get("kernel_path", "auto") not in KERNEL_PATHS:  # a bad choice fails here, not in a compile
        raise ValueError(f"kernel_path must be one of {KERNEL_PATHS}, got {options['kernel_path']!r}")
    PassOptions.from_mapping(options)  # a bad pass option fails here, not inside the first compile
    if options.get("kernel_config") is not None:  # a bad table fails here, not inside the first compile
        from .kernels.tuning import resolve

        resolve(options["kernel_config"])
    if router_dtype is not None:
        target = routers if routers is not None else attached_routers(model)
        if target is not None:
            p = next(model.parameters(), None)
            if router_dtype == "bf16x2":
                target.split_bf16_()
            else:
                if router_dtype == "model":
                    dt = p.dtype if p is not None else torch.float32
                elif isinstance(router_dtype, torch.dtype):
                    dt = router_dtype
                else:
                    raise ValueError("router_dtype must be None, 'model', 'bf16x2' or a torch.dtype, got "
                                     f"{router_dtype!r}")
                if not dt.is_floating_point:
                    raise ValueError(f"router_dtype must be a floating-point dtype, got {dt}")
                target.to(dt)
    reports: list = []
    backend_opts = dict(options)
    if routers is not None:
        if _is_hf_llama(model):
            attach(model, routers)
        else:
            p = next(model.parameters(), None)
            if p is not None:
                routers.to(device=p.device)
            backend_opts["routers"] = routers
            fullgraph = True
    elif attached_routers(model) is None:
        raise ValueError(
            f"{type(model).__name__} has no WIDE routers: pass routers (wide_compile.optimize(model, routers)) or "
            "attach them first (wide_compile.attach(model, routers)); make routers with "
            "wide_compile.Routers.init(model, cfg) / Routers.load(path, model)")
    backend_opts["report"] = reports.append
    # the cost model decides (kernel_path="auto", the default: it beat the tuning table's paths in every row timed
    # side by side, benchmarks/results/lean-h100/README.md); its mask density: the routers' target capacity
    backend_opts.setdefault("kernel_path", "auto")
    if backend_opts["kernel_path"] == "auto" and backend_opts.get("mask_stats") is None:
        backend_opts["mask_stats"] = (routers if routers is not None else attached_routers(model)).cfg.capacity
    backend_opts["geometry"] = GroupGeometry.from_routers(routers if routers is not None else attached_routers(model))
    object.__setattr__(model, "_wide_reports", reports)
    gen_cfg = getattr(model, "generation_config", None)
    if gen_cfg is not None and hasattr(gen_cfg, "disable_compile"):
        # generate() would otherwise wrap the already compiled model in a second (plain Inductor) compile
        gen_cfg.disable_compile = True
    model.compile(backend=_backend_fn(**backend_opts), dynamic=dynamic, fullgraph=fullgraph)
    return model


def _backend_fn(**opts):
    """The wide backend with its options bound, named "wide": Dynamo names a backend in its errors by __name__,
    and a bare functools.partial would print every option (the whole Routers module among them)."""
    from . import backend as _backend

    fn = functools.partial(_backend.wide_backend, **opts)
    fn.__name__ = "wide"
    return fn


def cache_arg_name(model: nn.Module) -> str:
    """The keyword under which `model` (and its generate()) takes a KV cache: "cache" in newer transformers
    releases (5.24), "past_key_values" in older ones (5.17)."""
    import inspect

    fwd = getattr(model, "_orig_mod", model).forward
    return "cache" if "cache" in inspect.signature(fwd).parameters else "past_key_values"


def static_cache(model: nn.Module, batch_size: int, max_cache_len: int):
    """A transformers StaticCache for `model`, allocated now (early_initialization) rather than on its first
    update. Pass it as generate(**{wc.api.cache_arg_name(model): cache}) (past_key_values= / cache=, by
    transformers version) when the whole model is compiled with CUDA graphs
    (mode="reduce-overhead"): a lazily initialised cache is allocated inside the compiled region and then
    fed back as a mutated input, the pattern of pytorch/pytorch#192748 (cudagraph trees SIGSEGV)."""
    from transformers import StaticCache

    cfg = model.config
    p = next(model.parameters())
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    n_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    cache = StaticCache(config=cfg, max_cache_len=max_cache_len)
    cache.early_initialization(batch_size=batch_size, num_heads=n_kv, head_dim=head_dim, dtype=p.dtype,
                               device=p.device)
    return cache


@dataclass
class Explanation:
    """What the WIDE passes detected, rewrote and left dense, per compiled graph and per layer."""
    graphs: list = field(default_factory=list)   # GraphReport per Dynamo graph
    warnings: list = field(default_factory=list)  # routed blocks kept on the masked reference, and why
    errors: list = field(default_factory=list)    # routing the pass would drop (optimize raises these)

    @property
    def layers(self) -> list[dict]:
        rows = []
        for g in self.graphs:
            for r in g.layers():
                rows.append({**r, "layer": len(rows)})
        return rows

    @property
    def counts(self) -> dict:
        c: dict = {}
        for g in self.graphs:
            for k, v in g.counts.items():
                c[k] = c.get(k, 0) + v
        return c

    def __str__(self) -> str:
        lines = [str(g) for g in self.graphs] + [f"error: {e}" for e in self.errors]
        return "\n".join(lines) if lines else "WIDE: no graph compiled yet"

    __repr__ = __str__


def explain(model: nn.Module, *args, routers: Routers | None = None, **kwargs) -> Explanation:
    """Report per layer what the `wide` passes detect, rewrite and leave dense.

    For a model returned by `optimize` that has already run, the reports of its compiled graphs are returned.
    Otherwise the model is traced once (Dynamo, no Inductor) on the given inputs, by default
    input_ids = zeros(1, 8), and the passes are run on that graph.
    """
    reports = getattr(model, "_wide_reports", None)
    if reports and not args and not kwargs and routers is None:
        return Explanation(graphs=list(reports))
    if routers is None and attached_routers(model) is None:
        raise ValueError(f"{type(model).__name__} has no WIDE routers: pass routers=... or attach them first")
    if not args and not kwargs:
        p = next(model.parameters())
        kwargs = {"input_ids": torch.zeros(1, 8, dtype=torch.long, device=p.device)}
    out: list = []
    opts = {"inductor": False, "report": out.append}
    if routers is not None:
        if _is_hf_llama(model) and attached_routers(model) is None:
            raise ValueError("explain(model, routers=...) on an HF model: attach the routers first "
                             "(wide_compile.attach) so the traced graph matches optimize()")
        opts["routers"] = routers
    fn = torch.compile(model, backend=_backend_fn(**opts), fullgraph=routers is not None)
    errors = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with torch.no_grad():
                fn(*args, **kwargs)
        except Exception as e:  # Dynamo wraps the backend's error (BackendCompilerFailed)
            dropped = _find_cause(e, RoutingDroppedError)
            if dropped is None:
                raise
            errors.append(str(dropped))
    return Explanation(graphs=out, warnings=[str(w.message) for w in caught if "wide_compile" in str(w.message)],
                       errors=errors)


def _find_cause(e: BaseException, cls: type):
    """`e` or the first exception of type `cls` in its chain (inner_exception / __cause__ / __context__)."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, cls):
            return e
        seen.add(id(e))
        e = getattr(e, "inner_exception", None) or e.__cause__ or e.__context__
    return None
