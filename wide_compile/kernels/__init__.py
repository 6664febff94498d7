"""WIDE kernels: group-sparse MLP and attention projections (Triton on CUDA, PyTorch reference elsewhere).

Public API (each backed by a ``torch.ops.wide.*`` op; group_size = channels / q columns / o rows per group):

    wide_mlp(x, w_gate, w_up, w_down_t, mask, group_size, tuning=None)
    wide_q_proj(x, w_q, b_q, mask, group_size, tuning=None)
    wide_o_proj(a, w_o_t, b_o, mask, group_size, tuning=None)
    mask_reorder(mask, block_m)
    wide_attn_prefill(q, k, v, mask, group_size, window=None, scale=None)   # attention over active head groups
    wide_attn_decode(q, k, v, head_mask, group_size, key_mask=None, scale=None)  # decode: active KV heads only
    # structured (codebook / nested) masks, tokens sorted by prototype; mask = protos[bucket]:
    wide_mlp_bucket(x, w_gate, w_up, w_down, bucket, protos, group_size)
    wide_q_proj_bucket(x, w_q, b_q, bucket, protos, group_size)
    wide_o_proj_bucket(a, w_o, b_o, bucket, protos, group_size)
    wide_rmsnorm_router(x, w_norm, eps, router_input, kind, w1, b1, w2, b2)  # RMSNorm + router mask, one launch
    wide_add_rmsnorm_router(a, b, w_norm, eps, router_input, kind, w1, b1, w2, b2)  # the residual add too
    # a split-bf16 linear router computed inside the select it feeds (the dense-masked paths), one launch:
    wide_routed_select(a, h, w2, b, group_size)
    wide_routed_gated_select(g, u, h, w2, b, group_size, activation)

`tuning` is the tile table (tuning.KernelTuning; None = the device's table in configs/).
"""
from .ops import wide_mlp, wide_q_proj, wide_o_proj, mask_reorder  # noqa: F401
from .attn_ops import wide_attn_decode, wide_attn_prefill  # noqa: F401
from .bucket_ops import wide_mlp_bucket, wide_o_proj_bucket, wide_q_proj_bucket  # noqa: F401
from .norm_router_ops import wide_add_rmsnorm_router, wide_rmsnorm_router  # noqa: F401
from .routed_select_ops import wide_routed_gated_select, wide_routed_select  # noqa: F401
from . import reference  # noqa: F401
from .tuning import KernelTuning  # noqa: F401

__all__ = ["wide_mlp", "wide_q_proj", "wide_o_proj", "mask_reorder", "wide_attn_prefill", "wide_attn_decode",
           "wide_mlp_bucket", "wide_q_proj_bucket", "wide_o_proj_bucket", "wide_rmsnorm_router",
           "wide_add_rmsnorm_router", "wide_routed_select", "wide_routed_gated_select", "reference", "KernelTuning"]
