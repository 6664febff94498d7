"""The state of one run: its records and skips, the time budget, --resume, and the results files
(<out>/<name>.json: {"records": [...], gpu, versions, date, command, options, skipped, elapsed_s, goals};
<name>.md), rewritten after every row so an interrupted run keeps what it measured."""
from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import platform
import sys
import time
from pathlib import Path

import torch

from . import report as R
from .records import row_key


def log(*a):
    print(*a, flush=True)


def env_info(options) -> dict:
    """Machine, versions, date and command of the run (the results file's header)."""
    import transformers

    try:
        import triton

        tv = triton.__version__
    except Exception:  # noqa: BLE001  no triton on this machine
        tv = None
    dev = options.device
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() and dev.startswith("cuda") else None
    return {"gpu": gpu, "device": dev, "torch": torch.__version__, "triton": tv,
            "transformers": transformers.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "host": platform.node(), "date": _dt.datetime.now().isoformat(timespec="seconds"),
            "command": "python " + " ".join([sys.argv[0]] + sys.argv[1:]) if sys.argv else None,
            "dtype": options.dtype, "options": dataclasses.asdict(options)}


def _jsonable(o):
    if isinstance(o, torch.Tensor):
        return o.tolist()
    return str(o)


class RunState:
    DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

    def __init__(self, options):
        self.options = options
        self.t0 = time.monotonic()
        self.device = torch.device(options.device)
        self.dtype = self.DTYPES[options.dtype]
        self.records: list[dict] = []
        self.out = Path(options.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.json_path = self.out / f"{options.name}.json"
        self.profile_path = self.out / f"{options.name}-profile.txt"
        self.meta = env_info(options)
        self.skips: list[str] = []
        self.done_keys: set = set()
        self.deadline: float | None = None  # soft deadline of the current (model, phase): a share of the budget
        self.trained_stats: dict | None = None  # trained-router statistics, measured once per run
        self.text_file: str | None = None       # the real model's prompt text (None: the built-in paragraph)
        if options.resume and self.json_path.is_file():
            old = json.loads(self.json_path.read_text())
            self.records = old.get("records", [])
            self.done_keys = {row_key(r) for r in self.records if r.get("wide_ms") is not None}
            log(f"resume: {len(self.records)} records loaded from {self.json_path}, "
                f"{len(self.done_keys)} complete rows will be skipped")

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def over_budget(self) -> bool:
        budget = self.options.time_budget_s
        if budget is None:
            return False
        return self.elapsed() > (budget if self.deadline is None else min(self.deadline, budget))

    def skip(self, msg: str) -> None:
        log(f"  SKIP {msg}")
        self.skips.append(msg)

    def add(self, rec: dict) -> None:
        """Add a row's record, replacing an older one of the same row (a resumed file's)."""
        self.records = [r for r in self.records if row_key(r) != row_key(rec)] + [rec]

    def write(self) -> None:
        data = {"records": self.records, **self.meta, "skipped": self.skips,
                "elapsed_s": round(self.elapsed(), 1), "goals": R.goals(self.records)}
        tmp = self.json_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=1, default=_jsonable))
        tmp.replace(self.json_path)
        try:
            (self.out / f"{self.options.name}.md").write_text(R.markdown(data))
        except Exception as e:  # noqa: BLE001  the JSON is the record; the markdown is a view of it
            log(f"  (markdown failed: {e})")
