"""Stage 1: train the routers only (base model frozen).

loss = kd_weight * KL(dense teacher || routed student)            (token-mean, full vocabulary, T=1)
     + lm_weight * next-token cross-entropy of the routed student
     + cap_weight * capacity_loss                                  (FLOP-weighted, DESIGN.md)

capacity_loss is (attn - target_attn)^2 + (ffn - target_ffn)^2 (separate attention / FFN targets, each
defaulting to `capacity`) with `separate_targets` (the "wide" recipe's default) or a per-kind target given,
else (overall - target)^2. Decisions are relaxed (`Routers.relax(tau)`: each router's hard
straight-through relaxation; the forward is hard 0/1, so the student sees what inference will do up to
noise). tau is annealed tau_start -> tau_end ("linear" or
"geometric"); the Gumbel noise is switched off for the last `noise_off_frac` of the steps so the
deterministic (inference) decisions are trained last. Capacity targets ramp linearly from 1.0 over the
first `ramp_frac` of the steps (routers start dense: `router_init="dense"`).

Budget: `epochs` passes over the training blocks (steps derived from the token count), held-out
perplexity of the routed model every `eval_every` steps (training/heldout.py: at the calibrated capacity),
early stopping after `patience` evaluations without improvement, the best routers kept. After training the
margins are calibrated on held-out text so the deterministic capacities equal the targets.

Files (<out>): routers.safetensors (final), curve.json / curve.png, stage1.json (config + last records),
ckpt/ (training/loop.py: exact resume). Re-running with the same --out resumes or, if finished, returns.
Under `torchrun --nproc-per-node N` the same command trains on N processes (training/distributed.py:
FSDP2-sharded backbone, replicated routers, --batch-size stays the global batch).
"""
from __future__ import annotations

import copy
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..config import WideConfig, kv_head_group_size
from ..models.spec import model_spec
from ..routing import FlopCost, Routers, attach, detach, record_masks
from ..routing.calibrate import calibrate_offset_, deterministic_capacity  # noqa: F401  (re-exported)
from . import distributed
from .heldout import HeldoutEval, split_heldout
from .loop import Clock, Phase, run_phase
from .losses import (anneal, autocast, capacity_loss, kd_loss, lm_loss, lr_factor,  # noqa: F401  (re-exported)
                     relaxed_capacity, set_lr, teacher_logits)

# per recipe, the defaults that differ from Stage1Config's own (the "wide" ones follow the method's authors)
RECIPE_DEFAULTS = {
    "linear": {},
    # a margin of 2 executes ~88% of groups under the training noise; a larger bias lr lets the ramp move it.
    # The noise stays on and tau stops at 1.5 (the method's code anneals to 0.5): with tau low and the noise off
    # the held-out ppl of the argmax routers rises to the end of the schedule (results/quality-smollm2/s1n-r64)
    "wide": {"router_recipe": "wide", "router_rank": 32, "tau_start": 5.0, "tau_end": 1.5, "tau_anneal": "linear",
             "noise_off_frac": 0.0, "lr": 2e-3, "bias_lr_mult": 25.0, "router_init_bias": 2.0,
             "separate_targets": True},
}


@dataclass
class Stage1Config:
    capacity: float = 0.5
    capacity_attn: float | None = None   # None: `capacity`
    capacity_ffn: float | None = None    # None: `capacity`
    separate_targets: bool = False       # regularise attention and FFN capacity separately
    steps: int = 400                     # used when epochs == 0
    epochs: float = 0.0                  # > 0: steps = ceil(epochs * train blocks / batch_size)
    batch_size: int = 8
    seq_len: int = 512
    lr: float = 3e-3
    bias_lr_mult: float = 10.0  # router margins move a few logits from the dense init: a larger lr
    warmup_frac: float = 0.05
    min_lr_frac: float = 0.1
    weight_decay: float = 0.0
    kd_weight: float = 1.0
    lm_weight: float = 0.1
    cap_weight: float = 30.0
    tau_start: float = 1.0
    tau_end: float = 0.2
    tau_anneal: str = "geometric"
    ramp_frac: float = 0.3
    noise_off_frac: float = 0.2
    seed: int = 0
    ckpt_every: int = 100
    log_every: int = 10
    eval_every: int = 0       # 0: 8 evaluations over the run
    patience: int = 0         # evaluations without a better held-out ppl before stopping; 0: never stop early
    eval_blocks: int = 64     # held-out blocks whose ppl is measured
    eval_calibrated: bool = True
    calibrate: bool = True
    calib_blocks: int = 32  # held-out blocks used by the capacity calibration
    amp: bool = False  # bf16 autocast on CUDA for the training steps
    # router shape
    ffn_group_size: int = 64
    head_group_size: int | str = 1  # or "kv": the query heads of one KV group
    router_hidden: int = 0
    router_recipe: str = "linear"
    router_rank: int = 32
    router_init_bias: float = 3.0
    structure: str = "free"     # or "codebook" / "nested" (WideConfig.structure)
    codebook_size: int = 16     # structure="codebook": prototypes per router
    nested_levels: int = 8      # structure="nested": width levels per router
    extra: dict = field(default_factory=dict)

    @classmethod
    def for_recipe(cls, recipe: str, **kw) -> "Stage1Config":
        if recipe not in RECIPE_DEFAULTS:
            raise ValueError(f"unknown router recipe {recipe!r}; choose one of {sorted(RECIPE_DEFAULTS)}")
        return cls(**{**RECIPE_DEFAULTS[recipe], **kw})

    def targets(self) -> dict:
        """Final capacity targets: overall, and attn / ffn when regularised separately."""
        t = {"overall": self.capacity}
        if self.separate_targets or self.capacity_attn is not None or self.capacity_ffn is not None:
            t["attn"] = self.capacity if self.capacity_attn is None else self.capacity_attn
            t["ffn"] = self.capacity if self.capacity_ffn is None else self.capacity_ffn
        return t

    def wide_config(self, model=None) -> WideConfig:
        hgs = self.head_group_size
        if model is not None:
            hgs = resolve_head_group_size(hgs, model)
        elif not isinstance(hgs, int):
            raise ValueError(f"head_group_size={hgs!r} needs the model to resolve; pass wide_config(model)")
        return WideConfig(ffn_group_size=self.ffn_group_size, head_group_size=hgs, capacity=self.capacity,
                          router_hidden=self.router_hidden, router_init="dense", router_recipe=self.router_recipe,
                          router_rank=self.router_rank, router_init_bias=self.router_init_bias,
                          structure=self.structure, codebook_size=self.codebook_size,
                          nested_levels=self.nested_levels)


def resolve_head_group_size(value, model) -> int:
    """An int, or "kv": query heads per KV head (one router bit per KV group under GQA)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if str(value).isdigit():
        return int(value)
    if value != "kv":
        raise ValueError(f"head_group_size must be a positive integer or 'kv', got {value!r}")
    return kv_head_group_size(model)


def schedule(step: int, steps: int, cfg: Stage1Config) -> tuple[float, float, bool]:
    """(tau, overall capacity target, noise) at `step`."""
    tau = anneal(step, steps, cfg.tau_start, cfg.tau_end, cfg.tau_anneal)
    return tau, _ramp(step, steps, cfg, cfg.capacity), step / max(1, steps - 1) < 1.0 - cfg.noise_off_frac


def _ramp(step: int, steps: int, cfg: Stage1Config, target: float) -> float:
    frac = step / max(1, steps - 1)
    return 1.0 - (1.0 - target) * min(1.0, frac / max(1e-9, cfg.ramp_frac))


def total_steps(cfg, n_train_blocks: int) -> int:
    if cfg.epochs and cfg.epochs > 0:
        return max(1, math.ceil(cfg.epochs * n_train_blocks / cfg.batch_size))
    return cfg.steps


def auto_eval_every(cfg, steps: int) -> int:
    return cfg.eval_every if cfg.eval_every > 0 else max(1, steps // 8)


def router_optimizer(routers: Routers, cfg) -> torch.optim.AdamW:
    """AdamW over the router parameters; the margins (free routers' biases, codebook prototypes) get
    lr * bias_lr_mult."""
    named = [(n, p) for n, p in routers.named_parameters() if p.requires_grad]
    is_bias = lambda n: n.endswith(("proj.bias", "up.bias", ".prototypes"))  # noqa: E731
    groups = [{"params": [p for n, p in named if not is_bias(n)], "base_lr": cfg.lr},
              {"params": [p for n, p in named if is_bias(n)], "base_lr": cfg.lr * cfg.bias_lr_mult}]
    for g in groups:
        g["lr"] = g["base_lr"]
    return torch.optim.AdamW(groups, weight_decay=cfg.weight_decay, betas=(0.9, 0.99))


def _scheduled_targets(step: int, steps: int, cfg: Stage1Config) -> dict:
    return {k: _ramp(step, steps, cfg, v) for k, v in cfg.targets().items()}


def _stage1_phase(model, routers: Routers, blocks, cfg: Stage1Config, out_dir, device) -> Phase:
    env = distributed.current()
    env.check_batch(cfg.batch_size)
    steps = total_steps(cfg, len(blocks.train))
    opt = router_optimizer(routers, cfg)
    cost = FlopCost.from_routers(routers)
    calib, evalb = split_heldout(blocks.heldout, cfg.calib_blocks, cfg.eval_blocks)

    def step_fn(step: int, ids: torch.Tensor) -> dict:
        ids = env.local_batch(ids).to(device, non_blocking=True)  # ids: [B / ranks, S]
        tau, _, noise = schedule(step, steps, cfg)
        set_lr(opt, lr_factor(step, steps, cfg.warmup_frac, cfg.min_lr_frac))
        with autocast(device, cfg.amp):
            t_logits = teacher_logits(model, ids) if cfg.kd_weight > 0 else None
            with routers.relax(tau, noise=noise), record_masks(model) as rec:
                logits = model(input_ids=ids).logits
            cap = env.global_capacity(relaxed_capacity(routers, rec, cost))
        zero = logits.new_zeros((), dtype=torch.float32)
        loss_kd = kd_loss(logits, t_logits) if t_logits is not None else zero
        loss_lm = lm_loss(logits, ids) if cfg.lm_weight > 0 else zero
        loss_cap = capacity_loss(cap, _scheduled_targets(step, steps, cfg))
        loss = cfg.kd_weight * loss_kd + cfg.lm_weight * loss_lm + cfg.cap_weight * loss_cap
        opt.zero_grad(set_to_none=True)
        loss.backward()
        env.reduce_grads_(routers.parameters())
        torch.nn.utils.clip_grad_norm_(routers.parameters(), 1.0)
        opt.step()
        return env.mean_scalars({"loss": loss.detach(), "kd": loss_kd.detach(), "lm": loss_lm.detach(),
                                 "cap": cap["overall"].detach(), "attn": cap["attn"].detach(),
                                 "ffn": cap["ffn"].detach()})

    def sched(step: int) -> dict:
        tau, target, noise = schedule(step, steps, cfg)
        t = _scheduled_targets(step, steps, cfg)
        return {"tau": tau, "target": target, "target_attn": t.get("attn"), "target_ffn": t.get("ffn"),
                "noise": noise, "lr_factor": lr_factor(step, steps, cfg.warmup_frac, cfg.min_lr_frac)}

    ramp_end = cfg.ramp_frac * (steps - 1)
    return Phase(
        name=f"stage1 c={cfg.capacity}", out_dir=Path(out_dir) if out_dir else None, total_steps=steps,
        tokens_per_step=cfg.batch_size * cfg.seq_len,
        batches=lambda start: blocks.batches(cfg.batch_size, steps, seed=cfg.seed, start=start),
        step_fn=step_fn, schedule=sched, optimizer=opt,
        evaluate=env.agreed(HeldoutEval(model, routers, calib, evalb, cfg.targets(), calibrated=cfg.eval_calibrated)),
        trainables=lambda: dict(routers.state_dict()),
        load_trainables=lambda d: routers.load_state_dict(d),
        eligible=lambda step: step >= ramp_end, eval_every=auto_eval_every(cfg, steps), patience=cfg.patience,
        log_every=cfg.log_every, ckpt_every=cfg.ckpt_every, config=asdict(cfg))


def train_stage1(model, blocks, cfg: Stage1Config, out_dir=None, device=None, log=print,
                 routers: Routers | None = None, progress: bool = True, clock: Clock | None = None,
                 stop_after: int | None = None) -> Routers:
    """Train routers for `model` (frozen) on `blocks` (a data.TokenBlocks). Returns the routers (detached,
    hard decisions, the best held-out ones, calibrated if cfg.calibrate), with `.train_history` (the
    curve's training records) and `.train_status` ("done", or "paused" when the clock's deadline or
    `stop_after` ended this invocation first: re-run to continue; nothing final is written then).

    Under torchrun (a process group of several ranks) it trains on an FSDP2-sharded copy of `model` on this
    rank's device; `model` itself stays as it is (load it on the CPU: only the shards go to the GPU). A model
    that is already sharded (distributed.is_sharded: built on the meta device, then DistEnv.shard) is
    trained as it is."""
    env = distributed.current()
    device = env.device if env.active else (device or next(model.parameters()).device)
    torch.manual_seed(cfg.seed)
    model.requires_grad_(False)
    model.eval()
    if routers is None:
        routers = Routers.init(model, cfg.wide_config(model), seed=cfg.seed)
    routers.to(device).train()
    routers.requires_grad_(True)
    if env.active:
        model = model if distributed.is_sharded(model) else env.shard(copy.deepcopy(model))
        env.broadcast_module_(routers)
        env.seed(cfg.seed)
        log, progress = env.main_only(log), progress and env.is_main
    phase = _stage1_phase(model, routers, blocks, cfg, out_dir, device)
    attach(model, routers)
    try:
        status, st = run_phase(phase, clock, log=log, stop_after=stop_after, progress=progress)
    finally:
        detach(model)
    routers.eval()
    routers.requires_grad_(False)
    routers.train_history, routers.train_status, routers.train_state = st.curve["train"], status, st
    if status == "paused":
        return routers
    if cfg.calibrate:
        calib, _ = split_heldout(blocks.heldout, cfg.calib_blocks, cfg.eval_blocks)
        t = cfg.targets()
        with env.rank0_decisions():  # the same bisection path on every rank
            calibrate_offset_(model, routers, calib, cfg.capacity, log=log, target_attn=t.get("attn"),
                              target_ffn=t.get("ffn"))
        env.broadcast_module_(routers)  # every rank returns the routers rank 0 writes
    if out_dir and env.is_main:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        routers.save(Path(out_dir) / "routers.safetensors")
        (Path(out_dir) / "stage1.json").write_text(json.dumps({"config": asdict(cfg), "history": st.curve["train"][-50:],
                                                               "best_step": st.best_step, "best_ppl": st.best_ppl}))
    env.barrier()
    return routers


def main(argv=None):
    import argparse
    import time

    from .data import TokenBlocks
    from .options import (add_config_args, add_run_args, config_from_args, fast_cuda, model_dtype,
                          real_model_and_tokens, smoke_model_and_tokens, training_device)

    t_start = time.time()
    ap = argparse.ArgumentParser(prog="python -m wide_compile.training stage1",
                                 description="Stage 1: train WIDE (or SkipGPT-style) routers, base frozen. "
                                             "On N GPUs: torchrun --nproc-per-node N -m wide_compile.training "
                                             "stage1 ... (FSDP2; --batch-size is the global batch)")
    add_run_args(ap)
    ap.add_argument("--method", choices=["wide", "skipgpt"], default="wide",
                    help="skipgpt = one group per module (skip the whole attention / MLP per token)")
    ap.add_argument("--smoke", action="store_true", help="tiny random model, a few steps (CPU check)")
    add_config_args(ap, Stage1Config)
    a = ap.parse_args(argv)
    cfg = config_from_args(a, Stage1Config)
    env, device, load_on = training_device(a.device)
    if a.smoke:
        model, toks = smoke_model_and_tokens(load_on)
        cfg.steps, cfg.seq_len, cfg.batch_size, cfg.epochs = min(cfg.steps, 20), 64, 4, 0
    else:
        fast_cuda()
        model, toks = real_model_and_tokens(load_on, a.gguf, a.data, a.tokens, dtype=model_dtype(device))
    if a.method == "skipgpt":
        s = model_spec(model)
        cfg.head_group_size, cfg.ffn_group_size = s.num_heads, s.intermediate_size
    blocks = TokenBlocks(toks, cfg.seq_len)
    clock = Clock(t_start + a.deadline_s if a.deadline_s else None)
    r = train_stage1(model, blocks, cfg, out_dir=a.out, device=device, clock=clock, stop_after=a.stop_after_steps)
    if r.train_status == "paused":
        return 75
    if env.is_main:
        print(json.dumps({"out": str(Path(a.out) / "routers.safetensors"), "best_step": r.train_state.best_step,
                          "best_ppl": r.train_state.best_ppl}))
    return 0
