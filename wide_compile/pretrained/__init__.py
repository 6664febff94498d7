"""Routers shipped with the package: <name>.safetensors files in this folder.

A stage-2 LoRA adapter that goes with routers <name> ships as <name>.lora.safetensors (not a router file:
`available()` does not list it); `lora_path(name)` finds it and
`wide_compile.training.stage2.load_lora_merged(model, lora_path(name))` merges it into a model.
"""
from __future__ import annotations

from pathlib import Path

_DIR = Path(__file__).parent


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
