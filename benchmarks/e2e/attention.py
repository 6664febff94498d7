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

"gqa_decode": sdpa_unpadded, except that a decode step (one query per sequence) runs the flash-decoding
kernel of `wide.attn_decode` (split over the context, GQA read in place) with every head on. transformers'
SDPA decode against a static cache repeats K / V per query head and runs SDPA with a mask, which leaves the
dense models far from the cache's read time at long context; this mode gives the dense and static models the
same decode kernel WIDE's attention rewrite uses, so a ratio measures what skipping heads saves. The WIDE
model keeps sdpa_unpadded (`wide_attention`): with --sparse-attention its pass rewrites that SDPA into the
same kernel with the routed head mask; without it WIDE runs gqa_decode like the others.
"""
from __future__ import annotations

ATTENTIONS = ("sdpa", "sdpa_unpadded", "gqa_decode")


def sdpa_unpadded_attention(module, query, key, value, attention_mask, **kwargs):
    """query [B, Hq, Tq, hd], key/value [B, Hkv, Tk, hd]: transformers' SDPA forward, without the mask when
    Tq == Tk (no cached positions, so the mask can only be the causal one)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    # a sliding-window mask (Mistral-style) is not the causal one even without cached positions: keep it
    if query.shape[2] == key.shape[2] and kwargs.get("sliding_window") is None:
        attention_mask = None  # sdpa_attention_forward then passes is_causal=True (Tq > 1)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def gqa_decode_attention(module, query, key, value, attention_mask, **kwargs):
    """Decode (Tq == 1): every head through `wide.attn_decode`, keys masked as transformers' mask says
    (bool [B, 1, 1, L] True = attend, or additive float 0 / -inf); otherwise sdpa_unpadded."""
    import torch

    from wide_compile.kernels import wide_attn_decode

    B, Hq, Tq, _ = query.shape
    Hkv = key.shape[1]
    if Tq != 1 or kwargs.get("sliding_window") is not None or kwargs.get("dropout", 0.0):
        return sdpa_unpadded_attention(module, query, key, value, attention_mask, **kwargs)
    key_mask = None
    if attention_mask is not None:
        m = attention_mask[:, 0, -1, : key.shape[2]]                        # [B, L]
        key_mask = m if m.dtype == torch.bool else m == 0
        key_mask = key_mask.expand(B, key.shape[2])
    heads_on = torch.ones((B, Hkv), dtype=torch.bool, device=query.device)  # one group per KV head, all on
    out = wide_attn_decode(query, key, value, heads_on, Hq // Hkv, key_mask, kwargs.get("scaling"))
    return out.transpose(1, 2).contiguous(), None                          # [B, 1, Hq, d]


def wide_attention(name: str) -> str:
    """The WIDE model's attention under `name`: gqa_decode's WIDE model runs sdpa_unpadded, whose SDPA the
    attention rewrite replaces (with the routed head mask) when --sparse-attention is on."""
    return "sdpa_unpadded" if name == "gqa_decode" else name


def use(name: str) -> str:
    """Register `name` with transformers where needed and return the `_attn_implementation` value."""
    if name not in ATTENTIONS:
        raise ValueError(f"attention {name!r}: expected one of {ATTENTIONS}")
    if name in ("sdpa_unpadded", "gqa_decode"):
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        for n, fn in (("sdpa_unpadded", sdpa_unpadded_attention), ("gqa_decode", gqa_decode_attention)):
            AttentionInterface.register(n, fn)
            AttentionMaskInterface.register(n, sdpa_mask)  # decode still gets transformers' SDPA mask
    return name
