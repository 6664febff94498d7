"""Fixed instruction prompts for the generation-agreement metric (built by `build.py`, committed as JSONL)."""
from __future__ import annotations

import json
from pathlib import Path

DIR = Path(__file__).parent
DEFAULT = "instructions-v1"


def load(name: str = DEFAULT) -> list[dict]:
    """[{"id", "prompt", "source"}] of prompt set `name` (a file in this folder, or a .jsonl path)."""
    p = Path(name) if str(name).endswith(".jsonl") else DIR / f"{name}.jsonl"
    if not p.is_file():
        have = sorted(q.stem for q in DIR.glob("*.jsonl"))
        raise FileNotFoundError(f"prompt set {name!r} not found ({p}); shipped: {have}")
    return [json.loads(line) for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
