"""How far the generation-agreement metric falls with no routing at all: SmolLM2-135M-Instruct's greedy answers
to the committed prompt set (`wide eval quality --metrics generation`'s prompts, chat template, 64 new tokens)
from the dense model as the quality metric runs it (fp32, SDPA attention) against the same dense model changed
only numerically:

    fp32_eager  fp32, eager attention instead of SDPA (a change of summation order: rounding noise in fp32)
    bf16        the whole model in bf16 (a rounding change of the size a bf16 deployment makes)

    python benchmarks/generation_floor.py --out DIR [--limit N] [--batch-size B] [--variants fp32_eager bf16]

Each variant's agreement with the reference is `eval.generation.agreement_summary` (the figures issue 19's
generation goal is stated in: mean exact-prefix agreement, the share of prompts agreeing for >= 16 tokens, the
dense model's NLL of the variant's text). A WIDE model's agreement with dense cannot be expected above what a
rounding change alone leaves. Writes DIR/generation-floor.json and DIR/generation-floor.md (command, machine,
date); runs on the CPU.
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

VARIANTS = ("fp32_eager", "bf16")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--limit", type=int, default=None, help="at most this many prompts (default: all)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--agree-at", type=int, default=16)
    ap.add_argument("--prompts", default="instructions-v1", help="prompt set name or .jsonl")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--gguf", default=None, help="SmolLM2 GGUF; unset: $WIDE_SMOLLM2_GGUF, else the cache")
    args = ap.parse_args(argv)

    import torch

    from wide_compile.eval import prompts as prompt_sets
    from wide_compile.eval.generation import agreement_summary, encode_prompts, greedy_continuations, stop_ids
    from wide_compile.models.smollm2 import load_smollm2

    torch.manual_seed(0)
    ref, tok = load_smollm2(torch.float32, "cpu", args.gguf)
    rows = prompt_sets.load(args.prompts)[:args.limit]
    ids = encode_prompts(tok, [r["prompt"] for r in rows])
    pad, eos = stop_ids(tok)
    kw = dict(max_new=args.max_new_tokens, batch_size=args.batch_size, pad_id=pad, eos_ids=eos)
    ref_cont = greedy_continuations(ref, ids, **kw)
    out = dict(command="python " + " ".join(sys.argv if argv is None else [__file__] + list(argv)),
               machine=f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
               date=datetime.datetime.now().isoformat(timespec="seconds"), prompts=args.prompts,
               n_prompts=len(rows), reference="fp32, SDPA attention", variants={})
    for name in args.variants:
        if name == "fp32_eager":
            model, _ = load_smollm2(torch.float32, "cpu", args.gguf)
            model.config._attn_implementation = "eager"
        else:
            model, _ = load_smollm2(torch.bfloat16, "cpu", args.gguf)
        cont = greedy_continuations(model, ids, **kw)
        res = agreement_summary(ids, ref_cont, cont, ref, args.max_new_tokens, args.agree_at, args.batch_size)
        res["agreement_per_prompt"] = [r["agreement"] for r in res.pop("per_prompt")]
        out["variants"][name] = res
        print(f"{name}: mean agreement {res['mean_agreement']:.1f} tokens, >= {args.agree_at}: "
              f"{res['frac_agree_at']:.0%}, dense NLL of its text {res['dense_nll_of_wide']:.3f} "
              f"(of dense's own {res['dense_nll_of_dense']:.3f})", flush=True)
        del model
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "generation-floor.json"), "w") as f:
        json.dump(out, f, indent=1)
    lines = ["# Generation agreement with no routing (SmolLM2-135M-Instruct)", "",
             f"command: `{out['command']}`  ", f"machine: {out['machine']}; date: {out['date']}  ",
             f"reference: {out['reference']}; {out['n_prompts']} prompts ({args.prompts}), greedy "
             f"{args.max_new_tokens} new tokens, chat template", "",
             f"| variant | mean agreement (tokens) | prompts agreeing >= {args.agree_at} tokens | dense NLL of its "
             "text (of dense's own) |", "|---|---|---|---|"]
    for name, r in out["variants"].items():
        lines.append(f"| {name} | {r['mean_agreement']:.1f} | {r['frac_agree_at']:.0%} | "
                     f"{r['dense_nll_of_wide']:.3f} ({r['dense_nll_of_dense']:.3f}) |")
    with open(os.path.join(args.out, "generation-floor.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return out


if __name__ == "__main__":
    main()
