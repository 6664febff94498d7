"""Table and plot of a conversion study: free routers against the codebook / nested routers converted from them.

    python benchmarks/convert_table.py benchmarks/results/quality-smollm2/convert-c0.5 [more study folders]

Each study folder holds `free/ppl.json` (the free set's `wide eval quality` record) and one folder per converted
set, `<structure><size>/` with `convert.json` (the `wide train convert` record) and `ppl.json`. Writes
`table.md` into each folder and `ppl-vs-size.png` beside the first one's parent
(`<parent>/convert-ppl-vs-size.png`): WikiText-2 ppl ratio to dense against the table size, one line per
structure and capacity, the free set as a horizontal line.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def load_study(folder: Path) -> dict:
    free = json.loads((folder / "free" / "ppl.json").read_text())
    rows = []
    for d in sorted(folder.iterdir()):
        m = re.fullmatch(r"(codebook|nested)(\d+)", d.name)
        if not m or not (d / "ppl.json").is_file():
            continue
        rows.append({"structure": m[1], "size": int(m[2]), "ppl": json.loads((d / "ppl.json").read_text()),
                     "convert": json.loads((d / "convert.json").read_text())})
    return {"free": free, "rows": sorted(rows, key=lambda r: (r["structure"], r["size"])), "name": folder.name}


def _cap(rec) -> str:
    c = rec["result"]["wide"]["capacity"]
    return f"{c['overall']:.3f} / {c['attn']:.3f} / {c['ffn']:.3f}"


def table(study: dict) -> str:
    f = study["free"]
    fr = f["result"]["ppl_ratio"]
    lines = [f"Study `{study['name']}`: WikiText-2 test, first {f['result']['wide']['tokens'] + 1} tokens, ctx "
             f"{f['result']['wide']['ctx']} stride {f['result']['wide']['stride']}; dense ppl "
             f"{f['result']['dense']['ppl']:.2f}.", "",
             "| routers | ppl ratio to dense | relative to free | WikiText capacity overall / attn / FFN | "
             "capacity on calibration text: free / converted |", "|---|---|---|---|---|",
             f"| free (source) | {fr:.3f} | 1.000 | {_cap(f)} | |"]
    for r in study["rows"]:
        rr = r["ppl"]["result"]["ppl_ratio"]
        cc = r["convert"]["capacity"]
        lines.append(f"| {r['structure']} {r['size']} | {rr:.3f} | {rr / fr:.3f} | {_cap(r['ppl'])} | "
                     f"{cc['free']['overall']:.3f} / {cc['converted']['overall']:.3f} |")
    lines += ["", "Commands: each `convert.json` (`command`) and `ppl.json` (`command`); machine and date in both."]
    return "\n".join(lines) + "\n"


def plot(studies: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, s in enumerate(studies):
        color = f"C{i}"
        ax.axhline(s["free"]["result"]["ppl_ratio"], color=color, ls=":", label=f"{s['name']}: free (source)")
        for structure, marker in (("codebook", "o"), ("nested", "s")):
            pts = [(r["size"], r["ppl"]["result"]["ppl_ratio"]) for r in s["rows"] if r["structure"] == structure]
            if pts:
                ax.plot(*zip(*pts), marker=marker, color=color, label=f"{s['name']}: {structure} (converted)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prototypes (codebook) / levels (nested) per router")
    ax.set_ylabel("WikiText-2 ppl ratio to dense")
    ax.set_title("Structured routers converted from trained free routers (SmolLM2-135M)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv=None) -> int:
    folders = [Path(p) for p in (sys.argv[1:] if argv is None else argv)]
    if not folders:
        print(__doc__)
        return 2
    studies = [load_study(f) for f in folders]
    for f, s in zip(folders, studies):
        (f / "table.md").write_text(table(s))
        print(table(s))
    plot(studies, folders[0].parent / "convert-ppl-vs-size.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
