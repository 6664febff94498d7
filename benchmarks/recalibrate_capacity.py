"""Trained free routers moved to another capacity by their margin offset alone (no training): how quality follows
capacity along one router set (SmolLM2-135M-Instruct, fp32, CPU or GPU).

    python benchmarks/recalibrate_capacity.py --routers smollm2-135m-c70 --capacity 0.85 --out DIR/c85.safetensors
    wide eval quality --routers DIR/c85.safetensors --lora wide_compile/pretrained/smollm2-135m-c70.lora.safetensors \
        --metrics ppl,generation --out DIR/c85-quality

The routers' LoRA is merged, one global offset on every learned router's margins is searched until the
deterministic overall capacity on held train-text blocks (or on --calib-file's text) equals --capacity
(routing/calibrate.calibrate_offset_, as the training recipe's final calibration does), and the shifted routers are
saved with a .json record (command, machine, date, capacity before and after). Routers trained for the target
capacity would do at least as well; this is the trained set's own quality-capacity curve.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(argv=None) -> dict:
    import torch

    from wide_compile.eval.records import command_line, machine
    from wide_compile.routing.calibrate import calibrate_offset_, calibrate_split_, deterministic_capacity
    from wide_compile.training.convert import free_routers_on_text

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--routers", required=True, help="free routers: a shipped name or a .safetensors file")
    ap.add_argument("--lora", default=None, help="their stage-2 LoRA (default: a shipped name's own; 'none')")
    ap.add_argument("--capacity", type=float, required=True, help="target FLOP-weighted overall capacity")
    ap.add_argument("--out", required=True, help="output router file (.safetensors); a .json record goes beside it")
    ap.add_argument("--calib-tokens", type=int, default=16384, help="train-text tokens the capacity is measured on")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--data", default=None, help="train-text folder; unset: $WIDE_DATA_DIR/train-text")
    ap.add_argument("--calib-file", default=None,
                    help="a raw text file to measure the capacity on instead of the train text (e.g. "
                         "wikitext-2/wiki.valid.raw under the data root: the evaluation's domain, not its test file)")
    ap.add_argument("--attn-capacity", type=float, default=None,
                    help="set the attention capacity to this first; the FFN routers' offset then brings the overall "
                         "capacity to --capacity (routing/calibrate.calibrate_split_; default: one global offset)")
    ap.add_argument("--tokens", default=None, help="token cache .npy (read if present)")
    ap.add_argument("--gguf", default=None, help="SmolLM2 GGUF; unset: $WIDE_SMOLLM2_GGUF, else the cache")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args(argv)
    if not 0.0 < a.capacity <= 1.0:
        ap.error(f"--capacity must be in (0, 1], got {a.capacity}")
    if a.attn_capacity is not None and not 0.0 < a.attn_capacity <= 1.0:
        ap.error(f"--attn-capacity must be in (0, 1], got {a.attn_capacity}")
    t0 = time.time()
    model, routers, blocks, src, lora = free_routers_on_text(a.routers, a.lora, a.calib_tokens // a.seq_len,
                                                             a.seq_len, a.device, a.gguf, a.data, a.tokens,
                                                             what="--calib-tokens", text_file=a.calib_file)
    before = deterministic_capacity(model, routers, blocks, batch_size=a.batch_size)
    if a.attn_capacity is None:
        offset = calibrate_offset_(model, routers, blocks, a.capacity, batch_size=a.batch_size)
    else:
        offset = calibrate_split_(model, routers, blocks, a.capacity, a.attn_capacity, batch_size=a.batch_size)
    after = deterministic_capacity(model, routers, blocks, batch_size=a.batch_size)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    routers.save(out)
    rec = {"command": command_line(argv, prog="python benchmarks/recalibrate_capacity.py"),
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine(a.device),
           "routers": a.routers, "routers_file": str(src), "lora": None if lora is None else str(lora),
           "target": a.capacity, "attn_target": a.attn_capacity, "offset": offset, "calib_tokens": blocks.numel(),
           "calib_file": a.calib_file,
           "capacity_before": before, "capacity_after": after, "seconds": round(time.time() - t0, 1)}
    out.with_suffix(".json").write_text(json.dumps(rec, indent=1))
    moved = f"offset {offset:+.3f}" if a.attn_capacity is None else \
        f"attn offset {offset['attn']:+.3f}, ffn offset {offset['ffn']:+.3f}; attn {after['attn']:.4f}"
    print(f"{a.routers}: capacity {before['overall']:.4f} -> {after['overall']:.4f} ({moved}) -> {out}")
    return rec


if __name__ == "__main__":
    main()
