"""What every eval record carries: where the data is, which machine ran it, with which command, on what.

`data_root()` is the local data folder ($WIDE_DATA_DIR, else ../shared/data next to the checkout);
`require_data` fails with one line saying what to pass when a file is missing, so commands can check
their data before loading a model.
"""
from __future__ import annotations

import datetime as _dt
import json
import platform
import sys
from pathlib import Path

import torch

from ..paths import DATA_ENV, data_root as package_data_root


class DataNotFound(FileNotFoundError):
    """A data file is missing; the message says what to pass."""


def data_root(explicit=None) -> Path:
    """`explicit`, else the package's one data root (wide_compile.paths: $WIDE_DATA_DIR or ../shared/data);
    it may not exist (see require_data)."""
    return Path(explicit) if explicit else package_data_root()


def require_data(root, *relative: str) -> Path:
    """The data root, after checking every `relative` file exists under it (DataNotFound otherwise)."""
    root = Path(root)
    for rel in relative:
        if not (root / rel).is_file():
            raise DataNotFound(f"{root / rel} not found: pass --data PATH (a folder holding {rel}) "
                               f"or set {DATA_ENV}")
    return root


def machine(device=None) -> dict:
    dev = torch.device(device) if device is not None else torch.device("cpu")
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else (platform.processor() or "cpu")
    return {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "device": str(dev), "device_name": name}


def command_line(argv=None, prog: str = "wide eval") -> str:
    args = list(sys.argv[1:] if argv is None else argv)
    return " ".join([prog, *args])


def make_record(metric: str, result: dict, *, command: str, models: dict, settings: dict, device=None) -> dict:
    """One JSON-ready record: the metric's result with its command, machine, date, models and settings."""
    return {"metric": metric, "command": command, "date": _dt.datetime.now(_dt.timezone.utc).isoformat(
        timespec="seconds"), "machine": machine(device), "models": models, "settings": settings, "result": result}


def write_record(out_dir, rec: dict) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    p = out / f"{rec['metric']}.json"
    p.write_text(json.dumps(rec, indent=1))
    return p
