"""The options of one bench_e2e run: one dataclass, built from argparse, with the presets (--quick, --smoke)
applied and every value checked once, so the rest of the harness reads plain fields.

The field names are argparse's dest names: records store `dataclasses.asdict(options)` under "options"
(and `kernel_config`, `router_dtype`, `attention` per record), and older result files carry the same keys.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from wide_compile.helpfmt import HelpFormatter
from wide_compile.passes.options import PassOptions

from .attention import ATTENTIONS
from .variants import OPT_IN, VARIANTS

MODELS = ("llama-3.1-8b", "llama-3.2-3b", "smollm2-135m")
SMOKE_MODEL = "tiny"  # --smoke: the CPU test shape of e2e/models.SHAPES
MASKS = ("random", "correlated", "trained")
STRUCTURED_MASKS = ("codebook", "nested")  # with a size: codebook16 = 16 prototypes, nested8 = 8 width levels
PHASES = ("prefill", "decode")
DTYPES = ("bf16", "fp16", "fp32")
KERNEL_CONFIG_PHASES = ("decode", "prefill")
RESULTS = Path(__file__).resolve().parents[1] / "results"
PASS_DEFAULTS = PassOptions()

# the full table; --quick and --smoke replace the ones they set
DEFAULTS = {"prefill_tokens": [512, 2048, 8192], "prefill_batch": [1, 4], "decode_ctx": [1024, 4096],
            "decode_batch": [1, 8], "capacities": [1.0, 0.75, 0.5, 0.3]}


class OptionsError(ValueError):
    """A bad option value; the message names the option and what to pass instead."""


@dataclasses.dataclass
class BenchOptions:
    models: list[str] | None = None
    phases: list[str] = dataclasses.field(default_factory=lambda: list(PHASES))
    capacities: list[float] | None = None
    masks: list[str] = dataclasses.field(default_factory=lambda: ["random", "correlated"])
    prefill_tokens: list[int] | None = None
    prefill_batch: list[int] | None = None
    decode_ctx: list[int] | None = None
    decode_batch: list[int] | None = None
    layers: int | None = None
    variants: list[str] | None = None
    quick: bool = False
    smoke: bool = False
    smoke_inductor: bool = False
    out: str = str(RESULTS)
    name: str | None = None
    device: str | None = None
    dtype: str = "bf16"
    time_budget_s: float | None = None
    no_budget_split: bool = False
    resume: bool = False
    check_replay: bool = False
    profile: bool = False
    profile_steps: int = 5
    rounds: int = 5
    target_s: float = 1.0
    warmup: int = 3
    calib_tokens: int = 1024
    ffn_group_size: int = 64
    head_group_size: int = 1
    smollm2_ffn_group_size: int = 64
    smollm2_head_group_size: int = 1
    smollm2_router_recipe: str = "wide"
    smollm2_weights: str = "auto"
    smollm2_gguf: str | None = None
    text_file: str | None = None
    no_trained_stats: bool = False
    no_trained_masks: bool = False
    no_lora: bool = False
    wide_backend: str = "wide"
    wide_entry: str = "backend"
    no_cuda_graphs: bool = False
    prefill_cuda_graphs: bool = False
    router_dtype: str = "float32"
    wide_decode_mode: str = "manual-graph"
    correlated_capacities: list[float] | None = None
    kernel_config: str | None = None
    attention: str = "sdpa"
    # which optional passes the WIDE variants run (wide_compile.passes.PassOptions: its defaults, so a run without
    # flags times optimize's defaults; the records store them per row); the order is the parser's
    sparse_attention: bool | str = PASS_DEFAULTS.sparse_attention
    kernel_path: str = "auto"
    fuse_norm_router: bool | str = PASS_DEFAULTS.fuse_norm_router
    sum_routers: bool = PASS_DEFAULTS.sum_routers
    fuse_qkv: bool = PASS_DEFAULTS.fuse_qkv
    compose_routers: bool = PASS_DEFAULTS.compose_routers
    split_routers: bool = PASS_DEFAULTS.split_routers
    fuse_router_select: bool = PASS_DEFAULTS.fuse_router_select
    fuse_gate_up: bool = PASS_DEFAULTS.fuse_gate_up
    fuse_router_gemm: bool = PASS_DEFAULTS.fuse_router_gemm
    bucket_ops: bool = PASS_DEFAULTS.bucket_ops
    no_plot: bool = False
    reset_mem_frac: float = 0.6
    seed: int = 0
    verbose: bool = False

    # -- presets ---------------------------------------------------------------------------------
    def _default(self, name: str, value) -> None:
        if getattr(self, name) is None:
            setattr(self, name, value)

    def _apply_quick(self) -> None:
        """8B shape at 8 layers, the goal workloads only, no max-autotune (its GEMM autotuning alone
        outlasts the rest of the run), a time budget."""
        self.models = self.models or ["llama-3.1-8b"]
        self.layers = self.layers or 8
        for k, v in (("prefill_tokens", [2048]), ("prefill_batch", [1]), ("decode_ctx", [1024]),
                     ("decode_batch", [1]), ("capacities", [0.5, 1.0])):  # the goal rows first
            self._default(k, v)
        self._default("variants", [v for v in VARIANTS if v != "max_autotune" and v not in OPT_IN])
        self._default("time_budget_s", 240.0)
        self.target_s = min(self.target_s, 0.6)

    def _apply_smoke(self) -> None:
        """The tiny model on the CPU with a few short rounds: exercises the plumbing, measures nothing."""
        self.models = [SMOKE_MODEL]
        self.device = self.device or "cpu"
        self.dtype = "fp32" if self.device == "cpu" else self.dtype
        for k, v in (("prefill_tokens", [16]), ("prefill_batch", [1, 2]), ("decode_ctx", [16]),
                     ("decode_batch", [1]), ("capacities", [1.0, 0.5])):
            self._default(k, v)
        self.rounds, self.target_s, self.warmup, self.calib_tokens = 2, 0.02, 1, 64
        self.no_trained_stats = True
        self.ffn_group_size = 16
        self.smollm2_weights = "random"

    def resolve(self, cuda_available: bool) -> "BenchOptions":
        """Apply the presets and the defaults, then check every value (OptionsError names the bad one)."""
        if self.quick:
            self._apply_quick()
        if self.smoke:
            self._apply_smoke()
        for k, v in DEFAULTS.items():
            self._default(k, list(v))
        self._default("variants", [v for v in VARIANTS if v not in OPT_IN])
        self.models = self.models or list(MODELS)
        self.device = self.device or ("cuda" if cuda_available else "cpu")
        self.name = self.name or ("e2e-smoke" if self.smoke else "e2e-h200")
        self.validate()
        return self

    # -- checks ----------------------------------------------------------------------------------
    def validate(self) -> None:
        known = MODELS + ((SMOKE_MODEL,) if self.smoke else ())
        bad = [m for m in self.models if m not in known]
        if bad:
            raise OptionsError(f"--models {' '.join(bad)}: unknown; choose from {' '.join(MODELS)} "
                               "(--smoke runs the tiny CPU model)")
        for flag, caps in (("--capacities", self.capacities), ("--correlated-capacities", self.correlated_capacities)):
            if caps is not None and not all(0.0 < c <= 1.0 for c in caps):
                raise OptionsError(f"{flag} {caps}: each capacity is a FLOP fraction in (0, 1]")
        for flag, vals in (("--prefill-tokens", self.prefill_tokens), ("--prefill-batch", self.prefill_batch),
                           ("--decode-ctx", self.decode_ctx), ("--decode-batch", self.decode_batch)):
            if not all(v >= 1 for v in vals):
                raise OptionsError(f"{flag} {vals}: sizes are positive integers")
        if self.warmup < 0:
            raise OptionsError(f"--warmup {self.warmup}: a number of untimed steps, >= 0")
        for flag, v in (("--layers", self.layers), ("--rounds", self.rounds),
                        ("--calib-tokens", self.calib_tokens), ("--profile-steps", self.profile_steps),
                        ("--ffn-group-size", self.ffn_group_size), ("--head-group-size", self.head_group_size),
                        ("--smollm2-ffn-group-size", self.smollm2_ffn_group_size),
                        ("--smollm2-head-group-size", self.smollm2_head_group_size)):
            if v is not None and v < 1:
                raise OptionsError(f"{flag} {v}: must be at least 1")
        if self.target_s <= 0:
            raise OptionsError(f"--target-s {self.target_s}: seconds of timed steps, > 0")
        if self.time_budget_s is not None and self.time_budget_s < 0:
            raise OptionsError(f"--time-budget-s {self.time_budget_s}: >= 0 seconds")
        if not 0.0 < self.reset_mem_frac <= 1.0:
            raise OptionsError(f"--reset-mem-frac {self.reset_mem_frac}: a fraction of GPU memory in (0, 1]")
        import torch

        try:
            torch.device(self.device)
        except (RuntimeError, ValueError) as e:
            raise OptionsError(f"--device {self.device!r}: not a torch device ({e}); e.g. cuda, cuda:1, cpu") from e
        self.kernel_overrides()  # parses and checks --kernel-config

    def kernel_overrides(self) -> dict:
        """--kernel-config as {phase: {field: value}} ({} when unset)."""
        if not self.kernel_config:
            return {}
        hint = ' e.g. \'{"decode": {"lists": "none"}}\''
        try:
            kc = json.loads(self.kernel_config)
        except json.JSONDecodeError as e:
            raise OptionsError(f"--kernel-config: not JSON ({e});{hint}") from e
        if not isinstance(kc, dict) or set(kc) - set(KERNEL_CONFIG_PHASES) or \
                not all(isinstance(v, dict) for v in kc.values()):
            raise OptionsError(f'--kernel-config: a JSON object with "decode" and/or "prefill" keys, each an '
                               f"object of kernel config fields;{hint}")
        return kc

    def router_recipe(self, model: str) -> str:
        """The WideConfig.router_recipe of the random / structured routers on `model`."""
        return self.smollm2_router_recipe if model == "smollm2-135m" else "linear"

    def group_sizes(self, model: str) -> tuple[int, int]:
        """(ffn_group_size, head_group_size) of the routers on `model`."""
        if model == "smollm2-135m":
            return self.smollm2_ffn_group_size, self.smollm2_head_group_size
        return self.ffn_group_size, self.head_group_size


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=HelpFormatter)
    p.add_argument("--models", nargs="+", default=None, help=f"subset of {MODELS} (default: all)")
    p.add_argument("--phases", nargs="+", default=list(PHASES), choices=PHASES, help="phases to time")
    p.add_argument("--capacities", nargs="+", type=float, default=None, help="default 1.0 0.75 0.5 0.3")
    p.add_argument("--masks", nargs="+", default=["random", "correlated"], type=mask_kind, metavar="KIND",
                   help="random, correlated, trained (trained: real SmolLM2 only; added automatically there), "
                        "codebookP (random codebook routers, P prototypes per layer, e.g. codebook16; the pass "
                        "runs them on the bucketed ops) or nestedL (nested routers with L width levels)")
    p.add_argument("--prefill-tokens", nargs="+", type=int, default=None, help="default 512 2048 8192")
    p.add_argument("--prefill-batch", nargs="+", type=int, default=None, help="default 1 4")
    p.add_argument("--decode-ctx", nargs="+", type=int, default=None, help="default 1024 4096")
    p.add_argument("--decode-batch", nargs="+", type=int, default=None, help="default 1 8")
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers of the random-weight models (default: the real depth 32/28/30)")
    p.add_argument("--variants", nargs="+", default=None, choices=tuple(VARIANTS),
                   help="default: all (--quick: all but max_autotune, whose GEMM autotuning is the slowest step)")
    p.add_argument("--quick", action="store_true",
                   help="8B shape, 8 layers, prefill 2048 b1, decode ctx 1024 b1, capacities 1.0 0.5, "
                        "random+correlated, a 240 s budget")
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU (tests); not a measurement")
    p.add_argument("--smoke-inductor", action="store_true", help="in --smoke, use real Inductor (slow on CPU)")
    p.add_argument("--out", default=str(RESULTS), help="folder of the results files")
    p.add_argument("--name", default=None, help="output file stem (default e2e-h200, or e2e-smoke)")
    p.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--dtype", default="bf16", choices=DTYPES, help="model dtype")
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
    p.add_argument("--profile-steps", type=int, default=5, help="steps per --profile table")
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    p.add_argument("--target-s", type=float, default=1.0, help="seconds of timed steps per variant and row")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps after the first call")
    p.add_argument("--calib-tokens", type=int, default=1024, help="tokens used to calibrate routers")
    p.add_argument("--ffn-group-size", type=int, default=64, help="FFN channels per router group")
    p.add_argument("--head-group-size", type=int, default=1, help="query heads per router group")
    p.add_argument("--smollm2-ffn-group-size", type=int, default=64, help="the same for SmolLM2")
    p.add_argument("--smollm2-head-group-size", type=int, default=1, help="the same for SmolLM2")
    p.add_argument("--smollm2-router-recipe", choices=["linear", "wide"], default="wide",
                   help="the SmolLM2 rows' random / structured routers: wide, the shipped routers' form (pair "
                        "routers of rank router_rank on the residual stream), or linear (D -> G on the normed input, "
                        "as every row of the 8B-shape models); each record says which (router_recipe)")
    p.add_argument("--smollm2-weights", choices=["auto", "random"], default="auto",
                   help="auto: the real SmolLM2 if it loads without network, else its shape with random weights")
    p.add_argument("--smollm2-gguf", default=None, help="path of SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--text-file", default=None,
                   help="text (.txt or .jsonl[.gz] with 'text') for the real SmolLM2 / trained-router statistics "
                        "(default: WikiText-2 valid under the data root, if present)")
    p.add_argument("--no-trained-stats", action="store_true",
                   help="do not fit correlated masks to trained routers; use the synthetic defaults")
    p.add_argument("--no-trained-masks", action="store_true",
                   help="on the real SmolLM2, do not add the 'trained' mask rows")
    p.add_argument("--no-lora", action="store_true",
                   help="time the shipped SmolLM2 routers on the dense weights, without their stage-2 LoRA merged "
                        "(default: merged into the WIDE model, as the product runs them; their masks differ)")
    p.add_argument("--wide-backend", default="wide", help="dynamo backend name for the WIDE variant")
    p.add_argument("--wide-entry", choices=["backend", "optimize"], default="backend",
                   help="backend: torch.compile(model, backend=...); optimize: wide_compile.optimize(model, routers)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="decode without manual CUDA graphs")
    p.add_argument("--prefill-cuda-graphs", action="store_true",
                   help="prefill in CUDA graphs too, as decode (dense and static: mode='reduce-overhead'; WIDE: the "
                        "--wide-decode-mode capture): the device time of the step without the host's launch cost, "
                        "which bounds a small model's prefill")
    p.add_argument("--router-dtype", choices=["float32", "model", "bf16x2"], default="float32",
                   help="router weights in fp32 (as trained; cuBLAS runs them without tensor cores), or in the "
                        "model dtype (tensor cores; decisions near 0 can change, see results/router-dtype), "
                        "or bf16x2: fp32 weights split in a bf16 pair, one tensor-core GEMM with fp32 output "
                        "(fp32 decisions up to rounding)")
    p.add_argument("--wide-decode-mode", choices=["manual-graph", "reduce-overhead", "none"], default="manual-graph",
                   help="WIDE decode: capture the compiled step in a CUDA graph here (default), or pass "
                        "mode='reduce-overhead' to the wide backend (Inductor CUDA graphs), or no graphs")
    p.add_argument("--correlated-capacities", nargs="+", type=float, default=None,
                   help="time the non-random mask kinds only at these capacities (random at every one): a "
                        "correlated row costs as much as a random one")
    p.add_argument("--kernel-config", default=None, metavar="JSON",
                   help="WIDE kernel config changes per phase for the whole run, e.g. "
                        '\'{"decode": {"lists": "none"}}\' (recorded in every record)')
    p.add_argument("--attention", default="sdpa", choices=ATTENTIONS,
                   help="attention of every variant: transformers' SDPA path (default; compiled models get an "
                        "explicit causal mask on torch < 2.14), or sdpa_unpadded: SDPA's causal kernel wherever "
                        "queries and keys have the same length (unpadded prefill), or gqa_decode: sdpa_unpadded "
                        "with decode through wide.attn_decode's kernel, every head on (e2e/attention.py)")
    p.add_argument("--sparse-attention", dest="sparse_attention", action="store_const", const=True, default="auto",
                   help="WIDE's attention runs only the active head groups wherever the grouping allows it "
                        "(optimize(..., sparse_attention=True)); default optimize's \"auto\" (every decode step, "
                        "prefills of KV-aligned groups)")
    p.add_argument("--dense-attention", dest="sparse_attention", action="store_const", const=False,
                   help="WIDE's attention stays dense sdpa (optimize(..., sparse_attention=False))")
    p.add_argument("--kernel-path", default="auto", choices=("auto", "table", "dense", "compact"),
                   help="the path of each routed projection (optimize(..., kernel_path=)): the cost model's choice "
                        "per token count (auto), the tuning table's, or forced dense-masked / compact; the choice "
                        "per row is the table's path column")
    p.add_argument("--fuse-norm-router", action="store_true",
                   help="each block's RMSNorm and router in one launch (optimize(..., fuse_norm_router=True))")
    p.add_argument("--no-sum-routers", dest="sum_routers", action="store_false",
                   help="decode-size routers as fp32 GEMMs, not Inductor reductions (optimize(..., sum_routers=False))")
    p.add_argument("--no-fuse-qkv", dest="fuse_qkv", action="store_false",
                   help="K / V as their own linears, not in q's launch (optimize(..., fuse_qkv=False))")
    p.add_argument("--no-compose-routers", dest="compose_routers", action="store_false",
                   help="pair routers as their two layers (optimize(..., compose_routers=False))")
    p.add_argument("--no-split-routers", dest="split_routers", action="store_false",
                   help="prefill-size routers as fp32 GEMMs, not over a bf16 pair (optimize(..., split_routers=False))")
    p.add_argument("--fuse-router-select", action="store_true",
                   help="a split router read by one dense-masked select runs in that select's launch "
                        "(optimize(..., fuse_router_select=True))")
    p.add_argument("--fuse-gate-up", action="store_true",
                   help="gate and up as one GEMM on the dense-masked path (optimize(..., fuse_gate_up=True))")
    p.add_argument("--no-fuse-router-gemm", dest="fuse_router_gemm", action="store_false",
                   help="prefill-size routers as their own GEMMs, not as extra columns of the projection GEMM after "
                        "their norm (optimize(..., fuse_router_gemm=False))")
    p.add_argument("--bucket-ops", action="store_true",
                   help="structured (codebook / nested) routers on their bucket ops, not the free-mask ops "
                        "(optimize(..., bucket_ops=True))")
    p.add_argument("--no-plot", action="store_true", help="do not draw <name>.png")
    p.add_argument("--reset-mem-frac", type=float, default=0.6,
                   help="after a row, if more than this fraction of GPU memory is allocated, reset Dynamo "
                        "(frees compiled WIDE graphs) and re-prepare the dense reference")
    p.add_argument("--seed", type=int, default=0, help="seed of weights, inputs and routers")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failures")
    return p


def mask_kind(text: str) -> str:
    """A --masks value: one of MASKS, or a structured kind with its size (codebook16, nested8)."""
    if text in MASKS or structured_kind(text) is not None:
        return text
    raise argparse.ArgumentTypeError(f"{text!r}: expected one of {', '.join(MASKS)}, or codebookP / nestedL with "
                                     "a size >= 2 (e.g. codebook16, nested8)")


def structured_kind(text: str) -> tuple[str, int] | None:
    """'codebook16' -> ('codebook', 16); None when `text` is not a structured kind with a size >= 2."""
    for s in STRUCTURED_MASKS:
        rest = text[len(s):]
        if text.startswith(s) and rest.isdigit() and int(rest) >= 2:
            return s, int(rest)
    return None


def parse_options(argv=None, description: str | None = None) -> BenchOptions:
    """argv -> resolved, checked BenchOptions; a bad value exits with one argparse error line."""
    import torch

    p = build_parser(description)
    ns = p.parse_args(argv)
    try:
        return BenchOptions(**vars(ns)).resolve(torch.cuda.is_available())
    except OptionsError as e:
        p.error(str(e))
