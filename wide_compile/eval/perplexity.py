"""WikiText-2 (raw) test perplexity with a sliding window.

Protocol (HF "perplexity of fixed-length models"): the test file `wiki.test.raw` is read as one string
(its own line layout, no joining), tokenized once without special tokens; windows of `ctx` tokens
(default 1024) advance by `stride` tokens (default 512); each window scores only the tokens not scored
by the previous window (the first window scores all but its first token), so every token after the first
is scored once with at least ctx - stride tokens of context (except in the first window). With
stride == ctx the windows do not overlap and each window's first token (no context) is not scored.
ppl = exp(total NLL / scored tokens). With routers attached, the FLOP capacity on the same tokens is
measured too (every token is real; no padding).
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F


WIKITEXT2_TEST = "wikitext-2/wiki.test.raw"


def wikitext2_path(data_root) -> Path:
    from .records import require_data

    return require_data(data_root, WIKITEXT2_TEST) / WIKITEXT2_TEST


def sliding_windows(n: int, ctx: int, stride: int) -> list[tuple[int, int, int]]:
    """[(begin, end, t0)] windows over n tokens; a window scores the targets at positions t0..end-begin-1
    of its slice (position j is predicted from positions < j), i.e. those no earlier window scored."""
    if ctx < 2 or not 0 < stride <= ctx:
        raise ValueError(f"need ctx >= 2 and 0 < stride <= ctx, got ctx={ctx} stride={stride}")
    wins, prev_end, begin = [], 0, 0
    while True:
        end = min(begin + ctx, n)
        wins.append((begin, end, max(prev_end - begin, 1)))
        prev_end = end
        if end == n:
            return wins
        begin += stride


def token_nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """NLL of ids[:, j+1] under logits[:, j] -> [B, S-1], in float32 at least (float64 stays float64)."""
    # logits: [B, S, V], ids: [B, S]
    lg = logits[:, :-1]
    lp = F.log_softmax(lg if lg.dtype == torch.float64 else lg.float(), -1)
    return -lp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def perplexity(model, tokenizer=None, text: str | None = None, ids: torch.Tensor | None = None,
               ctx: int = 1024, stride: int = 512, batch_size: int = 16, max_tokens: int | None = None,
               measure: bool = True) -> dict:
    """{"ppl", "nll", "tokens", "ctx", "stride", "capacity"?} of `model` on `text` (or token `ids`)."""
    from ..routing import is_attached
    from ..routing.attach import attached_routers, record_masks
    from ..routing.measure import capacity_from_record

    if ids is None:
        ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    ids = ids.reshape(-1)
    if max_tokens:
        ids = ids[:max_tokens]
    dev = next(model.parameters()).device
    n = ids.numel()
    wins = sliding_windows(n, ctx, stride)
    routed = is_attached(model)
    L = attached_routers(model).spec.num_layers if routed else 0
    acc = {"attn": [[] for _ in range(L)], "ffn": [[] for _ in range(L)]}
    nll, cnt = 0.0, 0
    # batch windows of full length; the (shorter) last one alone
    full = [w for w in wins if w[1] - w[0] == ctx]
    rest = [w for w in wins if w[1] - w[0] != ctx]
    groups = [full[i:i + batch_size] for i in range(0, len(full), batch_size)] + [[w] for w in rest]
    for grp in groups:
        x = torch.stack([ids[b:e] for b, e, _ in grp]).to(dev)
        if routed and measure:
            with record_masks(model) as rec:
                logits = model(input_ids=x).logits
        else:
            logits = model(input_ids=x).logits
        tok_nll = token_nll(logits, x)  # [B, S-1]
        for r, (b, e, t0) in enumerate(grp):
            nll += float(tok_nll[r, t0 - 1:].sum())
            cnt += tok_nll.shape[1] - (t0 - 1)
            if routed and measure:  # capacity on the scored tokens of this window
                for k in ("attn", "ffn"):
                    for i in range(L):
                        m = rec[k][i][0][r, t0:]
                        acc[k][i].append(m.float().mean(-1).reshape(-1, 1))
    out = {"ppl": math.exp(nll / cnt), "nll": nll / cnt, "tokens": cnt, "ctx": ctx, "stride": stride}
    if routed and measure:
        c = capacity_from_record(attached_routers(model), acc)
        out["capacity"] = {k: c[k] for k in ("overall", "attn", "ffn", "tokens")}
    return out


def wikitext2_ppl(model, tokenizer, data_root, **kw) -> dict:
    text = wikitext2_path(data_root).read_text(encoding="utf-8")
    return perplexity(model, tokenizer, text=text, **kw)
