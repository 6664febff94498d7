"""Routers shipped with the package: <name>.safetensors files in this folder.

A name ends in `-c<NN>`, the nominal capacity in percent the routers were trained for (`smollm2-135m-c50`:
0.5). A stage-2 LoRA adapter that goes with routers <name> ships as <name>.lora.safetensors (not a router
file: `available()` does not list it); `lora_path(name)` finds it and
`wide_compile.training.stage2.load_lora_merged(model, lora_path(name))` merges it into a model.
What was measured of routers <name> is in the sidecar <name>.json, written from a committed run:
{"wikitext2_ppl_ratio": <WIDE ppl / dense ppl>, "record": "benchmarks/results/<file>", "setup": <optional,
what was measured, e.g. "routers + LoRA, stage 2">}; `measured(name)` reads it (None when nothing is recorded).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

_DIR = Path(__file__).parent
_CAPACITY = re.compile(r"-c(\d+)$")


def available() -> list[str]:
    return sorted(p.stem for p in _DIR.glob("*.safetensors") if not p.stem.endswith(".lora"))


def path(name: str) -> Path:
    p = _DIR / f"{name}.safetensors"
    if not p.is_file() or name.endswith(".lora"):
        raise ValueError(f"no shipped routers named {name!r}; available: {available() or 'none'}")
    return p


def lora_path(name: str) -> Path | None:
    """The stage-2 LoRA shipped with routers `name`, or None."""
    p = _DIR / f"{name}.lora.safetensors"
    return p if p.is_file() else None


def nominal_capacity(name: str) -> float | None:
    """The capacity routers `name` were trained for, from its `-c<NN>` suffix (None without one)."""
    m = _CAPACITY.search(name)
    return int(m.group(1)) / 100 if m else None


def for_capacity(capacity: float) -> list[str]:
    """Shipped routers trained for exactly `capacity` (to the percent)."""
    return [n for n in available() if nominal_capacity(n) is not None
            and round(nominal_capacity(n) * 100) == round(capacity * 100)]


def measured(name: str) -> dict | None:
    """The sidecar <name>.json (what a committed run measured of these routers), or None if there is none.

    A sidecar must carry a numeric `wikitext2_ppl_ratio` and the `record` it comes from."""
    p = _DIR / f"{name}.json"
    if not p.is_file():
        return None
    try:
        meta = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{p} is not valid JSON ({e}): fix or delete it") from e
    ratio = meta.get("wikitext2_ppl_ratio") if isinstance(meta, dict) else None
    if not isinstance(ratio, (int, float)) or not isinstance(meta.get("record"), str):
        raise ValueError(f"{p} needs a numeric 'wikitext2_ppl_ratio' and a 'record' path: fix or delete it")
    return meta
