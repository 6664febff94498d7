"""Per-token NLL by position on long held-out passages: does routing hurt the use of long context?

Passages are WikiText-2 test articles (the file split at its top-level ` = Title = ` headings), kept when
they have at least `min_tokens` tokens, each scored from its first token in one forward of at most
`max_len` tokens. The NLL of the token at position p (predicted from positions < p) goes to the bucket
holding p; every bucket reports its token count, summed NLL and mean NLL, so buckets add up to the total.
"""
from __future__ import annotations

import re

import torch

from .perplexity import token_nll, wikitext2_path

BUCKETS = (0, 64, 128, 256, 512, 1024, 2048)  # edges: [0,64), [64,128), ..., [1024,2048)


def split_articles(text: str) -> list[str]:
    """Articles of a WikiText file: each starts at a top-level heading line ` = Title = `."""
    starts = [m.start() for m in re.finditer(r"^ = [^=].* = *$", text, flags=re.M)]
    bounds = starts + [len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def long_passages(tokenizer, text: str, min_tokens: int = 1024, max_len: int = 2048) -> list[torch.Tensor]:
    """Token ids (truncated to max_len) of the articles with >= min_tokens tokens, in file order."""
    out = []
    for art in split_articles(text):
        ids = tokenizer(art, add_special_tokens=False)["input_ids"]
        if len(ids) >= min_tokens:
            out.append(torch.tensor(ids[:max_len], dtype=torch.long))
    return out


def wikitext2_passages(tokenizer, data_root, min_tokens: int = 1024, max_len: int = 2048):
    return long_passages(tokenizer, wikitext2_path(data_root).read_text(encoding="utf-8"), min_tokens, max_len)


@torch.no_grad()
def position_nll(model, passages: list[torch.Tensor], batch_size: int = 4) -> list[torch.Tensor]:
    """Per-passage NLL [len-1] (entry j: the token at position j+1), float64 on the CPU.

    Passages are batched right-padded with no attention mask: the model is causal and the routers are
    per token, so the pad positions after a passage cannot change its scores."""
    dev = next(model.parameters()).device
    order = sorted(range(len(passages)), key=lambda i: -len(passages[i]))
    out: list = [None] * len(passages)
    for k in range(0, len(order), batch_size):
        grp = order[k:k + batch_size]
        S = len(passages[grp[0]])
        x = torch.zeros(len(grp), S, dtype=torch.long)
        for r, i in enumerate(grp):
            x[r, :len(passages[i])] = passages[i]
        nll = token_nll(model(input_ids=x.to(dev)).logits, x.to(dev)).double().cpu()  # [B, S-1]
        for r, i in enumerate(grp):
            out[i] = nll[r, :len(passages[i]) - 1]
    return out


def bucketize(nlls: list[torch.Tensor], edges=BUCKETS) -> list[dict]:
    """[{"lo", "hi", "tokens", "nll_sum", "nll"}] over target positions p in [lo, hi) (p >= 1)."""
    rows = []
    for lo, hi in zip(edges, edges[1:]):
        s, n = 0.0, 0
        for v in nlls:  # v[j] is position j + 1
            part = v[max(lo - 1, 0):max(hi - 1, 0)]
            s, n = s + float(part.sum()), n + part.numel()
        rows.append({"lo": lo, "hi": hi, "tokens": n, "nll_sum": s, "nll": s / n if n else None})
    return rows


def compare_buckets(dense: list[dict], wide: list[dict]) -> list[dict]:
    """Per bucket: dense and WIDE mean NLL and WIDE - dense."""
    rows = []
    for d, w in zip(dense, wide):
        if (d["lo"], d["hi"], d["tokens"]) != (w["lo"], w["hi"], w["tokens"]):
            raise ValueError(f"bucket mismatch: {d} vs {w}")
        diff = None if d["nll"] is None else w["nll"] - d["nll"]
        rows.append({"lo": d["lo"], "hi": d["hi"], "tokens": d["tokens"], "dense_nll": d["nll"],
                     "wide_nll": w["nll"], "diff": diff})
    return rows
