#!/usr/bin/env python3
"""End-to-end benchmark: WIDE (`torch.compile(model, backend="wide")`) against standard Inductor.

One run produces one table: for every model x phase x workload x capacity x mask type it times the
variants of e2e/variants.py (eager, Inductor default / max-autotune / CUDA graphs, a static model of the
same FLOP capacity, WIDE compiled and eager, torch-tensorrt) in interleaved rounds with device events
(medians, p10/p90). The baseline is dense Inductor: speedup = dense_inductor_ms / wide_ms.

Results: <out>/<name>.json ({"records": [...], gpu, versions, date, command, goals}), <name>.md, <name>.png,
and with --profile <name>-profile.txt. Every row is in try/except; results are written after every row;
--time-budget-s stops starting new work once exceeded. benchmarks/e2e/README.md lists the record fields.

The pieces: e2e/options.py (the options), e2e/variants.py (one builder per variant), e2e/workload.py
(a workload's rows), e2e/loop.py (the run loop), e2e/records.py (the record format).
"""
from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
for _i, _p in enumerate((_HERE, _HERE.parent)):  # e2e/ and wide_compile importable from a checkout
    if str(_p) not in sys.path:
        sys.path.insert(_i, str(_p))

from e2e.loop import run_all  # noqa: E402
from e2e.options import BenchOptions, parse_options  # noqa: E402


def parse_args(argv=None) -> BenchOptions:
    """argv -> the run's resolved and checked options."""
    return parse_options(argv, description=__doc__)


def main(argv=None) -> dict:
    return run_all(parse_args(argv))


if __name__ == "__main__":
    main()
