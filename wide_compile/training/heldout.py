"""Held-out evaluation during training: perplexity of the routed model (deterministic decisions) on
held-out training-text blocks, at the capacity the routers will be shipped with.

The held-out blocks (data.TokenBlocks.heldout) are split in two: the first `calib` blocks calibrate the
capacity, the next `eval` blocks measure perplexity, so the ppl is never measured on the tokens that set
the capacity.
"""
from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F

from ..routing import routed
from ..routing.calibrate import calibrate_offset_, deterministic_capacity


def split_heldout(heldout: torch.Tensor, calib_blocks: int, eval_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(calibration blocks, evaluation blocks) from the held-out blocks [N, S]."""
    n = len(heldout)
    if n < 2:
        raise ValueError(f"the held-out split has {n} block(s); need at least 2 (one to calibrate, one to "
                         "evaluate): use more tokens or a larger heldout fraction")
    c = min(calib_blocks, n // 2)
    return heldout[:c], heldout[c:c + eval_blocks]


@torch.no_grad()
def perplexity(model, blocks: torch.Tensor, batch_size: int = 16) -> float:
    """exp(mean next-token NLL) of `model` (as it is: routed or dense) over blocks [N, S]."""
    dev = next(model.parameters()).device
    total, count = torch.zeros((), dtype=torch.float64, device=dev), 0
    for i in range(0, len(blocks), batch_size):
        ids = blocks[i:i + batch_size].to(dev)
        logits = model(input_ids=ids).logits[:, :-1]
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1), reduction="sum")
        total += nll.double()
        count += ids[:, 1:].numel()
    return math.exp(float(total) / max(1, count))


class HeldoutEval:
    """evaluate() -> {"ppl", "cap", "attn", "ffn", "dense_ppl"} for `routers` on `model`.

    calibrated=True evaluates a copy of the routers whose margins are shifted (calibrate_offset_) to the
    targets first: routers are compared at the capacity they ship with, not at whatever their deterministic
    capacity drifted to while training (a higher capacity would look better for the wrong reason)."""

    def __init__(self, model, routers, calib: torch.Tensor, evalb: torch.Tensor, targets: dict,
                 calibrated: bool = True, batch_size: int = 16, dense_context=None):
        self.model, self.routers, self.calib, self.evalb = model, routers, calib, evalb
        # the dense teacher: `model` without routers, unless the caller says otherwise (LoRA disabled too)
        self.dense_context = dense_context or (lambda: routed(model, None))
        self.targets, self.calibrated, self.batch_size = targets, calibrated, batch_size
        self._dense = None

    def dense_ppl(self) -> float:
        if self._dense is None:
            with self.dense_context():
                self._dense = perplexity(self.model, self.evalb, self.batch_size)
        return self._dense

    def __call__(self, eligible: bool = True) -> dict:
        """eligible=False (e.g. while the capacity target still ramps): measure at the routers' own
        deterministic capacity, without calibrating."""
        # the routers may be a submodule of the model (attach) in another mode than it (stage 1 trains them
        # inside a frozen eval-mode model): restore both modes, or the training noise would stop here
        was_training, routers_training = self.model.training, self.routers.training
        self.model.eval()
        r = copy.deepcopy(self.routers).eval()
        if self.calibrated and eligible:
            calibrate_offset_(self.model, r, self.calib, self.targets["overall"], log=lambda *_: None,
                              target_attn=self.targets.get("attn"), target_ffn=self.targets.get("ffn"),
                              batch_size=len(self.calib))  # one forward per bisection step
        cap = deterministic_capacity(self.model, r, self.evalb, batch_size=self.batch_size)
        with routed(self.model, r):
            ppl = perplexity(self.model, self.evalb, self.batch_size)
        self.model.train(was_training)
        self.routers.train(routers_training)
        return {"ppl": ppl, "cap": cap["overall"], "attn": cap["attn"], "ffn": cap["ffn"],
                "dense_ppl": self.dense_ppl()}
