"""Markdown table, goal check and speedup-vs-capacity plot of the e2e records."""
from __future__ import annotations

from pathlib import Path

from .variants import VARIANTS

GOALS = {  # DESIGN.md / issue 6, Llama-3.1-8B shape, capacity 0.5, batch 1
    "prefill": {"tokens": [2048], "speedup": 1.75, "within_static": 0.05},
    "decode": {"tokens": None, "speedup": 1.6, "within_static": 0.10},
}


def default_attention(r: dict) -> bool:
    """True for a record timed with transformers' own attention (records from before `attention` existed
    were); the goals, the by-capacity table and the missing-cell list read only these (e2e/attention.py)."""
    return r.get("attention", "sdpa") == "sdpa"


def _f(x, nd=2):
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def one_line(r: dict) -> str:
    return (f"    {r['model']} L{r['layers']} {r['phase']:<7} {r['tokens']:>5}x{r['batch']:<2} cap {r['capacity']:.2f} "
            f"{r['masks']:<10} dense {_f(r.get('dense_inductor_ms'), 3)} static {_f(r.get('static_ms'), 3)} "
            f"wide {_f(r.get('wide_ms'), 3)} ms  speedup {_f(r.get('speedup'))}x  (static {_f(r.get('static_speedup'))}x)"
            f"  measured cap {_f(r.get('measured_capacity'), 3)}"
            + (f"  errors: {list(r['errors'])}" if r.get("errors") else ""))


def goals(records: list[dict]) -> list[dict]:
    out = []
    for phase, g in GOALS.items():
        rows = [r for r in records if r.get("model") == "llama-3.1-8b" and r.get("phase") == phase
                and default_attention(r)  # the goals compare against the model as users run it
                and r.get("batch") == 1 and abs(float(r.get("capacity", 0)) - 0.5) < 1e-6
                and (g["tokens"] is None or r.get("tokens") in g["tokens"])]
        for r in rows:
            sp, wos = r.get("speedup"), r.get("wide_over_static")
            out.append({
                "phase": phase, "tokens": r["tokens"], "masks": r["masks"], "layers": r["layers"],
                "speedup": sp, "goal_speedup": g["speedup"],
                "speedup_met": None if sp is None else sp >= g["speedup"],
                "wide_over_static": wos, "goal_within_static": g["within_static"],
                "within_static_met": None if wos is None else wos <= 1 + g["within_static"],
                "note": "full depth" if r["layers"] == 32 else f"{r['layers']} of 32 layers (lm_head share is larger)",
            })
    return out


# the dense variants a record may hold, timed in the same run as WIDE (eager, Inductor default / max-autotune,
# Inductor + CUDA graphs, torch-tensorrt)
DENSE_KEYS = ("eager_dense_ms", "dense_inductor_ms", "dense_max_autotune_ms", "dense_inductor_cg_ms", "trt_ms")


def best_dense(r: dict) -> tuple[str | None, float | None, float | None]:
    """(variant, ms, WIDE speedup over it) of the fastest dense variant timed in this record's run. The issue's
    speedup is over default Inductor; this says how WIDE fares against the best dense option that was measured
    (eager can beat Inductor at long prefill: e2e/attention.py says why). (None, None, None) if no dense
    variant was timed."""
    timed = [(r[k], k[:-3]) for k in DENSE_KEYS if isinstance(r.get(k), (int, float)) and r[k] > 0]
    if not timed:
        return None, None, None
    ms, name = min(timed)
    w = r.get("wide_ms")
    return name, ms, (round(ms / w, 4) if isinstance(w, (int, float)) and w > 0 else None)


def add_best_dense(r: dict) -> dict:
    """Set `best_dense` and `speedup_vs_best_dense` on a record (older records lack them)."""
    name, _, sp = best_dense(r)
    r["best_dense"], r["speedup_vs_best_dense"] = name, sp
    return r


COLS = [("model", "model"), ("layers", "L"), ("phase", "phase"), ("tokens", "tokens"), ("batch", "B"),
        ("capacity", "cap"), ("masks", "masks"), ("measured_capacity", "meas. cap"),
        ("eager_dense_ms", "eager"), ("dense_inductor_ms", "Inductor"), ("dense_max_autotune_ms", "max-autotune"),
        ("dense_inductor_cg_ms", "Ind.+graph"), ("trt_ms", "TRT"), ("static_ms", "static"), ("wide_ms", "WIDE"),
        ("wide_eager_ms", "WIDE eager"), ("wide_paths", "WIDE path (cost model)"),
        *[(f"{spec.key}_speedup", spec.ab_column) for spec in VARIANTS.values() if spec.ab_column],
        ("speedup", "speedup"),
        ("speedup_vs_graphed_default", "speedup vs Ind.+graph"),
        ("speedup_vs_best_dense", "speedup vs fastest dense"),
        ("static_speedup", "static speedup"),
        ("wide_over_static", "WIDE/static"), ("peak_mem_mb", "WIDE mem MB"), ("compile_s", "WIDE compile s")]


def markdown(data: dict) -> str:
    recs = sorted(data.get("records", []), key=lambda r: (r["model"], -r["layers"], r["phase"], r["tokens"],
                                                          r["batch"], -float(r["capacity"]), r["masks"]))
    lines = [f"# End-to-end: WIDE vs Inductor ({data.get('gpu') or data.get('device')})", "",
             f"torch {data.get('torch')}, triton {data.get('triton')}, transformers {data.get('transformers')}, "
             f"{data.get('dtype')}, {data.get('date')}", ""] + _commands(data, recs) + [
             "Times are medians in ms per step (prefill: one forward over tokens x batch, logits of the last "
             "position; decode: one token per sequence against a static KV cache of `tokens` positions). "
             "speedup = Inductor / WIDE; \"speedup vs fastest dense\" divides the fastest dense variant timed in "
             "the same run (eager, Inductor, max-autotune, Inductor + graph, TRT) by WIDE; " + _graphs_note(data)
             + " p10/p90 and compile times per variant are in the JSON.", "",
             "| " + " | ".join(h for _, h in COLS) + " |", "|" + "---|" * len(COLS)]
    for r in recs:
        if "speedup_vs_best_dense" not in r:
            r = add_best_dense(dict(r))
        cells = []
        for k, _ in COLS:
            v = r.get(k)
            if k == "model" and not default_attention(r):  # e2e/attention.py: not the default run
                v = f"{v} (attention {r['attention']})"
            nd = 3 if k.endswith("_ms") else 2
            if k == "peak_mem_mb" or k == "compile_s":
                nd = 0 if k == "peak_mem_mb" else 1
            cells.append(_f(v, nd) if not isinstance(v, float) or k != "capacity" else f"{v:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    g = data.get("goals") or goals(recs)
    if g:
        lines += ["", "## Goals (Llama-3.1-8B shape, capacity 0.5, batch 1)", "",
                  "| phase | tokens | masks | layers | speedup | goal | met | WIDE/static | goal | met |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for x in g:
            lines.append(f"| {x['phase']} | {x['tokens']} | {x['masks']} | {x['layers']} | {_f(x['speedup'])} | "
                         f"≥{x['goal_speedup']} | {_yn(x['speedup_met'])} | {_f(x['wide_over_static'])} | "
                         f"≤{1 + x['goal_within_static']:.2f} | {_yn(x['within_static_met'])} |")
    by_cap = capacity_table(recs)
    if by_cap:
        lines += ["", "## Speedup over dense Inductor by capacity (4 layers, random masks)", ""] + by_cap
    missing = data.get("missing") or []
    if missing:
        lines += ["", f"## Not measured yet ({len(missing)} cells of the table)", ""] + [f"- {m}" for m in missing]
    errs = [(r, k, v) for r in recs for k, v in (r.get("errors") or {}).items()]
    skips = data.get("skipped") or []
    if errs or skips:
        lines += ["", "## Skipped / failed", ""]
        seen = set()
        for r, k, v in errs:
            s = f"- {r['model']} {r['phase']} {r['tokens']}x{r['batch']} cap {r['capacity']} {r['masks']}: {k}: {v[:300]}"
            if (k, v) not in seen:
                lines.append(s)
                seen.add((k, v))
        for s in skips:
            lines.append(f"- {s[:400]}")
        row_skips = {(k, v) for r in recs for k, v in (r.get("skipped") or {}).items()}
        for k, v in sorted(row_skips):
            lines.append(f"- {k}: {v[:300]}")
    return "\n".join(lines) + "\n"


# The table: every workload at every capacity (DESIGN.md / issue 6)
GRID = {"prefill": [(t, b) for t in (512, 2048, 8192) for b in (1, 4)],
        "decode": [(t, b) for t in (1024, 4096) for b in (1, 8)]}
GRID_CAPACITIES = (1.0, 0.75, 0.5, 0.3)


def missing_cells(records: list[dict], model: str, layers: int, capacities=GRID_CAPACITIES) -> list[str]:
    """The cells of the issue's table (phase, tokens x batch, capacity) that have no complete WIDE row for
    this model at this depth, so a merged results file says what is still owed."""
    done = {(r["phase"], r["tokens"], r["batch"], round(float(r["capacity"]), 3)) for r in records
            if r["model"] == model and r["layers"] == layers and r.get("wide_ms") is not None
            and default_attention(r)}
    return [f"{model} ({layers} layers) {ph} {t}x{b} cap {c}" for ph, wl in GRID.items() for t, b in wl
            for c in capacities if (ph, t, b, round(c, 3)) not in done]


def capacity_table(records: list[dict], layers: int = 4, masks: str = "random",
                   capacities=GRID_CAPACITIES, static_capacities=(0.75, 0.5, 0.3)) -> list[str]:
    """Markdown rows of WIDE's (and the static model's) speedup over dense Inductor per capacity, one row per
    (model, workload) at this depth and mask kind; "dense Inductor" is the capacity-0.5 record's (else the
    first capacity timed). Each cell is one record's ratio, so every figure traces back to a run."""
    cells: dict = {}
    for r in records:
        if r.get("layers") == layers and r.get("masks") == masks and default_attention(r):
            key = (r["model"], r["phase"] != "prefill", r["tokens"], r["batch"])
            cells.setdefault(key, {})[round(float(r["capacity"]), 3)] = r
    if not cells:
        return []

    def ratio(r, k):
        d, x = (r or {}).get("dense_inductor_ms"), (r or {}).get(k)
        return f"{d / x:.2f}×" if isinstance(d, (int, float)) and isinstance(x, (int, float)) and x > 0 else "–"

    out = ["| model | workload | dense Inductor | " + " | ".join(
        [f"WIDE {capacities[0]}"] + [str(c) for c in capacities[1:]]
        + [f"static {static_capacities[0]}"] + [str(c) for c in static_capacities[1:]]) + " |",
        "|" + "---|" * (3 + len(capacities) + len(static_capacities))]
    for (model, is_decode, tokens, batch) in sorted(cells):
        c = cells[(model, is_decode, tokens, batch)]
        ref = c.get(0.5) or next(iter(c.values()))
        wl = f"decode ctx {tokens}×{batch}" if is_decode else f"prefill {tokens}×{batch}"
        out.append(f"| {model} | {wl} | {_f(ref.get('dense_inductor_ms'))} ms | " + " | ".join(
            [ratio(c.get(round(q, 3)), "wide_ms") for q in capacities]
            + [ratio(c.get(round(q, 3)), "static_ms") for q in static_capacities]) + " |")
    return out


def _graphs_note(data: dict) -> str:
    """Which phases ran in CUDA graphs (--prefill-cuda-graphs puts prefill in them too)."""
    if "--prefill-cuda-graphs" in str(data.get("command", "")):
        return ("the Inductor and static columns are mode=\"reduce-overhead\" (CUDA graphs) for prefill and decode "
                "(--prefill-cuda-graphs); WIDE runs in a manual CUDA graph in both phases.")
    return ("the Inductor column is default mode for prefill and mode=\"reduce-overhead\" (CUDA graphs) for "
            "decode; WIDE decode runs in a manual CUDA graph.")


def _commands(data: dict, recs: list[dict]) -> list[str]:
    """The command that produced the rows; a merged file lists every run with its date and row count."""
    runs: dict = {}
    for r in recs:
        key = (r.get("date") or data.get("date"), r.get("command") or data.get("command"))
        runs[key] = runs.get(key, 0) + 1
    if len(runs) <= 1:
        return [f"`{data.get('command')}`", ""]
    out = [f"Rows from {len(runs)} runs (each record's command and date are in the JSON):", ""]
    out += [f"- {d} ({n} rows): `{c}`" for (d, c), n in sorted(runs.items(), key=lambda x: str(x[0][0]))]
    return out + [""]


def _yn(x):
    return "–" if x is None else ("yes" if x else "**no**")


def plot_panels(records: list[dict]) -> list[tuple]:
    """One panel per (model, depth, phase), deepest first. Rows timed at different depths are not comparable
    (the lm_head and the embedding weigh more in a shallow model), so their lines must not join."""
    return sorted({(r["model"], r["layers"], r["phase"]) for r in records}, key=lambda p: (p[0], -p[1], p[2]))


def plot(data: dict, path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [r for r in data.get("records", []) if r.get("speedup") or r.get("static_speedup")]
    panels = plot_panels(data.get("records", []))
    if not panels:
        panels = [("none", 0, "none")]
    ncol = 2
    nrow = (len(panels) + ncol - 1) // ncol
    fig, axes = plt.subplots(nrow, ncol, figsize=(6.5 * ncol, 4.2 * nrow), squeeze=False)
    styles = {"random": "-", "correlated": "--", "trained": "-.", "all-on": ":"}
    for ax, (model, layers, phase) in zip(axes.flat, panels):
        rs = [r for r in recs if (r["model"], r["layers"], r["phase"]) == (model, layers, phase)]
        workloads = sorted({(r["tokens"], r["batch"]) for r in rs})
        cmap = plt.get_cmap("tab10")
        for wi, (t, b) in enumerate(workloads):
            col = cmap(wi % 10)
            for masks in sorted({r["masks"] for r in rs}):
                pts = sorted((r["capacity"], r["speedup"]) for r in rs
                             if (r["tokens"], r["batch"], r["masks"]) == (t, b, masks) and r.get("speedup"))
                if pts:
                    ax.plot(*zip(*pts), styles.get(masks, "-"), marker="o", color=col,
                            label=f"WIDE {t}x{b} {masks}")
            by_cap: dict = {}
            for r in rs:  # the static model is re-timed in every row: one point per capacity (median)
                if (r["tokens"], r["batch"]) == (t, b) and r.get("static_speedup"):
                    by_cap.setdefault(r["capacity"], []).append(r["static_speedup"])
            st = sorted((c, sorted(v)[len(v) // 2]) for c, v in by_cap.items())
            if st:
                ax.plot(*zip(*st), ":", marker="s", color=col, alpha=0.5, label=f"static {t}x{b}")
        caps = [0.3, 0.5, 0.75, 1.0]
        ax.plot(caps, [1 / c for c in caps], color="gray", lw=0.8, alpha=0.6, label="1/capacity")
        ax.axhline(1.0, color="k", lw=0.6)
        if model == "llama-3.1-8b" and layers == 32:  # the goals are set on the full-depth model
            goal = GOALS[phase]["speedup"] if phase in GOALS else None
            if goal:
                ax.plot([0.5], [goal], marker="*", ms=14, color="red", ls="none", label=f"goal {goal}x")
        ax.set_title(f"{model}, {layers} layers, {phase}")
        ax.set_xlabel("capacity (FLOP fraction)")
        ax.set_ylabel("speedup vs dense Inductor")
        ax.set_xlim(0.25, 1.05)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(f"WIDE end to end, {data.get('gpu') or data.get('device')}, torch {data.get('torch')}")
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_size_inches()[1]))  # room for the suptitle
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
