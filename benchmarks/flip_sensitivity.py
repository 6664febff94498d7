#!/usr/bin/env python
"""How much do router decisions that flip within rounding change a random-weight model's logits?

    python benchmarks/flip_sensitivity.py --layers 8 --tokens 256 [--shape llama-3.1-8b] [--device cpu]

Builds the bench_e2e model (random weights, std 0.02, bf16) with random routers calibrated to capacity 0.5,
then compares the eager WIDE reference with (a) itself after every router bias moved by N(0, 1e-3) and
(b) wide_compile.optimize() of the same model (on the CPU: Inductor + the reference ops, so no Triton
kernel is involved). When (a) is as large as (b), a compiled-vs-eager logit difference on such a model
says nothing about kernel error: use check_compiled_gpu.py's replayed masks for that.
Prints relative L2 error of all logits, of the last position, and argmax agreement.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e import masks as M  # noqa: E402
from e2e import models as MD  # noqa: E402

import wide_compile as wc  # noqa: E402


def compare(a, b):
    a, b = a.float(), b.float()
    return {"rel_all": round(((a - b).norm() / b.norm()).item(), 4),
            "rel_last": round(((a[:, -1] - b[:, -1]).norm() / b[:, -1].norm()).item(), 4),
            "argmax_agree": round((a.argmax(-1) == b.argmax(-1)).float().mean().item(), 4)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--vocab", type=int, default=32000, help="smaller than the real one: it does not affect routing")
    p.add_argument("--device", default="cpu")
    p.add_argument("--jitter", type=float, default=1e-3)
    p.add_argument("--no-compile", action="store_true")
    a = p.parse_args(argv)
    torch.manual_seed(0)
    model = MD.build_model(MD.make_config(a.shape, layers=a.layers, vocab_size=a.vocab), a.device, torch.bfloat16)
    cfg = wc.WideConfig(ffn_group_size=64, head_group_size=1, router_init="random")
    ids = torch.randint(0, a.vocab, (1, a.tokens), device=a.device)
    routers = M.random_routers(model, cfg, ids, 0.5)
    ref = wc.attach(MD.shared_clone(model), routers)
    t0 = time.time()
    with torch.no_grad():
        eager = ref(input_ids=ids).logits
        with M.jittered_router_biases(routers, a.jitter):
            jittered = ref(input_ids=ids).logits
    print(f"{a.shape} layers={a.layers} tokens={a.tokens}: eager vs eager with router biases + N(0, {a.jitter}): "
          f"{compare(jittered, eager)}", flush=True)
    if not a.no_compile:
        cm = wc.optimize(MD.shared_clone(model), routers)
        with torch.no_grad():
            comp = cm(input_ids=ids).logits
        print(f"{a.shape} layers={a.layers} tokens={a.tokens}: optimize() vs eager: {compare(comp, eager)} "
              f"({time.time() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
