"""Dense answers: the dense model's own greedy replies to chat prompts built from the training text, packed into
training blocks (sequence-level distillation data for stage 2).

Why: generation agreement (eval/generation.py) follows the routed model along the dense model's greedy answer
up to the first token where the two differ; until then the routed model's context is exactly dense's answer so
far. Plain text and chat-wrapped passages (training/chat.py) never show the routers and the LoRA that context:
their assistant turns are passages of the corpus, not what the dense model writes. These blocks are.

A prompt is one user turn through the model's template, as `apply_chat_template(..., add_generation_prompt=True)`
lays it out (the ChatFormat pieces):
    [system + user header] instruction passage [end of user turn + assistant header]
with the passage a span of the training part of the token stream (never the held-out tail, never across a
document boundary), starting at a word. A block of `seq_len` tokens is whole exchanges (prompt + answer, the
answer up to and including its end-of-turn token when it ended) one after another; the exchange that does not
fit fills the block's end with its first tokens and starts the next block whole, so no block holds padding.

    python -m wide_compile.training answers --out answers.npy --n 8192 --device cuda
writes answers.npy ([N, seq_len] int32) and answers.json (what was generated, how).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

from .chat import ChatFormat

# generic requests about a passage; none is the evaluation prompts' wording (eval/prompts/build.py)
PROMPT_INSTRUCTIONS = ("Explain the following:", "Summarize this text:", "What is this passage about?",
                       "Continue this text:", "Rewrite this in simple words:", "What is the main idea here?",
                       "Give a short explanation of this:", "Write a question about this text and answer it:", "")


def build_prompts(fmt: ChatFormat, tokens: np.ndarray, n: int, rng: np.random.Generator,
                  passage: tuple[int, int] = (12, 96), eos_id: int | None = None,
                  word_start: np.ndarray | None = None) -> list[list[int]]:
    """n prompt id lists (see the module docstring). tokens: [T] the training part of the stream; eos_id: the
    document separator (a passage ends before it); word_start: [vocab] bool, the ids that begin a word (a
    passage starts at one; None: anywhere)."""
    lo, hi = passage
    if not 1 <= lo <= hi:
        raise ValueError(f"passage lengths must satisfy 1 <= min <= max, got {passage}")
    if len(tokens) < 2 * hi:
        raise ValueError(f"{len(tokens)} tokens are too few for passages of up to {hi}")
    starts = np.arange(len(tokens) - hi)
    if word_start is not None:
        starts = starts[word_start[tokens[starts]]]
    if eos_id is not None:
        starts = starts[tokens[starts] != eos_id]
    if len(starts) == 0:
        raise ValueError("no position in the token stream starts a word: check word_start")
    out = []
    for s in rng.choice(starts, size=n, replace=len(starts) < n):
        span = tokens[s:s + int(rng.integers(lo, hi + 1))]
        if eos_id is not None and (cut := np.flatnonzero(span == eos_id)).size:
            span = span[:cut[0]]
        instr = fmt.instructions[int(rng.integers(len(fmt.instructions)))]
        out.append([*fmt.first_user, *instr, *span.tolist(), *fmt.to_assistant])
    return out


def pack_blocks(prompts: list[list[int]], answers: list[list[int]], seq_len: int) -> np.ndarray:
    """Exchanges (prompt + answer) packed into [N, seq_len] int64 blocks without padding (module docstring)."""
    if len(prompts) != len(answers):
        raise ValueError(f"{len(prompts)} prompts but {len(answers)} answers")
    blocks, cur = [], []
    for p, a in zip(prompts, answers):
        ex = list(p) + list(a)
        if cur and len(cur) + len(ex) > seq_len:
            blocks.append(cur + ex[:seq_len - len(cur)])
            cur = []
        cur = cur + ex
        while len(cur) >= seq_len:  # an exchange longer than a block: its first seq_len tokens only
            blocks.append(cur[:seq_len])
            cur = []
    if cur:  # the last, short block is topped up from the first exchange
        first = list(prompts[0]) + list(answers[0])
        while len(cur) < seq_len:
            cur = cur + first[:seq_len - len(cur)]
        blocks.append(cur)
    return np.asarray(blocks, dtype=np.int64).reshape(-1, seq_len)


def word_starts(tok) -> np.ndarray:
    """[vocab] bool: the byte-level BPE ids that begin with a space or a newline (they start a word)."""
    vocab = tok.convert_ids_to_tokens(list(range(len(tok))))
    return np.asarray([t is not None and t[:1] in ("Ġ", "Ċ") for t in vocab], dtype=bool)


def generate(model, tok_ids: np.ndarray, fmt: ChatFormat, n: int, seq_len: int, max_new: int = 96,
             batch_size: int = 256, seed: int = 0, pad_id: int = 0, eos_ids=(), doc_eos: int | None = None,
             word_start: np.ndarray | None = None, passage: tuple[int, int] = (12, 96),
             log=print) -> tuple[np.ndarray, dict]:
    """(blocks [N, seq_len], stats): n prompts from `tok_ids`, the model's greedy answers, packed."""
    from ..eval.generation import greedy_continuations

    prompts = build_prompts(fmt, tok_ids, n, np.random.default_rng(seed), passage, eos_id=doc_eos,
                            word_start=word_start)
    t0 = time.time()
    answers = greedy_continuations(model, prompts, max_new=max_new, batch_size=batch_size, pad_id=pad_id,
                                   eos_ids=eos_ids)
    ends = set(int(e) for e in eos_ids)
    ended = sum(1 for a in answers if a and a[-1] in ends)
    blocks = pack_blocks(prompts, answers, seq_len)
    stats = {"prompts": n, "max_new_tokens": max_new, "seq_len": seq_len, "blocks": len(blocks), "seed": seed,
             "mean_prompt_tokens": float(np.mean([len(p) for p in prompts])),
             "mean_answer_tokens": float(np.mean([len(a) for a in answers])),
             "answers_ended": ended / n, "empty_answers": sum(1 for a in answers if len(a) <= 1) / n,
             "generate_s": round(time.time() - t0, 1)}
    log(f"dense answers: {n} prompts -> {len(blocks)} blocks of {seq_len} ({stats['mean_answer_tokens']:.1f} "
        f"answer tokens on average, {100 * ended / n:.0f} % ended) in {stats['generate_s']} s")
    return blocks, stats


def load_answers(path, seq_len: int) -> np.ndarray:
    """[N, seq_len] blocks written by `main`; a file of another block length is an error."""
    arr = np.load(path)
    if arr.ndim != 2 or arr.shape[1] != seq_len:
        raise ValueError(f"{path} holds blocks of shape {tuple(arr.shape)}; this stage trains on blocks of {seq_len} "
                         f"tokens: write the answers again with --seq-len {seq_len}")
    return arr.astype(np.int64)


def main(argv=None) -> int:
    import argparse

    import torch

    ap = argparse.ArgumentParser(prog="python -m wide_compile.training answers", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", required=True, help="blocks to write (.npy); the record goes beside it as .json")
    ap.add_argument("--n", type=int, default=8192, help="prompts (one greedy answer each)")
    ap.add_argument("--max-new", type=int, default=96, help="greedy tokens per answer at most")
    ap.add_argument("--seq-len", type=int, default=512, help="block length (the training stage's seq_len)")
    ap.add_argument("--batch-size", type=int, default=256, help="prompts generated together")
    ap.add_argument("--passage-tokens", type=int, nargs=2, default=(12, 96), metavar=("MIN", "MAX"),
                    help="passage tokens in a prompt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokens", default=None, help="token cache .npy/.npz (training/data.py; written if absent)")
    ap.add_argument("--data", default=None, help="train-text folder (default ../shared/data/train-text)")
    ap.add_argument("--gguf", default=None, help="SmolLM2 GGUF; unset: $WIDE_SMOLLM2_GGUF, else the cache")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny random model and random tokens (CPU check)")
    a = ap.parse_args(argv)
    from .data import TokenBlocks
    from .options import model_dtype, real_model_and_tokens, smoke_chat_format, smoke_model_and_tokens

    if a.smoke:
        model, toks = smoke_model_and_tokens(a.device)
        fmt, pad, eos, doc_eos, ws = smoke_chat_format(model), 0, [model.config.vocab_size - 2], None, None
    else:
        from ..eval.generation import stop_ids

        model, toks, tok = real_model_and_tokens(a.device, a.gguf, a.data, a.tokens, with_tokenizer=True,
                                                 dtype=model_dtype(a.device))
        fmt = ChatFormat.from_tokenizer(tok, instructions=PROMPT_INSTRUCTIONS)
        (pad, eos), doc_eos, ws = stop_ids(tok), tok.eos_token_id, word_starts(tok)
    model.eval()
    train = TokenBlocks(toks, a.seq_len).train.reshape(-1).numpy()  # the held-out tail is never a prompt
    blocks, stats = generate(model, train, fmt, a.n, a.seq_len, a.max_new, a.batch_size, a.seed, pad, eos,
                             doc_eos, ws, tuple(a.passage_tokens))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.save(out, blocks.astype(np.int32))
    args = sys.argv[1:] if argv is None else list(argv)
    stats.update({"command": "python -m wide_compile.training answers " + " ".join(args),
                  "device": torch.cuda.get_device_name() if str(a.device).startswith("cuda") else "cpu",
                  "dtype": str(next(model.parameters()).dtype), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())})
    out.with_suffix(".json").write_text(json.dumps(stats, indent=1))
    print(json.dumps({"answers": str(out), "blocks": len(blocks)}))
    return 0
