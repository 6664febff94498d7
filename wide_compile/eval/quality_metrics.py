"""The metric runners of `wide eval quality`: each takes (Models, args, data root) -> (result, settings)."""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import torch

from ..routing.attach import record_masks, routed


def dense_cache_path(a, models, settings: dict) -> Path | None:
    """Where the dense ppl record for this model + settings is cached (None: caching off)."""
    if a.dense_cache == "none":
        return None
    from ..models.smollm2 import cache_dir

    key = json.dumps({"model": models.describe["model"], "dtype": models.describe["dtype"],
                      "device": torch.device(a.device).type, **settings}, sort_keys=True)
    d = Path(a.dense_cache) if a.dense_cache else cache_dir() / "eval-dense"
    return d / f"ppl-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def run_ppl(models, a, root):
    from .perplexity import wikitext2_ppl

    settings = {"file": "wikitext-2/wiki.test.raw", "ctx": a.ctx, "stride": a.stride, "max_tokens": a.max_tokens}
    kw = dict(ctx=a.ctx, stride=a.stride, batch_size=a.batch_size, max_tokens=a.max_tokens)
    cache = dense_cache_path(a, models, settings)
    if cache is not None and cache.is_file():
        dense = {**json.loads(cache.read_text()), "from_cache": str(cache)}
    else:
        with routed(models.dense, None):
            dense = wikitext2_ppl(models.dense, models.tokenizer, root, **kw)
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text(json.dumps(dense))
    with routed(models.wide, models.routers):
        wide = wikitext2_ppl(models.wide, models.tokenizer, root, **kw)
    if wide["tokens"] != dense["tokens"]:
        raise ValueError(f"dense ({dense['tokens']}) and WIDE ({wide['tokens']}) scored different token counts")
    return {"ppl_ratio": wide["ppl"] / dense["ppl"], "dense": dense, "wide": wide}, settings


def run_positions(models, a, root):
    from .positions import BUCKETS, bucketize, compare_buckets, position_nll, wikitext2_passages

    settings = {"file": "wikitext-2/wiki.test.raw", "min_tokens": a.min_passage, "max_len": a.max_passage,
                "buckets": list(BUCKETS), "limit": a.limit}
    passages = wikitext2_passages(models.tokenizer, root, a.min_passage, a.max_passage)[:a.limit]
    if not passages:
        raise ValueError(f"no WikiText-2 test article has >= {a.min_passage} tokens (lower --min-passage)")
    edges = [e for e in BUCKETS if e < a.max_passage] + [a.max_passage]
    with routed(models.dense, None):
        d = bucketize(position_nll(models.dense, passages, a.batch_size), edges)
    with routed(models.wide, models.routers):
        w = bucketize(position_nll(models.wide, passages, a.batch_size), edges)
    settings["buckets"] = edges
    n = sum(r["tokens"] for r in d)
    total = {"tokens": n, "dense_nll": sum(r["nll_sum"] for r in d) / n, "wide_nll": sum(r["nll_sum"] for r in w) / n}
    return {"passages": len(passages), "buckets": compare_buckets(d, w), "total": total}, settings


def run_generation(models, a, root):
    from . import prompts as prompt_sets
    from .generation import (agreement_summary, capacity_along, encode_prompts, greedy_continuations, stop_ids,
                             teacher_forced_summary, top1_along)

    rows = prompt_sets.load(a.prompts)[:a.limit]
    tok = models.tokenizer
    ids = encode_prompts(tok, [r["prompt"] for r in rows])
    pad, eos = stop_ids(tok)
    kw = dict(max_new=a.max_new_tokens, batch_size=a.batch_size, pad_id=pad, eos_ids=eos)
    with routed(models.dense, None):
        dense_cont = greedy_continuations(models.dense, ids, **kw)
    with routed(models.wide, models.routers):
        wide_cont = greedy_continuations(models.wide, ids, **kw)
        with record_masks(models.wide) as rec:  # teacher-forced along dense's answer
            wide_top = top1_along(models.wide, ids, dense_cont, a.batch_size)
        capacity = capacity_along(models.routers, rec, ids, dense_cont, a.batch_size)
    with routed(models.dense, None):
        res = agreement_summary(ids, dense_cont, wide_cont, models.dense, a.max_new_tokens, a.agree_at,
                                a.batch_size)
        dense_top = top1_along(models.dense, ids, dense_cont, a.batch_size)
    res["teacher_forced"] = teacher_forced_summary(dense_cont, wide_top, dense_top, a.agree_at)
    res["capacity_along_dense_answers"] = capacity
    for r, p, dc, wc, wt, dt in zip(res["per_prompt"], rows, dense_cont, wide_cont, wide_top, dense_top):
        r.update({"tf_first_match": bool(dc) and wt[0][0] == dc[0],
                  "dense_first_margin": dt[0][1] - dt[0][2] if dt else None,
                  "tf_top1_agreement": sum(w[0] == t for w, t in zip(wt, dc)) / len(dc) if dc else None})
        r.update({"id": p["id"], "source": p["source"], "prompt": p["prompt"],
                  "dense_text": tok.decode(dc, skip_special_tokens=True),
                  "wide_text": tok.decode(wc, skip_special_tokens=True)})
    settings = {"prompts": a.prompts, "limit": a.limit, "max_new_tokens": a.max_new_tokens,
                "agree_at": a.agree_at, "decoding": "greedy, chat template, left-padded batches, EOS stops a row",
                "eos_ids": sorted(set(eos))}
    return res, settings


def run_zeroshot(models, a, root):
    from .capacity import capacity_meter
    from .tasks import evaluate_tasks, prepare_tasks, write_yamls
    from .zeroshot import compare_tasks

    tdir = Path(a.tasks_dir) if a.tasks_dir else Path(a.out) / "tasks"
    if (tdir / "counts.json").is_file() and json.loads((tdir / "counts.json").read_text())["limit"] == a.limit:
        write_yamls(tdir)
    else:
        prepare_tasks(root, tdir, a.limit)
    with routed(models.dense, None):
        dense = evaluate_tasks(models.dense, models.tokenizer, tdir, batch_size=a.batch_size)
    with routed(models.wide, models.routers):
        with capacity_meter(models.wide) as cap:
            wide = evaluate_tasks(models.wide, models.tokenizer, tdir, batch_size=a.batch_size)
    res = {"acc": compare_tasks(dense, wide, metric="acc"), "acc_norm": compare_tasks(dense, wide, metric="acc_norm"),
           "capacity": cap}
    return res, {"tasks_dir": str(tdir), "limit": a.limit, "lm_eval": "zero-shot, local task configs"}


RUNNERS = {"ppl": run_ppl, "positions": run_positions, "generation": run_generation, "zeroshot": run_zeroshot}


def _f(x, fmt=".3f"):
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def summary_line(metric: str, r: dict) -> str:
    if metric == "ppl":
        return (f"ppl: WIDE/dense {_f(r['ppl_ratio'])} (dense {_f(r['dense']['ppl'], '.2f')}, WIDE "
                f"{_f(r['wide']['ppl'], '.2f')}, {r['wide']['tokens']} tokens)")
    if metric == "positions":
        parts = [f"[{b['lo']},{b['hi']}) {_f(b['diff'], '+.3f')}" for b in r["buckets"]]
        return f"positions: WIDE - dense NLL by position ({r['passages']} passages): " + ", ".join(parts)
    if metric == "generation":
        tf = r.get("teacher_forced") or {}
        rep_part = (f"; repeating itself ({r['repeat_ngram']} tokens {r['repeat_times']}+ times): WIDE "
                    f"{_f(r['wide_repeating'], '.0%')}, dense {_f(r['dense_repeating'], '.0%')}"
                    if "wide_repeating" in r else "")
        tf_part = (f"; teacher-forced along dense's answer: top-1 {_f(tf.get('top1_agreement'), '.1%')}, first token "
                   f"{_f((tf.get('first_token') or {}).get('agreement'), '.0%')}" if tf else "")
        cap = r.get("capacity_along_dense_answers") or {}
        cap_part = (f"; routers' capacity along dense's answers {_f(cap['answer']['overall'], '.3f')} (prompts "
                    f"{_f(cap['prompt']['overall'], '.3f')})" if "answer" in cap and "prompt" in cap else "")
        return (f"generation: {r['prompts']} prompts, mean agreement {_f(r['mean_agreement'], '.1f')} tokens, "
                f"{_f(r['frac_agree_at'], '.0%')} agree >= {r['agree_at']}; dense NLL of WIDE's text "
                f"{_f(r['dense_nll_of_wide'])} (of its own {_f(r['dense_nll_of_dense'])})" + rep_part + tf_part
                + cap_part)
    acc = r["acc"]
    parts = [f"{t} {_f(v['retention_above_chance'], '.2f')}" + ("" if v["informative"] else " (uninformative)")
             for t, v in acc["tasks"].items()]
    return "zeroshot: retention above chance (acc): " + ", ".join(parts)
