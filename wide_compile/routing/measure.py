"""measure_capacity: the FLOP-weighted capacity of an attached model on real tokens (padding excluded)."""
from __future__ import annotations

import torch

from .attach import _require, record_masks
from .capacity import FlopCost


def _fractions(masks: list[torch.Tensor]) -> torch.Tensor:
    # masks: one [B, S, G] (or [N, G]) per forward call -> per-token active fraction [N]
    return torch.cat([m.float().mean(-1).reshape(-1) for m in masks])


@torch.no_grad()
def measure_capacity(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> dict:
    """Run one forward of `model` (routers attached) on input_ids [B, S] and return
    {"overall", "attn", "ffn": float, "per_layer", "attn_per_layer", "ffn_per_layer": [float]*L,
     "tokens": int, "router_flops_fraction": float, "lm_head_flops_per_token": int, ...}."""
    att = _require(model)
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    with record_masks(model) as rec:
        model(input_ids=input_ids, attention_mask=attention_mask)
    return capacity_from_record(att.routers, rec, attention_mask, model)


def capacity_from_record(routers, rec: dict, attention_mask=None, model=None) -> dict:
    cost = FlopCost.from_routers(routers)
    weight = None if attention_mask is None else torch.as_tensor(attention_mask).reshape(-1).float()
    attn = [_fractions(m) for m in rec["attn"]]
    ffn = [_fractions(m) for m in rec["ffn"]]
    if weight is not None:
        weight = weight.to(attn[0].device)
    c = cost.capacity(attn, ffn, weight)
    L = cost.spec.num_layers
    dense = L * cost.dense_layer
    out = {k: float(c[k]) for k in ("overall", "attn", "ffn")}
    out.update({k: [float(x) for x in c[k]] for k in ("per_layer", "attn_per_layer", "ffn_per_layer")})
    out["tokens"] = int(attn[0].numel() if weight is None else weight.sum().item())
    out["router_flops_fraction"] = (sum(cost.router_attn) + sum(cost.router_ffn)) / dense
    out["dense_linear_flops_per_token"] = dense
    emb = getattr(getattr(model, "lm_head", None), "weight", None) if model is not None else None
    if emb is not None:
        out["lm_head_flops_per_token"] = 2 * emb.shape[0] * emb.shape[1]  # reported, not counted
    return out


def per_token_capacity(routers, rec: dict) -> torch.Tensor:
    """Capacity of each token position [N] (all forward calls concatenated in order, batch flattened):
    the FLOP fraction of the whole layer stack that token executed (routers counted)."""
    cost = FlopCost.from_routers(routers)
    executed = 0
    for i in range(cost.spec.num_layers):
        ea, ef = cost.executed(i, _fractions(rec["attn"][i]), _fractions(rec["ffn"][i]))
        executed = executed + ea + ef
    return executed / (cost.spec.num_layers * cost.dense_layer)
