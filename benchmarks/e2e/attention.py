"""The attention implementation the benchmark models run with (`bench_e2e.py --attention`).

"sdpa": transformers' own SDPA path, what a user gets. On torch < 2.14 transformers keeps an explicit
causal mask while Dynamo traces, where eager passes `is_causal=True` without a mask
(`benchmarks/sdpa_causal_check.py`), so every compiled model (dense Inductor, static and WIDE alike) runs
masked SDPA, which is why eager dense can beat Inductor at long prefill (results/E2E_NOTES.md).

"sdpa_unpadded": the same SDPA call, except that where queries and keys have the same length (prefill
from an empty cache, the only prefill the benchmark runs) the mask is dropped and SDPA runs its causal
kernel, in eager and compiled models alike; decode against the static cache keeps its mask. It assumes no
padding (a padded batch would attend to its pad tokens), which holds for the benchmark's inputs and is
why this lives here and not in the package. It applies to every variant of a run, so WIDE's ratio to
dense stays a like-for-like comparison; records carry the setting in `attention`.
"""
from __future__ import annotations

ATTENTIONS = ("sdpa", "sdpa_unpadded")


def sdpa_unpadded_attention(module, query, key, value, attention_mask, **kwargs):
    """query [B, Hq, Tq, hd], key/value [B, Hkv, Tk, hd]: transformers' SDPA forward, without the mask when
    Tq == Tk (no cached positions, so the mask can only be the causal one)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    # a sliding-window mask (Mistral-style) is not the causal one even without cached positions: keep it
    if query.shape[2] == key.shape[2] and kwargs.get("sliding_window") is None:
        attention_mask = None  # sdpa_attention_forward then passes is_causal=True (Tq > 1)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def use(name: str) -> str:
    """Register `name` with transformers where needed and return the `_attn_implementation` value."""
    if name not in ATTENTIONS:
        raise ValueError(f"attention {name!r}: expected one of {ATTENTIONS}")
    if name == "sdpa_unpadded":
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(name, sdpa_unpadded_attention)
        AttentionMaskInterface.register(name, sdpa_mask)  # decode still gets transformers' SDPA mask
    return name
