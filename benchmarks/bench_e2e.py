#!/usr/bin/env python3
"""End-to-end benchmark: WIDE (`torch.compile(model, backend="wide")`) against standard Inductor.

One run produces one table: for every model x phase x workload x capacity x mask type it times, in
interleaved rounds with device events (medians, p10/p90):

  eager_dense        the HF model, eager
  dense_inductor     torch.compile default mode (prefill) / mode="reduce-overhead" CUDA graphs (decode)
                     -- THE baseline: speedup = dense_inductor_ms / wide_ms
  dense_max_autotune torch.compile mode="max-autotune-no-cudagraphs" (prefill)
  dense_inductor_cg  torch.compile default mode captured in a manual CUDA graph (decode; the same capture
                     method WIDE's decode step uses)
  static             a physically smaller model of the same FLOP capacity (fewer q heads, narrower FFN)
                     under Inductor (same mode as dense_inductor): the ceiling for dynamic routing
  wide               torch.compile(model, backend="wide") with routers attached (decode: + manual CUDA graph)
  wide_eager         the WIDE eager reference (wide_compile.attach hooks)
  trt                torch-tensorrt (prefill) when importable, else skipped with the reason

Prefill = one forward over [batch, tokens] with use_cache=False and logits_to_keep=1 (the last
position's logits, as generation's prefill needs). Decode = one token per sequence against a static KV
cache pre-filled (eager prefill) to `tokens` positions; the cache write position is rewound before every
step outside the timed region, so every timed step attends over exactly `tokens`+1 keys.

Results: <out>/<name>.json ({"records": [...], gpu, versions, date, command, goals}), <name>.md, <name>.png,
and with --profile <name>-profile.txt. Every row is in try/except; results are written after every row;
--time-budget-s stops starting new work once exceeded. See --help and benchmarks/e2e/*.py.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import inspect
import json
import platform
import sys
import time
import traceback
from pathlib import Path

_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))
if str(_HERE.parent) not in sys.path:
    sys.path.insert(1, str(_HERE.parent))

import torch  # noqa: E402

from e2e import masks as M  # noqa: E402
from e2e import models as MD  # noqa: E402
from e2e.attention import ATTENTIONS  # noqa: E402
from e2e import report as R  # noqa: E402
from e2e.timing import (MemTracker, Variant, cuda_graph_step, first_call, free, is_cuda,  # noqa: E402
                        profile_step, sync, time_interleaved, warmup)

ALL_VARIANTS = ("eager", "inductor", "max_autotune", "inductor_cg", "static", "wide", "wide_eager", "trt")
KEY = {"eager": "eager_dense", "inductor": "dense_inductor", "max_autotune": "dense_max_autotune",
       "inductor_cg": "dense_inductor_cg", "static": "static", "wide": "wide", "wide_eager": "wide_eager",
       "trt": "trt"}
MODELS = ("llama-3.1-8b", "llama-3.2-3b", "smollm2-135m")
PER_ROW = ("inductor", "inductor_cg")  # dense variants timed in every row (the rest once per workload)
TEXT = ("The history of the region begins with small farming villages along the river, where families grew "
        "wheat and barley and kept sheep on the hills. Over the centuries the villages became towns, and the "
        "towns were joined by roads that carried grain, wool and news. Merchants built warehouses near the "
        "harbour, and a market was held every week in the square in front of the old church. In the winter "
        "the river froze and children skated on it, while their parents mended nets and told stories about "
        "storms and shipwrecks. Scientists later studied the soil and the weather, measuring rainfall and "
        "temperature every day, and found that the climate had slowly become warmer. Today the town has a "
        "university, a hospital and a railway station, and many people work in offices or shops. Tourists "
        "come in summer to walk along the coast, visit the museum and eat fresh fish in the restaurants. ")


# -- run context ----------------------------------------------------------------------------------
class Ctx:
    def __init__(self, args):
        self.args = args
        self.t0 = time.monotonic()
        self.device = torch.device(args.device)
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
        self.records: list[dict] = []
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.json_path = self.out / f"{args.name}.json"
        self.profile_path = self.out / f"{args.name}-profile.txt"
        self.meta = env_info(args)
        self.skips: list[str] = []
        self.done_keys = set()
        if args.resume and self.json_path.is_file():
            old = json.loads(self.json_path.read_text())
            self.records = old.get("records", [])
            self.done_keys = {row_key(r) for r in self.records if r.get("wide_ms") is not None}
            log(f"resume: {len(self.records)} records loaded from {self.json_path}, "
                f"{len(self.done_keys)} complete rows will be skipped")

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    deadline: float | None = None  # soft deadline of the current (model, phase): a share of the budget

    def over_budget(self) -> bool:
        if self.args.time_budget_s is None:
            return False
        limit = self.args.time_budget_s if self.deadline is None else min(self.deadline, self.args.time_budget_s)
        return self.elapsed() > limit

    def skip(self, msg: str):
        log(f"  SKIP {msg}")
        self.skips.append(msg)

    def write(self):
        data = {"records": self.records, **self.meta, "skipped": self.skips,
                "elapsed_s": round(self.elapsed(), 1), "goals": R.goals(self.records)}
        tmp = self.json_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=1, default=_jsonable))
        tmp.replace(self.json_path)
        try:
            (self.out / f"{self.args.name}.md").write_text(R.markdown(data))
        except Exception as e:  # noqa: BLE001
            log(f"  (markdown failed: {e})")


def _jsonable(o):
    if isinstance(o, torch.Tensor):
        return o.tolist()
    if isinstance(o, torch.dtype):
        return str(o)
    return str(o)


def row_key(r: dict) -> tuple:
    return (r.get("model"), r.get("layers"), r.get("phase"), r.get("tokens"), r.get("batch"),
            round(float(r.get("capacity", 0)), 3), r.get("masks"))


def log(*a):
    print(*a, flush=True)


def env_info(args) -> dict:
    import transformers

    try:
        import triton

        tv = triton.__version__
    except Exception:  # noqa: BLE001
        tv = None
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() and args.device.startswith("cuda") else None
    return {"gpu": gpu, "device": args.device, "torch": torch.__version__, "triton": tv,
            "transformers": transformers.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "host": platform.node(), "date": _dt.datetime.now().isoformat(timespec="seconds"),
            "command": "python " + " ".join([sys.argv[0]] + sys.argv[1:]) if sys.argv else None,
            "dtype": args.dtype, "options": {k: v for k, v in vars(args).items()}}


# -- capabilities --------------------------------------------------------------------------------
def wide_backend_status(name: str) -> str | None:
    """None if `name` is a usable dynamo backend, else the reason."""
    try:
        import wide_compile.backend  # noqa: F401  registers "wide"
    except Exception as e:  # noqa: BLE001
        if name == "wide":
            return f"import wide_compile.backend failed: {type(e).__name__}: {e}"
    try:
        from torch._dynamo.backends.registry import lookup_backend

        lookup_backend(name)
        return None
    except Exception as e:  # noqa: BLE001
        return f"dynamo backend {name!r} not registered: {type(e).__name__}: {str(e)[:200]}"


def trt_status() -> str | None:
    try:
        import torch_tensorrt  # noqa: F401

        return None
    except Exception as e:  # noqa: BLE001
        return f"torch_tensorrt not importable ({type(e).__name__}: {str(e)[:120]})"


def set_dynamo_limits():
    import torch._dynamo.config as dc

    for n, v in (("recompile_limit", 4096), ("cache_size_limit", 4096), ("accumulated_recompile_limit", 65536),
                 ("accumulated_cache_size_limit", 65536)):
        if hasattr(dc, n):
            try:
                setattr(dc, n, v)
            except Exception:  # noqa: BLE001
                pass


def graph_count() -> int:
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001
        return -1


_TEXT_FILE: str | None = None


def load_text(path: str, max_chars: int = 400_000) -> str:
    """Plain text, or JSONL(.gz) with a "text" field per line."""
    import gzip

    op = gzip.open if path.endswith(".gz") else open
    out, n = [], 0
    with op(path, "rt", encoding="utf-8", errors="replace") as f:
        for line in f:
            if ".jsonl" in path:
                try:
                    line = json.loads(line).get("text", "")
                except Exception:  # noqa: BLE001
                    continue
            out.append(line)
            n += len(line)
            if n >= max_chars:
                break
    return "\n".join(out)


def text_ids(tok, n: int, batch: int = 1) -> torch.Tensor:
    """Real text for the real SmolLM2 (trained routers): --text-file (default: WikiText-2 valid under the data
    root, when there is one), else a built-in paragraph (repeated to length: repetition makes masks of
    repeated tokens alike, so prefer a file). ids: [batch, n], each row its own consecutive piece of the
    text, so a batch's rows do not share their masks."""
    text = TEXT
    if _TEXT_FILE:
        try:
            text = load_text(_TEXT_FILE)
        except OSError as e:
            log(f"  --text-file {_TEXT_FILE}: {e}; using the built-in paragraph")
    ids = tok(text, return_tensors="pt")["input_ids"][0]
    reps = (n * batch + ids.numel() - 1) // ids.numel()
    return ids.repeat(reps)[:n * batch].view(batch, n)


def default_text_file() -> str | None:
    """WikiText-2 valid (raw) under the data root (../shared/data, $WIDE_DATA_DIR or .data), if present."""
    from wide_compile.training.data import default_data_root

    root = default_data_root()
    f = root / "wikitext-2" / "wiki.valid.raw" if root else None
    return str(f) if f is not None and f.is_file() else None


def step_logits(step, reset=None) -> torch.Tensor:
    """Run one timed step (after its reset) and return its logits as a float copy."""
    if reset:
        reset()
    o = step()
    lg = getattr(o, "logits", None)
    if lg is None:
        lg = o[0] if isinstance(o, (tuple, list)) else o
    return lg.float().clone()


def compare_logits(x: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(relative L2 error of x against ref, fraction of positions whose argmax agrees)."""
    return (((x - ref).norm() / ref.norm().clamp_min(1e-30)).item(),
            (x.argmax(-1) == ref.argmax(-1)).float().mean().item())


# -- KV cache for decode ---------------------------------------------------------------------------
class DecodeState:
    """A static KV cache filled to `ctx` positions + the fixed inputs of one decode step."""

    def __init__(self, model, batch: int, ctx: int, vocab: int, device, gen_seed: int = 0):
        from transformers import StaticCache

        sig = inspect.signature(StaticCache.__init__).parameters
        kw = {"config": model.config, "max_cache_len": ctx + 1}
        for k, v in (("max_batch_size", batch), ("batch_size", batch), ("device", device),
                     ("dtype", next(model.parameters()).dtype)):
            if k in sig:
                kw[k] = v
        self.cache = StaticCache(**kw)
        fwd = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in fwd else "past_key_values"
        g = torch.Generator(device="cpu").manual_seed(gen_seed)
        ctx_ids = torch.randint(0, vocab, (batch, ctx), generator=g).to(device)
        self.tok = torch.randint(0, vocab, (batch, 1), generator=g).to(device)
        self.pos = torch.full((batch, 1), ctx, dtype=torch.long, device=device)
        self.ctx = ctx
        with torch.no_grad():  # fill the cache with real K/V (eager dense prefill)
            model(input_ids=ctx_ids, use_cache=True, logits_to_keep=1,
                  **{self.cache_kw: self.cache}, **self._pos_kwargs(torch.arange(ctx, device=device)))
        self.counters = [t for t in (getattr(layer, "cumulative_length", None)
                                     for layer in getattr(self.cache, "layers", []))
                         if isinstance(t, torch.Tensor)]
        self.use_cache_position = not self.counters  # older transformers: positions passed explicitly
        self.cache_position = torch.tensor([ctx], device=device)
        self.reset()

    def _pos_kwargs(self, cp):
        from transformers import cache_utils

        layer_cls = getattr(cache_utils, "StaticLayer", None)
        new_api = layer_cls is not None and "cumulative_length" in inspect.getsource(layer_cls)
        return {} if new_api else {"cache_position": cp}

    def reset(self):
        for t in self.counters:
            t.fill_(self.ctx)

    def nbytes(self) -> int:
        n = 0
        for layer in getattr(self.cache, "layers", []):
            for a in ("keys", "values"):
                t = getattr(layer, a, None)
                if isinstance(t, torch.Tensor):
                    n += t.numel() * t.element_size()
        return n

    def step_fn(self, m):
        kw = {self.cache_kw: self.cache}
        if self.use_cache_position:
            kw["cache_position"] = self.cache_position

        def step():
            return m(input_ids=self.tok, position_ids=self.pos, use_cache=True, **kw)

        return step


# -- one model ------------------------------------------------------------------------------------
class ModelBench:
    def __init__(self, ctx: Ctx, name: str):
        self.ctx, self.name = ctx, name
        a = ctx.args
        self.weights = "random"
        self.tok = None
        dev, dt = ctx.device, ctx.dtype
        if name == "smollm2-135m" and a.smollm2_weights != "random":
            try:
                self.dense, self.tok = MD.load_smollm2_real(dev, dt, a.smollm2_gguf)
                self.weights = "pretrained"
                if a.layers:
                    log("  (--layers is ignored for the real SmolLM2)")
            except Exception as e:  # noqa: BLE001
                ctx.skip(f"{name}: real weights unavailable ({type(e).__name__}: {str(e)[:300]}); "
                         "using the SmolLM2 shape with random weights; 'trained' masks skipped")
        if self.weights == "random":
            self.config = MD.make_config(name, layers=a.layers, max_positions=max(16384, max(a.decode_ctx + a.prefill_tokens) + 8))
            self.dense = MD.build_model(self.config, dev, dt, seed=a.seed)
        self.config = self.dense.config
        self.layers = self.config.num_hidden_layers
        self.vocab = self.config.vocab_size
        self.dense_bytes = MD.param_bytes(self.dense)
        self.wide_model = MD.shared_clone(self.dense)
        g = torch.Generator().manual_seed(a.seed + 7)
        if self.tok is not None:
            self.calib_ids = text_ids(self.tok, a.calib_tokens).to(dev)
        else:
            self.calib_ids = torch.randint(0, self.vocab, (1, a.calib_tokens), generator=g).to(dev)
        self.routers: dict = {}
        self.mask_model: dict | None = None
        log(f"== {name}: {self.layers} layers, hidden {self.config.hidden_size}, FFN {self.config.intermediate_size}, "
            f"{self.config.num_attention_heads}/{self.config.num_key_value_heads} heads, weights={self.weights}, "
            f"{self.dense_bytes / 2**30:.2f} GiB")

    def cfg(self, cap: float):
        return M.make_cfg(cap, self.ctx.args.ffn_group_size if self.name != "smollm2-135m" else self.ctx.args.smollm2_ffn_group_size,
                          self.ctx.args.head_group_size if self.name != "smollm2-135m" else self.ctx.args.smollm2_head_group_size)

    # -- routers ---
    def correlated_model(self) -> dict:
        if self.mask_model is None:
            a = self.ctx.args
            stats = None
            if not a.no_trained_stats:
                if not hasattr(self.ctx, "trained_stats"):  # measured once per run
                    self.ctx.trained_stats = M.trained_router_stats(
                        self.ctx.device, self.ctx.dtype, lambda tok, n: text_ids(tok, n), log=log,
                        gguf=a.smollm2_gguf)
                stats = self.ctx.trained_stats
            stats = stats or dict(M.DEFAULT_STATS)
            rho, tried = M.fit_rho(self.wide_model, self.cfg, self.calib_ids, 0.5, stats, seed=a.seed, log=log,
                                   grid=(0.0, 0.9) if a.smoke else M.RHO_GRID)
            self.mask_model = {"stats_target": {k: v for k, v in stats.items() if k != "all"}, "rho": rho,
                               "rank": M.LATENT_RANK, "fit": tried}
            log(f"  correlated mask model: {self.mask_model['stats_target']} -> rho={rho}")
        return self.mask_model

    def get_routers(self, cap: float, masks: str):
        key = (round(cap, 4), masks)
        if key in self.routers:
            return self.routers[key]
        a = self.ctx.args
        if cap >= 0.9999:
            r = M.all_on_routers(self.wide_model, self.cfg(1.0), seed=a.seed)
        elif masks == "random":
            r = M.random_routers(self.wide_model, self.cfg(cap), self.calib_ids, cap, seed=a.seed)
        elif masks == "correlated":
            mm = self.correlated_model()
            r = M.correlated_routers(self.wide_model, self.cfg(cap), self.calib_ids, cap, mm["rho"],
                                     mm["stats_target"], seed=a.seed)
        elif masks == "trained":
            if self.weights != "pretrained":
                raise RuntimeError("trained routers need the real SmolLM2 weights")
            names = [n for n in M.Routers.available() if "smollm" in n.lower()]
            cands = []
            for n in names:
                try:
                    rr = M.Routers.pretrained(n, self.wide_model)
                    cands.append((abs(rr.cfg.capacity - cap), n, rr))
                except Exception as e:  # noqa: BLE001
                    log(f"  trained routers {n}: {e}")
            cands = [c for c in cands if c[0] <= 0.05]
            if not cands:
                raise RuntimeError(f"no trained SmolLM2 routers with capacity ~{cap} (available: {names or 'none'})")
            r = min(cands, key=lambda c: c[0])[2]
        else:
            raise ValueError(masks)
        try:  # capacity on the calibration tokens (the decode rows' per-step figure is one token's)
            import wide_compile as wc

            wc.attach(self.wide_model, r)
            try:
                with torch.no_grad():
                    r.calib_capacity = round(wc.measure_capacity(self.wide_model, self.calib_ids)["overall"], 4)
            finally:
                wc.detach(self.wide_model)
        except Exception as e:  # noqa: BLE001
            log(f"    measure_capacity on calibration tokens failed: {type(e).__name__}: {e}")
        self.routers[key] = r
        return r

    # -- variants ---
    def prepare(self, vname: str, label: str, make, shared_bytes: int, wl: dict) -> Variant | None:
        """make() -> (step, reset, info). Compiles (first call), warms up, measures memory."""
        ctx = self.ctx
        if ctx.over_budget():
            wl["skipped"][label] = "time budget exceeded"
            return None
        try:
            tr = MemTracker(ctx.device, shared_bytes)
            sync(ctx.device)
            t0 = time.perf_counter()
            step, reset, info = make()  # graphed variants compile + capture in here
            c_s = time.perf_counter() - t0 + first_call(step, ctx.device, reset)
            info = info or {}
            keep = info.pop("_keep", None)
            v = Variant(label, step, reset, compile_s=c_s, info=info)
            v.keep.append(keep)
            warmup(v, ctx.device, ctx.args.warmup)
            tr.finish(v)
            log(f"    ready {label:<22} compile+first call {c_s:7.2f}s  ~{v.est_ms:9.3f} ms/step"
                + (f"  mem {v.peak_mem_mb:8.0f} MB" if v.peak_mem_mb else ""))
            return v
        except Exception as e:  # noqa: BLE001
            msg = f"{type(e).__name__}: {str(e).strip()[:600]}"
            wl["errors"][label] = msg
            log(f"    FAILED {label}: {msg}")
            if ctx.args.verbose:
                traceback.print_exc()
            free(ctx.device)
            return None

    def compiled(self, model, **kw):
        return torch.compile(model, dynamic=False, **kw)

    def run_workload(self, phase: str, tokens: int, batch: int):
        ctx, a = self.ctx, self.ctx.args
        caps = list(a.capacities)
        mask_types = list(a.masks)
        if self.weights == "pretrained" and "trained" not in mask_types and not a.no_trained_masks:
            mask_types.append("trained")
        if self.weights != "pretrained" and "trained" in mask_types:
            mask_types.remove("trained")
        rows = [(c, m) for c in caps for m in (self.row_masks(c, mask_types) if c < 0.9999 else ["all-on"])]
        todo = [(c, m) for c, m in rows
                if not all(row_key(self.base_record(phase, tokens, batch, c, mm)) in ctx.done_keys
                           for mm in (mask_types if m == "all-on" else [m]))]
        if not todo:
            log(f"  {phase} tokens={tokens} batch={batch}: all rows done (resume)")
            return
        log(f"-- {self.name} {phase} tokens={tokens} batch={batch} ({ctx.elapsed():.0f}s elapsed)")
        dev = ctx.device
        wl = {"errors": {}, "skipped": {}}
        V = set(a.variants)
        state = None
        if phase == "prefill":
            g = torch.Generator().manual_seed(a.seed + tokens * 31 + batch)
            if self.tok is not None:
                ids = text_ids(self.tok, tokens, batch).to(dev)
            else:
                ids = torch.randint(0, self.vocab, (batch, tokens), generator=g).to(dev)

            def step_of(m):
                return lambda: m(input_ids=ids, use_cache=False, logits_to_keep=1)

            reset = None
            extra_bytes = 0
        else:
            state = DecodeState(self.dense, batch, tokens, self.vocab, dev, gen_seed=a.seed + tokens + batch)
            step_of = state.step_fn
            reset = state.reset
            extra_bytes = state.nbytes()
        cuda = is_cuda(dev)
        smoke_backend = a.smoke and not a.smoke_inductor  # CPU smoke: Inductor slots use backend="eager"

        def ind(model, mode=None):
            if smoke_backend:
                return self.compiled(model, backend="eager")
            return self.compiled(model, mode=mode) if mode else self.compiled(model)

        def ro_reset(base_reset):
            def r():
                if base_reset:
                    base_reset()
                if hasattr(torch, "compiler") and hasattr(torch.compiler, "cudagraph_mark_step_begin"):
                    torch.compiler.cudagraph_mark_step_begin()
            return r

        def graphed(step, rst, info):
            if not cuda or a.no_cuda_graphs:
                info["cuda_graph"] = False
                return step, rst, info
            replay, g = cuda_graph_step(step, rst)
            info.update(cuda_graph=True, raw_step=step, _keep=g)
            return replay, rst, info

        # ---- dense variants (once per workload) ----
        dense_vars: dict[str, Variant] = {}
        shared = self.dense_bytes + extra_bytes

        def prepare_ref():
            if "inductor" not in V:
                return None
            if phase == "prefill" or not cuda:
                mk = lambda: (step_of(ind(self.dense)), reset, {"mode": "default"})  # noqa: E731
            else:
                mk = lambda: (step_of(ind(self.dense, "reduce-overhead")), ro_reset(reset),  # noqa: E731
                              {"mode": "reduce-overhead"})
            return self.prepare("inductor", "dense_inductor", mk, shared, wl)

        def prepare_cg():
            if phase != "decode" or "inductor_cg" not in V or not cuda:
                return None
            return self.prepare("inductor_cg", "dense_inductor_cg",
                                lambda: graphed(step_of(ind(self.dense)), reset, {"mode": "default+cudagraph"}),
                                shared, wl)

        with torch.no_grad():
            v = prepare_ref()
            if v:
                dense_vars["inductor"] = v
            if "eager" in V:
                v = self.prepare("eager", "eager_dense", lambda: (step_of(self.dense), reset, {}), shared, wl)
                if v:
                    dense_vars["eager"] = v
            if phase == "prefill" and "max_autotune" in V and not a.smoke:
                v = self.prepare("max_autotune", "dense_max_autotune",
                                 lambda: (step_of(ind(self.dense, "max-autotune-no-cudagraphs")), reset,
                                          {"mode": "max-autotune-no-cudagraphs"}), shared, wl)
                if v:
                    dense_vars["max_autotune"] = v
            if phase == "decode" and "inductor_cg" in V:
                if cuda:
                    v = prepare_cg()
                    if v:
                        dense_vars["inductor_cg"] = v
                else:
                    wl["skipped"]["dense_inductor_cg"] = "CUDA graphs need a GPU"
            if "trt" in V:
                why = trt_status() if phase == "prefill" else "torch-tensorrt decode with a mutating static " \
                                                               "KV cache is not supported by this harness"
                if why is None and not cuda:
                    why = "torch-tensorrt needs CUDA"
                if why:
                    wl["skipped"]["trt"] = why
                else:
                    def mk_trt():
                        import torch_tensorrt  # noqa: F401

                        m = torch.compile(self.dense, backend="torch_tensorrt", dynamic=False,
                                          options={"enabled_precisions": {ctx.dtype}, "min_block_size": 1})
                        return step_of(m), reset, {}
                    v = self.prepare("trt", "trt", mk_trt, shared, wl)
                    if v:
                        dense_vars["trt"] = v

            v = None
            ref = dense_vars.get("inductor")
            extras_timed = False
            for cap in caps:
                if ctx.over_budget():
                    ctx.skip(f"{self.name} {phase} {tokens}x{batch} cap {cap}+: time budget "
                             f"({a.time_budget_s}s) exceeded")
                    break
                # ---- static model of this capacity ----
                static_v, st_shape = None, None
                if "static" in V and cap < 0.9999:
                    holder = {}

                    def mk_static(cap=cap, holder=holder):
                        sm, shp = MD.build_static(self.config, cap, dev, ctx.dtype, seed=a.seed + 1)
                        holder["shape"] = shp
                        if phase == "prefill" or not cuda:
                            m = ind(sm)
                            return step_of(m), reset, {"mode": "default", "_keep": sm}
                        m = ind(sm, "reduce-overhead")
                        return step_of(m), ro_reset(reset), {"mode": "reduce-overhead", "_keep": sm}
                    static_v = self.prepare("static", "static", mk_static, extra_bytes, wl)
                    st_shape = holder.get("shape")
                for masks in (self.row_masks(cap, mask_types) if cap < 0.9999 else ["all-on"]):
                    if ctx.over_budget():
                        ctx.skip(f"{self.name} {phase} {tokens}x{batch} cap {cap} {masks}: time budget exceeded")
                        break
                    emit_masks = mask_types if masks == "all-on" else [masks]
                    if all(row_key(self.base_record(phase, tokens, batch, cap, mm)) in ctx.done_keys
                           for mm in emit_masks):
                        continue
                    rw = {"errors": dict(wl["errors"]), "skipped": dict(wl["skipped"])}
                    try:
                        routers = self.get_routers(cap, masks)
                        if a.router_dtype == "model":  # tensor-core routers (bf16 weights, fp32 accumulation)
                            routers = routers.to(ctx.dtype)
                        elif a.router_dtype == "bf16x2" and ctx.dtype == torch.bfloat16:
                            routers = routers.split_bf16_()
                    except Exception as e:  # noqa: BLE001
                        rw["errors"]["routers"] = f"{type(e).__name__}: {str(e)[:400]}"
                        log(f"    routers cap={cap} masks={masks} FAILED: {rw['errors']['routers']}")
                        if a.verbose:
                            traceback.print_exc()
                        routers = None
                    wide_v = wide_eager_v = None
                    measured = None
                    if routers is not None:
                        import wide_compile as wc

                        wc.attach(self.wide_model, routers)
                        try:
                            measured = self.measured_capacity(step_of(self.wide_model), reset, routers)
                        except Exception as e:  # noqa: BLE001
                            rw["errors"]["measure_capacity"] = f"{type(e).__name__}: {str(e)[:300]}"
                        if "wide" in V:
                            why = wide_backend_status(a.wide_backend)
                            if why:
                                rw["skipped"]["wide"] = why
                                log(f"    SKIP wide: {why}")
                            else:
                                def mk_wide(routers=routers):
                                    ro = phase == "decode" and cuda and a.wide_decode_mode == "reduce-overhead"
                                    kw = {"mode": "reduce-overhead"} if ro else {}
                                    if a.wide_entry == "optimize":
                                        m = wc.optimize(self.wide_model, routers, dynamic=False, **kw)
                                    else:
                                        m = self.compiled(self.wide_model, backend=a.wide_backend, **kw)
                                    st = step_of(m)
                                    if ro:
                                        return st, ro_reset(reset), {"entry": a.wide_entry,
                                                                     "mode": "reduce-overhead"}
                                    if phase == "decode" and a.wide_decode_mode == "manual-graph":
                                        try:
                                            return graphed(st, reset, {"entry": a.wide_entry})
                                        except Exception as e:  # noqa: BLE001
                                            log(f"    wide: CUDA-graph capture failed ({type(e).__name__}: "
                                                f"{str(e)[:200]}); timing without graphs")
                                            free(dev)
                                            return st, reset, {"entry": a.wide_entry, "cuda_graph": False,
                                                               "cuda_graph_error": str(e)[:300]}
                                    return st, reset, {"entry": a.wide_entry}
                                wide_v = self.prepare("wide", "wide", mk_wide, shared, rw)
                        if "wide_eager" in V:
                            wide_eager_v = self.prepare("wide_eager", "wide_eager",
                                                        lambda: (step_of(self.wide_model), reset, {}), shared, rw)
                    # ---- time this row: reference + static + wide (+ extras the first time) ----
                    cg = dense_vars.get("inductor_cg")  # decode: same capture method as WIDE, every row
                    group = [v for v in (ref, cg, static_v, wide_v, wide_eager_v) if v is not None]
                    if not extras_timed:
                        group += [v for k, v in dense_vars.items() if k not in PER_ROW]
                    for v in group:
                        v.times_ms = []
                    n0 = graph_count()
                    try:
                        if group:
                            time_interleaved(group, dev, rounds=a.rounds, target_s=a.target_s)
                    except Exception as e:  # noqa: BLE001
                        rw["errors"]["timing"] = f"{type(e).__name__}: {str(e)[:400]}"
                        log(f"    timing FAILED: {rw['errors']['timing']}")
                        traceback.print_exc()
                    recompiled = graph_count() != n0 and n0 >= 0
                    if wide_v is not None and wide_eager_v is not None:
                        try:
                            rw["check"] = self.check(wide_v, wide_eager_v)
                        except Exception as e:  # noqa: BLE001
                            rw["errors"]["check"] = f"{type(e).__name__}: {str(e)[:300]}"
                    if a.check_replay and wide_v is not None and routers is not None:
                        try:
                            rw["replay_check"] = self.replay_check(step_of, reset, routers)
                            log(f"    replay check: {rw['replay_check']}")
                        except Exception as e:  # noqa: BLE001
                            rw["errors"]["replay_check"] = f"{type(e).__name__}: {str(e)[:300]}"
                            log(f"    replay check FAILED: {rw['errors']['replay_check']}")
                    if not extras_timed:
                        extras = {k: v.summary() for k, v in dense_vars.items() if k not in PER_ROW}
                        self._extras = {k: (v.compile_s, v.peak_mem_mb, extras[k]) for k, v in dense_vars.items()
                                        if k not in PER_ROW}
                        extras_timed = True
                    for k in [k for k in dense_vars if k not in PER_ROW]:
                        dense_vars.pop(k)  # extras are timed once per workload: release their graphs now
                    prof = None
                    if a.profile and cuda or (a.profile and a.smoke):
                        prof = self.profile(phase, tokens, batch, cap, masks,
                                            {"dense_inductor": ref, "static": static_v, "wide": wide_v})
                    for mm in emit_masks:
                        rec = self.base_record(phase, tokens, batch, cap, mm)
                        self.fill(rec, ref, static_v, wide_v, wide_eager_v, st_shape, measured, routers, rw,
                                  recompiled, prof, shared_measurement=(masks == "all-on"), cg=cg)
                        # each record names its own run: a resumed file holds rows of several runs
                        rec.update(command=ctx.meta.get("command"), date=ctx.meta.get("date"))
                        ctx.records = [r for r in ctx.records if row_key(r) != row_key(rec)] + [rec]
                        log(R.one_line(rec))
                    ctx.write()
                    if routers is not None:
                        import wide_compile as wc

                        wc.detach(self.wide_model)
                    del wide_v, wide_eager_v
                    free(dev)
                del static_v
                free(dev)
                if cuda and self.memory_high() and cap != caps[-1]:
                    # compiled WIDE graphs stay in Dynamo's cache (with any weight copies the backend made)
                    # until a reset: reset, and re-prepare the per-row references (Inductor's cache is warm)
                    log(f"    memory {torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated: "
                        "torch._dynamo.reset() and re-preparing the dense references")
                    ref = None
                    dense_vars.clear()
                    torch._dynamo.reset()
                    free(dev)
                    ref = prepare_ref()
                    if ref:
                        dense_vars["inductor"] = ref
                    cgv = prepare_cg()
                    if cgv:
                        dense_vars["inductor_cg"] = cgv
        dense_vars.clear()
        ref = None
        self._extras = {}
        del state
        torch._dynamo.reset()
        free(dev)

    def row_masks(self, cap: float, mask_types: list[str]) -> list[str]:
        """The mask types timed at this capacity (--correlated-capacities limits the non-random ones). The
        resume check uses the same list, or a workload whose rows are all done would be compiled again."""
        cc = self.ctx.args.correlated_capacities
        if cap >= 0.9999 or cc is None:
            return list(mask_types)
        return [m for m in mask_types if m == "random" or any(abs(cap - c) < 1e-6 for c in cc)]

    def memory_high(self) -> bool:
        free_b, total = torch.cuda.mem_get_info()
        return torch.cuda.memory_allocated() > self.ctx.args.reset_mem_frac * total

    @torch.no_grad()
    def check(self, wide_v: Variant, eager_v: Variant) -> dict:
        """Compiled WIDE vs the eager reference on the timed inputs: relative error of the logits."""
        def logits(v: Variant) -> torch.Tensor:
            return step_logits(v.info.get("raw_step", v.step), v.reset)

        c, e = logits(wide_v), logits(eager_v)
        rel, agree = compare_logits(c, e)
        res = {"logits_rel_err": round(rel, 6), "argmax_agree": round(agree, 4), "finite": bool(torch.isfinite(c).all())}
        # Noise floor of that comparison: the same eager reference with every router bias moved by
        # N(0, 1e-3) (below bf16 rounding of a logit of size ~1). Decisions within that of 0 flip, and in a deep
        # random-weight model a flip early on changes everything after it; when this floor is as large as
        # logits_rel_err, the live-router comparison cannot tell kernel error from flips (check_compiled_gpu's
        # replayed-mask cases can).
        try:
            import wide_compile as wc

            with M.jittered_router_biases(wc.routing.attached_routers(self.wide_model), 1e-3) as moved:
                if moved:
                    j_rel, j_agree = compare_logits(logits(eager_v), e)
                    res["jitter_floor_rel_err"] = round(j_rel, 6)
                    res["jitter_floor_argmax_agree"] = round(j_agree, 4)
        except Exception as ex:  # noqa: BLE001
            res["jitter_floor_error"] = f"{type(ex).__name__}: {str(ex)[:200]}"
        return res

    def replay_check(self, step_of, reset, routers, tol: float = 0.05) -> dict:
        """Kernel and pass error alone, at this row's shape and input: the masks the live routers give on the
        timed input are recorded in the eager WIDE model and replayed (Routers.replay) both there and in a
        fresh compile with the WIDE backend, so no router decision can flip between the two (the live check
        above cannot tell flips from kernel error on random-weight models). Relative L2 error of the logits:
        bf16 rounding gives ~1e-2 or less at these depths (check-compiled-h200.json: 45-52 dB), a wrong
        group, index or tile gives errors of order 1; `ok` is rel_err < tol."""
        import wide_compile as wc
        from wide_compile.routing import record_masks

        a = self.ctx.args
        if reset:
            reset()
        with record_masks(self.wide_model) as rec:
            step_of(self.wide_model)()
        replay = wc.Routers.replay(self.wide_model, routers.cfg, rec)
        wc.attach(self.wide_model, replay)
        try:
            if a.wide_entry == "optimize":
                m = wc.optimize(self.wide_model, replay, dynamic=False)
            else:
                m = self.compiled(self.wide_model, backend=a.wide_backend)
            c, e = step_logits(step_of(m), reset), step_logits(step_of(self.wide_model), reset)
        finally:
            wc.attach(self.wide_model, routers)  # the live routers again, for the rest of the row
        rel, agree = compare_logits(c, e)
        finite = bool(torch.isfinite(c).all())
        return {"logits_rel_err": round(rel, 6), "argmax_agree": round(agree, 4),
                "finite": finite, "tol": tol, "ok": finite and rel < tol}

    def measured_capacity(self, step, reset, routers) -> dict:
        from wide_compile.routing import record_masks
        from wide_compile.routing.measure import capacity_from_record

        if reset:
            reset()
        with record_masks(self.wide_model) as rec:
            step()
        c = capacity_from_record(routers, rec)
        return {k: round(c[k], 4) for k in ("overall", "attn", "ffn")}

    def base_record(self, phase, tokens, batch, cap, masks) -> dict:
        return {"model": self.name, "layers": self.layers, "weights": self.weights, "phase": phase,
                "tokens": tokens, "batch": batch, "capacity": cap, "masks": masks,
                "router_dtype": self.ctx.args.router_dtype, "kernel_config": self.ctx.args.kernel_config,
                "attention": self.ctx.args.attention}

    def fill(self, rec, ref, static_v, wide_v, wide_eager_v, st_shape, measured, routers, rw, recompiled, prof,
             shared_measurement=False, cg=None):
        def put(prefix, v):
            if v is None:
                rec[f"{prefix}_ms"] = None
                return None
            s = v.summary()
            rec[f"{prefix}_ms"] = round(s["median"], 4) if s else None
            if s:
                rec[f"{prefix}_p10"], rec[f"{prefix}_p90"], rec[f"{prefix}_n"] = round(s["p10"], 4), round(s["p90"], 4), s["n"]
            rec[f"{prefix}_compile_s"] = round(v.compile_s, 2) if v.compile_s is not None else None
            rec[f"{prefix}_peak_mem_mb"] = round(v.peak_mem_mb, 1) if v.peak_mem_mb is not None else None
            for k in ("mode", "cuda_graph", "entry", "cuda_graph_error"):
                if k in v.info:
                    rec[f"{prefix}_{k}"] = v.info[k]
            return rec[f"{prefix}_ms"]

        put("dense_inductor", ref)
        if cg is not None:
            put("dense_inductor_cg", cg)
        for k, (c_s, mem, s) in getattr(self, "_extras", {}).items():
            key = KEY[k]
            rec[f"{key}_ms"] = round(s["median"], 4) if s else None
            if s:
                rec[f"{key}_p10"], rec[f"{key}_p90"] = round(s["p10"], 4), round(s["p90"], 4)
            rec[f"{key}_compile_s"] = round(c_s, 2) if c_s is not None else None
            rec[f"{key}_peak_mem_mb"] = round(mem, 1) if mem is not None else None
        for k in ("eager_dense", "dense_max_autotune", "dense_inductor_cg", "trt"):
            rec.setdefault(f"{k}_ms", None)
        if rec["capacity"] >= 0.9999:
            rec["static_ms"] = rec["dense_inductor_ms"]
            rec["static_note"] = "capacity 1.0: the static model is the dense model (same measurement)"
            rec["static_capacity"] = 1.0
        else:
            put("static", static_v)
            if st_shape is not None:
                rec.update(static_capacity=round(st_shape.capacity, 4), static_heads=st_shape.num_heads,
                           static_intermediate=st_shape.intermediate_size)
        put("wide", wide_v)
        put("wide_eager", wide_eager_v)
        d, w, s = rec.get("dense_inductor_ms"), rec.get("wide_ms"), rec.get("static_ms")
        rec["speedup"] = round(d / w, 4) if d and w else None
        rec["static_speedup"] = round(d / s, 4) if d and s else None
        dcg = rec.get("dense_inductor_cg_ms")
        rec["speedup_vs_graphed_default"] = round(dcg / w, 4) if dcg and w else None
        ma = rec.get("dense_max_autotune_ms")
        rec["speedup_vs_max_autotune"] = round(ma / w, 4) if ma and w else None
        R.add_best_dense(rec)
        rec["wide_over_static"] = round(w / s, 4) if w and s else None
        rec["peak_mem_mb"] = rec.get("wide_peak_mem_mb")
        rec["compile_s"] = rec.get("wide_compile_s")
        if measured:
            rec["measured_capacity"] = measured["overall"]
            rec["measured_capacity_attn"] = measured["attn"]
            rec["measured_capacity_ffn"] = measured["ffn"]
        if routers is not None:
            rec["calibrated_capacity"] = getattr(routers, "calib_capacity", None)
            rec["ffn_group_size"] = routers.cfg.ffn_group_size
            rec["head_group_size"] = routers.cfg.head_group_size
        if rec["masks"] == "correlated" and self.mask_model and rec["capacity"] < 0.9999:
            rec["mask_model"] = {k: v for k, v in self.mask_model.items() if k != "fit"}
        if shared_measurement:
            rec["masks_note"] = "capacity 1.0: every group on (all-on routers); one measurement for all mask types"
        rec["recompiled_during_timing"] = bool(recompiled)
        if rw.get("check"):
            rec["wide_check"] = rw["check"]
        if rw.get("replay_check"):
            rec["wide_replay_check"] = rw["replay_check"]
        rec["errors"] = rw["errors"]
        rec["skipped"] = rw["skipped"]
        if prof:
            rec["profile"] = prof

    def profile(self, phase, tokens, batch, cap, masks, variants: dict) -> dict:
        out = {}
        lines = [f"\n===== {self.name} layers={self.layers} {phase} tokens={tokens} batch={batch} "
                 f"capacity={cap} masks={masks} ====="]
        for name, v in variants.items():
            if v is None:
                continue
            step = v.info.get("raw_step", v.step)  # profile kernels outside the CUDA graph
            try:
                table, cats = profile_step(step, v.reset, self.ctx.device, n=self.ctx.args.profile_steps)
                out[name] = cats
                lines += [f"--- {name} ---", table]
            except Exception as e:  # noqa: BLE001
                lines.append(f"--- {name}: profile failed: {type(e).__name__}: {e}")
        text = "\n".join(lines)
        print(text, flush=True)
        with open(self.ctx.profile_path, "a") as f:
            f.write(text + "\n")
        return out


# -- CLI ----------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=None, help=f"subset of {MODELS} (default: all)")
    p.add_argument("--phases", nargs="+", default=["prefill", "decode"], choices=["prefill", "decode"])
    p.add_argument("--capacities", nargs="+", type=float, default=None, help="default 1.0 0.75 0.5 0.3")
    p.add_argument("--masks", nargs="+", default=["random", "correlated"],
                   help="random, correlated, trained (trained: real SmolLM2 only; added automatically there)")
    p.add_argument("--prefill-tokens", nargs="+", type=int, default=None, help="default 512 2048 8192")
    p.add_argument("--prefill-batch", nargs="+", type=int, default=None, help="default 1 4")
    p.add_argument("--decode-ctx", nargs="+", type=int, default=None, help="default 1024 4096")
    p.add_argument("--decode-batch", nargs="+", type=int, default=None, help="default 1 8")
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers of the random-weight models (default: the real depth 32/28/30)")
    p.add_argument("--variants", nargs="+", default=None, choices=ALL_VARIANTS,
                   help="default: all (--quick: all but max_autotune, whose GEMM autotuning alone takes minutes)")
    p.add_argument("--quick", action="store_true",
                   help="8B shape, 8 layers, prefill 2048 b1, decode ctx 1024 b1, capacities 1.0 0.5, "
                        "random+correlated (< 5 min on an H200)")
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU (tests); not a measurement")
    p.add_argument("--smoke-inductor", action="store_true", help="in --smoke, use real Inductor (slow on CPU)")
    p.add_argument("--out", default=str(_HERE / "results"))
    p.add_argument("--name", default=None, help="output file stem (default e2e-h200, or e2e-smoke)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="stop starting new variants/rows once this many seconds have passed")
    p.add_argument("--no-budget-split", action="store_true",
                   help="let the first (model, phase) use the whole --time-budget-s (default: each gets a share)")
    p.add_argument("--resume", action="store_true", help="load <out>/<name>.json and skip rows already complete")
    p.add_argument("--check-replay", action="store_true",
                   help="per row, also compare compiled WIDE with its eager reference on replayed masks (one more "
                        "WIDE compile per row): kernel error alone, no router decision can flip")
    p.add_argument("--profile", action="store_true",
                   help="torch.profiler table of the top kernels of the WIDE / static / dense steps per row")
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    p.add_argument("--target-s", type=float, default=1.0, help="seconds of timed steps per variant and row")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--calib-tokens", type=int, default=1024, help="tokens used to calibrate routers")
    p.add_argument("--ffn-group-size", type=int, default=64)
    p.add_argument("--head-group-size", type=int, default=1)
    p.add_argument("--smollm2-ffn-group-size", type=int, default=64)
    p.add_argument("--smollm2-head-group-size", type=int, default=1)
    p.add_argument("--smollm2-weights", choices=["auto", "random"], default="auto",
                   help="auto: the real SmolLM2 if it loads without network, else its shape with random weights")
    p.add_argument("--smollm2-gguf", default=None, help="path of SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--text-file", default=None,
                   help="text (.txt or .jsonl[.gz] with 'text') for the real SmolLM2 / trained-router statistics")
    p.add_argument("--no-trained-stats", action="store_true",
                   help="do not fit correlated masks to trained routers; use the synthetic defaults")
    p.add_argument("--no-trained-masks", action="store_true")
    p.add_argument("--wide-backend", default="wide", help="dynamo backend name for the WIDE variant")
    p.add_argument("--wide-entry", choices=["backend", "optimize"], default="backend",
                   help="backend: torch.compile(model, backend=...); optimize: wide_compile.optimize(model, routers)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="decode without manual CUDA graphs")
    p.add_argument("--router-dtype", choices=["float32", "model", "bf16x2"], default="float32",
                   help="router weights in fp32 (as trained; cuBLAS runs them without tensor cores) or in the "
                        "model dtype (tensor cores; on SmolLM2 0.7%% / 1.0%% of attention / FFN decisions change, "
                        "capacity 0.5091 -> 0.5093); bf16x2: fp32 weights split in a bf16 pair, one tensor-core "
                        "GEMM with fp32 output (fp32 decisions up to rounding)")
    p.add_argument("--wide-decode-mode", choices=["manual-graph", "reduce-overhead", "none"], default="manual-graph",
                   help="WIDE decode: capture the compiled step in a CUDA graph here (default), or pass "
                        "mode='reduce-overhead' to the wide backend (Inductor CUDA graphs), or no graphs")
    p.add_argument("--correlated-capacities", nargs="+", type=float, default=None,
                   help="time the non-random mask kinds only at these capacities (random at every one): the "
                        "correlated rows cost as much as the random ones and change little (e2e-h200.md)")
    p.add_argument("--kernel-config", default=None, metavar="JSON",
                   help='WIDE kernel config changes per phase for the whole run, e.g. \'{"decode": {"lists": "none"}}\' '
                        "(wide_compile.kernels.compact_mlp.set_default_overrides; recorded in every record)")
    p.add_argument("--attention", default="sdpa", choices=ATTENTIONS,
                   help="attention of every variant: transformers' SDPA path (default; compiled models get an "
                        "explicit causal mask on torch < 2.14), or sdpa_unpadded: SDPA's causal kernel wherever "
                        "queries and keys have the same length (unpadded prefill; e2e/attention.py)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--reset-mem-frac", type=float, default=0.6,
                   help="after a row, if more than this fraction of GPU memory is allocated, reset Dynamo "
                        "(frees compiled WIDE graphs) and re-prepare the dense reference")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failures")
    a = p.parse_args(argv)
    def dflt(name, value):
        if getattr(a, name) is None:
            setattr(a, name, value)

    if a.quick:
        a.models = a.models or ["llama-3.1-8b"]
        a.layers = a.layers or 8
        dflt("prefill_tokens", [2048]), dflt("prefill_batch", [1])
        dflt("decode_ctx", [1024]), dflt("decode_batch", [1])
        dflt("capacities", [0.5, 1.0])  # the goal rows first
        dflt("variants", [v for v in ALL_VARIANTS if v != "max_autotune"])
        dflt("time_budget_s", 240.0)
        a.target_s = min(a.target_s, 0.6)
    if a.smoke:
        a.models = ["tiny"]
        a.device = a.device or "cpu"
        a.dtype = "fp32" if a.device == "cpu" else a.dtype
        dflt("prefill_tokens", [16]), dflt("prefill_batch", [1, 2])
        dflt("decode_ctx", [16]), dflt("decode_batch", [1])
        dflt("capacities", [1.0, 0.5])
        a.rounds, a.target_s, a.warmup, a.calib_tokens = 2, 0.02, 1, 64
        a.no_trained_stats = True
        a.ffn_group_size = 16
        a.smollm2_weights = "random"
    dflt("prefill_tokens", [512, 2048, 8192]), dflt("prefill_batch", [1, 4])
    dflt("decode_ctx", [1024, 4096]), dflt("decode_batch", [1, 8])
    dflt("capacities", [1.0, 0.75, 0.5, 0.3])
    dflt("variants", list(ALL_VARIANTS))
    if a.smoke and torch.device(a.device).type == "cpu":
        torch.set_num_threads(min(2, torch.get_num_threads()))  # tiny shapes: OpenMP spinning only hurts
    a.models = a.models or list(MODELS)
    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    a.name = a.name or ("e2e-smoke" if a.smoke else "e2e-h200")
    return a


def main(argv=None) -> dict:
    a = parse_args(argv)
    global _TEXT_FILE
    _TEXT_FILE = a.text_file or default_text_file()
    set_dynamo_limits()
    MD.set_attention(a.attention)  # before any model is built: every variant runs the same attention
    torch.manual_seed(a.seed)
    if a.kernel_config:
        from wide_compile.kernels.compact_mlp import set_default_overrides

        kc = json.loads(a.kernel_config)
        if not isinstance(kc, dict) or set(kc) - {"decode", "prefill"}:
            raise SystemExit('--kernel-config: a JSON object with "decode" and/or "prefill" keys')
        set_default_overrides(**kc)
    ctx = Ctx(a)
    ctx.meta["text_file"] = _TEXT_FILE  # the real model's prompt text (None: the built-in paragraph)
    log(f"bench_e2e: {ctx.meta['gpu'] or a.device} torch {ctx.meta['torch']} triton {ctx.meta['triton']} "
        f"transformers {ctx.meta['transformers']}; models {a.models}; phases {a.phases}; caps {a.capacities}; "
        f"masks {a.masks}; variants {a.variants}; layers {a.layers or 'full'}; budget {a.time_budget_s}")
    if not is_cuda(a.device):
        log("  NOTE: not on CUDA: timings are meaningless (smoke/plumbing only)")
    for why, what in ((wide_backend_status(a.wide_backend), "wide"), (trt_status(), "trt")):
        if why and what in a.variants:
            ctx.skip(f"{what}: {why}")
    ctx.write()
    units = [(m, ph) for m in a.models for ph in a.phases]
    for name in a.models:
        ctx.deadline = None
        if ctx.over_budget():
            ctx.skip(f"{name}: time budget exceeded before start")
            continue
        mb = None
        try:
            mb = ModelBench(ctx, name)
            for phase in a.phases:
                if a.time_budget_s is not None and not a.no_budget_split:
                    # each (model, phase) may use the budget up to its share's end, so a slow first phase
                    # cannot starve the others; time a fast one leaves over goes to the next
                    ctx.deadline = a.time_budget_s * (units.index((name, phase)) + 1) / len(units)
                work = ([(t, b) for t in a.prefill_tokens for b in a.prefill_batch] if phase == "prefill"
                        else [(t, b) for t in a.decode_ctx for b in a.decode_batch])
                for tokens, batch in work:
                    if ctx.over_budget():
                        ctx.skip(f"{name} {phase} tokens={tokens} batch={batch}: time budget exceeded")
                        continue
                    try:
                        mb.run_workload(phase, tokens, batch)
                    except Exception as e:  # noqa: BLE001
                        ctx.skip(f"{name} {phase} tokens={tokens} batch={batch}: FAILED {type(e).__name__}: "
                                 f"{str(e)[:500]}")
                        traceback.print_exc()
                        torch._dynamo.reset()
                        free(ctx.device)
                    ctx.write()
        except Exception as e:  # noqa: BLE001
            ctx.skip(f"{name}: FAILED {type(e).__name__}: {str(e)[:500]}")
            traceback.print_exc()
        finally:
            del mb
            torch._dynamo.reset()
            free(ctx.device)
    ctx.write()
    if not a.no_plot:
        try:
            png = R.plot(json.loads(ctx.json_path.read_text()), ctx.out / f"{a.name}.png")
            log(f"plot: {png}")
        except Exception as e:  # noqa: BLE001
            log(f"plot failed: {type(e).__name__}: {e}")
    data = json.loads(ctx.json_path.read_text())
    log("\n" + R.markdown(data))
    log(f"wrote {ctx.json_path} ({len(data['records'])} records) in {ctx.elapsed():.0f}s")
    return data


if __name__ == "__main__":
    main()
