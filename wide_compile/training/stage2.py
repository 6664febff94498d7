"""Stage 2: LoRA (peft) on the routed model, routers fixed (hard masks), or trained jointly.

LoRA is applied BEFORE `attach`, so the WIDE hooks sit on the LoRA-wrapped q/o/gate/down modules and the
masks act on base + LoRA paths alike. loss = kd_weight * KL(dense teacher || routed student) + lm_weight * LM
(+ the stage-1 capacity regulariser when `joint`, with relaxed router decisions at tau_end).
The teacher is the original dense model (adapters disabled, routers detached).

`train_stage2` returns (merged_model, routers, lora_state): the LoRA merged into a copy of the base weights
(a plain HF model, routers detached), the routers (possibly updated), and the adapter tensors (to save).
Checkpoints: <out>/lora.safetensors (+ routers.safetensors), <out>/ckpt/{lora,opt}.safetensors for resuming.
"""
from __future__ import annotations

import copy
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..routing import FlopCost, Routers, attach, detach, record_masks
from .stage1 import _fast_forward, _load_opt, _previous_history, _save_opt, kd_loss, lm_loss, relaxed_capacity

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class Stage2Config:
    steps: int = 200
    batch_size: int = 8
    seq_len: int = 512
    lr: float = 1e-3
    rank: int = 8
    alpha: int = 16
    kd_weight: float = 1.0
    lm_weight: float = 0.1
    joint: bool = False          # also train the routers (relaxed, capacity regulariser)
    router_lr: float = 1e-3
    cap_weight: float = 30.0
    tau: float = 0.2
    seed: int = 0
    ckpt_every: int = 100


def lora_state(peft_model) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    return {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(peft_model).items()}


def save_lora(peft_model, path, meta: dict | None = None) -> None:
    from safetensors.torch import save_file

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    cfg = peft_model.peft_config["default"]
    m = {"rank": str(cfg.r), "alpha": str(cfg.lora_alpha), "targets": json.dumps(sorted(cfg.target_modules))}
    m.update({k: str(v) for k, v in (meta or {}).items()})
    save_file({k: v.to(torch.bfloat16) for k, v in lora_state(peft_model).items()}, str(path), metadata=m)


def apply_lora(model, rank: int = 8, alpha: int = 16, targets=None):
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets or TARGETS), lora_dropout=0.0,
                     bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, cfg)


def load_lora_merged(model, path):
    """Apply the LoRA adapter saved by `save_lora` at `path` to `model` (in place of a copy) and merge it.
    Returns the merged plain model."""
    from peft import set_peft_model_state_dict
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        sd = {k: f.get_tensor(k) for k in f.keys()}
    pm = apply_lora(model, int(meta["rank"]), int(meta["alpha"]), json.loads(meta["targets"]))
    dt = next(model.parameters()).dtype
    set_peft_model_state_dict(pm, {k: v.to(dt) for k, v in sd.items()})
    return pm.merge_and_unload()


def train_stage2(base_model, routers: Routers, blocks, cfg: Stage2Config, out_dir=None, log=print,
                 progress: bool = True):
    from tqdm.auto import tqdm

    device = next(base_model.parameters()).device
    torch.manual_seed(cfg.seed)
    model = copy.deepcopy(base_model)
    model.requires_grad_(False)
    pm = apply_lora(model, cfg.rank, cfg.alpha)
    for n, p in pm.named_parameters():
        if "lora_" in n:
            p.data = p.data.float()  # fp32 adapters (the base may be bf16)
    routers = copy.deepcopy(routers).to(device)
    routers.requires_grad_(cfg.joint)
    attach(pm, routers)
    lora_params = [p for n, p in pm.named_parameters() if "lora_" in n]
    for p in lora_params:
        p.requires_grad_(True)
    groups = [{"params": lora_params, "lr": cfg.lr}]
    if cfg.joint:
        groups.append({"params": [p for p in routers.parameters()], "lr": cfg.router_lr})
    opt = torch.optim.AdamW(groups, weight_decay=0.0, betas=(0.9, 0.99))
    ck = Path(out_dir) / "ckpt" if out_dir else None
    start = 0
    if ck is not None and (ck / "lora.safetensors").is_file() and (ck / "opt.safetensors").is_file():
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        set_peft_model_state_dict(pm, {k: v.float() for k, v in load_file(str(ck / "lora.safetensors")).items()})
        if cfg.joint and (ck / "routers.safetensors").is_file():
            routers.load_state_dict(Routers.load(ck / "routers.safetensors", model).state_dict())
        start = _load_opt(opt, ck / "opt.safetensors")
        log(f"resumed stage 2 from {ck} at step {start}")
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / max(1, cfg.steps))))
    _fast_forward(sched, start)
    cost = FlopCost.from_routers(routers)
    pm.train()
    it = blocks.batches(cfg.batch_size, cfg.steps, seed=cfg.seed + 1, start=start)
    t0, hist = time.time(), (_previous_history(out_dir, "stage2.json") if start else [])
    bar = tqdm(range(start, cfg.steps), desc="stage2", disable=not progress, mininterval=5)
    for step in bar:
        ids = next(it).to(device)
        with torch.no_grad():
            detach(pm)
            with pm.disable_adapter():
                t_logits = pm(input_ids=ids).logits
            attach(pm, routers)
        if cfg.joint:
            with routers.relax(cfg.tau, noise=False), record_masks(pm) as rec:
                logits = pm(input_ids=ids).logits
            loss_cap = (relaxed_capacity(routers, rec, cost)["overall"] - routers.cfg.capacity) ** 2
        else:
            logits = pm(input_ids=ids).logits
            loss_cap = logits.new_zeros((), dtype=torch.float32)
        loss_kd = kd_loss(logits, t_logits)
        loss_lm = lm_loss(logits, ids) if cfg.lm_weight > 0 else loss_kd.new_zeros(())
        loss = cfg.kd_weight * loss_kd + cfg.lm_weight * loss_lm + cfg.cap_weight * loss_cap
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for g in groups for p in g["params"]], 1.0)
        opt.step()
        sched.step()
        hist.append({"step": step + 1, "kd": float(loss_kd.detach()), "lm": float(loss_lm.detach())})
        bar.set_postfix(kd=f"{float(loss_kd.detach()):.3f}")
        if ck is not None and ((step + 1) % cfg.ckpt_every == 0 or step + 1 == cfg.steps):
            from safetensors.torch import save_file

            ck.mkdir(parents=True, exist_ok=True)
            save_file(lora_state(pm), str(ck / "lora.safetensors"))
            if cfg.joint:
                routers.save(ck / "routers.safetensors")
            _save_opt(opt, ck / "opt.safetensors", step + 1)
        if (step + 1) % max(1, cfg.steps // 4) == 0:
            log(f"  stage2 step {step + 1}/{cfg.steps} kd {float(loss_kd):.4f} lm {float(loss_lm):.3f} "
                f"[{time.time() - t0:.0f}s]")
    detach(pm)
    pm.eval()
    routers.eval()
    routers.requires_grad_(False)
    state = lora_state(pm)
    if out_dir:
        save_lora(pm, Path(out_dir) / "lora.safetensors")
        routers.save(Path(out_dir) / "routers.safetensors")
        (Path(out_dir) / "stage2.json").write_text(json.dumps({"config": asdict(cfg), "history": hist[-50:]}))
    for n, p in pm.named_parameters():
        if "lora_" in n:
            p.data = p.data.to(next(base_model.parameters()).dtype)
    merged = pm.merge_and_unload()
    merged.requires_grad_(False)
    merged.train_history = hist
    return merged, routers, state


def main(argv=None):
    import argparse

    ap = argparse.ArgumentParser(prog="python -m wide_compile.training stage2",
                                 description="Stage 2: LoRA with fixed (or jointly trained) routers")
    ap.add_argument("--routers", required=True, help="stage-1 routers .safetensors")
    ap.add_argument("--out", required=True)
    ap.add_argument("--data", default=None)
    ap.add_argument("--tokens", default=None)
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--smoke", action="store_true")
    for k, v in asdict(Stage2Config()).items():
        if isinstance(v, bool):
            ap.add_argument(f"--{k.replace('_', '-')}", type=lambda s: s.lower() in ("1", "true", "yes"), default=v)
        else:
            ap.add_argument(f"--{k.replace('_', '-')}", type=type(v), default=v)
    a = ap.parse_args(argv)
    cfg = Stage2Config(**{k: getattr(a, k) for k in asdict(Stage2Config())})
    from .data import TokenBlocks, load_tokens

    if a.smoke:
        import numpy as np

        from ..models import tiny_model

        model = tiny_model("smollm2").to(a.device)
        toks = np.random.default_rng(0).integers(0, 128, 20000)
        cfg.steps, cfg.seq_len, cfg.batch_size = min(cfg.steps, 10), 64, 4
    else:
        from ..models import load_smollm2

        dt = torch.bfloat16 if str(a.device).startswith("cuda") else torch.float32
        model, tok = load_smollm2(dtype=dt, device=a.device, gguf_path=a.gguf)
        toks = load_tokens(tok, a.data, a.tokens)
    routers = Routers.load(a.routers, model)
    blocks = TokenBlocks(toks, cfg.seq_len)
    train_stage2(model, routers, blocks, cfg, out_dir=a.out)
    print(json.dumps({"lora": str(Path(a.out) / "lora.safetensors")}))
    return 0
