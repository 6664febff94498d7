"""How often WIDE's and dense's answers repeat themselves, in generation records written before the record
counted it itself (`wide eval quality --metrics generation` now reports `wide_repeating` / `dense_repeating`).

Each record keeps every prompt's two answers as text; they are encoded again with SmolLM2's tokenizer (no
special tokens) and checked with the same rule as the record (`eval.generation.repeating`: a run of 4 tokens
3 or more times). Re-encoding decoded text can split a few tokens differently from the generated ids; a record
that carries its own figures is read as it is.

    python benchmarks/generation_repetition.py RECORD.json [RECORD.json ...] --out OUT.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def shares(record: dict, encode) -> dict:
    """{"prompts", "wide_repeating", "dense_repeating", "source"} of one generation record."""
    from wide_compile.eval.generation import repeating

    r = record["result"]
    if "wide_repeating" in r:
        return {"prompts": r["prompts"], "wide_repeating": r["wide_repeating"], "dense_repeating": r["dense_repeating"],
                "source": "the record's own figures"}
    pp = r["per_prompt"]
    n = len(pp)
    return {"prompts": n, "wide_repeating": sum(repeating(encode(p["wide_text"])) for p in pp) / n,
            "dense_repeating": sum(repeating(encode(p["dense_text"])) for p in pp) / n,
            "source": "answers re-encoded from the record's text"}


def main(argv=None) -> int:
    from wide_compile.eval.records import command_line, make_record
    from wide_compile.models.smollm2 import load_smollm2

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("records", nargs="+", help="generation.json files written by `wide eval quality`")
    ap.add_argument("--out", required=True, help="JSON of the shares per record")
    ap.add_argument("--gguf", default=None, help="SmolLM2 GGUF (default: $WIDE_SMOLLM2_GGUF, else the cache)")
    a = ap.parse_args(argv)
    _, tok = load_smollm2(gguf_path=a.gguf)
    encode = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    rows = []
    for path in a.records:
        full = Path(path).resolve()
        rec = json.loads(full.read_text())
        models = rec.get("models") if isinstance(rec.get("models"), dict) else {}
        row = {"record": str(full.relative_to(ROOT)) if full.is_relative_to(ROOT) else path,
               "routers": models.get("routers"), **shares(rec, encode)}
        rows.append(row)
        print(f"{row['record']}: {row['prompts']} prompts, repeating itself: WIDE {row['wide_repeating']:.0%}, "
              f"dense {row['dense_repeating']:.0%} ({row['source']})")
    command = command_line(argv, "python benchmarks/generation_repetition.py")
    out = make_record("repetition", {"rows": rows}, command=command, models={"tokenizer": "SmolLM2-135M-Instruct"},
                      settings={"what": "share of answers with a run of 4 tokens 3+ times (eval.generation.repeating)"})
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
