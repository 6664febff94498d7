"""`wide train convert`: structured (codebook / nested) routers converted from trained free ones, no training.

The free routers' margins are recorded on train text with the routers attached (and the LoRA they were
trained with merged), the table is fitted to them (routing/convert.py), and each kind's capacity is
calibrated on other train-text blocks to the free routers' own capacity there. The output is a router
checkpoint like any other (its structure in its metadata) plus a JSON record of what was done; evaluate it
with `wide eval quality --routers OUT --lora LORA` and fine-tune it with `wide train stage2 --routers OUT`.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch


def _routers_source(name_or_path: str):
    """(routers file, default LoRA or None) of a shipped name or a .safetensors path."""
    from .. import pretrained

    if name_or_path in pretrained.available():
        return pretrained.path(name_or_path), pretrained.lora_path(name_or_path)
    p = Path(name_or_path)
    if not p.is_file():
        raise SystemExit(f"--routers {name_or_path}: neither a shipped router set ({', '.join(pretrained.available())}) "
                         "nor a file")
    return p, None


def resolve_lora(routers: str, lora: str | None) -> Path | None:
    """The LoRA to merge with `routers` (a shipped name or a file): `lora` as given ('none': no LoRA; a file must
    exist), else a shipped name's own stage-2 LoRA (None for a router file)."""
    if lora is None:
        return _routers_source(routers)[1]
    if lora == "none":
        return None
    if not Path(lora).is_file():
        raise SystemExit(f"--lora {lora}: no such file (or 'none' for no LoRA)")
    return Path(lora)


def free_routers_on_text(routers: str, lora: str | None, n_blocks: int, seq_len: int, device, gguf, data, tokens,
                         what: str = "the blocks", text_file=None):
    """(SmolLM2 in fp32 with the routers' LoRA merged, the free routers, text blocks [n_blocks, seq_len],
    routers file, LoRA file or None). `routers`: a shipped name or a file; `lora`: None (a shipped name's own),
    'none' or a file; the blocks come from the train text, or from `text_file` (one raw text read as one string,
    as the perplexity protocol reads WikiText-2) when given. fp32: recorded margins and calibration decide every
    token's pick."""
    from ..models import load_smollm2
    from ..routing.routers import Routers
    from .data import load_tokens
    from .stage2 import load_lora_merged

    src, _ = _routers_source(routers)
    lora_path = resolve_lora(routers, lora)
    model, tok = load_smollm2(dtype=torch.float32, device=device, gguf_path=gguf)
    if lora_path is not None:
        load_lora_merged(model, lora_path)
    free = Routers.load(src, model, structure="free")
    need = n_blocks * seq_len
    if text_file is not None:
        toks = np.asarray(tok(Path(text_file).read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"])
    else:
        toks = load_tokens(tok, data, tokens, max_tokens=None if tokens else need)
    if len(toks) < need:
        raise SystemExit(f"only {len(toks)} tokens: {what} need {need}")
    blocks = torch.from_numpy(toks[:need].astype("int64")).view(-1, seq_len)
    return model, free, blocks, src, lora_path


def _shown(p) -> str:
    # a path inside the working directory as a relative one (records stay the same on every checkout)
    p = Path(p).resolve()
    try:
        return str(p.relative_to(Path.cwd()))
    except ValueError:
        return str(p)


def main(argv=None) -> int:
    from ..eval.records import command_line, machine
    from ..routing.convert import convert_routers

    ap = argparse.ArgumentParser(prog="wide train convert",
                                 description="Codebook / nested routers converted from trained free routers "
                                             "(SmolLM2-135M-Instruct), calibrated to the free routers' capacity.")
    ap.add_argument("--routers", required=True, help="free routers: a shipped name or a .safetensors file")
    ap.add_argument("--lora", default=None,
                    help="stage-2 LoRA the routers were trained with (merged before recording); default: the "
                         "shipped one of a shipped name; 'none': no LoRA")
    ap.add_argument("--structure", required=True, choices=("codebook", "nested"))
    ap.add_argument("--size", type=int, required=True, help="prototypes (codebook) or width levels (nested) per router")
    ap.add_argument("--out", required=True, help="output router file (.safetensors); a .json record goes beside it")
    ap.add_argument("--fit-tokens", type=int, default=32768, help="train-text tokens the table is fitted to")
    ap.add_argument("--calib-tokens", type=int, default=4096, help="further train-text tokens for calibration")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", default=None, help="train-text folder; unset: $WIDE_DATA_DIR/train-text, else "
                                                 "../shared/data/train-text")
    ap.add_argument("--tokens", default=None, help="token cache .npy (read if present)")
    ap.add_argument("--gguf", default=None, help="SmolLM2 GGUF; unset: $WIDE_SMOLLM2_GGUF, else the cache")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args(argv)
    if a.size < 2:
        ap.error(f"--size must be >= 2, got {a.size}")
    if a.fit_tokens < a.seq_len or a.calib_tokens < a.seq_len:
        ap.error(f"--fit-tokens and --calib-tokens must each hold at least one block of --seq-len {a.seq_len}")
    t0 = time.time()
    n_fit, n_cal = a.fit_tokens // a.seq_len, a.calib_tokens // a.seq_len
    model, free, blocks, src, lora = free_routers_on_text(a.routers, a.lora, n_fit + n_cal, a.seq_len, a.device,
                                                          a.gguf, a.data, a.tokens, what="--fit-tokens + --calib-tokens")
    out, caps = convert_routers(model, free, a.structure, a.size, blocks[:n_fit], blocks[n_fit:],
                                batch_size=a.batch_size, seed=a.seed)
    out_path = Path(a.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out.save(out_path)
    rec = {"command": command_line(argv, prog="wide train convert"),
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine(a.device),
           "source": {"routers": a.routers, "routers_file": _shown(src), "lora": None if lora is None else _shown(lora)},
           "structure": a.structure, "size": a.size, "fit_tokens": n_fit * a.seq_len,
           "calib_tokens": n_cal * a.seq_len, "capacity": caps, "seconds": round(time.time() - t0, 1)}
    out_path.with_suffix(".json").write_text(json.dumps(rec, indent=1))
    print(f"{a.structure} routers ({a.size} per router) -> {out_path}; capacity on calibration tokens: free "
          f"{caps['free']['overall']:.4f}, converted {caps['converted']['overall']:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
