"""torch.library registration of the WIDE attention ops (namespace ``wide``), the pattern of ops.py:

* ``wide::attn_prefill``: query-sparse causal prefill attention (attn_prefill.py);
* ``wide::attn_decode``: one query token per sequence over a KV cache, reading only the KV heads of active
  head groups (attn_decode.py). CUDA tensors run the Triton kernels through ``torch.library.wrap_triton`` inside ``torch.library.triton_op`` (Inductor sees
  the kernels); any other device runs the PyTorch reference.
* Fake/meta: ``triton_op`` registers the same body as the fake impl; the output shape ([B, Hq, T, d]) and
  the reorder buffers are static functions of the input shapes, no host sync.
* ``config`` is the kernel's tile overrides as JSON ("" = attn_prefill.CONFIGS), so a compiled graph
  keeps the tiles it was compiled with.
"""
from __future__ import annotations

import functools
import json
from typing import Optional

import torch
from torch import Tensor
from torch.library import triton_op

from .attn_decode import attn_decode_ref, attn_decode_triton
from .attn_prefill import attn_prefill_ref, attn_prefill_triton


@functools.lru_cache(maxsize=64)
def _config(config: str) -> Optional[dict]:
    return json.loads(config) if config else None


def _attn_prefill_impl(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, group_size: int,
                       window: Optional[int] = None, scale: Optional[float] = None, config: str = "") -> Tensor:
    if q.device.type == "cuda":
        return attn_prefill_triton(q, k, v, mask, group_size, window, scale, config=_config(config), wrap=True)
    return attn_prefill_ref(q, k, v, mask, group_size, window, scale)


attn_prefill_op = triton_op("wide::attn_prefill", _attn_prefill_impl, mutates_args=())


def wide_attn_prefill(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, group_size: int,
                      window: Optional[int] = None, scale: Optional[float] = None,
                      config: Optional[dict] = None) -> Tensor:
    """q [B, Hq, T, d] (after RoPE), k, v [B, Hkv, T, d], mask [B, T, G] (G = Hq // group_size) -> [B, Hq, T, d]:
    causal (sliding-window when `window` is set) attention on the active (token, head-group) rows, exactly 0
    on the inactive ones. scale: None = 1/sqrt(d). config: tile overrides (attn_prefill.CONFIG_KEYS)."""
    cfg = json.dumps(config, sort_keys=True) if config else ""
    return torch.ops.wide.attn_prefill(q, k, v, mask.bool(), int(group_size),
                                       None if window is None else int(window),
                                       None if scale is None else float(scale), cfg)



def _attn_decode_impl(q: Tensor, k: Tensor, v: Tensor, head_mask: Tensor, group_size: int,
                      key_mask: Optional[Tensor] = None, scale: Optional[float] = None, config: str = "") -> Tensor:
    if q.device.type == "cuda":
        return attn_decode_triton(q, k, v, head_mask, group_size, key_mask, scale, config=_config(config),
                                  wrap=True)
    return attn_decode_ref(q, k, v, head_mask, group_size, key_mask, scale)


attn_decode_op = triton_op("wide::attn_decode", _attn_decode_impl, mutates_args=())


def wide_attn_decode(q: Tensor, k: Tensor, v: Tensor, head_mask: Tensor, group_size: int,
                     key_mask: Optional[Tensor] = None, scale: Optional[float] = None,
                     config: Optional[dict] = None) -> Tensor:
    """q [B, Hq, 1, d] (after RoPE), k, v [B, Hkv, L, d] (the cache), head_mask [B, G] (G = Hq // group_size),
    key_mask [B, L] (True = attend; None = every key) -> [B, Hq, 1, d]: attention of the active head groups'
    queries, reading only their KV heads; exactly 0 on the inactive ones. scale: None = 1/sqrt(d).
    config: attn_decode.DEFAULT_CONFIG fields to change."""
    cfg = json.dumps(config, sort_keys=True) if config else ""
    return torch.ops.wide.attn_decode(q, k, v, head_mask.bool(), int(group_size),
                                      None if key_mask is None else key_mask.bool(),
                                      None if scale is None else float(scale), cfg)
