"""WIDE kernels: group-sparse MLP and attention projections (Triton on CUDA, PyTorch reference elsewhere).

Public API (each backed by a ``torch.ops.wide.*`` op; group_size = channels / q columns / o rows per group):

    wide_mlp(x, w_gate, w_up, w_down_t, mask, group_size, tuning=None)
    wide_q_proj(x, w_q, b_q, mask, group_size, tuning=None)
    wide_o_proj(a, w_o_t, b_o, mask, group_size, tuning=None)
    mask_reorder(mask, block_m)
    wide_attn_prefill(q, k, v, mask, group_size, window=None, scale=None)   # attention over active head groups
    wide_attn_decode(q, k, v, head_mask, group_size, key_mask=None, scale=None)  # decode: active KV heads only
    wide_rmsnorm_router(x, w_norm, eps, router_input, kind, w1, b1, w2, b2)  # RMSNorm + router mask, one launch

`tuning` is the tile table (tuning.KernelTuning; None = the device's table in configs/).
"""
from .ops import wide_mlp, wide_q_proj, wide_o_proj, mask_reorder  # noqa: F401
from .attn_ops import wide_attn_decode, wide_attn_prefill  # noqa: F401
from .norm_router_ops import wide_rmsnorm_router  # noqa: F401
from . import reference  # noqa: F401
from .tuning import KernelTuning  # noqa: F401

__all__ = ["wide_mlp", "wide_q_proj", "wide_o_proj", "mask_reorder", "wide_attn_prefill", "wide_attn_decode", "wide_rmsnorm_router", "reference", "KernelTuning"]
