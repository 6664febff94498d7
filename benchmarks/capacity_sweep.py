#!/usr/bin/env python3
"""The capacity sweep at equal measured FLOPs (issue 19, item 5): one table and one plot from recipe runs.

    python benchmarks/capacity_sweep.py RUN [RUN ...] --out DIR

Each RUN is a `python -m wide_compile.training recipe` run folder (summary.json) whose routers were scored by
`wide eval quality --out RUN/quality` (quality/ppl.json; quality/generation.json is read when present); a
folder without summary.json stands for its subfolders that are runs. Runs are grouped by method from
summary.json's baseline: WIDE (free masks; another --s1-structure is its own method), SkipGPT-style, static.

Writes DIR/capacity-sweep.md, .json and .png: per run the target capacity, the FLOP-weighted capacity
measured on the WikiText-2 test tokens (overall / attention / FFN), the WikiText-2 perplexity, its ratio to
dense and the generation agreement; the plot draws the ppl ratio (log scale) against the measured capacity,
one line per method, with the issue's ratio goals.

Equal measured FLOPs: targets are met only approximately, so methods are compared at measured capacities.
Each method's curve is log(ppl) linear in measured capacity between its runs. At every capacity some run
measured, the other methods' curves are interpolated there (never extrapolated outside a curve's measured
range) and WIDE's advantage factor is ppl(method) / ppl(WIDE) at that capacity (above 1: WIDE is better).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import shlex
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

METHODS = {"none": "WIDE", "skipgpt": "SkipGPT-style", "static": "static"}
WIDE = "WIDE"
RATIO_GOALS = ((0.5, 1.6), (0.7, 1.25))  # (capacity, highest WIDE/dense ppl ratio): the goals
ADVANTAGE_GOAL = 1.5  # WIDE's ppl at least this many times lower than each baseline's, at equal FLOPs
EVAL_SETTINGS = ("file", "ctx", "stride", "max_tokens")  # must agree across runs for ratios to compare
DENSE_RTOL = 1e-6


class SweepError(ValueError):
    """A run folder or record the sweep cannot use; the message names the folder and what to do."""


@dataclass
class Run:
    folder: str
    method: str
    target: float
    capacity: dict  # measured on the WikiText-2 test tokens: overall / attn / ffn
    ppl: float
    dense_ppl: float
    ratio: float
    argv: list
    train_device: str
    eval_device: str
    eval_date: str
    eval_settings: dict
    model: str
    generation: dict | None = field(default=None)


def _read_json(path: Path, run: Path) -> dict:
    if not path.is_file():
        hint = ("not a finished recipe run (python -m wide_compile.training recipe writes it at the end)"
                if path.name == "summary.json" else
                f"score it: wide eval quality --routers {run}/routers.safetensors --lora {run}/lora.safetensors "
                f"--metrics ppl --out {run}/quality")
        raise SweepError(f"run folder {run}: no {path.relative_to(run)}; {hint}")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SweepError(f"run folder {run}: {path.relative_to(run)} is not valid JSON ({e}); "
                         "re-run the command that wrote it") from None


def _get(rec: dict, keys: str, run: Path, name: str):
    cur = rec
    for k in keys.split("."):
        if not isinstance(cur, dict) or k not in cur:
            raise SweepError(f"run folder {run}: {name} has no {keys} (written by an older or another command?); "
                             "re-run the command that wrote it")
        cur = cur[k]
    return cur


def _method(summary: dict, run: Path) -> str:
    base = summary.get("baseline", "none")
    if base not in METHODS:
        raise SweepError(f"run folder {run}: summary.json baseline {base!r} is none of {sorted(METHODS)}")
    argv = summary.get("argv") or []
    structure = argv[argv.index("--s1-structure") + 1] if "--s1-structure" in argv[:-1] else "free"
    return METHODS[base] if structure == "free" else f"{METHODS[base]} ({structure})"


def load_run(folder) -> Run:
    """One run's records -> Run; SweepError naming the folder when one is missing or malformed."""
    run = Path(folder)
    if not run.is_dir():
        raise SweepError(f"run folder {run} does not exist")
    summary = _read_json(run / "summary.json", run)
    ppl = _read_json(run / "quality" / "ppl.json", run)
    cap = {k: float(_get(ppl, f"result.wide.capacity.{k}", run, "quality/ppl.json")) for k in ("overall", "attn", "ffn")}
    gen = None
    if (run / "quality" / "generation.json").is_file():
        g = _read_json(run / "quality" / "generation.json", run)
        gen = {k: _get(g, f"result.{k}", run, "quality/generation.json")
               for k in ("prompts", "agree_at", "frac_agree_at", "mean_agreement")}
    return Run(folder=str(run), method=_method(summary, run),
               target=float(_get(summary, "capacity", run, "summary.json")), capacity=cap,
               ppl=float(_get(ppl, "result.wide.ppl", run, "quality/ppl.json")),
               dense_ppl=float(_get(ppl, "result.dense.ppl", run, "quality/ppl.json")),
               ratio=float(_get(ppl, "result.ppl_ratio", run, "quality/ppl.json")),
               argv=list(summary.get("argv") or []), train_device=str(summary.get("device", "?")),
               eval_device=str(_get(ppl, "machine.device_name", run, "quality/ppl.json")),
               eval_date=str(_get(ppl, "date", run, "quality/ppl.json")),
               eval_settings={k: _get(ppl, f"settings.{k}", run, "quality/ppl.json") for k in EVAL_SETTINGS},
               model=str(ppl.get("models", {}).get("model", {}).get("name", "model")),
               generation=gen)


def find_runs(paths) -> list[Path]:
    """Run folders: each path holding summary.json, else its subfolders holding summary.json or quality/."""
    out = []
    for p in map(Path, paths):
        if not p.is_dir():
            raise SweepError(f"run folder {p} does not exist")
        if (p / "summary.json").exists():
            out.append(p)
            continue
        subs = sorted(d for d in p.iterdir() if d.is_dir() and ((d / "summary.json").exists() or (d / "quality").is_dir()))
        if not subs:
            raise SweepError(f"{p} is no run folder (no summary.json) and holds none; pass recipe run folders")
        out += subs
    return out


def check_comparable(runs: list[Run]) -> None:
    """Ratios compare only on the same evaluation: same settings, same dense ppl; one run per method and target."""
    if not runs:
        raise SweepError("no runs given")
    ref = runs[0]
    seen = {}
    for r in runs:
        if r.eval_settings != ref.eval_settings:
            raise SweepError(f"run folders {ref.folder} and {r.folder} were scored with different ppl settings "
                             f"({ref.eval_settings} vs {r.eval_settings}); score them alike")
        if abs(r.dense_ppl - ref.dense_ppl) > DENSE_RTOL * ref.dense_ppl:
            raise SweepError(f"run folders {ref.folder} and {r.folder} have different dense ppl "
                             f"({ref.dense_ppl} vs {r.dense_ppl}): another model, dtype or data; score them alike")
        key = (r.method, r.target)
        if key in seen:
            raise SweepError(f"run folders {seen[key]} and {r.folder} are both {r.method} at target capacity "
                             f"{r.target}; pass one of them")
        seen[key] = r.folder


def interpolate_log(points: list[tuple[float, float]], x: float) -> float | None:
    """ppl at capacity x on a curve [(capacity, ppl)], linear in log(ppl) between neighbours; None outside."""
    pts = sorted(points)
    if not pts or x < pts[0][0] or x > pts[-1][0]:
        return None
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            if x1 == x0:
                return math.exp((math.log(y0) + math.log(y1)) / 2)
            t = (x - x0) / (x1 - x0)
            return math.exp((1 - t) * math.log(y0) + t * math.log(y1))
    return pts[0][1]  # a single-point curve, x on it


def equal_flops(runs: list[Run], wide: str = WIDE) -> list[dict]:
    """WIDE's advantage factor against every other method at every measured capacity both curves cover."""
    curves: dict[str, list] = {}
    for r in runs:
        curves.setdefault(r.method, []).append((r.capacity["overall"], r.ppl))
    if wide not in curves:
        return []
    rows = []
    for other in sorted(m for m in curves if m != wide):
        at: dict[float, list] = {}
        for m in (wide, other):
            for c, _ in curves[m]:
                at.setdefault(c, []).append(f"{m} run")
        for c, sources in sorted(at.items()):
            source = " and ".join(dict.fromkeys(sources))
            pw, po = interpolate_log(curves[wide], c), interpolate_log(curves[other], c)
            if pw is None or po is None:
                continue
            rows.append({"method": other, "capacity": c, "measured_by": source, "wide_ppl": pw, "method_ppl": po,
                         "advantage": po / pw, "goal_met": po / pw >= ADVANTAGE_GOAL})
    return rows


def ratio_goals(runs: list[Run], wide: str = WIDE) -> list[dict]:
    """The issue's WIDE/dense ratio goals against WIDE's curve (interpolated at the goal's capacity)."""
    pts = [(r.capacity["overall"], r.ratio) for r in runs if r.method == wide]
    out = []
    for cap, goal in RATIO_GOALS:
        got = interpolate_log(pts, cap)
        out.append({"capacity": cap, "ratio_goal": goal, "wide_ratio": got, "met": None if got is None else got <= goal})
    return out


def build(runs: list[Run], command: str) -> dict:
    check_comparable(runs)
    runs = sorted(runs, key=lambda r: (r.method != WIDE, r.method, r.capacity["overall"]))
    dates = sorted(r.eval_date for r in runs)
    return {"command": command, "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "records_dated": [dates[0], dates[-1]],
            "machines": {"training": sorted({r.train_device for r in runs}),
                         "quality": sorted({r.eval_device for r in runs})},
            "model": runs[0].model, "eval_settings": runs[0].eval_settings, "dense_ppl": runs[0].dense_ppl,
            "how": __doc__.split("\n\n")[-1].strip().replace("\n", " "),
            "runs": [asdict(r) for r in runs], "equal_flops": equal_flops(runs), "ratio_goals": ratio_goals(runs),
            "advantage_goal": ADVANTAGE_GOAL}


def _f(x, fmt=".3f"):
    return "n/a" if x is None else format(x, fmt)


def markdown(d: dict) -> str:
    lines = [f"# Capacity sweep at equal measured FLOPs ({d['model']}, WikiText-2 test)", "",
             f"Command: `{d['command']}`  ", f"Made {d['date']} from records dated {d['records_dated'][0]} .. "
             f"{d['records_dated'][1]}; trained on {', '.join(d['machines']['training'])}, scored on "
             f"{', '.join(d['machines']['quality'])}. Dense ppl {d['dense_ppl']:.3f} "
             f"(settings {d['eval_settings']}).", "",
             "| method | run | target capacity | measured overall / attn / FFN | ppl | ratio to dense | "
             "generation: agree >= N tokens (mean) | argv |", "|---|---|---|---|---|---|---|---|"]
    for r in d["runs"]:
        c, g = r["capacity"], r["generation"]
        gen = "-" if g is None else f"{g['frac_agree_at']:.0%} >= {g['agree_at']} ({g['mean_agreement']:.1f})"
        lines.append(f"| {r['method']} | `{Path(r['folder']).name}` | {r['target']:g} | {c['overall']:.3f} / "
                     f"{c['attn']:.3f} / {c['ffn']:.3f} | {r['ppl']:.2f} | **{r['ratio']:.3f}** | {gen} | "
                     f"`{shlex.join(r['argv'])}` |")
    lines += ["", "## WIDE against each method at equal measured FLOPs", "", d["how"], "",
              f"| method | measured capacity | measured by | WIDE ppl | method ppl | WIDE's advantage "
              f"(goal >= {d['advantage_goal']}) |", "|---|---|---|---|---|---|"]
    for e in d["equal_flops"]:
        lines.append(f"| {e['method']} | {e['capacity']:.3f} | {e['measured_by']} | {e['wide_ppl']:.2f} | "
                     f"{e['method_ppl']:.2f} | **{e['advantage']:.2f}x**{'' if e['goal_met'] else ' (below goal)'} |")
    if not d["equal_flops"]:
        lines.append("| (no capacity where WIDE's and another method's measured ranges overlap) | | | | | |")
    lines += ["", "## WIDE/dense ratio goals (WIDE's curve at the goal's capacity)", ""]
    for g in d["ratio_goals"]:
        state = "outside WIDE's measured range" if g["met"] is None else ("met" if g["met"] else "missed")
        lines.append(f"- capacity {g['capacity']}: goal <= {g['ratio_goal']}, WIDE {_f(g['wide_ratio'])} ({state})")
    return "\n".join(lines) + "\n"


def plot(d: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(8, 5.2))
    for m in dict.fromkeys(r["method"] for r in d["runs"]):
        pts = sorted((r["capacity"]["overall"], r["ratio"]) for r in d["runs"] if r["method"] == m)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m, lw=2.2 if m == WIDE else 1.4)
    for i, g in enumerate(d["ratio_goals"]):
        ax.plot([g["capacity"] - 0.03, g["capacity"] + 0.03], [g["ratio_goal"]] * 2, color="red", lw=2.5,
                label="goal: WIDE ratio at most" if i == 0 else None)
        ax.annotate(f"<= {g['ratio_goal']} at {g['capacity']}", (g["capacity"], g["ratio_goal"]),
                    textcoords="offset points", xytext=(0, -12), ha="center", fontsize=8, color="red")
    ax.set_yscale("log")
    ax.yaxis.set_minor_locator(matplotlib.ticker.LogLocator(subs=(1.25, 1.6, 2, 3, 5)))
    for axis in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
        axis(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.set_xlabel("measured FLOP-weighted capacity (WikiText-2 test tokens)")
    ax.set_ylabel("WikiText-2 ppl / dense ppl (log scale)")
    ax.set_title(f"{d['model']}: WikiText-2 ppl ratio against measured capacity")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    foot = (f"{d['command']}\ntrained on {', '.join(d['machines']['training'])}; scored on "
            f"{', '.join(d['machines']['quality'])}; records {d['records_dated'][0]} .. {d['records_dated'][1]}; "
            f"made {d['date']}")
    fig.text(0.01, 0.005, foot, fontsize=6, va="bottom", wrap=True)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks/capacity_sweep.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="recipe run folders, or folders holding them")
    ap.add_argument("--out", required=True, help="folder for capacity-sweep.md / .json / .png")
    ap.add_argument("--no-plot", action="store_true", help="table only (no matplotlib)")
    a = ap.parse_args(argv)
    command = shlex.join(["python", "benchmarks/capacity_sweep.py", *(sys.argv[1:] if argv is None else argv)])
    try:
        d = build([load_run(p) for p in find_runs(a.runs)], command)
    except SweepError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "capacity-sweep.json").write_text(json.dumps(d, indent=1))
    (out / "capacity-sweep.md").write_text(markdown(d))
    if not a.no_plot:
        plot(d, out / "capacity-sweep.png")
    print(f"wrote {out}/capacity-sweep.{{md,json{'' if a.no_plot else ',png'}}}: {len(d['runs'])} runs, "
          f"{len(d['equal_flops'])} equal-FLOPs comparisons")
    return 0


if __name__ == "__main__":
    sys.exit(main())
