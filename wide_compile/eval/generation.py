"""Generation agreement with dense: greedy continuations of fixed instruction prompts, compared token by token.

Per prompt: the exact-prefix agreement length (new tokens until the first one that differs, capped at
`max_new`; two identical continuations count as `max_new`, also when both stopped at EOS early). Overall:
the mean agreement, the fraction of prompts agreeing for >= `agree_at` tokens, and a reference-free
fluency figure: the dense model's mean per-token NLL of WIDE's continuations (and of its own, for scale).
The fluency figure cannot see a loop (a repeated sentence is likely text), so the share of continuations
that repeat themselves (`repeating`: a run of REPEAT_NGRAM tokens REPEAT_TIMES times or more) is reported
beside it, for both models.
"""
from __future__ import annotations

from collections import Counter

import torch

REPEAT_NGRAM, REPEAT_TIMES = 4, 3


def repeating(cont: list[int], n: int = REPEAT_NGRAM, times: int = REPEAT_TIMES) -> bool:
    """True when some run of n consecutive tokens occurs `times` or more times in the continuation."""
    counts = Counter(tuple(cont[i:i + n]) for i in range(len(cont) - n + 1))
    return bool(counts) and max(counts.values()) >= times


def encode_prompts(tokenizer, prompts: list[str]) -> list[list[int]]:
    """Token ids of each prompt as one user turn through the chat template (plain text without one)."""
    out = []
    for p in prompts:
        if tokenizer.chat_template:
            text = tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                 add_generation_prompt=True)
        else:
            text = p
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def stop_ids(tokenizer) -> tuple[int, list[int]]:
    """(pad id, ids that end an answer: EOS and the chat template's end-of-turn token when it has one)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    turn_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    eos = [tokenizer.eos_token_id] + [t for t in [turn_end] if isinstance(t, int) and t != tokenizer.unk_token_id]
    return pad, eos


def _cut_at_eos(row: list[int], eos: set[int]) -> list[int]:
    for j, t in enumerate(row):
        if t in eos:
            return row[:j + 1]
    return row


@torch.no_grad()
def greedy_continuations(model, prompt_ids: list[list[int]], max_new: int = 64, batch_size: int = 32,
                         pad_id: int = 0, eos_ids=()) -> list[list[int]]:
    """Greedy new tokens per prompt (up to and including the first EOS), batched with left padding."""
    dev = next(model.parameters()).device
    eos = set(int(e) for e in eos_ids)
    order = sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
    out: list = [None] * len(prompt_ids)
    for k in range(0, len(order), batch_size):
        grp = order[k:k + batch_size]
        S = max(len(prompt_ids[i]) for i in grp)
        x = torch.full((len(grp), S), pad_id, dtype=torch.long)
        am = torch.zeros(len(grp), S, dtype=torch.long)
        for r, i in enumerate(grp):  # x: [B, S] left-padded
            x[r, S - len(prompt_ids[i]):] = torch.tensor(prompt_ids[i])
            am[r, S - len(prompt_ids[i]):] = 1
        gen = model.generate(input_ids=x.to(dev), attention_mask=am.to(dev), max_new_tokens=max_new,
                             min_new_tokens=0, do_sample=False, pad_token_id=pad_id,
                             eos_token_id=sorted(eos) or None)
        for r, i in enumerate(grp):
            out[i] = _cut_at_eos(gen[r, S:].tolist(), eos)
    return out


def agreement_length(a: list[int], b: list[int], cap: int = 64) -> int:
    """Tokens until a and b first differ, capped at `cap`; identical sequences give `cap`."""
    a, b = list(a[:cap]), list(b[:cap])
    if a == b:
        return cap
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _teacher_forced(model, prompt_ids: list[list[int]], cont_ids: list[list[int]], batch_size: int):
    """Yields (prompt index, logits [n, V] predicting cont[0 .. n-1], x [S] the row's ids) for every prompt: one
    forward per batch of prompt + continuation rows, right-padded with no attention mask (the model is causal,
    so later pad positions cannot change the real ones)."""
    dev = next(model.parameters()).device
    seqs = [list(p) + list(c) for p, c in zip(prompt_ids, cont_ids)]
    for k in range(0, len(seqs), batch_size):
        idx = list(range(k, min(k + batch_size, len(seqs))))
        S = max(len(seqs[i]) for i in idx)
        x = torch.zeros(len(idx), S, dtype=torch.long)
        for r, i in enumerate(idx):
            x[r, :len(seqs[i])] = torch.tensor(seqs[i])
        logits = model(input_ids=x.to(dev)).logits  # [B, S, V]
        for r, i in enumerate(idx):
            p, n = len(prompt_ids[i]), len(cont_ids[i])
            yield i, logits[r, p - 1:p - 1 + n], x[r, p:p + n]


@torch.no_grad()
def continuation_nll(model, prompt_ids: list[list[int]], cont_ids: list[list[int]],
                     batch_size: int = 32) -> list[tuple[float, int]]:
    """(summed NLL, tokens) of each continuation given its prompt under `model`, float64 sums (one teacher-forced
    forward per batch, see _teacher_forced)."""
    out: list = [None] * len(prompt_ids)
    for i, lg, tgt in _teacher_forced(model, prompt_ids, cont_ids, batch_size):
        lp = torch.log_softmax(lg if lg.dtype == torch.float64 else lg.float(), -1).double().cpu()  # [n, V]
        out[i] = (float(-lp.gather(-1, tgt[:, None]).sum()), len(tgt))
    return out


@torch.no_grad()
def top1_along(model, prompt_ids: list[list[int]], cont_ids: list[list[int]],
               batch_size: int = 32) -> list[list[tuple[int, float, float]]]:
    """Per prompt, per continuation position j: (the model's argmax token, its top-1 and top-2 probabilities)
    for predicting cont[j] from prompt + cont[:j] (teacher forcing along the given continuation)."""
    out: list = [None] * len(prompt_ids)
    for i, lg, _ in _teacher_forced(model, prompt_ids, cont_ids, batch_size):
        top = torch.softmax(lg.double(), -1).topk(2, -1)  # lg: [n, V]
        out[i] = [(int(t), float(a), float(b)) for t, (a, b) in zip(top.indices[:, 0].tolist(), top.values.tolist())]
    return out


def capacity_along(routers, rec: dict, prompt_ids: list[list[int]], cont_ids: list[list[int]],
                   batch_size: int = 32) -> dict:
    """The routers' FLOP capacity (overall / attn / ffn) on the prompts' positions and on the positions that predict
    the continuation's tokens (prompt's last .. continuation's second to last), from `rec`, the masks
    (routing.record_masks) of one teacher-forced pass as _teacher_forced runs it at `batch_size` (top1_along or
    continuation_nll), right padding excluded: what the routers spend while they write the answer, which a
    calibration on other text does not fix."""
    from ..routing.measure import capacity_from_record

    weights: dict[str, list] = {"prompt": [], "answer": []}
    seqs = [(len(p), len(c)) for p, c in zip(prompt_ids, cont_ids)]
    for k in range(0, len(seqs), batch_size):  # the batches _teacher_forced ran, in its order
        grp = seqs[k:k + batch_size]
        S = max(p + n for p, n in grp)
        w = {name: torch.zeros(len(grp), S) for name in weights}
        for r, (p, n) in enumerate(grp):
            w["prompt"][r, :p] = 1
            w["answer"][r, p - 1:p - 1 + n] = 1
        for name in weights:
            weights[name].append(w[name].reshape(-1))
    out = {}
    for name, ws in weights.items():
        weight = torch.cat(ws)
        if weight.sum() > 0:
            c = capacity_from_record(routers, rec, weight)
            out[name] = {"overall": c["overall"], "attn": c["attn"], "ffn": c["ffn"], "tokens": c["tokens"]}
    return out


TF_BUCKETS = ((0, 1), (1, 4), (4, 16), (16, 64))


def teacher_forced_summary(dense_cont: list[list[int]], wide_top: list, dense_top: list, agree_at: int = 16) -> dict:
    """How often WIDE's argmax is dense's next token along dense's own greedy answer (teacher forcing), by
    answer position; `implied_frac_agree_at` is the product of the per-position rates over the first agree_at
    positions (what exact-prefix agreement would be if positions failed independently). The first position is
    also split by dense's own top-1 margin there (p1 - p2 < 0.2: a near tie, which any change can flip)."""
    by_pos: dict[int, list[int]] = {}
    for d, w in zip(dense_cont, wide_top):
        for j, (t, (a, _, _)) in enumerate(zip(d, w)):
            by_pos.setdefault(j, []).append(int(a == t))
    rate = {j: sum(v) / len(v) for j, v in by_pos.items()}
    implied = 1.0
    for j in range(agree_at):
        implied *= rate.get(j, 1.0)
    buckets = []
    for lo, hi in TF_BUCKETS:
        v = [x for j in range(lo, hi) for x in by_pos.get(j, [])]
        buckets.append({"lo": lo, "hi": hi, "positions": len(v), "top1_agreement": sum(v) / len(v) if v else None})
    first = [(w[0][0] == d[0], dt[0][1] - dt[0][2]) for d, w, dt in zip(dense_cont, wide_top, dense_top) if d]
    tie = [m for m, g in first if g < 0.2]
    clear = [m for m, g in first if g >= 0.2]
    allv = [x for v in by_pos.values() for x in v]
    return {"top1_agreement": sum(allv) / len(allv) if allv else None, "by_position": buckets,
            "implied_frac_agree_at": implied,
            "first_token": {"agreement": sum(m for m, _ in first) / len(first) if first else None,
                            "dense_near_tie_prompts": len(tie),
                            "agreement_near_tie": sum(tie) / len(tie) if tie else None,
                            "agreement_clear": sum(clear) / len(clear) if clear else None}}


def _mean(pairs: list[tuple[float, int]]) -> float | None:
    n = sum(c for _, c in pairs)
    return sum(s for s, _ in pairs) / n if n else None


def agreement_summary(prompt_ids, dense_cont, wide_cont, dense_model, max_new: int = 64, agree_at: int = 16,
                      batch_size: int = 32) -> dict:
    """Per-prompt agreement and the overall figures, given both models' continuations."""
    agree = [agreement_length(d, w, max_new) for d, w in zip(dense_cont, wide_cont)]
    wide_rep = [repeating(w) for w in wide_cont]
    fl_wide = continuation_nll(dense_model, prompt_ids, wide_cont, batch_size)
    fl_dense = continuation_nll(dense_model, prompt_ids, dense_cont, batch_size)
    n = len(agree)
    return {"prompts": n, "max_new_tokens": max_new, "agree_at": agree_at,
            "mean_agreement": sum(agree) / n if n else None,
            "frac_agree_at": sum(a >= agree_at for a in agree) / n if n else None,
            "dense_nll_of_wide": _mean(fl_wide), "dense_nll_of_dense": _mean(fl_dense),
            "repeat_ngram": REPEAT_NGRAM, "repeat_times": REPEAT_TIMES,
            "wide_repeating": sum(wide_rep) / n if n else None,
            "dense_repeating": sum(map(repeating, dense_cont)) / n if n else None,
            "per_prompt": [{"agreement": a, "dense_tokens": len(d), "wide_tokens": len(w),
                            "dense_nll_of_wide": s / c if c else None, "wide_repeating": r}
                           for a, d, w, (s, c), r in zip(agree, dense_cont, wide_cont, fl_wide, wide_rep)]}
