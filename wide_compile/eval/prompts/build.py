"""Build a fixed instruction-prompt set from the local evaluation data (run once; the output is committed).

    python -m wide_compile.eval.prompts.build [--data DIR] [--out FILE] [--seed 0]

Each prompt turns one item of ARC / PIQA / BoolQ / HellaSwag, or one WikiText-2 test heading, into an
instruction; `source` says which file and item it came from. The items are a seeded random sample, so the
same data and seed give the same file.
"""
from __future__ import annotations

import argparse
import gzip
import json
import random
import re
from pathlib import Path

from ..records import data_root, require_data
from . import DEFAULT, DIR

# (source file, how many prompts, how an item becomes an instruction)
ARC_E, ARC_C = "arc-easy/ARC-Easy-Test.jsonl", "arc-challenge/ARC-Challenge-Test.jsonl"
PIQA, BOOLQ = "piqa/valid.jsonl", "boolq/dev.jsonl"
HELLASWAG, WIKI = "hellaswag/hellaswag_val.reconstructed.jsonl.gz", "wikitext-2/wiki.test.raw"
COUNTS = {ARC_E: 20, ARC_C: 10, PIQA: 25, BOOLQ: 20, HELLASWAG: 15, WIKI: 20}


def _jsonl(p: Path) -> list[dict]:
    op = gzip.open if p.name.endswith(".gz") else open
    with op(p, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _detok(s: str) -> str:  # WikiText's " @-@ " style tokenisation back to plain text
    s = re.sub(r" @(.)@ ", r"\1", s)
    return re.sub(r"\( (.*?) \)", r"(\1)", s).strip()


def _instructions(root: Path, rel: str) -> list[tuple[str, str]]:
    """[(item id, instruction)] for every usable item of `rel`."""
    if rel in (ARC_E, ARC_C):
        return [(d["id"], f"Answer the question and explain your answer briefly: {d['question']['stem']}")
                for d in _jsonl(root / rel)]
    if rel == PIQA:
        out = []
        for i, d in enumerate(_jsonl(root / rel)):
            g = d["goal"].strip().rstrip("?.")
            if len(g.split()) >= 4:  # short goals ("dresser") make no sentence
                g = g[0].upper() + g[1:]
                out.append((str(i), f"{g}? Explain the steps." if g.lower().startswith("how")
                            else f"How would you do this: {g}?"))
        return out
    if rel == BOOLQ:
        return [(str(i), f"Answer yes or no, then explain: {d['question'][0].upper()}{d['question'][1:]}?")
                for i, d in enumerate(_jsonl(root / rel))]
    if rel == HELLASWAG:
        return [(str(d["ind"]), f"Explain what is likely to happen next: {d['ctx'].strip()}")
                for d in _jsonl(root / rel) if "[" not in d["ctx"]]
    if rel == WIKI:
        heads = re.findall(r"^ = ([^=].*?) = $", (root / rel).read_text(encoding="utf-8"), flags=re.M)
        return [(h, f"Write a short paragraph about {_detok(h)}.") for h in heads]
    raise ValueError(rel)


def build(root, seed: int = 0) -> list[dict]:
    root = require_data(root, *COUNTS)
    rng = random.Random(seed)
    rows = []
    for rel, n in COUNTS.items():
        items = _instructions(root, rel)
        for item_id, text in sorted(rng.sample(items, n), key=lambda x: items.index(x)):
            rows.append({"id": f"p{len(rows):03d}", "prompt": text, "source": {"file": rel, "item": item_id}})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m wide_compile.eval.prompts.build", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=None, help="data root (default $WIDE_DATA_DIR or ../shared/data)")
    ap.add_argument("--out", default=str(DIR / f"{DEFAULT}.jsonl"))
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    rows = build(data_root(a.data), a.seed)
    with open(a.out, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"{len(rows)} prompts -> {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
