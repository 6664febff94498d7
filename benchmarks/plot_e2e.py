#!/usr/bin/env python3
"""Re-draw the speedup-vs-capacity plot and the markdown table from an e2e results JSON.

    python benchmarks/plot_e2e.py benchmarks/results/e2e-h200.json   # writes e2e-h200.png / .md beside it
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e import report as R  # noqa: E402


def _table_spec(t: str):
    """"model:layers[:cap,cap...]" -> (model, layers, capacities)."""
    parts = t.split(":")
    if len(parts) not in (2, 3):
        raise SystemExit(f"--table {t!r}: expected MODEL:LAYERS or MODEL:LAYERS:CAP[,CAP...]")
    caps = tuple(float(c) for c in parts[2].split(",")) if len(parts) == 3 else R.GRID_CAPACITIES
    return parts[0], int(parts[1]), caps


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", nargs="+", help="one or more e2e JSON files (records are merged, later files win)")
    p.add_argument("--out", default=None, help="output stem (default: the first JSON's path without .json)")
    p.add_argument("--table", nargs="+", default=[], metavar="MODEL:LAYERS[:CAPS]",
                   help="list the issue's table cells this model/depth still lacks (e.g. llama-3.2-3b:4; "
                        "smollm2-135m:30:0.5 for a model timed at its routers' capacity only, CAPS comma-separated)")
    a = p.parse_args(argv)
    data, recs, skipped = None, {}, []
    for f in a.json:
        d = json.loads(Path(f).read_text())
        data = data or d
        # a run's time-budget skips describe that run only (a later run may have measured the rows): the
        # merged file lists what is still missing instead (--table); other skips (e.g. TRT missing) stay
        skipped += [s for s in d.get("skipped", []) if "time budget" not in s and s not in skipped]
        for r in d.get("records", []):
            for k in ("command", "date"):  # merged files: each record keeps the run it came from
                r.setdefault(k, d.get(k))
            # a run with another attention setting (e2e/attention.py) is another row, never a replacement
            recs[(r["model"], r["layers"], r["phase"], r["tokens"], r["batch"], r["capacity"], r["masks"],
                  r.get("attention", "sdpa"))] = R.add_best_dense(r)
    data = dict(data, records=list(recs.values()))
    if len(a.json) > 1:
        data["skipped"] = skipped
    if a.table:
        data["missing"] = [m for t in a.table for m in R.missing_cells(data["records"], *_table_spec(t))]
    data["goals"] = R.goals(data["records"])
    stem = Path(a.out) if a.out else Path(a.json[0]).with_suffix("")
    png = R.plot(data, stem.with_suffix(".png"))
    stem.with_suffix(".md").write_text(R.markdown(data))
    if len(a.json) > 1 or a.table:
        stem.with_suffix(".json").write_text(json.dumps(data, indent=1))
    print(f"wrote {png} and {stem.with_suffix('.md')}")


if __name__ == "__main__":
    main()
