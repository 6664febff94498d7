"""Dense GEMMs with the group mask applied to their result: the path for what compact kernels cannot skip.

Used where per-token masks leave nothing to skip:
* small batches of decode tokens (the tuning tables' path="dense" rows, 4 to 16 tokens): with per-token masks
  the union of the groups that 4 tokens need covers 1 - (1 - c)^4 of the weight rows (94 % at capacity
  0.5), so the gather GEMV reads almost every row anyway and loses to cuBLAS (benchmarks/results/);
  one dense GEMM plus a select costs what dense costs;
* the prefill o_proj (config down="dense"): no 128-token tile leaves a head group inactive (the prefill MLP's
  reduction side is a dense GEMM too, over the h its gather kernel zero-fills: compact_mlp.mlp_triton).

Same semantics as reference.py: inactive groups contribute exactly 0 (a select, never a multiply, so a
non-finite value in an inactive group cannot leak), h is rounded to the input dtype once, after
act(g) * u in fp32, like the Triton kernels.
"""
from __future__ import annotations

from typing import Optional

import torch

from .reference import activation


def _select(t: torch.Tensor, mask: torch.Tensor, group: int) -> torch.Tensor:
    """t [T, G*group] where mask [T, G] (bool or uint8) else exactly 0; a [T, G, group] view, no expanded
    mask is built."""
    T, N = t.shape
    G = mask.shape[1]
    # a Python 0, not a 0-d tensor: eager would launch a fill kernel for the tensor on every call
    return torch.where(mask.to(torch.bool).reshape(T, G, 1), t.reshape(T, G, group), 0).view(T, N)


def mlp_dense_masked(x, w_gate, w_up, w_down_t, mask, group_size: int, act: str = "silu") -> torch.Tensor:
    """x [T, D], w_gate/w_up [F, D], w_down_t [F, D], mask [T, G] bool -> [T, D]; act: the gate activation
    (reference.ACTIVATIONS)."""
    g = torch.mm(x, w_gate.t())  # [T, F]
    u = torch.mm(x, w_up.t())  # [T, F]
    h = (activation(g.float(), act) * u.float()).to(x.dtype)
    return torch.mm(_select(h, mask, group_size), w_down_t)


def q_proj_dense_masked(x, w_q, b_q: Optional[torch.Tensor], mask, group_size: int) -> torch.Tensor:
    """x [T, D], w_q [Nq, D], b_q [Nq] or None, mask [T, G] -> [T, Nq], inactive columns exactly 0."""
    q = torch.mm(x, w_q.t()) if b_q is None else torch.addmm(b_q, x, w_q.t())
    return _select(q, mask, group_size)


def o_proj_dense_masked(a, w_o_t, b_o: Optional[torch.Tensor], mask, group_size: int) -> torch.Tensor:
    """a [T, Nq], w_o_t [Nq, D], b_o [D] or None (added once), mask [T, G] -> [T, D]; inactive input
    columns of a are never used (selected away, not multiplied)."""
    am = _select(a, mask, group_size)
    return torch.mm(am, w_o_t) if b_o is None else torch.addmm(b_o, am, w_o_t)
