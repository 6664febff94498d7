"""Where a routed SmolLM2 leaves the dense model's answer: teacher-forced top-1 agreement along dense's own greedy
answers, for several variants against one set of dense answers (CPU).

    python benchmarks/agreement_diagnosis.py --out DIR [--limit N] [--batch-size B] \\
        --variants NAME:ROUTERS:LORA[:DTYPE] ...

Each variant is the model with a LoRA merged (LORA: a shipped router name whose LoRA ships with it, a LoRA file,
or `none`) and routers attached (ROUTERS: a shipped name, a router file, or `none`), in DTYPE (float32 unless
given). For every answer position the variant predicts the dense model's next token from the prompt and dense's
answer so far; the figures are those of the generation metric (`eval.generation.teacher_forced_summary`): top-1
agreement by position, the first answer token split by dense's own margin there, and the exact-prefix agreement
that independent positions would imply. Separating the LoRA from the routers shows which of the two moves the
model off dense's path. Writes DIR/agreement-diagnosis.json and .md (command, machine, date).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def parse_variant(spec: str) -> dict:
    parts = spec.split(":")
    if len(parts) not in (3, 4) or not parts[0]:
        raise SystemExit(f"--variants: {spec!r} is not NAME:ROUTERS:LORA[:DTYPE] (use `none` for no routers / LoRA)")
    dtype = parts[3] if len(parts) == 4 else "float32"
    if dtype not in ("float32", "bfloat16"):
        raise SystemExit(f"--variants: dtype {dtype!r} in {spec!r} must be float32 or bfloat16")
    return {"name": parts[0], "routers": parts[1], "lora": parts[2], "dtype": dtype}


def _lora_file(spec: str):
    from pathlib import Path

    from wide_compile import pretrained

    if Path(spec).is_file():
        return Path(spec)
    p = pretrained.lora_path(spec)
    if p is None:
        raise SystemExit(f"no LoRA {spec!r}: give a LoRA file or shipped routers with one ({pretrained.available()})")
    return p


def build(v: dict, load):
    """(model, routers or None) of variant v; load(dtype) -> (model, tokenizer)."""
    from pathlib import Path

    import torch

    from wide_compile.routing import Routers
    from wide_compile.training.stage2 import load_lora_merged

    model, _ = load(getattr(torch, v["dtype"]))
    if v["lora"] != "none":
        model = load_lora_merged(model, _lora_file(v["lora"]))
    routers = None
    if v["routers"] != "none":
        src = Path(v["routers"])
        routers = Routers.load(src, model) if src.is_file() else Routers.pretrained(v["routers"], model)
    return model.eval(), routers


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--variants", nargs="+", required=True, help="NAME:ROUTERS:LORA[:DTYPE] (see the module docstring)")
    ap.add_argument("--limit", type=int, default=None, help="at most this many prompts (default: all)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--agree-at", type=int, default=16)
    ap.add_argument("--prompts", default="instructions-v1", help="prompt set name or .jsonl")
    ap.add_argument("--gguf", default=None, help="SmolLM2 GGUF; unset: $WIDE_SMOLLM2_GGUF, else the cache")
    args = ap.parse_args(argv)
    variants = [parse_variant(s) for s in args.variants]

    import torch

    from wide_compile.eval import prompts as prompt_sets
    from wide_compile.eval.generation import (encode_prompts, greedy_continuations, stop_ids, teacher_forced_summary,
                                              top1_along)
    from wide_compile.models.smollm2 import load_smollm2
    from wide_compile.routing import routed

    def load(dtype):
        return load_smollm2(dtype, "cpu", args.gguf)

    torch.manual_seed(0)
    dense, tok = load(torch.float32)
    rows = prompt_sets.load(args.prompts)[:args.limit]
    ids = encode_prompts(tok, [r["prompt"] for r in rows])
    pad, eos = stop_ids(tok)
    dense_cont = greedy_continuations(dense, ids, max_new=args.max_new_tokens, batch_size=args.batch_size,
                                      pad_id=pad, eos_ids=eos)
    dense_top = top1_along(dense, ids, dense_cont, args.batch_size)
    del dense
    out = dict(command="python " + " ".join(sys.argv if argv is None else [__file__] + list(argv)),
               machine=f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
               date=datetime.datetime.now().isoformat(timespec="seconds"), prompts=args.prompts, n_prompts=len(rows),
               reference="the dense model, fp32, greedy", max_new_tokens=args.max_new_tokens, variants={})
    for v in variants:
        model, routers = build(v, load)
        with routed(model, routers):
            top = top1_along(model, ids, dense_cont, args.batch_size)
        res = teacher_forced_summary(dense_cont, top, dense_top, args.agree_at)
        out["variants"][v["name"]] = {**v, **res}
        f = res["first_token"]
        print(f"{v['name']}: top-1 along dense's answers {res['top1_agreement']:.1%}, first token {f['agreement']:.0%} "
              f"(near ties {f['agreement_near_tie']}, clear {f['agreement_clear']}), implied >= {args.agree_at}: "
              f"{res['implied_frac_agree_at']:.0%}", flush=True)
        del model
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "agreement-diagnosis.json"), "w") as fh:
        json.dump(out, fh, indent=1)
    ties = next(iter(out["variants"].values()))["first_token"]["dense_near_tie_prompts"] if variants else 0
    lines = ["# Teacher-forced agreement along the dense model's own answers (SmolLM2-135M-Instruct)", "",
             f"command: `{out['command']}`  ", f"machine: {out['machine']}; date: {out['date']}  ",
             f"{out['n_prompts']} prompts ({args.prompts}), dense greedy answers of up to {args.max_new_tokens} tokens; "
             f"dense's first token is a near tie (top-1 minus top-2 probability < 0.2) for {ties} of them", "",
             "| variant | routers | LoRA | dtype | top-1 agreement | position 0 / 1-3 / 4-15 / 16-63 | first token: all / "
             "near ties / clear | implied share agreeing >= %d |" % args.agree_at, "|---|---|---|---|---|---|---|---|"]

    def pct(x):
        return "-" if x is None else f"{x:.0%}"

    for name, r in out["variants"].items():
        b = " / ".join(pct(x["top1_agreement"]) for x in r["by_position"])
        f = r["first_token"]
        lines.append(f"| {name} | {r['routers']} | {r['lora']} | {r['dtype']} | {r['top1_agreement']:.1%} | {b} | "
                     f"{pct(f['agreement'])} / {pct(f['agreement_near_tie'])} / {pct(f['agreement_clear'])} | "
                     f"{pct(r['implied_frac_agree_at'])} |")
    with open(os.path.join(args.out, "agreement-diagnosis.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    return out


if __name__ == "__main__":
    main()
