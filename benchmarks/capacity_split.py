"""A trained router set moved along its attention / FFN split at one overall capacity (no training): which split
keeps the most quality (SmolLM2-135M-Instruct, fp32, CPU or GPU).

    python benchmarks/capacity_split.py --routers smollm2-135m-c70 --capacity 0.7 --attn-targets 0.55 0.9 \
        --out DIR/split.json

The routers' LoRA is merged. Each row starts from the shipped routers: with no attention target, one global offset
brings the overall capacity to --capacity (recalibrate_capacity.py's move); with one, the attention routers' offset
sets the attention capacity and the FFN routers' offset then brings the overall capacity to --capacity
(routing/calibrate.calibrate_split_). Calibration and evaluation read disjoint parts of one raw text (default
WikiText-2 *validation*: the test text stays for the final score): the first --calib-tokens, then --eval-tokens,
in blocks of --seq-len. Each row records its offsets, its capacities on both parts and the mean NLL of the
evaluation blocks, beside the dense model's; a .md table goes beside the JSON.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def block_nll(model, routers, blocks, batch_size: int = 8) -> float:
    """Mean next-token NLL over `blocks` [N, S] with `routers` (None: dense), each block on its own (perplexity()
    with non-overlapping windows of the block length)."""
    from wide_compile.eval.perplexity import perplexity
    from wide_compile.routing.attach import routed

    with routed(model, routers):
        return perplexity(model, ids=blocks, ctx=blocks.shape[1], stride=blocks.shape[1], batch_size=batch_size,
                          measure=False)["nll"]


def split_rows(model, routers, calib, evalb, capacity: float, attn_targets, batch_size: int = 8,
               log=print) -> list[dict]:
    """One row per attention target (None: the global offset), each from a copy of `routers`."""
    from wide_compile.routing.calibrate import calibrate_offset_, calibrate_split_, deterministic_capacity

    rows = []
    for t in attn_targets:
        r = copy.deepcopy(routers)
        if t is None:
            offs = {"global": calibrate_offset_(model, r, calib, capacity, batch_size=batch_size, log=log)}
        else:
            offs = calibrate_split_(model, r, calib, capacity, t, batch_size=batch_size, log=log)
        cap_c = deterministic_capacity(model, r, calib, batch_size=batch_size)
        cap_e = deterministic_capacity(model, r, evalb, batch_size=batch_size)
        nll = block_nll(model, r, evalb, batch_size)
        rows.append({"attn_target": t, "offsets": offs,
                     "capacity_calib": {k: cap_c[k] for k in ("overall", "attn", "ffn")},
                     "capacity_eval": {k: cap_e[k] for k in ("overall", "attn", "ffn")}, "nll": nll})
        log(f"attn target {t}: calib capacity {cap_c['overall']:.4f} (attn {cap_c['attn']:.3f} ffn {cap_c['ffn']:.3f}),"
            f" eval capacity {cap_e['overall']:.4f}, NLL {nll:.4f}")
    return rows


# the columns capacity_cells fills, after a table's first (the row's label)
CAPACITY_HEADER = ("capacity (calibration text): overall / attn / ffn | capacity (evaluation text): overall / attn / "
                   "ffn | NLL | ppl ratio to dense |")


def capacity_cells(r: dict, dense_nll: float) -> str:
    """A row's capacities on the calibration and evaluation text, its NLL and ppl ratio, as markdown cells."""
    c, e = r["capacity_calib"], r["capacity_eval"]
    return (f"{c['overall']:.3f} / {c['attn']:.3f} / {c['ffn']:.3f} | {e['overall']:.3f} / {e['attn']:.3f} / "
            f"{e['ffn']:.3f} | {r['nll']:.4f} | {math.exp(r['nll'] - dense_nll):.3f} |")


def add_set_args(ap, torch) -> None:
    """The options of a run on one trained router set over WikiText-2 validation blocks (this script's and
    layer_allocation.py's)."""
    ap.add_argument("--routers", required=True, help="free routers: a shipped name or a .safetensors file")
    ap.add_argument("--lora", default=None, help="their stage-2 LoRA (default: a shipped name's own; 'none')")
    ap.add_argument("--capacity", type=float, required=True, help="overall FLOP-weighted capacity every row keeps")
    ap.add_argument("--text-file", default=None, help="raw text (default: the data root's wikitext-2/wiki.valid.raw)")
    ap.add_argument("--calib-tokens", type=int, default=4096)
    ap.add_argument("--eval-tokens", type=int, default=16384)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--gguf", default=None, help="SmolLM2 GGUF; unset: $WIDE_SMOLLM2_GGUF, else the cache")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", required=True, help="output .json (a .md table goes beside it)")


def set_record(a, argv, prog: str, src, lora, text: str, t0: float, **fields) -> dict:
    """The JSON record of a run on one trained set: its command, date, machine, the set and the text, `fields`,
    and the seconds since t0."""
    from wide_compile.eval.records import command_line, machine

    return {"command": command_line(argv, prog=prog), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": machine(a.device), "routers": a.routers, "routers_file": str(src),
            "lora": None if lora is None else str(lora), "capacity": a.capacity, "text_file": text, **fields,
            "seconds": round(time.time() - t0, 1)}


def write_record(rec: dict, out: str, table_fn) -> dict:
    """`rec` as JSON at `out`, its table_fn markdown beside it (.md) and on stdout."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec, indent=1))
    path.with_suffix(".md").write_text(table_fn(rec))
    print(table_fn(rec))
    return rec


def table(rec: dict) -> str:
    lines = [f"Routers `{rec['routers']}` with LoRA `{rec['lora']}`, overall capacity {rec['capacity']}, "
             f"calibration on {rec['calib_tokens']} / evaluation on {rec['eval_tokens']} tokens of "
             f"`{rec['text_file']}`; dense NLL {rec['dense_nll']:.4f}.", "",
             "| attention target | " + CAPACITY_HEADER, "|---|---|---|---|---|"]
    for r in rec["rows"]:
        lines.append(f"| {'global offset' if r['attn_target'] is None else r['attn_target']} | "
                     + capacity_cells(r, rec["dense_nll"]))
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    import torch

    from wide_compile.paths import data_file
    from wide_compile.training.convert import free_routers_on_text

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_set_args(ap, torch)
    ap.add_argument("--attn-targets", type=float, nargs="+", required=True,
                    help="attention capacities to try (a row with the global offset alone is always added first)")
    a = ap.parse_args(argv)
    if not 0.0 < a.capacity <= 1.0 or not all(0.0 < t <= 1.0 for t in a.attn_targets):
        ap.error("--capacity and --attn-targets must be in (0, 1]")
    if a.calib_tokens % a.seq_len or a.eval_tokens % a.seq_len:
        ap.error("--calib-tokens and --eval-tokens must be multiples of --seq-len")
    text = a.text_file or str(data_file("wikitext-2", "wiki.valid.raw"))
    t0 = time.time()
    n_c, n_e = a.calib_tokens // a.seq_len, a.eval_tokens // a.seq_len
    model, routers, blocks, src, lora = free_routers_on_text(a.routers, a.lora, n_c + n_e, a.seq_len, a.device,
                                                             a.gguf, None, None, what="--calib-tokens + --eval-tokens",
                                                             text_file=text)
    calib, evalb = blocks[:n_c], blocks[n_c:]
    dense = block_nll(model, None, evalb, a.batch_size)
    rows = split_rows(model, routers, calib, evalb, a.capacity, [None, *a.attn_targets], a.batch_size)
    rec = set_record(a, argv, "python benchmarks/capacity_split.py", src, lora, text, t0, calib_tokens=calib.numel(),
                     eval_tokens=evalb.numel(), seq_len=a.seq_len, dense_nll=dense, rows=rows)
    return write_record(rec, a.out, table)


if __name__ == "__main__":
    main()
