#!/usr/bin/env python
"""How often do the compiled model's router decisions agree with the eager reference's? SmolLM2-135M-Instruct
with shipped routers, on WikiText-2 text, per dtype:

    python benchmarks/decision_agreement.py [--dtypes fp32,bf16] [--tokens 256] [--routers smollm2-135m-c50]
                                            [--device cpu] [--out benchmarks/results/decision-agreement]

The eager reference is wc.attach (the model's own forward with router hooks); the compiled model is
wc.optimize of the same model (backend="wide": Inductor + the WIDE ops; on the CPU their PyTorch references).
Both record their masks with wc.routing.record_masks (in the compiled model the hooks are traced, so the
masks it records are the ones its graph computed). A decision whose logit lies within rounding of 0 can fall
on the other side when the router's input h is computed by fused Inductor kernels instead of eager ops; one
flip changes later hidden states, so later layers can disagree more. Reported per dtype: the agreement over
every (token, layer, group) decision (attention and FFN), per layer, the share of tokens with every decision
equal, and the eager router logits |logit| of the decisions that flip in the first layer that has any (there
the inputs differ by rounding only).
Writes one JSON record (command, machine, date) to --out.
"""
from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import wide_compile as wc  # noqa: E402
from wide_compile.eval.records import command_line, make_record, write_record  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def record(model, ids):
    """Masks ({"attn"/"ffn": [layer] -> bool [T, G]}) and router logits of one forward of `model`."""
    with torch.no_grad(), wc.routing.record_masks(model) as rec:
        model(input_ids=ids)
    return {k: [v[0].reshape(-1, v[0].shape[-1]) for v in rec[k]] for k in ("attn", "ffn")}


def eager_logits(model, ids):
    with torch.no_grad(), wc.routing.record_logits(model) as rec:
        model(input_ids=ids)
    return rec


def compare(eager: dict, compiled: dict, logits: dict) -> dict:
    L = len(eager["attn"])
    per_layer, agree_tok = [], torch.ones(eager["attn"][0].shape[0], dtype=torch.bool)
    n_eq = n_all = 0
    first = None
    for i in range(L):
        row = {}
        for k in ("attn", "ffn"):
            e, c = eager[k][i], compiled[k][i]
            eq = e == c
            row[k] = round(eq.float().mean().item(), 6)
            n_eq += int(eq.sum())
            n_all += eq.numel()
            agree_tok &= eq.all(-1)
            if first is None and not eq.all():
                first = {"layer": i, "kind": k, "flips": int((~eq).sum()),
                         "eager_abs_logit_max": float(logits[k][i].float()[~eq].abs().max()),
                         "eager_abs_logit_median_all": float(logits[k][i].float().abs().median())}
        per_layer.append(row)
    return {"decisions": n_all, "agreement": round(n_eq / n_all, 6),
            "tokens_all_decisions_equal": round(agree_tok.float().mean().item(), 6),
            "first_disagreement": first, "per_layer": per_layer}


def run_dtype(name: str, dtype, ids_of, routers_name: str, device: str, patches: dict) -> dict:
    from wide_compile.models import load_smollm2

    model, tok = load_smollm2(dtype=dtype, device=device)
    ids = ids_of(tok).to(device)
    wc.attach(model, wc.Routers.pretrained(routers_name, model))
    eager = record(model, ids)
    logits = eager_logits(model, ids)
    t0 = time.time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wc.optimize(model, **patches)
        compiled = record(model, ids)
    out = compare(eager, compiled, logits)
    out["compile_and_run_s"] = round(time.time() - t0, 1)
    out["rewritten_layers"] = sum(r["mlp"] is not None and r["mlp"]["status"] == "rewritten"
                                  for r in wc.explain(model).layers)
    print(name, {k: v for k, v in out.items() if k != "per_layer"}, flush=True)
    return out


def _value(v: str):
    return {"1": True, "0": False, "true": True, "false": False}.get(v.lower(), v)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--routers", default="smollm2-135m-c50")
    p.add_argument("--device", default="cpu")
    p.add_argument("--data", default=None, help="data root (default: wide_compile.paths.data_root())")
    p.add_argument("--inductor", action="append", default=[], metavar="KEY=VALUE",
                   help="an Inductor config patch passed through optimize (e.g. emulate_precision_casts=1: "
                        "Inductor rounds intermediates to their dtype the way eager does); repeatable")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "decision-agreement"))
    p.add_argument("--name", default="decision-agreement", help="the record's file name (without .json)")
    a = p.parse_args(argv)
    from wide_compile.eval.perplexity import wikitext2_path
    from wide_compile.paths import data_root

    text = wikitext2_path(Path(a.data) if a.data else data_root()).read_text()[:20000]

    def ids_of(tok):
        return tok(text, return_tensors="pt").input_ids[:, : a.tokens]

    patches = {k: _value(v) for k, v in (kv.split("=", 1) for kv in a.inductor)}
    result = {}
    for name in a.dtypes.split(","):
        torch._dynamo.reset()
        result[name] = run_dtype(name, DTYPES[name], ids_of, a.routers, a.device, patches)
    rec = make_record(a.name, result, command=command_line(argv, "python benchmarks/decision_agreement.py"),
                      models={"model": "SmolLM2-135M-Instruct (GGUF Q4_1, dequantised)", "routers": a.routers},
                      settings={"tokens": a.tokens, "text": "WikiText-2 test, first tokens", "device": a.device,
                                "inductor_patches": patches},
                      device=a.device)
    print("wrote", write_record(a.out, rec))


if __name__ == "__main__":
    main()
