"""Sub-commands of `wide eval` (also `python -m wide_compile.eval`): one parser builder and one runner each.

`wide eval` with no sub-command, or with --help, prints every sub-command's options and defaults.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from . import records
from ..helpfmt import HelpFormatter

DATA_HELP = "data root; unset: $WIDE_DATA_DIR, else ../shared/data next to the checkout"


def _parser(name: str, description: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=f"wide eval {name}", description=description, formatter_class=HelpFormatter)


def _model_args(ap):
    ap.add_argument("--routers", default=None, help="router .safetensors or a shipped name (none: dense)")
    ap.add_argument("--lora", default=None, help="LoRA .safetensors (stage 2) merged before routing")
    ap.add_argument("--gguf", default=None, help="SmolLM2 GGUF; unset: $WIDE_SMOLLM2_GGUF, else the cache")
    ap.add_argument("--data", default=None, help=DATA_HELP)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="bf16 on CUDA, fp32 on the CPU")


# -- parsers ----------------------------------------------------------------------------------------
def parser_prepare():
    ap = _parser("prepare", "write normalised task data + lm-eval YAMLs for the local data")
    ap.add_argument("--data", default=None, help=DATA_HELP)
    ap.add_argument("--out", required=True, help="folder for the normalised task files, the YAMLs and counts.json")
    ap.add_argument("--limit", type=int, default=None, help="items per task (seeded random subset); unset: all")
    return ap


def parser_ppl():
    ap = _parser("ppl", "WikiText-2 test perplexity (sliding window) of one model, dense or routed")
    _model_args(ap)
    ap.add_argument("--ctx", type=int, default=1024, help="window (tokens)")
    ap.add_argument("--stride", type=int, default=512, help="window step; every token is scored once")
    ap.add_argument("--max-tokens", type=int, default=None, help="score only the first N test tokens")
    ap.add_argument("--batch-size", type=int, default=16, help="windows per forward")
    return ap


def parser_tasks():
    ap = _parser("tasks", "zero-shot accuracy (lm-eval) of one model on the five local tasks")
    _model_args(ap)
    ap.add_argument("--tasks-dir", default="wide_tasks", help="prepared tasks (made from --data if absent)")
    ap.add_argument("--limit", type=int, default=None, help="items per task when preparing")
    ap.add_argument("--batch-size", type=int, default=64, help="lm-eval batch size")
    return ap


def parser_quality():
    from .quality import __doc__ as doc, add_arguments

    ap = _parser("quality", doc)
    add_arguments(ap)
    return ap


def parser_report():
    ap = _parser("report", "markdown table / PNG from a pipeline results file")
    ap.add_argument("results", help="accuracy-smollm2.json")
    ap.add_argument("--md", default=None, help="also write the markdown table here")
    ap.add_argument("--png", default=None, help="also plot the routers' skip rates here")
    return ap


def parser_merge():
    ap = _parser("merge", "merge pipeline results files (first record per key wins; later ones are kept "
                          "as repeats)")
    ap.add_argument("inputs", nargs="+", help="accuracy-smollm2.json files, oldest first")
    ap.add_argument("--out", required=True, help="the merged results file")
    ap.add_argument("--md", default=None, help="also write the markdown table here")
    ap.add_argument("--png", default=None, help="also plot the routers' skip rates here")
    return ap


def parser_pipeline():
    from .pipeline import build_parser

    return build_parser()


# -- runners ----------------------------------------------------------------------------------------
def _load(a):
    from .. import Routers
    from ..models import load_smollm2
    from ..training.stage2 import load_lora_merged

    dt = torch.bfloat16 if str(a.device).startswith("cuda") else torch.float32
    model, tok = load_smollm2(dtype=dt, device=a.device, gguf_path=a.gguf)
    if a.lora:
        model = load_lora_merged(model, a.lora)
    r = None
    if a.routers:
        r = Routers.load(a.routers, model) if Path(a.routers).is_file() else Routers.pretrained(a.routers, model)
    return model, tok, r


def pipeline(argv):
    from .pipeline import main

    return main(argv)


def prepare(argv):
    from .tasks import data_files, prepare_tasks

    a = parser_prepare().parse_args(argv)
    root = records.require_data(records.data_root(a.data), *data_files())
    print(json.dumps(prepare_tasks(root, a.out, a.limit)))
    return 0


def ppl(argv):
    from .. import attach
    from .perplexity import WIKITEXT2_TEST, wikitext2_ppl

    a = parser_ppl().parse_args(argv)
    root = records.require_data(records.data_root(a.data), WIKITEXT2_TEST)  # before the model loads
    model, tok, r = _load(a)
    if r is not None:
        attach(model, r)
    print(json.dumps(wikitext2_ppl(model, tok, root, ctx=a.ctx, stride=a.stride, batch_size=a.batch_size,
                                   max_tokens=a.max_tokens)))
    return 0


def tasks(argv):
    from .. import attach
    from .capacity import capacity_meter
    from .tasks import data_files, evaluate_tasks, prepare_tasks

    a = parser_tasks().parse_args(argv)
    tdir = Path(a.tasks_dir)
    if not (tdir / "counts.json").is_file():
        root = records.require_data(records.data_root(a.data), *data_files())
        prepare_tasks(root, tdir, a.limit)
    model, tok, r = _load(a)
    if r is not None:
        attach(model, r)
        with capacity_meter(model) as cap:
            res = evaluate_tasks(model, tok, tdir, batch_size=a.batch_size)
        res["capacity"] = cap
    else:
        res = evaluate_tasks(model, tok, tdir, batch_size=a.batch_size)
    print(json.dumps(res, indent=1))
    return 0


def quality(argv):
    from .quality import main

    return main(argv)


def report(argv):
    from .report import write_report

    a = parser_report().parse_args(argv)
    print(write_report(a.results, a.md, a.png))
    return 0


def merge(argv):
    from .report import markdown_table, merge_runs, plot_stats

    a = parser_merge().parse_args(argv)
    merged = merge_runs([json.loads(Path(p).read_text()) for p in a.inputs])
    Path(a.out).write_text(json.dumps(merged, indent=1))
    md = markdown_table(merged["records"])
    if a.md:
        Path(a.md).write_text(md)
    if a.png and merged["router_stats"]:
        plot_stats(merged["router_stats"], a.png)
    print(md)
    return 0


COMMANDS = {  # name -> (parser builder, runner, one-line summary)
    "quality": (parser_quality, quality, "all quality metrics of WIDE against dense (ppl ratio, NLL by "
                                         "position, generation agreement, zero-shot retention)"),
    "ppl": (parser_ppl, ppl, "WikiText-2 perplexity of one model"),
    "tasks": (parser_tasks, tasks, "zero-shot accuracy of one model (lm-eval)"),
    "prepare": (parser_prepare, prepare, "prepare the lm-eval task folder from the local data"),
    "pipeline": (parser_pipeline, pipeline, "the whole accuracy study: train, baselines, evaluate, report"),
    "report": (parser_report, report, "table / plot of a pipeline results file"),
    "merge": (parser_merge, merge, "merge pipeline results files"),
}


def full_help() -> str:
    """Every sub-command with its options and defaults."""
    head = ["usage: wide eval {" + ",".join(COMMANDS) + "} [options]", ""]
    head += [f"  {n:<9} {s}" for n, (_, _, s) in COMMANDS.items()]
    parts = ["\n".join(head)]
    for n, (build, _, _) in COMMANDS.items():
        parts.append("=" * 100 + f"\nwide eval {n}\n" + build().format_help())
    return "\n\n".join(parts)
