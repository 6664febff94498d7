"""Loss terms and schedules shared by stage 1 and stage 2."""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from ..routing import FlopCost, routed


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


def relaxed_capacity(routers, rec: dict, cost: FlopCost | None = None) -> dict:
    """Differentiable FLOP capacity from recorded (relaxed) masks of one forward."""
    cost = cost or FlopCost.from_routers(routers)
    attn = [torch.cat([m.float().mean(-1).reshape(-1) for m in rec["attn"][i]]) for i in range(len(rec["attn"]))]
    ffn = [torch.cat([m.float().mean(-1).reshape(-1) for m in rec["ffn"][i]]) for i in range(len(rec["ffn"]))]
    return cost.capacity(attn, ffn)


def capacity_loss(cap: dict, targets: dict) -> torch.Tensor:
    """Squared distance of the relaxed capacity to its targets: attention and FFN separately when targets
    has "attn" / "ffn", else the overall (FLOP-weighted) capacity."""
    keys = [k for k in ("attn", "ffn") if targets.get(k) is not None] or ["overall"]
    return sum((cap[k] - targets[k]) ** 2 for k in keys)


@torch.no_grad()
def teacher_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Dense logits of `model` (routers temporarily detached if attached)."""
    with routed(model, None):
        return model(input_ids=ids).logits


def autocast(device, enabled: bool):
    """bf16 autocast on CUDA when enabled, else nothing."""
    if enabled and torch.device(device).type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def lr_factor(step: int, steps: int, warmup_frac: float, min_frac: float) -> float:
    """Linear warmup over warmup_frac of the steps, then cosine from 1 down to min_frac."""
    warm = max(1, int(round(warmup_frac * steps)))
    if step < warm:
        return (step + 1) / warm
    p = (step - warm) / max(1, steps - warm)
    return min_frac + (1 - min_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, p)))


def set_lr(opt: torch.optim.Optimizer, factor: float) -> None:
    for g in opt.param_groups:
        g["lr"] = g["base_lr"] * factor


def anneal(step: int, steps: int, start: float, end: float, how: str) -> float:
    """start -> end over the steps, "linear" or "geometric"."""
    frac = step / max(1, steps - 1)
    if how == "linear":
        return start + (end - start) * frac
    return start * (end / start) ** frac
