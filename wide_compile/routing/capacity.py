"""FLOP-weighted capacity (DESIGN.md): executed linear FLOPs per token / dense linear FLOPs per token.

Per layer and token (multiply-add = 2 FLOPs):
  attention: q = o = 2*D*Nq, k = v = 2*D*Nkv; executed = a*(q + o) + k + v + router_attn
  FFN:       gate = up = down = 2*D*F;          executed = f*(gate + up + down) + router_ffn
where a / f are the fractions of active head / FFN groups for that token. Dense excludes routers;
embeddings and lm_head are not counted (reported separately by `measure_capacity`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.spec import ModelSpec


@dataclass(frozen=True)
class FlopCost:
    spec: ModelSpec
    router_attn: tuple[int, ...]  # per layer
    router_ffn: tuple[int, ...]

    @classmethod
    def from_routers(cls, routers) -> "FlopCost":
        a, f = routers.flops_per_token()
        return cls(routers.spec, tuple(a), tuple(f))

    @property
    def qo(self) -> int:
        return 2 * 2 * self.spec.hidden_size * self.spec.q_size

    @property
    def kv(self) -> int:
        return 2 * 2 * self.spec.hidden_size * self.spec.kv_size

    @property
    def ffn(self) -> int:
        return 3 * 2 * self.spec.hidden_size * self.spec.intermediate_size

    @property
    def dense_layer(self) -> int:
        return self.qo + self.kv + self.ffn

    def uniform_rate(self, capacity: float) -> float:
        """On-rate r, the same for every attention and FFN group, that gives `capacity` overall."""
        L = self.spec.num_layers
        fixed = L * self.kv + sum(self.router_attn) + sum(self.router_ffn)
        r = (capacity * L * self.dense_layer - fixed) / (L * (self.qo + self.ffn))
        if r < 0:
            raise ValueError(f"capacity {capacity} is below the minimum {fixed / (L * self.dense_layer):.3f} "
                             "(K/V projections and routers always run)")
        return min(r, 1.0)

    def executed(self, i: int, attn_frac, ffn_frac):
        """Executed FLOPs of layer i's attention and FFN for active fractions attn_frac / ffn_frac
        (floats or tensors, any shape)."""
        return (attn_frac * self.qo + self.kv + self.router_attn[i],
                ffn_frac * self.ffn + self.router_ffn[i])

    def capacity(self, attn_frac: list[torch.Tensor], ffn_frac: list[torch.Tensor],
                 weight: torch.Tensor | None = None) -> dict:
        """attn_frac[i] / ffn_frac[i]: per-token active fractions [N] for layer i (differentiable if the
        inputs are). weight [N]: 1 for real tokens, 0 for padding. Returns overall/attn/ffn and per-layer
        capacities as tensors."""
        per_layer, attn_l, ffn_l = [], [], []
        for i, (a, f) in enumerate(zip(attn_frac, ffn_frac)):
            w = torch.ones_like(a) if weight is None else weight.to(a.dtype)
            n = w.sum().clamp_min(1)
            a_m, f_m = (a * w).sum() / n, (f * w).sum() / n
            ea, ef = self.executed(i, a_m, f_m)
            attn_l.append(ea / (self.qo + self.kv))
            ffn_l.append(ef / self.ffn)
            per_layer.append((ea + ef) / self.dense_layer)
        L = len(per_layer)
        overall = torch.stack(per_layer).mean()
        return {"overall": overall, "attn": torch.stack(attn_l).mean(), "ffn": torch.stack(ffn_l).mean(),
                "per_layer": torch.stack(per_layer), "attn_per_layer": torch.stack(attn_l),
                "ffn_per_layer": torch.stack(ffn_l), "layers": L}
