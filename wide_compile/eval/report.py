"""Results file, README table, and what the routers learned (per-layer / per-token-kind skip rates, PNG).

Retention (per record, against the dense record): raw = mean_task(acc) / mean_task(acc_dense);
above chance = (mean(acc) - mean(chance)) / (mean(acc_dense) - mean(chance)); both for acc and acc_norm.
Token kinds: a token that starts a word (leading space or first in block) and is alphabetic is a
"function" word if the word is in FUNCTION_WORDS (closed-class English words), else a "content" word;
word-continuation pieces, digits and punctuation are "other".
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .tasks import CHANCE, TASKS

FUNCTION_WORDS = frozenset("""
a an the this that these those some any each every no all both either neither much many more most few
little several such what which whose who whom whoever whatever whichever i me my mine myself you your
yours yourself yourselves he him his himself she her hers herself it its itself we us our ours ourselves
they them their theirs themselves one ones
and or but nor so yet for if then else because although though while whereas unless since until till
than as whether
of in on at by to from with without within into onto upon about above below under over between among
through during before after against around along across behind beyond near off out up down toward
towards via per like unlike despite except inside outside throughout beneath beside besides
be am is are was were been being have has had having do does did doing will would shall should can
could may might must ought
not n't also too very just only even still already there here where when why how again ever never
once yes
""".split())


def token_kinds(tokenizer, ids: torch.Tensor) -> torch.Tensor:
    """Kind per token of ids [N]: 0 = function word, 1 = content word, 2 = other."""
    cache: dict[int, int] = {}
    out = torch.empty(ids.numel(), dtype=torch.long)
    for n, t in enumerate(ids.reshape(-1).tolist()):
        k = cache.get(t)
        if k is None:
            piece = tokenizer.convert_ids_to_tokens(t) or ""
            starts = piece.startswith(("Ġ", "▁", " "))
            word = piece.lstrip("Ġ▁ ").lower()
            if starts and word.isalpha():
                k = 0 if word in FUNCTION_WORDS else 1
            else:
                k = 2
            cache[t] = k
        out[n] = k
    return out


KIND_NAMES = ("function", "content", "other")


@torch.no_grad()
def router_stats(model, tokenizer, routers, blocks: torch.Tensor, batch_size: int = 8) -> dict:
    """Skip rates of `routers` on `blocks` [N, S] (hard decisions): per layer, by token kind, attn vs FFN."""
    from ..routing import FlopCost, record_masks, routed

    dev = next(model.parameters()).device
    L = routers.spec.num_layers
    fa = [[] for _ in range(L)]
    ff = [[] for _ in range(L)]
    with routed(model, routers):  # these routers, whatever was attached before
        for b in range(0, len(blocks), batch_size):
            with record_masks(model) as rec:
                model(input_ids=blocks[b:b + batch_size].to(dev))
            for i in range(L):
                fa[i].append(rec["attn"][i][0].float().mean(-1).reshape(-1).cpu())
                ff[i].append(rec["ffn"][i][0].float().mean(-1).reshape(-1).cpu())
    A = torch.stack([torch.cat(x) for x in fa])  # [L, N] active fraction
    Fm = torch.stack([torch.cat(x) for x in ff])
    kinds = token_kinds(tokenizer, blocks.reshape(-1)) if tokenizer is not None else torch.full((A.shape[1],), 2)
    cost = FlopCost.from_routers(routers)
    out = {"tokens": int(A.shape[1]),
           "attn_skip_per_layer": (1 - A.mean(1)).tolist(), "ffn_skip_per_layer": (1 - Fm.mean(1)).tolist(),
           "attn_skip": float(1 - A.mean()), "ffn_skip": float(1 - Fm.mean()), "by_kind": {}}
    c = cost.capacity(list(A), list(Fm))
    out["capacity"] = float(c["overall"])
    # the FLOP split: of the skipped linear FLOPs, how much is attention (q/o) and how much FFN
    skip_a = float((1 - A).mean(1).sum()) * cost.qo
    skip_f = float((1 - Fm).mean(1).sum()) * cost.ffn
    out["skipped_flops_attn_share"] = skip_a / max(1e-9, skip_a + skip_f)
    for k, name in enumerate(KIND_NAMES):
        sel = kinds == k
        if sel.sum() == 0:
            continue
        ck = cost.capacity([a[sel] for a in A], [f[sel] for f in Fm])
        out["by_kind"][name] = {"count": int(sel.sum()), "attn_skip": float(1 - A[:, sel].mean()),
                                "ffn_skip": float(1 - Fm[:, sel].mean()), "capacity": float(ck["overall"]),
                                "attn_skip_per_layer": (1 - A[:, sel].mean(1)).tolist(),
                                "ffn_skip_per_layer": (1 - Fm[:, sel].mean(1)).tolist()}
    return out


def plot_stats(stats: dict, path) -> None:
    """stats: {label: router_stats(...)} -> one PNG: per-layer heatmaps (attn / FFN skip) + token-kind bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    labels = list(stats)
    n = len(labels)
    fig, axes = plt.subplots(n, 2, figsize=(14, 2.2 * n + 0.6), squeeze=False,
                             gridspec_kw={"width_ratios": [3.2, 1]})
    for r, lab in enumerate(labels):
        s = stats[lab]
        rows = [s["attn_skip_per_layer"], s["ffn_skip_per_layer"]]
        names = ["attn", "FFN"]
        for kname in ("function", "content"):
            if kname in s["by_kind"]:
                rows += [s["by_kind"][kname]["attn_skip_per_layer"], s["by_kind"][kname]["ffn_skip_per_layer"]]
                names += [f"attn|{kname[:4]}", f"FFN|{kname[:4]}"]
        ax = axes[r][0]
        im = ax.imshow(np.array(rows), aspect="auto", cmap="magma_r", vmin=0, vmax=1)
        ax.set_yticks(range(len(names)), names, fontsize=7)
        ax.set_xticks(range(len(rows[0])), range(len(rows[0])), fontsize=6)
        ax.set_title(f"{lab}: skip rate per layer (capacity {s['capacity']:.3f})", fontsize=9)
        fig.colorbar(im, ax=ax, fraction=0.02)
        ax2 = axes[r][1]
        kinds = [k for k in ("function", "content", "other") if k in s["by_kind"]]
        x = np.arange(len(kinds))
        ax2.bar(x - 0.2, [s["by_kind"][k]["attn_skip"] for k in kinds], 0.4, label="attn")
        ax2.bar(x + 0.2, [s["by_kind"][k]["ffn_skip"] for k in kinds], 0.4, label="FFN")
        ax2.set_xticks(x, kinds, fontsize=7)
        ax2.set_ylim(0, 1)
        ax2.set_title("skip rate by token kind", fontsize=9)
        ax2.legend(fontsize=7)
    axes[-1][0].set_xlabel("layer")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _avg(rec: dict, metric: str) -> float | None:
    t = rec.get("tasks") or {}
    if not all(k in t for k in TASKS):
        return None
    return sum(t[k][metric] for k in TASKS) / len(TASKS)


def informative_tasks(dense: dict, margin: float = 0.05) -> list[str]:
    """Tasks on which the dense model is at least `margin` above chance (acc). Retention on a task where
    the dense model is at (or below) chance measures label bias, not kept ability."""
    return [t for t in TASKS if t in (dense.get("tasks") or {}) and dense["tasks"][t]["acc"] - CHANCE[t] >= margin]


def add_retention(records: list[dict]) -> list[dict]:
    dense = next((r for r in records if r["method"] == "dense"), None)
    chance = sum(CHANCE[t] for t in TASKS) / len(TASKS)
    if dense is not None:
        inf = informative_tasks(dense)
        ch_i = sum(CHANCE[t] for t in inf) / max(1, len(inf))
        d_i = sum(dense["tasks"][t]["acc"] for t in inf) / max(1, len(inf))
    for r in records:
        if dense is not None and inf and all(t in (r.get("tasks") or {}) for t in inf):
            a_i = sum(r["tasks"][t]["acc"] for t in inf) / len(inf)
            r["informative_tasks"] = inf
            r["retention_informative_acc"] = a_i / d_i
            r["retention_informative_above_chance_acc"] = (a_i - ch_i) / (d_i - ch_i)
        for m in ("acc", "acc_norm"):
            a = _avg(r, m)
            r[f"avg_{m}"] = a
            if dense is not None and a is not None and _avg(dense, m):
                d = _avg(dense, m)
                r[f"retention_{m}"] = a / d
                r[f"retention_above_chance_{m}"] = (a - chance) / (d - chance)
    return records


def markdown_table(records: list[dict]) -> str:
    add_retention(records)
    head = ("| method | stage | cap. target | cap. measured | " + " | ".join(TASKS) +
            " | avg acc | retention (raw) | retention (above chance) | retention, informative tasks (raw / above"
            " chance) | avg acc_norm | WikiText-2 ppl |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    order = {"dense": 0, "wide": 1, "static": 2, "skipgpt": 3}
    for r in sorted(records, key=lambda r: (-r["capacity_target"], order.get(r["method"], 9), r.get("variant", ""),
                                            r["stage"])):
        t = r.get("tasks") or {}
        cells = [f"{t[k]['acc']:.3f}/{t[k]['acc_norm']:.3f}" if k in t else "–" for k in TASKS]
        f = lambda v, p=3: "–" if v is None else f"{v:.{p}f}"  # noqa: E731
        name = r["method"] + (f" ({r['variant']})" if r.get("variant") else "")
        lines.append(f"| {name} | {r['stage']} | {r['capacity_target']:.2f} | {f(r.get('capacity_measured'))} | "
                     + " | ".join(cells) + f" | {f(r.get('avg_acc'))} | {f(r.get('retention_acc'))} | "
                     f"{f(r.get('retention_above_chance_acc'))} | {f(r.get('retention_informative_acc'))} / "
                     f"{f(r.get('retention_informative_above_chance_acc'))} | {f(r.get('avg_acc_norm'))} | "
                     f"{f(r.get('wikitext2_ppl'), 2)} |")
    inf = next((r.get("informative_tasks") for r in records if r.get("informative_tasks")), None)
    note = ("\n\nTask cells: acc/acc_norm. Retention uses acc averaged over the five tasks; 'informative tasks' "
            f"are those where dense is >= 5 points above chance ({', '.join(inf or [])}).\n")
    return "\n".join(lines) + note


def write_report(results_path, md_path=None, png_path=None) -> str:
    res = json.loads(Path(results_path).read_text())
    md = markdown_table(res["records"])
    if md_path:
        Path(md_path).write_text(md)
    if png_path and res.get("router_stats"):
        plot_stats(res["router_stats"], png_path)
    return md


RUN_KEYS = ("command", "date", "gpu", "versions")


def record_key(r: dict) -> tuple:
    return (r["method"], r["stage"], round(float(r["capacity_target"]), 3), r.get("variant") or "")


def merge_runs(results: list[dict]) -> dict:
    """One results file from several pipeline runs (each a results dict as the pipeline writes it).

    Every record is stamped with its own run's command, date, GPU and versions (a merged file has no
    single command). The first record of each (method, stage, capacity, variant) is kept; a later one is
    listed under `repeats` with its average accuracy, so run-to-run noise stays visible instead of being
    silently replaced. Router statistics are merged by name (later runs win). An input that is itself a
    merged file (it has `runs`) contributes its runs and repeats as they are."""
    if not results:
        raise ValueError("merge_runs: no results to merge")
    out: dict = {"records": [], "repeats": [], "router_stats": {}, "runs": []}
    seen: dict = {}
    for res in results:
        if "runs" in res:  # an already merged file: keep its runs and its repeats (run indices shifted)
            shift = len(out["runs"])
            out["runs"].extend(res["runs"])
            out["repeats"].extend({**rep, "run": rep["run"] + shift} for rep in res.get("repeats", []))
            i = None
        else:
            run = {k: res[k] for k in RUN_KEYS if k in res}
            run.update({k: res[k] for k in ("protocol", "skipped", "timings", "notes") if k in res})
            out["runs"].append(run)
            i = len(out["runs"]) - 1
        for r in res.get("records", []):
            r = dict(r)
            for k in RUN_KEYS:
                if k not in r and k in res:
                    r[k] = res[k]
            key = record_key(r)
            if key in seen:
                add_retention([r] + [x for x in out["records"] if x["method"] == "dense"][:1])
                out["repeats"].append({"key": list(key), "run": i, "avg_acc": _avg(r, "acc"),
                                       "kept_avg_acc": _avg(seen[key], "acc"),
                                       "wikitext2_ppl": r.get("wikitext2_ppl"),
                                       "kept_wikitext2_ppl": seen[key].get("wikitext2_ppl"),
                                       "command": r.get("command"), "date": r.get("date")})
                continue
            seen[key] = r
            out["records"].append(r)
        out["router_stats"].update(res.get("router_stats") or {})
    add_retention(out["records"])
    return out
