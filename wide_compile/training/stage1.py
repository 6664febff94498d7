"""Stage 1: train the routers only (base model frozen).

loss = kd_weight * KL(dense teacher || routed student)            (token-mean, full vocabulary, T=1)
     + lm_weight * next-token cross-entropy of the routed student
     + cap_weight * (capacity - target_t)^2                        (FLOP-weighted, DESIGN.md)

Decisions are relaxed with a straight-through Gumbel-sigmoid (`Routers.relax(tau)`): the forward pass is
hard 0/1 (so the student sees exactly what inference will do, up to noise), the backward pass uses the
sigmoid's gradient. tau is annealed geometrically tau_start -> tau_end; the Gumbel noise is switched off
for the last `noise_off_frac` of the steps so the deterministic (inference) decisions are trained last.
The capacity target is ramped linearly from 1.0 to `capacity` over the first `ramp_frac` of the steps
(routers start dense: `router_init="dense"`). After training, one global logit offset is calibrated by
bisection on held-out training text so the deterministic capacity equals the target (|err| < 0.005).

Checkpoints (safetensors): <out>/routers.safetensors (final), <out>/ckpt/last.safetensors (routers) +
<out>/ckpt/opt.safetensors (AdamW state, step in metadata). Re-running with the same --out resumes.
"""
from __future__ import annotations

import json
import math
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from ..config import WideConfig
from ..routing import FlopCost, Routers, attach, detach, record_masks, routed
from ..routing.calibrate import calibrate_offset_, deterministic_capacity  # noqa: F401  (re-exported)


@dataclass
class Stage1Config:
    capacity: float = 0.5
    steps: int = 400
    batch_size: int = 8
    seq_len: int = 512
    lr: float = 3e-3
    bias_lr_mult: float = 10.0  # router biases move ~3 logits from the dense init: give them a larger lr
    weight_decay: float = 0.0
    kd_weight: float = 1.0
    lm_weight: float = 0.1
    cap_weight: float = 30.0
    tau_start: float = 1.0
    tau_end: float = 0.2
    ramp_frac: float = 0.3
    noise_off_frac: float = 0.2
    seed: int = 0
    ckpt_every: int = 100
    calibrate: bool = True
    calib_blocks: int = 32  # held-out blocks used by the capacity calibration
    amp: bool = False  # bf16 autocast on CUDA (default: run the model in its own dtype, routers fp32)
    # router shape
    ffn_group_size: int = 64
    head_group_size: int = 1
    router_hidden: int = 0
    extra: dict = field(default_factory=dict)

    def wide_config(self) -> WideConfig:
        return WideConfig(ffn_group_size=self.ffn_group_size, head_group_size=self.head_group_size,
                          capacity=self.capacity, router_hidden=self.router_hidden, router_init="dense")


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """Token-mean KL(teacher || student) over the full vocabulary, computed in fp32 chunks."""
    s = student_logits.reshape(-1, student_logits.shape[-1])
    t = teacher_logits.reshape(-1, teacher_logits.shape[-1])
    total = s.new_zeros((), dtype=torch.float32)
    for i in range(0, s.shape[0], chunk):
        ls = F.log_softmax(s[i:i + chunk].float(), -1)
        lt = F.log_softmax(t[i:i + chunk].float(), -1)
        total = total + (lt.exp() * (lt - ls)).sum()
    return total / s.shape[0]


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))


def relaxed_capacity(routers: Routers, rec: dict, cost: FlopCost | None = None) -> dict:
    """Differentiable FLOP capacity from recorded (relaxed) masks of one forward."""
    cost = cost or FlopCost.from_routers(routers)
    attn = [torch.cat([m.float().mean(-1).reshape(-1) for m in rec["attn"][i]]) for i in range(len(rec["attn"]))]
    ffn = [torch.cat([m.float().mean(-1).reshape(-1) for m in rec["ffn"][i]]) for i in range(len(rec["ffn"]))]
    return cost.capacity(attn, ffn)


@torch.no_grad()
def teacher_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Dense logits of `model` (routers temporarily detached if attached)."""
    with routed(model, None):
        return model(input_ids=ids).logits


def _autocast(device, enabled: bool):
    dev = torch.device(device)
    if enabled and dev.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    import contextlib

    return contextlib.nullcontext()


def schedule(step: int, steps: int, cfg: Stage1Config) -> tuple[float, float, bool]:
    """(tau, capacity target, noise) at `step`."""
    frac = step / max(1, steps - 1)
    tau = cfg.tau_start * (cfg.tau_end / cfg.tau_start) ** frac
    ramp = max(1e-9, cfg.ramp_frac)
    target = 1.0 - (1.0 - cfg.capacity) * min(1.0, frac / ramp)
    noise = frac < 1.0 - cfg.noise_off_frac
    return tau, target, noise


# -- optimizer state in safetensors ----------------------------------------------------------------
def _save_opt(opt: torch.optim.Optimizer, path: Path, step: int) -> None:
    from safetensors.torch import save_file

    sd = opt.state_dict()
    tensors = {}
    for pid, st in sd["state"].items():
        for k, v in st.items():
            tensors[f"{pid}.{k}"] = (v if torch.is_tensor(v) else torch.tensor(v)).detach().cpu().contiguous()
    meta = {"step": str(step), "param_groups": json.dumps(sd["param_groups"])}
    save_file(tensors, str(path), metadata=meta)


def _previous_history(out_dir, name: str) -> list:
    """The loss history a resumed run's earlier part wrote (its last 50 steps), so a run resumed at
    its final step still reports how it ended; [] when the earlier part stopped before writing it."""
    f = Path(out_dir) / name if out_dir else None
    if f is None or not f.is_file():
        return []
    return list(json.loads(f.read_text()).get("history", []))


def _fast_forward(sched, steps: int) -> None:
    """Advance a resumed run's LR schedule to its step (no optimizer step is due here, so torch's
    "scheduler before optimizer" warning does not apply)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(steps):
            sched.step()


def _load_opt(opt: torch.optim.Optimizer, path: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        state: dict = {}
        for k in f.keys():
            pid, name = k.split(".", 1)
            state.setdefault(int(pid), {})[name] = f.get_tensor(k)
    opt.load_state_dict({"state": state, "param_groups": json.loads(meta["param_groups"])})
    return int(meta["step"])


# -- capacity calibration (routing/calibrate.py; re-exported here) ----------------------------------
# -- the trainer ------------------------------------------------------------------------------------
def train_stage1(model, blocks, cfg: Stage1Config, out_dir=None, device=None, log=print,
                 routers: Routers | None = None, progress: bool = True) -> Routers:
    """Train routers for `model` (frozen) on `blocks` (a data.TokenBlocks). Returns routers (detached,
    hard decisions, calibrated if cfg.calibrate)."""
    from tqdm.auto import tqdm

    device = device or next(model.parameters()).device
    torch.manual_seed(cfg.seed)
    model.requires_grad_(False)
    model.eval()
    if routers is None:
        routers = Routers.init(model, cfg.wide_config(), seed=cfg.seed)
    routers.to(device).train()
    for p in routers.parameters():
        p.requires_grad_(True)
    named = [(n, p) for n, p in routers.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for n, p in named if not n.endswith("proj.bias")], "lr": cfg.lr},
                             {"params": [p for n, p in named if n.endswith("proj.bias")],
                              "lr": cfg.lr * cfg.bias_lr_mult}],
                            weight_decay=cfg.weight_decay, betas=(0.9, 0.99))
    start = 0
    ck = Path(out_dir) / "ckpt" if out_dir else None
    if ck is not None and (ck / "last.safetensors").is_file() and (ck / "opt.safetensors").is_file():
        loaded = Routers.load(ck / "last.safetensors", model)
        routers.load_state_dict(loaded.state_dict())
        start = _load_opt(opt, ck / "opt.safetensors")
        log(f"resumed stage 1 from {ck} at step {start}")
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / max(1, cfg.steps)))))
    _fast_forward(sched, start)
    cost = FlopCost.from_routers(routers)
    attach(model, routers)
    hist = _previous_history(out_dir, "stage1.json") if start else []
    t0 = time.time()
    it = blocks.batches(cfg.batch_size, cfg.steps, seed=cfg.seed, start=start)
    bar = tqdm(range(start, cfg.steps), desc=f"stage1 c={cfg.capacity}", disable=not progress, mininterval=5)
    try:
        for step in bar:
            ids = next(it).to(device)
            tau, target, noise = schedule(step, cfg.steps, cfg)
            with _autocast(device, cfg.amp):
                t_logits = teacher_logits(model, ids) if cfg.kd_weight > 0 else None
                with routers.relax(tau, noise=noise), record_masks(model) as rec:
                    logits = model(input_ids=ids).logits
                cap = relaxed_capacity(routers, rec, cost)
            loss_kd = kd_loss(logits, t_logits) if t_logits is not None else logits.new_zeros(())
            loss_lm = lm_loss(logits, ids) if cfg.lm_weight > 0 else logits.new_zeros(())
            loss_cap = (cap["overall"] - target) ** 2
            loss = cfg.kd_weight * loss_kd + cfg.lm_weight * loss_lm + cfg.cap_weight * loss_cap
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(routers.parameters(), 1.0)
            opt.step()
            sched.step()
            rec_ = {"step": step + 1, "loss": float(loss.detach()), "kd": float(loss_kd.detach()), "lm": float(loss_lm.detach()),
                    "cap": float(cap["overall"].detach()), "attn": float(cap["attn"].detach()),
                    "ffn": float(cap["ffn"].detach()),
                    "target": target, "tau": tau}
            hist.append(rec_)
            bar.set_postfix(kd=f"{rec_['kd']:.3f}", cap=f"{rec_['cap']:.3f}", tgt=f"{target:.2f}")
            if ck is not None and ((step + 1) % cfg.ckpt_every == 0 or step + 1 == cfg.steps):
                ck.mkdir(parents=True, exist_ok=True)
                routers.save(ck / "last.safetensors")
                _save_opt(opt, ck / "opt.safetensors", step + 1)
            if (step + 1) % max(1, cfg.steps // 8) == 0:
                log(f"  step {step + 1}/{cfg.steps} kd {rec_['kd']:.4f} lm {rec_['lm']:.3f} cap {rec_['cap']:.3f} "
                    f"(attn {rec_['attn']:.3f} ffn {rec_['ffn']:.3f}) target {target:.3f} tau {tau:.2f} "
                    f"[{time.time() - t0:.0f}s]")
    finally:
        detach(model)
    routers.eval()
    routers.requires_grad_(False)
    if cfg.calibrate:
        calibrate_offset_(model, routers, blocks.heldout[:cfg.calib_blocks], cfg.capacity, amp=cfg.amp, log=log)
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        routers.save(Path(out_dir) / "routers.safetensors")
        (Path(out_dir) / "stage1.json").write_text(json.dumps({"config": asdict(cfg), "history": hist[-50:]}))
    routers.train_history = hist
    return routers


def main(argv=None):
    import argparse

    ap = argparse.ArgumentParser(prog="python -m wide_compile.training stage1",
                                 description="Stage 1: train WIDE (or SkipGPT-style) routers, base frozen")
    ap.add_argument("--out", required=True, help="output folder (resumes if it holds a checkpoint)")
    ap.add_argument("--data", default=None, help="train-text folder (default ../shared/data/train-text)")
    ap.add_argument("--tokens", default=None, help="token cache .npy (read if present, else written)")
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--method", choices=["wide", "skipgpt"], default="wide",
                    help="skipgpt = one group per module (skip the whole attention / MLP per token)")
    ap.add_argument("--smoke", action="store_true", help="tiny random model, a few steps (CPU check)")
    for k, v in asdict(Stage1Config()).items():
        if k == "extra":
            continue
        if isinstance(v, bool):
            ap.add_argument(f"--{k.replace('_', '-')}", type=lambda s: s.lower() in ("1", "true", "yes"), default=v)
        else:
            ap.add_argument(f"--{k.replace('_', '-')}", type=type(v), default=v)
    a = ap.parse_args(argv)
    cfg = Stage1Config(**{k: getattr(a, k) for k in asdict(Stage1Config()) if k != "extra"})
    from .data import TokenBlocks, load_tokens

    if a.smoke:
        from ..models import tiny_model

        model = tiny_model("smollm2").to(a.device)
        import numpy as np

        toks = np.random.default_rng(0).integers(0, 128, 20000)
        cfg.steps, cfg.seq_len, cfg.batch_size = min(cfg.steps, 20), 64, 4
    else:
        from ..models import load_smollm2

        model, tok = load_smollm2(device=a.device, gguf_path=a.gguf)
        toks = load_tokens(tok, a.data, a.tokens)
    if a.method == "skipgpt":
        from ..models.spec import model_spec

        s = model_spec(model)
        cfg.head_group_size, cfg.ffn_group_size = s.num_heads, s.intermediate_size
    blocks = TokenBlocks(toks, cfg.seq_len)
    r = train_stage1(model, blocks, cfg, out_dir=a.out, device=a.device)
    c = deterministic_capacity(model, r, blocks.heldout[:16], amp=cfg.amp)
    print(json.dumps({"out": str(Path(a.out) / "routers.safetensors"), "capacity_heldout": c["overall"],
                      "attn": c["attn"], "ffn": c["ffn"]}))
    return 0
