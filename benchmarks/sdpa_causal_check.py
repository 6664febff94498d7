#!/usr/bin/env python
"""Does a traced (torch.compile) Llama call SDPA the way the eager model does?

    python benchmarks/sdpa_causal_check.py [--tokens 64] [--attention sdpa_unpadded]

Runs a tiny HF Llama once eagerly, with scaled_dot_product_attention spied on, and once through
torch.compile with a backend that only reads the FX graph, and prints for each: whether SDPA got an explicit
attention mask, and its is_causal flag. On torch < 2.14, transformers keeps the causal mask while Dynamo
traces (masking_utils._ignore_causal_mask_sdpa), so every compiled model (dense Inductor, static, WIDE)
runs masked SDPA, while eager runs is_causal=True without a mask. This script shows which of the two a
run gets: the explanation results/E2E_NOTES.md gives for eager dense beating Inductor at long prefill.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from wide_compile.models.tiny import tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e.attention import ATTENTIONS  # noqa: E402
from e2e.attention import use as use_attention  # noqa: E402


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--attention", default="sdpa", choices=ATTENTIONS,
                   help="sdpa_unpadded: bench_e2e.py's --attention setting (e2e/attention.py)")
    a = p.parse_args(argv)
    model = tiny_model("llama", seed=0).eval()
    model.config._attn_implementation = use_attention(a.attention)
    ids = torch.randint(1, 128, (1, a.tokens))

    eager_calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        eager_calls.append({"mask": attn_mask is not None, "is_causal": bool(is_causal)})
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)

    F.scaled_dot_product_attention = spy  # transformers looks it up on torch.nn.functional at call time
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    finally:
        F.scaled_dot_product_attention = sdpa

    traced_calls = []

    def read_graph(gm, example_inputs):  # noqa: ARG001
        for n in gm.graph.nodes:
            if n.op == "call_function" and "scaled_dot_product_attention" in str(n.target):
                mask = n.kwargs.get("attn_mask", n.args[3] if len(n.args) > 3 else None)
                causal = n.kwargs.get("is_causal", n.args[5] if len(n.args) > 5 else False)
                traced_calls.append({"mask": mask is not None, "is_causal": bool(causal)})
        return gm.forward

    with torch.no_grad():
        torch.compile(model, backend=read_graph, dynamic=False)(input_ids=ids, use_cache=False)
    import transformers

    out = {"torch": torch.__version__, "transformers": transformers.__version__, "tokens": a.tokens,
           "attention": a.attention,
           "eager": eager_calls, "traced": traced_calls}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
