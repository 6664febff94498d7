"""Sub-commands of `python -m wide_compile.eval` (see eval_main)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def pipeline(argv):
    from .pipeline import main

    return main(argv)


def prepare(argv):
    from ..training.data import default_data_root
    from .tasks import prepare_tasks

    ap = argparse.ArgumentParser(prog="python -m wide_compile.eval prepare",
                                 description="write normalised task data + lm-eval YAMLs for the local data")
    ap.add_argument("--data", default=None)
    ap.add_argument("--out", required=True)
    ap.add_argument("--limit", type=int, default=None)
    a = ap.parse_args(argv)
    print(json.dumps(prepare_tasks(a.data or default_data_root(), a.out, a.limit)))
    return 0


def _model_args(ap):
    ap.add_argument("--routers", default=None, help="router .safetensors or a shipped name")
    ap.add_argument("--lora", default=None, help="LoRA .safetensors (stage 2) merged before routing")
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--data", default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


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


def ppl(argv):
    from .. import attach
    from ..training.data import default_data_root
    from .perplexity import wikitext2_ppl

    ap = argparse.ArgumentParser(prog="python -m wide_compile.eval ppl")
    _model_args(ap)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--stride", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=None)
    a = ap.parse_args(argv)
    model, tok, r = _load(a)
    if r is not None:
        attach(model, r)
    print(json.dumps(wikitext2_ppl(model, tok, a.data or default_data_root(), ctx=a.ctx, stride=a.stride,
                                   max_tokens=a.max_tokens)))
    return 0


def tasks(argv):
    from .. import attach
    from ..training.data import default_data_root
    from .pipeline import capacity_meter
    from .tasks import evaluate_tasks, prepare_tasks

    ap = argparse.ArgumentParser(prog="python -m wide_compile.eval tasks")
    _model_args(ap)
    ap.add_argument("--tasks-dir", default=None)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=64)
    a = ap.parse_args(argv)
    tdir = Path(a.tasks_dir or "wide_tasks")
    if not (tdir / "counts.json").is_file():
        prepare_tasks(a.data or default_data_root(), tdir, a.limit)
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


def report(argv):
    from .report import write_report

    ap = argparse.ArgumentParser(prog="python -m wide_compile.eval report")
    ap.add_argument("results", help="accuracy-smollm2.json")
    ap.add_argument("--md", default=None)
    ap.add_argument("--png", default=None)
    a = ap.parse_args(argv)
    print(write_report(a.results, a.md, a.png))
    return 0


def merge(argv):
    from .report import markdown_table, merge_runs, plot_stats

    ap = argparse.ArgumentParser(prog="python -m wide_compile.eval merge",
                                 description="merge pipeline results files (first record per key wins; "
                                             "later ones are kept as repeats)")
    ap.add_argument("inputs", nargs="+", help="accuracy-smollm2.json files, oldest first")
    ap.add_argument("--out", required=True)
    ap.add_argument("--md", default=None)
    ap.add_argument("--png", default=None)
    a = ap.parse_args(argv)
    merged = merge_runs([json.loads(Path(p).read_text()) for p in a.inputs])
    Path(a.out).write_text(json.dumps(merged, indent=1))
    md = markdown_table(merged["records"])
    if a.md:
        Path(a.md).write_text(md)
    if a.png and merged["router_stats"]:
        plot_stats(merged["router_stats"], a.png)
    print(md)
    return 0
