"""Baselines at the same FLOP capacity (DESIGN.md accounting: K/V always counted, routers counted).

(a) Static width pruning, Wanda-sp / FLAP style: remove whole head groups and FFN channel groups chosen
    by a calibration importance score, as token-independent masks (`Routers.constant`). The oracle in
    DESIGN.md makes this identical to physically slicing o_proj / down_proj columns (and the matching
    q / gate / up rows). Score of input channel j of o_proj / down_proj: ||X_j||_2 * ||W[:, j]||_1
    (Wanda: activation norm over calibration tokens times weight magnitude); a group's score is the sum
    over its channels. Allocation across layers: "uniform" (every layer keeps the same fraction of
    attention and FFN groups) or "global" (groups ranked by score normalised by its layer-module mean,
    FLAP-style adaptive structure); `static_pruning(..., allocation="best")` builds both and keeps the one
    with the lower KL to the dense model on calibration tokens. Groups are added in priority order while
    they fit the FLOP budget, so the capacity is the target minus less than one group (< 0.2%).
(b) SkipGPT-style per-token module skipping: one router per layer and module that keeps or skips the whole
    attention block (all query heads; K/V still computed, as in WIDE) or the whole MLP for a token. It is
    WIDE with one group per module (`skipgpt_config`) and trains with the same stage-1 / stage-2 code,
    the same data and the same FLOP-capacity regulariser.
"""
from __future__ import annotations

import torch

from ..config import WideConfig
from ..models.spec import decoder_layers, model_spec
from ..routing import FlopCost, Routers, routed


def skipgpt_config(model, capacity: float) -> WideConfig:
    s = model_spec(model)
    return WideConfig(ffn_group_size=s.intermediate_size, head_group_size=s.num_heads, capacity=capacity,
                      router_hidden=0, router_init="dense")


def _weight(mod):
    return mod.base_layer.weight if hasattr(mod, "base_layer") else mod.weight


@torch.no_grad()
def group_importance(model, blocks: torch.Tensor, cfg: WideConfig, batch_size: int = 8) -> dict:
    """Wanda-sp scores: {"attn": [L x G_a], "ffn": [L x G_f]} (float tensors on CPU)."""
    spec = model_spec(model)
    layers = decoder_layers(model)
    dev = next(model.parameters()).device
    sq = {"attn": [torch.zeros(spec.q_size, device=dev) for _ in layers],
          "ffn": [torch.zeros(spec.intermediate_size, device=dev) for _ in layers]}
    handles = []
    for i, layer in enumerate(layers):
        def mk(kind, i):
            def hook(mod, args):
                x = args[0].float()
                sq[kind][i] += x.pow(2).reshape(-1, x.shape[-1]).sum(0)
            return hook
        handles.append(layer.self_attn.o_proj.register_forward_pre_hook(mk("attn", i)))
        handles.append(layer.mlp.down_proj.register_forward_pre_hook(mk("ffn", i)))
    try:
        for b in range(0, len(blocks), batch_size):
            model(input_ids=blocks[b:b + batch_size].to(dev))
    finally:
        for h in handles:
            h.remove()
    out = {"attn": [], "ffn": []}
    ga, gf = cfg.num_head_groups(spec), cfg.num_ffn_groups(spec)
    for i, layer in enumerate(layers):
        for kind, mod, g in (("attn", layer.self_attn.o_proj, ga), ("ffn", layer.mlp.down_proj, gf)):
            w = _weight(mod).float().abs().sum(0)  # ||W[:, j]||_1
            s = sq[kind][i].sqrt() * w
            out[kind].append(s.reshape(g, -1).sum(-1).cpu())
    return out


def select_groups(scores: dict, cfg: WideConfig, spec, capacity: float, allocation: str = "global"):
    """Masks (lists of bool tensors) that keep the highest-priority groups within the FLOP budget."""
    cost = FlopCost(spec, (0,) * spec.num_layers, (0,) * spec.num_layers)
    L = spec.num_layers
    budget = capacity * L * cost.dense_layer - L * cost.kv
    ga, gf = len(scores["attn"][0]), len(scores["ffn"][0])
    c_a, c_f = cost.qo / ga, cost.ffn / gf
    items = []  # (priority key, kind, layer, group, cost); smaller key first
    for kind, g, c in (("attn", ga, c_a), ("ffn", gf, c_f)):
        for i in range(L):
            s = scores[kind][i].double()
            norm = s / s.mean().clamp_min(1e-12)
            order = torch.argsort(s, descending=True)
            for rank, j in enumerate(order.tolist()):
                if allocation == "uniform":
                    key = (rank + 0.5) / g
                elif allocation == "global":
                    key = -float(norm[j])
                else:
                    raise ValueError(f"allocation must be 'uniform' or 'global', got {allocation!r}")
                items.append((key, kind, i, j, c))
    items.sort(key=lambda t: t[0])
    masks = {"attn": [torch.zeros(ga, dtype=torch.bool) for _ in range(L)],
             "ffn": [torch.zeros(gf, dtype=torch.bool) for _ in range(L)]}
    used = 0.0
    for _, kind, i, j, c in items:
        if used + c <= budget + 1e-6:
            masks[kind][i][j] = True
            used += c
    return masks


@torch.no_grad()
def _kl_to_dense(model, routers, blocks, batch_size: int = 8) -> float:
    from ..training.stage1 import kd_loss, teacher_logits

    dev = next(model.parameters()).device
    tot = 0.0
    for b in range(0, len(blocks), batch_size):
        x = blocks[b:b + batch_size].to(dev)
        t = teacher_logits(model, x)
        with routed(model, routers):
            s = model(input_ids=x).logits
        tot += float(kd_loss(s, t)) * len(x)
    return tot / len(blocks)


def static_pruning(model, blocks: torch.Tensor, capacity: float, cfg: WideConfig | None = None,
                   allocation: str = "best", eval_blocks: torch.Tensor | None = None, log=print) -> Routers:
    """Constant routers (Wanda-sp scores on `blocks`) at `capacity`; allocation uniform/global/best."""
    cfg = cfg or WideConfig(capacity=capacity)
    spec = model_spec(model)
    scores = group_importance(model, blocks, cfg)
    cands = ["uniform", "global"] if allocation == "best" else [allocation]
    best = None
    for a in cands:
        m = select_groups(scores, cfg, spec, capacity, a)
        r = Routers.constant(model, cfg, m["attn"], m["ffn"])
        r.allocation = a
        if len(cands) == 1:
            return r
        kl = _kl_to_dense(model, r, eval_blocks if eval_blocks is not None else blocks[:8])
        log(f"static pruning ({a}) at capacity {capacity}: KL to dense {kl:.4f}")
        if best is None or kl < best[0]:
            best = (kl, r)
    return best[1]
