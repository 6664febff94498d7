"""Routers shipped with the package: <name>.safetensors files in this folder."""
from __future__ import annotations

from pathlib import Path

_DIR = Path(__file__).parent


def available() -> list[str]:
    return sorted(p.stem for p in _DIR.glob("*.safetensors"))


def path(name: str) -> Path:
    p = _DIR / f"{name}.safetensors"
    if not p.is_file():
        raise ValueError(f"no shipped routers named {name!r}; available: {available() or 'none'}")
    return p
