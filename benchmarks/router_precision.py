#!/usr/bin/env python
"""How much running the routers in bf16 (optimize(router_dtype="model")) or as a bf16 pair
(router_dtype="bf16x2", Routers.split_bf16_) changes WIDE on SmolLM2.

    python benchmarks/router_precision.py [--data ../shared/data] [--tokens 2048] [--device cpu]

Loads SmolLM2-135M-Instruct in bf16 with the shipped routers, runs the first --tokens tokens of the
WikiText-2 test set with the routers in fp32 (as trained), cast to bf16, and split into a bf16 pair, and prints
the share of attention / FFN decisions that differ from fp32, the measured FLOP capacity and the perplexity of
each.
"""
from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.nn.functional as F

import wide_compile as wc
from wide_compile.models import load_smollm2
from wide_compile.routing import record_masks


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_data = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data")
    p.add_argument("--data", default=default_data)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--device", default="cpu")
    a = p.parse_args(argv)
    model, tok = load_smollm2(dtype=torch.bfloat16, device=a.device)
    text = open(os.path.join(a.data, "wikitext-2", "wiki.test.raw")).read()[:20 * a.tokens]
    ids = tok(text, return_tensors="pt").input_ids[:, :a.tokens].to(a.device)
    r32 = wc.Routers.pretrained("smollm2-135m-c50", model)
    runs = {}
    for name, routers in (("fp32", r32), ("bf16", copy.deepcopy(r32).to(torch.bfloat16)),
                          ("bf16x2", copy.deepcopy(r32).split_bf16_())):
        with wc.routing.routed(model, routers), torch.no_grad():
            with record_masks(model) as rec:
                logits = model(input_ids=ids).logits.float()
            cap = wc.measure_capacity(model, ids)["overall"]
        ppl = F.cross_entropy(logits[0, :-1], ids[0, 1:]).exp().item()
        runs[name] = (rec, cap, ppl)
    for other in ("bf16", "bf16x2"):
        for kind in ("attn", "ffn"):
            a32, ao = runs["fp32"][0][kind], runs[other][0][kind]
            differ = sum((x[0] != y[0]).sum().item() for x, y in zip(a32, ao))
            total = sum(x[0].numel() for x in a32)
            print(f"{other} vs fp32, {kind}: {differ} / {total} decisions differ ({100 * differ / total:.3f} %)")
    for name, (_, cap, ppl) in runs.items():
        print(f"routers {name}: capacity {cap:.4f}, perplexity on {ids.shape[1]} tokens {ppl:.2f}")


if __name__ == "__main__":
    main()
