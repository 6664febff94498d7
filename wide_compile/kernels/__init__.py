"""WIDE kernels: group-sparse MLP and attention projections (Triton on CUDA, PyTorch reference elsewhere).

Public API (each backed by a ``torch.ops.wide.*`` op):

    wide_mlp(x, w_gate, w_up, w_down_t, mask, group_size)
    wide_q_proj(x, w_q, b_q, mask, group_size)
    wide_o_proj(a, w_o_t, b_o, mask, group_size)
    mask_reorder(mask, block_m)
"""
from .ops import wide_mlp, wide_q_proj, wide_o_proj, mask_reorder  # noqa: F401
from . import reference  # noqa: F401

__all__ = ["wide_mlp", "wide_q_proj", "wide_o_proj", "mask_reorder", "reference"]
