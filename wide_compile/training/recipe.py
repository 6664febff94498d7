"""`python -m wide_compile.training recipe`: the whole training of one capacity, resumable.

Stage 1 (routers, base frozen) in <out>/stage1, then stage 2 (LoRA, routers jointly trained with the "wide"
recipe) in <out>/stage2, then <out>/routers.safetensors + <out>/lora.safetensors + <out>/summary.json. Each
phase is exactly resumable (training/loop.py); a finished phase is skipped on a re-run. With --deadline-s
the command checkpoints and exits with code 75 (EX_TEMPFAIL) before that many seconds have passed since it
started; running the same command again continues. Exit code 0: everything is done. Under
`torchrun --nproc-per-node N` both stages train on N processes (training/distributed.py).

Every Stage1Config / Stage2Config field is a flag (--s1-<field> / --s2-<field>); the shared ones
(--capacity, --recipe, group sizes, --batch-size, --seq-len, --epochs of each stage) set both stages.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from . import distributed
from .chat import ChatFormat
from .loop import Clock
from .stage1 import RECIPE_DEFAULTS as S1_RECIPE, Stage1Config, train_stage1
from .stage2 import RECIPE_DEFAULTS as S2_RECIPE, Stage2Config, train_stage2

PAUSED = 75
# sized for SmolLM2-135M on one large GPU: 64 x 512 = 32k tokens per step
GPU_DEFAULTS = {"batch_size": 64, "seq_len": 512, "amp": True, "patience": 3, "ckpt_every": 50}
S1_GPU = {**GPU_DEFAULTS, "epochs": 0.75}
# rank 64: the held-out ppl keeps falling through stage 2 where rank 16 flattens (results/quality-smollm2/s1n-r64);
# `wide train lora-rank` cuts the result for shipping
S2_GPU = {**GPU_DEFAULTS, "epochs": 1.0, "rank": 64, "alpha": 128}
CHAT_FRAC_GPU = 0.25  # share of train blocks laid out as chat turns (training/chat.py)
BASELINES = ("none", "skipgpt", "static")
# the CPU check: a tiny random model, tiny blocks, a few hundred steps in all
SMOKE = {"batch_size": 4, "seq_len": 64, "amp": False, "patience": 0, "ckpt_every": 20, "log_every": 5,
         "eval_blocks": 8, "calib_blocks": 8}
S1_SMOKE = {**SMOKE, "epochs": 0.25}
S2_SMOKE = {**SMOKE, "epochs": 0.1}
SHARED = ("capacity", "capacity_attn", "capacity_ffn", "batch_size", "seq_len", "seed", "amp")


def _parser(recipe: str, smoke: bool) -> argparse.ArgumentParser:
    from .options import add_config_args

    ap = argparse.ArgumentParser(prog="python -m wide_compile.training recipe", description=__doc__.split("\n\n")[1],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", required=True, help="run folder (resumes / skips finished phases)")
    ap.add_argument("--recipe", choices=sorted(S1_RECIPE), default="wide", help="router recipe")
    ap.add_argument("--capacity", type=float, default=0.5, help="target FLOP-weighted capacity")
    ap.add_argument("--capacity-attn", type=float, default=None, help="attention target (default: --capacity)")
    ap.add_argument("--capacity-ffn", type=float, default=None, help="FFN target (default: --capacity)")
    ap.add_argument("--ffn-group-size", type=int, default=64, help="FFN channels per router bit")
    ap.add_argument("--head-group-size", default="1", help="query heads per router bit, or 'kv' (one KV group)")
    ap.add_argument("--baseline", choices=BASELINES, default="none",
                    help="skipgpt: one group per module (whole attention / MLP per token), same training; "
                         "static: token-independent Wanda-sp pruning (eval/baselines.py) instead of stage 1, "
                         "then stage 2 with the masks fixed")
    ap.add_argument("--chat-frac", type=float, default=0.0 if smoke else CHAT_FRAC_GPU,
                    help="share of train blocks laid out as chat-template turns (training/chat.py)")
    ap.add_argument("--answers", default=None,
                    help="blocks of the dense model's own chat answers (.npy of `python -m wide_compile.training "
                         "answers`), mixed into both stages' train blocks")
    ap.add_argument("--answers-frac", type=float, default=0.25, help="with --answers: the share of train blocks they replace")
    ap.add_argument("--batch-size", type=int, default=None, help="both stages (default: per stage)")
    ap.add_argument("--seq-len", type=int, default=None, help="both stages (default: per stage)")
    ap.add_argument("--s1-only", action="store_true", help="stop after stage 1")
    ap.add_argument("--tokens", default=None, help="token cache .npy/.npz (training/data.py; written if absent)")
    ap.add_argument("--data", default=None, help="train-text folder (default ../shared/data/train-text)")
    ap.add_argument("--gguf", default=None, help="SmolLM2 GGUF; unset: $WIDE_SMOLLM2_GGUF, else the cache")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="training device")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="seconds for this invocation: checkpoint and exit 75 before them; re-run to continue")
    ap.add_argument("--stop-after-steps", type=int, default=None,
                    help="pause after this many training steps in this invocation (as a deadline would)")
    ap.add_argument("--smoke", action="store_true", help="tiny random model and random tokens (CPU check)")
    skip = ("extra",) + SHARED + ("ffn_group_size", "head_group_size")
    s1 = {**S1_RECIPE[recipe], **(S1_SMOKE if smoke else S1_GPU)}
    s2 = {**S2_RECIPE[recipe], **(S2_SMOKE if smoke else S2_GPU)}
    add_config_args(ap, Stage1Config, prefix="s1-", skip=skip, defaults=s1)
    add_config_args(ap, Stage2Config, prefix="s2-", skip=skip + ("capacity",), defaults=s2)
    return ap


def parse(argv) -> argparse.Namespace:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--recipe", default="wide")
    pre.add_argument("--smoke", action="store_true")
    known, _ = pre.parse_known_args(argv)
    if known.recipe not in S1_RECIPE:
        raise SystemExit(f"--recipe must be one of {sorted(S1_RECIPE)}, got {known.recipe!r}")
    return _parser(known.recipe, known.smoke).parse_args(argv)


def configs(a: argparse.Namespace) -> tuple[Stage1Config, Stage2Config]:
    from .options import config_from_args

    skip = ("extra",) + SHARED + ("ffn_group_size", "head_group_size")
    shared = {"capacity": a.capacity, "capacity_attn": a.capacity_attn, "capacity_ffn": a.capacity_ffn}
    sizes = {k: getattr(a, k) for k in ("batch_size", "seq_len") if getattr(a, k) is not None}
    base = SMOKE if a.smoke else GPU_DEFAULTS
    both = {"batch_size": base["batch_size"], "seq_len": base["seq_len"], "amp": base["amp"], **sizes}
    hgs = a.head_group_size if a.head_group_size == "kv" else int(a.head_group_size)
    c1 = config_from_args(a, Stage1Config, prefix="s1-", skip=skip,
                          base={**shared, **both, "ffn_group_size": a.ffn_group_size, "head_group_size": hgs})
    c2 = config_from_args(a, Stage2Config, prefix="s2-", skip=skip + ("capacity",), base={**shared, **both})
    return c1, c2


def _done(folder: Path, final: str) -> bool:
    st = folder / "ckpt" / "state.json"
    return (folder / final).is_file() and st.is_file() and json.loads(st.read_text()).get("trained", False)


def run(a: argparse.Namespace, log=print) -> int:
    """The whole recipe for one capacity; returns 0 (done) or PAUSED."""
    t_start = time.time()
    from .data import TokenBlocks
    from .dense_answers import load_answers
    from .options import (fast_cuda, model_dtype, real_model_and_tokens, smoke_chat_format, smoke_model_and_tokens,
                          training_device)

    env, device, load_on = training_device(a.device)
    log = env.main_only(log)
    if a.smoke:
        model, toks = smoke_model_and_tokens(load_on)
        chat = smoke_chat_format(model) if a.chat_frac > 0 else None
    else:
        fast_cuda()
        model, toks, tok = real_model_and_tokens(load_on, a.gguf, a.data, a.tokens, with_tokenizer=True,
                                                 dtype=model_dtype(device))
        chat = ChatFormat.from_tokenizer(tok) if a.chat_frac > 0 else None
    clock = Clock(t_start + a.deadline_s if a.deadline_s else None)
    c1, c2 = configs(a)
    _apply_baseline(a.baseline, model, c1, c2)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    def make_blocks(seq_len):
        ans = load_answers(a.answers, seq_len) if a.answers else None
        return TokenBlocks(toks, seq_len, chat=chat, chat_frac=a.chat_frac, seed=c1.seed, answers=ans,
                           answers_frac=a.answers_frac if ans is not None else 0.0)

    blocks = make_blocks(c1.seq_len)
    log(f"recipe {a.recipe} ({a.baseline=}) capacity {a.capacity}: {len(blocks.train)} train blocks x "
        f"{c1.seq_len} tokens ({len(blocks.chat_rows)} as chat turns, {len(blocks.answer_rows)} dense answers), "
        f"{len(blocks.heldout)} held-out")
    from ..routing import Routers

    s1_dir, s2_dir = out / "stage1", out / "stage2"
    if _done(s1_dir, "routers.safetensors"):
        r1 = Routers.load(s1_dir / "routers.safetensors", model).to(device)
        log("stage 1: finished earlier, skipped")
    elif a.baseline == "static":
        r1 = _static_stage1(model, blocks, c1, s1_dir, log).to(device)
    else:
        r1 = train_stage1(model, blocks, c1, out_dir=s1_dir, device=device, log=log, progress=False, clock=clock,
                          stop_after=a.stop_after_steps)
        if r1.train_status == "paused":
            return PAUSED
    if a.s1_only:
        return _finish(a, out, s1_dir, None, model, blocks, c1)
    b2 = blocks if c2.seq_len == c1.seq_len else make_blocks(c2.seq_len)
    if _done(s2_dir, "lora.safetensors"):
        log("stage 2: finished earlier, skipped")
    else:
        merged, _, _ = train_stage2(model, r1, b2, c2, out_dir=s2_dir, log=log, progress=False, clock=clock,
                                    stop_after=a.stop_after_steps)
        if merged is None:
            return PAUSED
    return _finish(a, out, s1_dir, s2_dir, model, blocks, c1)


def _apply_baseline(baseline: str, model, c1: Stage1Config, c2: Stage2Config) -> None:
    """skipgpt: one router bit per module; static: stage 2 keeps the pruning masks fixed."""
    if baseline == "skipgpt":
        from ..models.spec import model_spec

        s = model_spec(model)
        c1.head_group_size, c1.ffn_group_size = s.num_heads, s.intermediate_size
    elif baseline == "static":
        c2.joint = False


def _static_stage1(model, blocks, c1: Stage1Config, s1_dir: Path, log):
    """Token-independent masks at the capacity (Wanda-sp scores on the calibration blocks), saved as stage 1."""
    from ..eval.baselines import static_pruning
    from .heldout import split_heldout

    calib, evalb = split_heldout(blocks.heldout, c1.calib_blocks, c1.eval_blocks)
    r = static_pruning(model, calib, c1.capacity, cfg=c1.wide_config(model), eval_blocks=evalb[:8], log=log)
    env = distributed.current()
    if env.is_main:
        s1_dir.mkdir(parents=True, exist_ok=True)
        r.save(s1_dir / "routers.safetensors")
        (s1_dir / "ckpt").mkdir(exist_ok=True)
        (s1_dir / "ckpt" / "state.json").write_text(json.dumps({"trained": True, "static": r.allocation}))
    env.barrier()
    return r


def _finish(a, out: Path, s1_dir: Path, s2_dir: Path | None, model, blocks, c1) -> int:
    """Copy the final routers (+ LoRA) to <out> and write summary.json (rank 0 under torchrun)."""
    env = distributed.current()
    if not env.is_main:
        return 0
    src = s2_dir or s1_dir
    shutil.copy(src / "routers.safetensors", out / "routers.safetensors")
    if s2_dir is not None:
        shutil.copy(s2_dir / "lora.safetensors", out / "lora.safetensors")
    summary = {"recipe": a.recipe, "baseline": a.baseline, "chat_frac": a.chat_frac, "answers": a.answers,
               "answers_frac": a.answers_frac if a.answers else 0.0, "capacity": a.capacity, "capacity_attn": a.capacity_attn,
               "capacity_ffn": a.capacity_ffn, "argv": sys.argv[1:], "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "device": torch.cuda.get_device_name() if str(a.device).startswith("cuda") else "cpu",
               "processes": env.world_size}
    for name, d in (("stage1", s1_dir), ("stage2", s2_dir)):
        if d is not None and (d / "curve.json").is_file():
            cur = json.loads((d / "curve.json").read_text())
            ev = cur.get("eval", [])
            summary[name] = {"steps": cur.get("step"), "total_steps": cur.get("total_steps"),
                             "tokens": cur["train"][-1]["tokens"] if cur.get("train") else 0,
                             "best_step": cur.get("best_step"), "best_heldout_ppl": cur.get("best_ppl"),
                             "dense_heldout_ppl": ev[0].get("dense_ppl") if ev else None,
                             "stopped_early": cur.get("stopped_early"), "last_eval": ev[-1] if ev else None}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({"done": True, "out": str(out), "routers": str(out / "routers.safetensors"),
                      "lora": str(out / "lora.safetensors") if s2_dir else None}))
    return 0


def main(argv=None) -> int:
    return run(parse(list(sys.argv[1:] if argv is None else argv)))
