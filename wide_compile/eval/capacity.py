"""FLOP capacity over every forward of a block of code, on the tokens lm-eval scores (padding excluded)."""
from __future__ import annotations

import contextlib

import torch

from ..routing import FlopCost
from ..routing.attach import _require


class _Acc(list):
    """Stands in for one layer's mask list in an attach recorder: keeps a weighted running mean of the
    active fraction instead of the masks."""

    def __init__(self, meter):
        super().__init__()
        self.meter, self.s, self.n = meter, 0.0, 0.0

    def append(self, m):  # called by the attach hooks with one mask [B, S, G]
        w = self.meter.weight
        frac = m.float().mean(-1).reshape(-1)
        if w is None or w.numel() != frac.numel():
            w = torch.ones_like(frac)
        self.s += float((frac * w).sum())
        self.n += float(w.sum())


@contextlib.contextmanager
def capacity_meter(model, pad_id: int = 0):
    """Accumulate the FLOP capacity over every forward in the context; tokens equal to `pad_id` (lm-eval's
    right padding) are excluded. Yields a dict filled with {"overall", "attn", "ffn", "tokens"} on exit."""
    att = _require(model)
    L = att.routers.spec.num_layers
    meter = type("M", (), {"weight": None})()
    rec = {"attn": [_Acc(meter) for _ in range(L)], "ffn": [_Acc(meter) for _ in range(L)]}

    def pre(mod, args, kwargs):
        ids = args[0] if args else kwargs.get("input")
        meter.weight = (ids != pad_id).reshape(-1).float() if ids is not None else None

    h = model.get_input_embeddings().register_forward_pre_hook(pre, with_kwargs=True)
    att.recorders.append(rec)
    out: dict = {}
    try:
        yield out
    finally:
        att.recorders.remove(rec)
        h.remove()
        if rec["attn"][0].n > 0:
            cost = FlopCost.from_routers(att.routers)
            c = cost.capacity([torch.tensor([a.s / a.n]) for a in rec["attn"]],
                              [torch.tensor([f.s / f.n]) for f in rec["ffn"]])
            out.update({k: float(c[k]) for k in ("overall", "attn", "ffn")})
            out["tokens"] = int(rec["attn"][0].n)
