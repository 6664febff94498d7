"""Training text for router training: ../shared/data/train-text (JSONL, "text" field, some .gz).

The evaluation sets are never read here. Documents are tokenized, joined with the EOS token and cut into
fixed-length blocks. A token cache (uint16/int32 .npy) can be written once and carried to the GPU machine
so that no tokenization happens there (`python -m wide_compile.training.data --out tokens.npy`).
The last `heldout_frac` of the stream (after a seeded document shuffle) is held out for calibration and
analysis; training never sees it.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import random
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from ..paths import data_root


def default_data_root() -> Path | None:
    """The data root (wide_compile.paths.data_root: $WIDE_DATA_DIR or ../shared/data), if it exists."""
    return root if (root := data_root()).is_dir() else None


def train_text_files(path: str | os.PathLike | None = None) -> list[Path]:
    root = Path(path) if path is not None else default_data_root()
    if root is None:
        raise FileNotFoundError("no training text: pass --data PATH (a folder of .jsonl/.jsonl.gz files) "
                                "or set WIDE_DATA_DIR; default is ../shared/data/train-text")
    if not root.is_dir():
        raise FileNotFoundError(f"no train-text folder at {root}: pass --data PATH (a folder of .jsonl/.jsonl.gz "
                                "files) or set WIDE_DATA_DIR")
    if (root / "train-text").is_dir():
        root = root / "train-text"
    files = sorted(p for p in root.iterdir() if p.name.endswith((".jsonl", ".jsonl.gz")))
    if not files:
        raise FileNotFoundError(f"no .jsonl / .jsonl.gz files in {root}")
    return files


def iter_docs(files: list[Path]) -> Iterator[str]:
    for p in files:
        op = gzip.open if p.name.endswith(".gz") else open
        with op(p, "rt", encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if line:
                    t = json.loads(line).get("text", "")
                    if t and t.strip():
                        yield t


def tokenize_corpus(tok, files: list[Path], max_tokens: int | None = None, seed: int = 0,
                    batch: int = 256) -> np.ndarray:
    """All documents (seeded shuffle), tokenized and joined with EOS, as one int array."""
    docs = list(iter_docs(files))
    random.Random(seed).shuffle(docs)
    eos = tok.eos_token_id if tok.eos_token_id is not None else 0
    out, n = [], 0
    for i in range(0, len(docs), batch):
        enc = tok(docs[i:i + batch], add_special_tokens=False)["input_ids"]
        for ids in enc:
            out.append(np.asarray(ids + [eos], dtype=np.int64))
            n += len(ids) + 1
        if max_tokens and n >= max_tokens:
            break
    arr = np.concatenate(out) if out else np.zeros(0, np.int64)
    if max_tokens:
        arr = arr[:max_tokens]
    return arr.astype(np.uint16 if arr.size == 0 or arr.max() < 65535 else np.int32)


class TokenBlocks:
    """Fixed-length blocks of a token stream, split into train / held-out. With `chat` (training/chat.py) a
    seeded `chat_frac` of the train blocks is laid out as chat exchanges; with `answers` ([N, seq_len] blocks of
    the dense model's own chat answers, training/dense_answers.py) a seeded `answers_frac` of the other train
    blocks is replaced by them (cycling through them when fewer). The held-out blocks stay plain text, so
    held-out perplexity means the same with and without."""

    def __init__(self, tokens: np.ndarray, seq_len: int, heldout_frac: float = 0.02, chat=None,
                 chat_frac: float = 0.0, seed: int = 0, answers: np.ndarray | None = None,
                 answers_frac: float = 0.0):
        tokens = np.asarray(tokens)
        nblk = len(tokens) // seq_len
        if nblk < 2:
            raise ValueError(f"only {len(tokens)} tokens: need at least 2 blocks of {seq_len}")
        blocks = tokens[: nblk * seq_len].astype(np.int64).reshape(nblk, seq_len)
        nh = max(1, int(round(nblk * heldout_frac)))
        train, self.chat_rows = blocks[:-nh], np.zeros(0, np.int64)
        if chat_frac > 0:
            if chat is None:
                raise ValueError("chat_frac > 0 needs a ChatFormat (training/chat.py) for the model's template")
            from .chat import wrap_blocks

            train, self.chat_rows = wrap_blocks(train, chat, chat_frac, seed=seed)
        self.answer_rows = np.zeros(0, np.int64)
        if answers is not None and answers_frac > 0:
            train, self.answer_rows = _mix_answers(train, self.chat_rows, answers, answers_frac, seed)
        elif answers_frac > 0:
            raise ValueError("answers_frac > 0 needs the answer blocks (training/dense_answers.py)")
        self.train, self.heldout = torch.from_numpy(train), torch.from_numpy(blocks[-nh:])
        self.seq_len = seq_len

    def batches(self, batch_size: int, steps: int, seed: int = 0, start: int = 0) -> Iterator[torch.Tensor]:
        """`steps` batches (seeded; epoch-wise permutation), skipping the first `start` (for resuming)."""
        g = torch.Generator().manual_seed(seed)
        n, pos = len(self.train), 0
        perm = torch.randperm(n, generator=g)
        for step in range(steps):
            if pos + batch_size > n:
                perm, pos = torch.randperm(n, generator=g), 0
            idx = perm[pos:pos + batch_size]
            pos += batch_size
            if step >= start:
                yield self.train[idx]


def _mix_answers(train: np.ndarray, chat_rows: np.ndarray, answers: np.ndarray, frac: float,
                 seed: int) -> tuple[np.ndarray, np.ndarray]:
    """train [N, L] with a seeded `frac` of its rows (never a chat row) replaced by answer blocks [M, L]."""
    answers = np.asarray(answers)
    if answers.ndim != 2 or answers.shape[1] != train.shape[1] or len(answers) == 0:
        raise ValueError(f"answer blocks of shape {tuple(answers.shape)} do not fit train blocks of "
                         f"{train.shape[1]} tokens: write them again with --seq-len {train.shape[1]}")
    n = int(round(frac * len(train)))
    free = np.setdiff1d(np.arange(len(train)), chat_rows)
    if not 0.0 <= frac <= 1.0 or n > len(free):
        raise ValueError(f"answers fraction {frac} with {len(chat_rows)} of {len(train)} train blocks already "
                         "chat turns: the two fractions must add up to at most 1")
    idx = np.sort(np.random.default_rng(seed + 1).choice(free, size=n, replace=False))
    out = train.copy()
    out[idx] = answers[np.arange(n) % len(answers)]
    return out, idx


def load_tokens(tok=None, data: str | os.PathLike | None = None, cache: str | os.PathLike | None = None,
                max_tokens: int | None = None) -> np.ndarray:
    """Token stream: from `cache` (.npy) if it exists, else tokenized from the train-text files (and written
    to `cache` when given)."""
    if cache is not None and Path(cache).is_file():
        arr = np.load(cache)
        if hasattr(arr, "files"):  # .npz (np.savez_compressed(..., tokens=arr))
            arr = arr["tokens"]
        return arr[:max_tokens] if max_tokens else arr
    if tok is None:
        raise ValueError("need a tokenizer to tokenize the training text")
    arr = tokenize_corpus(tok, train_text_files(data), max_tokens=max_tokens)
    if cache is not None:
        Path(cache).parent.mkdir(parents=True, exist_ok=True)
        np.save(cache, arr)
    return arr


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m wide_compile.training tokenize",
                                 description="tokenize the train-text once with SmolLM2's tokenizer")
    ap.add_argument("--data", default=None,
                    help="train-text folder; unset: $WIDE_DATA_DIR/train-text, else ../shared/data/train-text")
    ap.add_argument("--out", required=True, help="token cache to write (.npy)")
    ap.add_argument("--max-tokens", type=int, default=None, help="keep only the first N tokens; unset: all")
    ap.add_argument("--gguf", default=None, help="SmolLM2 GGUF; unset: $WIDE_SMOLLM2_GGUF, else the cache")
    a = ap.parse_args(argv)
    from ..models import load_smollm2

    files = train_text_files(a.data)  # checked before the model loads
    _, tok = load_smollm2(gguf_path=a.gguf)
    arr = tokenize_corpus(tok, files, max_tokens=a.max_tokens)
    if a.out.endswith(".npz"):
        np.savez_compressed(a.out, tokens=arr)
    else:
        np.save(a.out, arr)
    print(f"{len(arr)} tokens -> {a.out} ({arr.dtype})")


if __name__ == "__main__":
    main()
