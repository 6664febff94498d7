"""Stage 2: LoRA (peft) on the routed model, routers fixed (hard masks), or trained jointly (`joint`).

LoRA is applied BEFORE `attach`, so the WIDE hooks sit on the LoRA-wrapped modules and the masks act on
base + LoRA paths alike. loss = kd_weight * KL(dense teacher || routed student) + lm_weight * LM
(+ with `joint`: the stage-1 capacity regulariser, relaxed router decisions with tau annealed
tau_start -> tau_end, Gumbel noise off for the last noise_off_frac). The teacher is the original dense
model (adapters disabled, routers detached), run under no_grad.

Budget, held-out evaluation, early stopping and exact resume as stage 1 (training/loop.py). After training
the jointly trained routers are calibrated back to their capacity targets.

Target text (`calib_text`, `train_stage2(..., target_blocks=)`): the capacity a set reaches on held-out train text is
not the one it runs at on another text (SmolLM2's sets calibrated to 0.7 on train text measure 0.71-0.725 on
WikiText-2: benchmarks/results/quality-smollm2/s2-more-c70/), and moving them there after training costs quality
the training never saw. Given blocks of the text the capacity is meant for, stage 2 measures each kind's capacity
gap between that text and the held-out train text once, before training (hard decisions, the routers and LoRA it
starts from), trains toward the targets minus that gap, and calibrates the final margins on the target text to the
targets themselves.

`train_stage2` returns (merged_model, routers, lora_state): the LoRA merged into a copy of the base weights
(a plain HF model, routers detached), the routers (possibly updated), and the adapter tensors (to save).
Files (<out>): lora.safetensors, routers.safetensors, curve.json / curve.png, stage2.json, ckpt/.
Under `torchrun --nproc-per-node N` the same command trains on N processes (training/distributed.py: the
LoRA-wrapped backbone sharded with FSDP2, the adapters' fp32 master weights sharded with it, routers
replicated; the files hold full tensors, as one process writes them).
"""
from __future__ import annotations

import contextlib
import copy
import json
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from ..routing import FlopCost, Routers, attach, detach, record_masks, routed
from ..routing.calibrate import calibrate_offset_
from . import distributed
from .heldout import HeldoutEval, split_heldout
from .loop import Clock, Phase, run_phase
from .losses import anneal, autocast, capacity_loss, kd_loss, lm_loss, lr_factor, relaxed_capacity, set_lr
from .stage1 import auto_eval_every, total_steps

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

RECIPE_DEFAULTS = {
    "linear": {},
    "wide": {"joint": True, "tau_start": 5.0, "tau_end": 0.5, "tau_anneal": "linear", "router_lr": 5e-4,
             "separate_targets": True},
}


@dataclass
class Stage2Config:
    steps: int = 200              # used when epochs == 0
    epochs: float = 0.0           # > 0: steps = ceil(epochs * train blocks / batch_size)
    batch_size: int = 8
    seq_len: int = 512
    lr: float = 1e-3
    warmup_frac: float = 0.05
    min_lr_frac: float = 0.0
    rank: int = 8
    alpha: int = 16
    lora_dropout: float = 0.0
    init_lora: str | None = None  # a saved LoRA (save_lora) to start from; its rank and alpha replace rank / alpha
    kd_weight: float = 1.0
    lm_weight: float = 0.1
    joint: bool = False          # also train the routers (relaxed, capacity regulariser)
    router_lr: float = 1e-3
    cap_weight: float = 30.0
    capacity: float | None = None        # None: the routers' own cfg.capacity
    capacity_attn: float | None = None   # None: capacity
    capacity_ffn: float | None = None
    separate_targets: bool = False
    tau_start: float = 0.2
    tau_end: float = 0.2
    tau_anneal: str = "geometric"
    noise_off_frac: float = 1.0  # 1.0: no Gumbel noise at all (the routers are already trained)
    seed: int = 0
    ckpt_every: int = 100
    log_every: int = 10
    eval_every: int = 0
    patience: int = 0
    eval_blocks: int = 64
    calib_blocks: int = 32
    eval_calibrated: bool = True
    calibrate: bool = True
    amp: bool = False
    calib_text: str | None = None  # a raw text file the capacity targets are meant for (see the module docstring)
    calib_text_tokens: int = 8192  # tokens of calib_text measured (whole blocks of seq_len)

    @classmethod
    def for_recipe(cls, recipe: str, **kw) -> "Stage2Config":
        if recipe not in RECIPE_DEFAULTS:
            raise ValueError(f"unknown router recipe {recipe!r}; choose one of {sorted(RECIPE_DEFAULTS)}")
        return cls(**{**RECIPE_DEFAULTS[recipe], **kw})

    def targets(self, routers: Routers) -> dict:
        c = routers.cfg.capacity if self.capacity is None else self.capacity
        t = {"overall": c}
        if self.separate_targets or self.capacity_attn is not None or self.capacity_ffn is not None:
            t["attn"] = c if self.capacity_attn is None else self.capacity_attn
            t["ffn"] = c if self.capacity_ffn is None else self.capacity_ffn
        return t


def lora_state(peft_model) -> dict[str, torch.Tensor]:
    """The adapter tensors, full (gathered from FSDP shards: under torchrun call it on every rank), on the CPU."""
    from peft import get_peft_model_state_dict

    full = distributed.full_tensors(get_peft_model_state_dict(peft_model))
    return {k: v.detach().cpu().contiguous() for k, v in full.items()}


def save_lora(peft_model, path, meta: dict | None = None) -> None:
    """Write the adapter (bf16) with its rank / alpha / targets; under torchrun every rank calls it (the
    tensors are gathered) and rank 0 writes."""
    from safetensors.torch import save_file

    state = lora_state(peft_model)
    if not distributed.current().is_main:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    cfg = peft_model.peft_config["default"]
    m = {"rank": str(cfg.r), "alpha": str(cfg.lora_alpha), "targets": json.dumps(sorted(cfg.target_modules))}
    m.update({k: str(v) for k, v in (meta or {}).items()})
    save_file({k: v.to(torch.bfloat16) for k, v in state.items()}, str(path), metadata=m)


def apply_lora(model, rank: int = 8, alpha: int = 16, targets=None, dropout: float = 0.0):
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets or TARGETS), lora_dropout=dropout,
                     bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, cfg)


def read_lora(path) -> tuple[dict, int, int, list]:
    """(adapter tensors, rank, alpha, targets) of a LoRA saved by `save_lora`."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        sd = {k: f.get_tensor(k) for k in f.keys()}
    if not {"rank", "alpha", "targets"} <= set(meta):
        raise ValueError(f"{path} is not a LoRA written by save_lora (its metadata lacks rank / alpha / targets)")
    return sd, int(meta["rank"]), int(meta["alpha"]), json.loads(meta["targets"])


def load_lora_merged(model, path):
    """Apply the LoRA adapter saved by `save_lora` at `path` to `model` (in place of a copy) and merge it.
    Returns the merged plain model."""
    sd, rank, alpha, targets = read_lora(path)
    return merge_lora(model, sd, rank, alpha, targets)


def merge_lora(model, state: dict, rank: int, alpha: int, targets) -> torch.nn.Module:
    """`model` (changed in place) with the adapter tensors `state` (lora_state's keys) merged in."""
    pm = apply_lora(model, rank, alpha, targets)
    set_adapter(pm, state, next(model.parameters()).dtype, "the LoRA to merge")
    return pm.merge_and_unload()


def set_adapter(pm, state: dict, dtype: torch.dtype, what: str) -> None:
    """Load saved adapter tensors (lora_state's keys) into the LoRA-wrapped `pm`, as `dtype`; a tensor the model
    has no place for is an error (an adapter of another model or other targets), never dropped."""
    from peft import set_peft_model_state_dict

    res = set_peft_model_state_dict(pm, {k: v.to(dtype) for k, v in state.items()})
    if getattr(res, "unexpected_keys", None):
        raise ValueError(f"{what}: tensors the model has no place for: {res.unexpected_keys[:3]}")


@contextmanager
def dense_teacher(pm):
    """The original dense model inside a routed LoRA model: routers detached, adapters disabled."""
    with routed(pm, None), pm.disable_adapter():
        yield pm


def _trainables(pm, routers: Routers, joint: bool) -> dict:
    from peft import get_peft_model_state_dict

    d = {f"lora.{k}": v for k, v in get_peft_model_state_dict(pm).items()}
    if joint:
        d.update({f"routers.{k}": v for k, v in routers.state_dict().items()})
    return d


def adapter_parameters(pm, adapter: str = "default") -> dict:
    """{key: parameter} of the LoRA adapter, keyed as get_peft_model_state_dict keys its tensors (the adapter's name
    left out). The parameters themselves (DTensors under FSDP2): peft from 0.22 returns gathered copies of
    sharded entries from get_peft_model_state_dict, so copying into what it returns would change nothing."""
    return {n.replace(f".{adapter}.", "."): p for n, p in pm.named_parameters() if "lora_" in n}


def _load_trainables(pm, routers: Routers, d: dict) -> None:
    from peft import set_peft_model_state_dict

    lora = {k[5:]: v.float() for k, v in d.items() if k.startswith("lora.")}
    if distributed.current().active:  # into this rank's shards of the (DTensor) adapter parameters
        distributed.copy_into_(adapter_parameters(pm), lora)
    else:
        set_peft_model_state_dict(pm, lora)
    rs = {k[8:]: v for k, v in d.items() if k.startswith("routers.")}
    if rs:
        routers.load_state_dict(rs)


def _stage2_phase(pm, routers: Routers, blocks, cfg: Stage2Config, out_dir, groups, device) -> Phase:
    env = distributed.current()
    env.check_batch(cfg.batch_size)
    steps = total_steps(cfg, len(blocks.train))
    opt = torch.optim.AdamW(groups, weight_decay=0.0, betas=(0.9, 0.99))
    cost = FlopCost.from_routers(routers)
    targets = cfg.targets(routers)
    calib, evalb = split_heldout(blocks.heldout, cfg.calib_blocks, cfg.eval_blocks)
    params = [p for g in groups for p in g["params"]]

    def tau_noise(step):
        return (anneal(step, steps, cfg.tau_start, cfg.tau_end, cfg.tau_anneal),
                step / max(1, steps - 1) < 1.0 - cfg.noise_off_frac)

    def step_fn(step: int, ids: torch.Tensor) -> dict:
        ids = env.local_batch(ids).to(device, non_blocking=True)  # ids: [B / ranks, S]
        set_lr(opt, lr_factor(step, steps, cfg.warmup_frac, cfg.min_lr_frac))
        tau, noise = tau_noise(step)
        with autocast(device, cfg.amp):
            with torch.no_grad(), dense_teacher(pm):
                t_logits = pm(input_ids=ids).logits
            relax = routers.relax(tau, noise=noise) if cfg.joint else contextlib.nullcontext()
            with relax, record_masks(pm) as rec:
                logits = pm(input_ids=ids).logits
            cap = env.global_capacity(relaxed_capacity(routers, rec, cost))
        loss_kd = kd_loss(logits, t_logits)
        loss_lm = lm_loss(logits, ids) if cfg.lm_weight > 0 else loss_kd.new_zeros(())
        loss_cap = capacity_loss(cap, targets) if cfg.joint else loss_kd.new_zeros(())
        loss = cfg.kd_weight * loss_kd + cfg.lm_weight * loss_lm + cfg.cap_weight * loss_cap
        opt.zero_grad(set_to_none=True)
        loss.backward()  # FSDP averages the adapters' gradients over the ranks; the routers' are averaged here
        env.reduce_grads_(routers.parameters())
        env.clip_grad_norm_(params, 1.0)
        opt.step()
        return env.mean_scalars({"loss": loss.detach(), "kd": loss_kd.detach(), "lm": loss_lm.detach(),
                                 "cap": cap["overall"].detach(), "attn": cap["attn"].detach(),
                                 "ffn": cap["ffn"].detach()})

    def sched(step: int) -> dict:
        tau, noise = tau_noise(step)
        return {"tau": tau, "noise": noise, "target": targets["overall"],
                "lr_factor": lr_factor(step, steps, cfg.warmup_frac, cfg.min_lr_frac)}

    return Phase(
        name="stage2", out_dir=Path(out_dir) if out_dir else None, total_steps=steps,
        tokens_per_step=cfg.batch_size * cfg.seq_len,
        batches=lambda start: blocks.batches(cfg.batch_size, steps, seed=cfg.seed + 1, start=start),
        step_fn=step_fn, schedule=sched, optimizer=opt,
        evaluate=env.agreed(HeldoutEval(pm, routers, calib, evalb, targets,
                                        calibrated=cfg.joint and cfg.eval_calibrated,
                                        dense_context=lambda: dense_teacher(pm))),
        trainables=lambda: _trainables(pm, routers, cfg.joint),
        load_trainables=lambda d: _load_trainables(pm, routers, d),
        eval_every=auto_eval_every(cfg, steps), patience=cfg.patience, log_every=cfg.log_every,
        ckpt_every=cfg.ckpt_every, config=asdict(cfg))


def target_text_gap(model, routers: Routers, heldout_calib: torch.Tensor, target_blocks: torch.Tensor,
                    keys=("overall", "attn", "ffn")) -> dict:
    """{kind: capacity on target_blocks - capacity on heldout_calib} of `routers` on `model` (hard decisions)."""
    from ..routing.calibrate import deterministic_capacity

    on_train = deterministic_capacity(model, routers, heldout_calib)
    on_target = deterministic_capacity(model, routers, target_blocks)
    return {k: float(on_target[k]) - float(on_train[k]) for k in keys}


def shifted_targets(cfg: Stage2Config, routers: Routers, gap: dict) -> Stage2Config:
    """cfg with each capacity target moved by -gap (the train-text targets whose target-text capacity is cfg's)."""
    t = cfg.targets(routers)
    clip = lambda v: min(1.0, max(0.0, v))  # noqa: E731
    return replace(cfg, capacity=clip(t["overall"] - gap["overall"]),
                   capacity_attn=clip(t["attn"] - gap["attn"]) if "attn" in t else cfg.capacity_attn,
                   capacity_ffn=clip(t["ffn"] - gap["ffn"]) if "ffn" in t else cfg.capacity_ffn)


def train_stage2(base_model, routers: Routers, blocks, cfg: Stage2Config, out_dir=None, log=print,
                 progress: bool = True, clock: Clock | None = None, stop_after: int | None = None,
                 target_blocks: torch.Tensor | None = None):
    """Returns (merged model, routers, lora tensors); when the clock's deadline or `stop_after` ends this
    invocation first: (None, routers, None) with routers.train_status == "paused" (re-run to continue).
    target_blocks [N, S]: blocks of the text the capacity targets are meant for (joint training only; see the
    module docstring): the training targets move by the routers' capacity gap between it and the held-out train
    text, and the final calibration runs on it.

    Under torchrun (a process group of several ranks) the LoRA-wrapped copy of `base_model` is sharded with
    FSDP2 onto this rank's device (load `base_model` on the CPU); the merged model is built from the gathered
    adapter on another copy of `base_model`, where `base_model` is."""
    env = distributed.current()
    device = env.device if env.active else next(base_model.parameters()).device
    torch.manual_seed(cfg.seed)
    model = copy.deepcopy(base_model)
    model.requires_grad_(False)
    init = None
    if cfg.init_lora:  # continue a saved adapter (e.g. the one a converted router set was made with)
        init, rank, alpha, targets = read_lora(cfg.init_lora)
        if sorted(targets) != sorted(TARGETS):
            raise ValueError(f"init_lora {cfg.init_lora} adapts {sorted(targets)}; stage 2 trains {sorted(TARGETS)}")
        if (rank, alpha) != (cfg.rank, cfg.alpha):
            log(f"stage 2 starts from {cfg.init_lora}: rank {rank}, alpha {alpha} (instead of {cfg.rank}, {cfg.alpha})")
            cfg = replace(cfg, rank=rank, alpha=alpha)
    pm = apply_lora(model, cfg.rank, cfg.alpha, dropout=cfg.lora_dropout)
    if init is not None:
        set_adapter(pm, init, torch.float32, f"init_lora {cfg.init_lora}")
    for n, p in pm.named_parameters():
        if "lora_" in n:
            p.data = p.data.float()  # fp32 adapters (the base may be bf16)
            p.requires_grad_(True)
    if env.active:
        env.shard(pm)  # before attach: the routers stay replicated, outside the FSDP units
        env.seed(cfg.seed)
        log, progress = env.main_only(log), progress and env.is_main
    lora_params = [p for n, p in pm.named_parameters() if "lora_" in n]  # (sharded: the DTensor parameters)
    routers = env.broadcast_module_(copy.deepcopy(routers).to(device))
    final_targets, gap = cfg.targets(routers), None
    if target_blocks is not None:
        if not cfg.joint:
            raise ValueError("target_blocks (calib_text) moves the capacity targets of jointly trained routers: "
                             "pass joint=True (--joint true), or leave calib_text unset")
        calib, _ = split_heldout(blocks.heldout, cfg.calib_blocks, cfg.eval_blocks)
        with env.rank0_decisions():
            gap = target_text_gap(pm, routers, calib, target_blocks)
        cfg = shifted_targets(cfg, routers, gap)
        log("stage 2: capacity on the target text minus held-out train text: " +
            ", ".join(f"{k} {v:+.4f}" for k, v in gap.items()) + "; training targets " +
            ", ".join(f"{k} {v:.4f}" for k, v in cfg.targets(routers).items()))
    routers.requires_grad_(cfg.joint)
    attach(pm, routers)
    groups = [{"params": lora_params, "base_lr": cfg.lr, "lr": cfg.lr}]
    if cfg.joint:
        groups.append({"params": list(routers.parameters()), "base_lr": cfg.router_lr, "lr": cfg.router_lr})
    phase = _stage2_phase(pm, routers, blocks, cfg, out_dir, groups, device)
    pm.train()
    try:
        status, st = run_phase(phase, clock, log=log, stop_after=stop_after, progress=progress)
    finally:
        detach(pm)
    pm.eval()
    routers.eval()
    routers.requires_grad_(False)
    routers.train_status, routers.train_state = status, st
    if status == "paused":
        return None, routers, None
    if cfg.joint and cfg.calibrate:
        calib, _ = split_heldout(blocks.heldout, cfg.calib_blocks, cfg.eval_blocks)
        t = cfg.targets(routers)
        if target_blocks is not None:  # the targets themselves, on the text they are meant for
            calib, t = target_blocks, final_targets
        with env.rank0_decisions():  # the same bisection path on every rank
            calibrate_offset_(pm, routers, calib, t["overall"], log=log, target_attn=t.get("attn"),
                              target_ffn=t.get("ffn"))
        env.broadcast_module_(routers)  # every rank returns the routers rank 0 writes
    state = lora_state(pm)
    if out_dir:
        save_lora(pm, Path(out_dir) / "lora.safetensors")
        if env.is_main:
            routers.save(Path(out_dir) / "routers.safetensors")
            summary = {"config": asdict(cfg), "history": st.curve["train"][-50:], "best_step": st.best_step,
                       "best_ppl": st.best_ppl}
            if gap is not None:
                summary["target_text"] = {"gap": gap, "targets": final_targets,
                                          "training_targets": cfg.targets(routers), "blocks": len(target_blocks)}
            (Path(out_dir) / "stage2.json").write_text(json.dumps(summary))
    env.barrier()
    if env.active:  # the sharded model cannot be merged in place: merge the gathered adapter into a copy
        merged = merge_lora(copy.deepcopy(base_model), state, cfg.rank, cfg.alpha, TARGETS)
    else:
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.data = p.data.to(next(base_model.parameters()).dtype)
        merged = pm.merge_and_unload()
    merged.requires_grad_(False)
    merged.train_history = st.curve["train"]
    return merged, routers, state


def text_blocks(tok, path, n_tokens: int, seq_len: int) -> torch.Tensor:
    """The first n_tokens of a raw text file (read as one string, tokenized without special tokens) as whole
    blocks [n_tokens // seq_len, seq_len]."""
    ids = tok(Path(path).read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    n = min(n_tokens, len(ids)) // seq_len
    if n < 1:
        raise SystemExit(f"{path}: {len(ids)} tokens, fewer than one block of {seq_len}: give a longer text")
    return torch.tensor(ids[:n * seq_len], dtype=torch.long).view(n, seq_len)


def parser():
    """The stage2 command's options (every Stage2Config field is one)."""
    import argparse

    from .options import add_config_args, add_run_args

    ap = argparse.ArgumentParser(prog="python -m wide_compile.training stage2",
                                 description="Stage 2: LoRA with fixed (or jointly trained) routers. On N GPUs: "
                                             "torchrun --nproc-per-node N -m wide_compile.training stage2 ... "
                                             "(FSDP2; --batch-size is the global batch)")
    ap.add_argument("--routers", required=True, help="stage-1 routers .safetensors")
    add_run_args(ap)
    ap.add_argument("--smoke", action="store_true", help="tiny random model and random tokens (CPU check)")
    ap.add_argument("--chat-frac", type=float, default=0.0,
                    help="share of train blocks laid out as chat-template turns (training/chat.py)")
    ap.add_argument("--answers", default=None,
                    help="blocks of the dense model's own chat answers (.npy of `python -m wide_compile.training "
                         "answers`), mixed into the train blocks")
    ap.add_argument("--answers-frac", type=float, default=0.25,
                    help="with --answers: the share of train blocks they replace")
    add_config_args(ap, Stage2Config)
    return ap


def main(argv=None):
    import time

    from .chat import ChatFormat
    from .data import TokenBlocks
    from .dense_answers import load_answers
    from .options import (config_from_args, fast_cuda, model_dtype, real_model_and_tokens,
                          smoke_chat_format, smoke_model_and_tokens, training_device)

    t_start = time.time()
    a = parser().parse_args(argv)
    cfg = config_from_args(a, Stage2Config, skip=())
    env, device, load_on = training_device(a.device)
    target_blocks = None
    if a.smoke:
        if cfg.calib_text:
            raise SystemExit("--calib-text needs the real model's tokenizer: drop --smoke or --calib-text")
        model, toks = smoke_model_and_tokens(load_on)
        cfg.steps, cfg.seq_len, cfg.batch_size, cfg.epochs = min(cfg.steps, 10), 64, 4, 0
        chat = smoke_chat_format(model) if a.chat_frac > 0 else None
    else:
        fast_cuda()
        model, toks, tok = real_model_and_tokens(load_on, a.gguf, a.data, a.tokens, with_tokenizer=True,
                                                 dtype=model_dtype(device))
        chat = ChatFormat.from_tokenizer(tok) if a.chat_frac > 0 else None
        if cfg.calib_text:
            target_blocks = text_blocks(tok, cfg.calib_text, cfg.calib_text_tokens, cfg.seq_len)
    routers = Routers.load(a.routers, model)
    answers = load_answers(a.answers, cfg.seq_len) if a.answers else None
    blocks = TokenBlocks(toks, cfg.seq_len, chat=chat, chat_frac=a.chat_frac, seed=cfg.seed, answers=answers,
                         answers_frac=a.answers_frac if answers is not None else 0.0)
    if env.is_main:
        print(f"stage 2: {len(blocks.train)} train blocks x {cfg.seq_len} tokens ({len(blocks.chat_rows)} chat turns, "
              f"{len(blocks.answer_rows)} dense answers), {len(blocks.heldout)} held-out")
    clock = Clock(t_start + a.deadline_s if a.deadline_s else None)
    merged, r, _ = train_stage2(model, routers, blocks, cfg, out_dir=a.out, clock=clock, stop_after=a.stop_after_steps,
                                target_blocks=target_blocks)
    if merged is None:
        return 75
    if env.is_main:
        print(json.dumps({"lora": str(Path(a.out) / "lora.safetensors")}))
    return 0
