"""`wide eval quality`: every quality metric of a WIDE model against its dense model, one JSON record each.

Loads SmolLM2-135M-Instruct (GGUF from --gguf or $WIDE_SMOLLM2_GGUF), builds the dense model and the WIDE
model (the LoRA, if any, merged into a copy, then the routers attached), runs the chosen metrics and writes
<out>/<metric>.json (result + command, machine, date, models, settings) and <out>/summary.md.
Metrics: ppl (WikiText-2 test sliding window, reported as the WIDE/dense ratio), positions (NLL by
position on long articles), generation (greedy agreement with dense on the committed prompt set, dense's NLL
of the answers, the share that loop), zeroshot (lm-eval, retention above chance). The data files are checked
before the model is loaded.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
from pathlib import Path

import torch

from . import records
from ..helpfmt import HelpFormatter
from .perplexity import WIKITEXT2_TEST

METRICS = ("ppl", "positions", "generation", "zeroshot")


@dataclasses.dataclass
class Models:
    dense: torch.nn.Module
    wide: torch.nn.Module  # the dense model itself, or a LoRA-merged copy; routed under `routed(wide, routers)`
    routers: object
    tokenizer: object
    describe: dict  # model / routers / LoRA / dtype, as written into every record


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--routers", required=True, help="router .safetensors file or a shipped name")
    ap.add_argument("--lora", default=None, help="stage-2 LoRA .safetensors merged into the WIDE model")
    ap.add_argument("--metrics", default=",".join(METRICS), help="comma-separated subset of " + ",".join(METRICS))
    ap.add_argument("--out", required=True, help="folder for <metric>.json and summary.md")
    ap.add_argument("--data", default=None, help="data root; unset: $WIDE_DATA_DIR, else ../shared/data")
    ap.add_argument("--gguf", default=None, help="SmolLM2 GGUF; unset: $WIDE_SMOLLM2_GGUF, else the cache")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                    help="auto: bfloat16 on CUDA, float32 on the CPU")
    ap.add_argument("--limit", type=int, default=None,
                    help="at most this many prompts / long passages / items per zero-shot task")
    ap.add_argument("--max-tokens", type=int, default=None, help="ppl: score only the first N test tokens")
    ap.add_argument("--ctx", type=int, default=1024, help="ppl window")
    ap.add_argument("--stride", type=int, default=512, help="ppl stride")
    ap.add_argument("--min-passage", type=int, default=1024, help="positions: shortest article kept (tokens)")
    ap.add_argument("--max-passage", type=int, default=2048, help="positions: tokens scored per article")
    ap.add_argument("--prompts", default="instructions-v1", help="generation: prompt set name or .jsonl")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="generation: greedy tokens per prompt")
    ap.add_argument("--agree-at", type=int, default=16, help="generation: agreement length that counts")
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per forward / generate call")
    ap.add_argument("--tasks-dir", default=None, help="zeroshot: prepared lm-eval tasks; unset: <out>/tasks")
    ap.add_argument("--dense-cache", default=None,
                    help="folder of cached dense ppl records; unset: <cache>/eval-dense; 'none': no cache")


def required_files(metrics) -> list[str]:
    from .tasks import data_files

    need = [WIKITEXT2_TEST] if {"ppl", "positions"} & set(metrics) else []
    if "zeroshot" in metrics:
        need += data_files()
    return need


def load_models(a) -> Models:
    from .. import Routers
    from ..models import load_smollm2
    from ..models.smollm2 import find_gguf
    from ..training.stage2 import load_lora_merged

    dt = {"auto": torch.bfloat16 if str(a.device).startswith("cuda") else torch.float32,
          "float32": torch.float32, "bfloat16": torch.bfloat16}[a.dtype]
    gguf = find_gguf(a.gguf)
    dense, tok = load_smollm2(dtype=dt, device=a.device, gguf_path=gguf)
    dense.requires_grad_(False)
    src = Path(a.routers)
    routers = Routers.load(src, dense) if src.is_file() else Routers.pretrained(a.routers, dense)
    wide = load_lora_merged(copy.deepcopy(dense), a.lora) if a.lora else dense
    describe = {"model": {"name": "SmolLM2-135M-Instruct", "gguf": gguf.name, "gguf_bytes": gguf.stat().st_size},
                "routers": a.routers, "routers_capacity": getattr(routers.cfg, "capacity", None),
                "lora": a.lora, "dtype": str(dt).replace("torch.", "")}
    return Models(dense, wide, routers, tok, describe)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="wide eval quality", description=__doc__,
                                 formatter_class=HelpFormatter)
    add_arguments(ap)
    a = ap.parse_args(argv)
    metrics = [m for m in a.metrics.split(",") if m]
    bad = [m for m in metrics if m not in METRICS]
    if bad:
        ap.error(f"unknown metric(s) {bad}; choose from {','.join(METRICS)}")
    root = records.require_data(records.data_root(a.data), *required_files(metrics))
    models = load_models(a)
    from .quality_metrics import RUNNERS, summary_line

    lines = []
    for m in metrics:
        result, settings = RUNNERS[m](models, a, root)
        rec = records.make_record(m, result, command=records.command_line(["quality", *(argv or [])]),
                                  models=models.describe, settings=settings, device=a.device)
        p = records.write_record(a.out, rec)
        lines.append(f"- {summary_line(m, result)} ({p.name})")
        print(lines[-1], flush=True)
    head = f"# WIDE quality: routers {a.routers}" + (f", LoRA {a.lora}" if a.lora else "")
    (Path(a.out) / "summary.md").write_text("\n".join([head, "", *lines, ""]))
    return 0
