"""torch.library registration of the WIDE attention ops (namespace ``wide``), the pattern of ops.py:

* ``wide::attn_prefill``: query-sparse causal prefill attention (attn_prefill.py). CUDA tensors run the
  Triton kernel through ``torch.library.wrap_triton`` inside ``torch.library.triton_op`` (Inductor sees
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

