"""`wide`: the command-line front end (demo, train, eval, bench, inspect)."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

DEFAULT_PROMPT = "Explain in two sentences why the sky is blue."
REPO_ROOT = Path(__file__).resolve().parent.parent


class CLIError(RuntimeError):
    """An error with a message meant for the user (printed without a traceback)."""


# -- helpers ---------------------------------------------------------------------------------------
def _device(name: str):
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise CLIError(f"--device {name} was asked for, but this machine has no CUDA GPU (torch "
                       f"{torch.__version__}). Run with --device cpu: the CPU runs WIDE's reference path, which "
                       "is exact but not faster than dense; speed needs the GPU kernels.")
    return name


def _routers_for(model, name: str | None, capacity: float | None):
    """Shipped routers by name (default: the one closest to --capacity), else untrained (said loudly)."""
    import wide_compile as wc

    avail = wc.Routers.available()
    if name:
        return wc.Routers.pretrained(name, model), f"shipped routers '{name}'"
    if avail:
        def nominal(n):
            digits = "".join(ch for ch in n.rsplit("c", 1)[-1] if ch.isdigit())
            return int(digits) / 100 if digits else 1.0

        target = 0.5 if capacity is None else capacity
        for cand in sorted(avail, key=lambda n: abs(nominal(n) - target)):
            try:  # only routers made for this model's shape qualify
                return wc.Routers.pretrained(cand, model), f"shipped routers '{cand}'"
            except ValueError:
                continue
    cfg = wc.WideConfig(capacity=capacity or 0.5, router_init="random")
    return wc.Routers.init(model, cfg), "UNTRAINED random routers (no shipped routers fit this model)"


def _shipped_lora(routers):
    from wide_compile import pretrained

    return pretrained.lora_path(routers.name) if routers.name else None


def _colour(frac: float) -> str:
    # fraction of the layer stack a token used -> green (little) .. red (a lot)
    stops = ["green", "chartreuse3", "yellow", "dark_orange", "red"]
    return stops[min(len(stops) - 1, max(0, int(frac * len(stops))))]


# -- demo ------------------------------------------------------------------------------------------
def cmd_demo(args) -> int:
    import torch
    from rich.console import Console
    from rich.text import Text

    import wide_compile as wc
    from wide_compile.models import load_smollm2
    from wide_compile.routing import per_token_capacity, record_masks

    con = Console()
    dev = _device(args.device)
    dtype = torch.bfloat16 if dev.startswith("cuda") else torch.float32
    con.print(f"[bold]wide demo[/] on {dev} ({dtype}) — loading SmolLM2-135M-Instruct ...")
    model, tok = load_smollm2(dtype=dtype, device=dev, gguf_path=args.gguf)
    routers, what = _routers_for(model, args.routers, args.capacity)
    con.print(f"routers: {what}")
    msgs = [{"role": "user", "content": args.prompt}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) if tok.chat_template else args.prompt
    ids = tok(text, return_tensors="pt").input_ids.to(dev)
    gen_kw = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)

    def timed(fn):
        if dev.startswith("cuda"):
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn()
        if dev.startswith("cuda"):
            torch.cuda.synchronize()
        return out, time.perf_counter() - t

    model.generate(ids, **{**gen_kw, "max_new_tokens": 2})  # warm-up
    dense_out, dense_s = timed(lambda: model.generate(ids, **gen_kw))
    lora = _shipped_lora(routers) if not args.no_lora else None
    if lora is not None:  # the stage-2 model: its LoRA merged into the weights, then routed
        from wide_compile.training.stage2 import load_lora_merged

        model = load_lora_merged(model, lora)
        con.print(f"stage-2 LoRA merged: {lora.name}")
    wc.attach(model, routers)
    if dev.startswith("cuda") and not args.no_compile:
        runner = wc.optimize(model)
        runner.generate(ids, **gen_kw)  # compile + warm-up
    else:
        runner = model
        runner.generate(ids, **{**gen_kw, "max_new_tokens": 2})  # warm-up
    with record_masks(model) as rec:
        out, wide_s = timed(lambda: runner.generate(ids, **gen_kw))
    new = out[0, ids.shape[1]:]
    per_tok = per_token_capacity(routers, rec).cpu()
    # prefill positions come first, then one position per decode step: the generated token at step j was
    # *produced* by position (prompt_len - 1 + j); colour each generated token by the cost of computing it.
    n_prompt = ids.shape[1]
    costs = per_tok[n_prompt - 1: n_prompt - 1 + len(new)]
    line = Text()
    for t, c in zip(new.tolist(), costs.tolist()):
        line.append(tok.decode([t]), style=_colour(c))
    con.print("\n[bold]generation[/] (colour = share of the layer stack used to produce each token: "
              "[green]little[/] → [red]all[/]):")
    con.print(line)
    cap = wc.measure_capacity(model, out)
    con.print(f"\nmeasured capacity on prompt+generation: overall {cap['overall']:.3f} "
              f"(attention {cap['attn']:.3f}, FFN {cap['ffn']:.3f}; routers {cap['router_flops_fraction']:.4f})")
    con.print(f"[bold]dense model[/] for comparison: {tok.decode(dense_out[0, n_prompt:])!r}")
    path = "compiled WIDE (backend='wide', Triton kernels)" if runner is not model else "WIDE eager reference"
    n_dense = dense_out.shape[1] - n_prompt
    # the two runs can stop at different lengths (EOS): compare time per generated token
    dense_tok, wide_tok = dense_s / max(n_dense, 1), wide_s / max(len(new), 1)
    con.print(f"time on {dev}: dense eager {dense_s:.2f} s for {n_dense} new tokens ({1e3 * dense_tok:.1f} ms/token), "
              f"{path} {wide_s:.2f} s for {len(new)} ({1e3 * wide_tok:.1f} ms/token)")
    if runner is not model:
        con.print(f"per-token speedup against dense eager on this GPU: {dense_tok / wide_tok:.2f}× (one run, prompt "
                  "included; `wide bench` measures properly against dense Inductor)")
    else:
        con.print("[dim]On the CPU WIDE runs its exact reference path (every group computed, then masked): it is "
                  "not meant to be faster. Speed comes from the GPU kernels (wide bench).[/]")
    if args.heatmap:
        from wide_compile.viz import skip_heatmap

        skip_heatmap(rec, [tok.decode([t]) for t in out[0].tolist()], args.heatmap)
        con.print(f"per-layer skip heatmap written to {args.heatmap}")
    return 0


# -- inspect ---------------------------------------------------------------------------------------
def _load_named_model(name: str, gguf=None):
    from wide_compile.models import ARCHS, load_smollm2, tiny_model

    if name == "smollm2":
        return load_smollm2(gguf_path=gguf)[0]
    if name.startswith("tiny-") and name[5:] in ARCHS:
        return tiny_model(name[5:])
    raise CLIError(f"unknown model {name!r}: use smollm2 or tiny-<arch> with arch in {ARCHS}")


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


def cmd_bench(args, rest: list[str]) -> int:
    scripts = {"kernels": "bench_kernels.py", "e2e": "bench_e2e.py"}
    script = REPO_ROOT / "benchmarks" / scripts[args.which]
    if not script.is_file():
        raise CLIError(f"{script} not found: `wide bench` runs the benchmark scripts of a source checkout")
    import runpy

    sys.argv = [str(script), *rest]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="wide", description="WIDE dynamic-width inference for Llama-family models")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="routed generation on SmolLM2 with the shipped routers")
    d.add_argument("--prompt", default=DEFAULT_PROMPT)
    d.add_argument("--max-new-tokens", type=int, default=48)
    d.add_argument("--device", default="auto", help="auto (GPU if present), cpu, cuda")
    d.add_argument("--routers", default=None, help="name of shipped routers (see `wide inspect --list`)")
    d.add_argument("--capacity", type=float, default=None, help="pick the shipped routers nearest this capacity")
    d.add_argument("--gguf", default=None, help="path to SmolLM2-135M-Instruct.Q4_1.gguf (else found/fetched)")
    d.add_argument("--heatmap", default=None, help="write a per-layer skip heatmap PNG here")
    d.add_argument("--no-compile", action="store_true", help="on a GPU, run the eager reference instead")
    d.add_argument("--no-lora", action="store_true", help="do not merge the shipped stage-2 LoRA (routers only)")
    i = sub.add_parser("inspect", help="what the WIDE pass detects in a model, layer by layer (no compiling)")
    i.add_argument("--model", default="smollm2", help="smollm2 or tiny-<llama|mistral|qwen2|smollm2>")
    i.add_argument("--routers", default=None)
    i.add_argument("--capacity", type=float, default=None)
    i.add_argument("--gguf", default=None)
    sub.add_parser("train", help="two-stage router training (see `wide train --help`)", add_help=False)
    sub.add_parser("eval", help="perplexity, zero-shot accuracy, baselines (see `wide eval --help`)", add_help=False)
    b = sub.add_parser("bench", help="GPU benchmarks: kernels or end-to-end (see `wide bench e2e --help`)")
    b.add_argument("which", choices=["kernels", "e2e"])
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] == "train":
            return _forward("wide_compile.training", "train_main", argv[1:])
        if argv and argv[0] == "eval":
            return _forward("wide_compile.eval", "eval_main", argv[1:])
        parser = build_parser()
        args, rest = parser.parse_known_args(argv)
        if args.cmd == "bench":
            return cmd_bench(args, rest)
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        return {"demo": cmd_demo, "inspect": cmd_inspect}[args.cmd](args)
    except CLIError as e:
        print(f"wide: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # user-facing errors from the library carry their own fix
        from wide_compile.models import ModelNotFoundError

        if isinstance(e, (ModelNotFoundError, ValueError, FileNotFoundError)):
            print(f"wide: error: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
