"""Prompt text for the real SmolLM2 (trained routers): a text file when there is one, else a built-in
paragraph (repeated to length; repetition makes the masks of repeated tokens alike, so prefer a file)."""
from __future__ import annotations

import gzip
import json

import torch

TEXT = ("The history of the region begins with small farming villages along the river, where families grew "
        "wheat and barley and kept sheep on the hills. Over the centuries the villages became towns, and the "
        "towns were joined by roads that carried grain, wool and news. Merchants built warehouses near the "
        "harbour, and a market was held every week in the square in front of the old church. In the winter "
        "the river froze and children skated on it, while their parents mended nets and told stories about "
        "storms and shipwrecks. Scientists later studied the soil and the weather, measuring rainfall and "
        "temperature every day, and found that the climate had slowly become warmer. Today the town has a "
        "university, a hospital and a railway station, and many people work in offices or shops. Tourists "
        "come in summer to walk along the coast, visit the museum and eat fresh fish in the restaurants. ")


def load_text(path: str, max_chars: int = 400_000) -> str:
    """Plain text, or JSONL(.gz) with a "text" field per line."""
    op = gzip.open if path.endswith(".gz") else open
    out, n = [], 0
    with op(path, "rt", encoding="utf-8", errors="replace") as f:
        for line in f:
            if ".jsonl" in path:
                try:
                    line = json.loads(line).get("text", "")
                except Exception:  # noqa: BLE001  a malformed line is skipped, the rest is text
                    continue
            out.append(line)
            n += len(line)
            if n >= max_chars:
                break
    return "\n".join(out)


def text_ids(tok, n: int, batch: int = 1, text_file: str | None = None, log=print) -> torch.Tensor:
    """ids: [batch, n] of `text_file` (else the built-in paragraph), each row its own consecutive piece of
    the text, so a batch's rows do not share their masks; wraps around when the text is shorter."""
    text = TEXT
    if text_file:
        try:
            text = load_text(text_file)
        except OSError as e:
            log(f"  --text-file {text_file}: {e}; using the built-in paragraph")
    ids = tok(text, return_tensors="pt")["input_ids"][0]
    reps = (n * batch + ids.numel() - 1) // ids.numel()
    return ids.repeat(reps)[:n * batch].view(batch, n)


def default_text_file() -> str | None:
    """WikiText-2 valid (raw) under the data root (wide_compile.training.data.default_data_root), if present."""
    from wide_compile.training.data import default_data_root

    root = default_data_root()
    f = root / "wikitext-2" / "wiki.valid.raw" if root else None
    return str(f) if f is not None and f.is_file() else None
