"""torch.library registration of the bucketed MLP (namespace ``wide``), the pattern of attn_ops.py:

* ``wide::mlp_bucket``: the MLP of structured (codebook / nested) masks, tokens sorted by prototype
  (bucket_mlp.py). CUDA tensors run the Triton kernels through ``torch.library.wrap_triton`` inside
  ``torch.library.triton_op`` (Inductor sees the kernels); any other device runs the PyTorch reference.
* Fake/meta: ``triton_op`` registers the same body as the fake impl; the output ([T, D]) and the list and
  h buffers are static functions of the input shapes, no host sync.
* ``config`` is the kernels' tile overrides as JSON ("" = bucket_mlp.CONFIGS), so a compiled graph keeps the
  tiles it was compiled with.
"""
from __future__ import annotations

import functools
import json
from typing import Optional

import torch
from torch import Tensor
from torch.library import triton_op

from .bucket_mlp import check_inputs, mlp_bucket_ref, mlp_bucket_triton


@functools.lru_cache(maxsize=64)
def _config(config: str) -> Optional[dict]:
    return json.loads(config) if config else None


def _mlp_bucket_impl(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, bucket: Tensor, protos: Tensor,
                     group_size: int, activation: str = "silu", config: str = "") -> Tensor:
    if x.device.type == "cuda":
        return mlp_bucket_triton(x, w_gate, w_up, w_down, bucket, protos, group_size, activation,
                                 config=_config(config), wrap=True)
    return mlp_bucket_ref(x, w_gate, w_up, w_down, bucket, protos, group_size, activation)


mlp_bucket_op = triton_op("wide::mlp_bucket", _mlp_bucket_impl, mutates_args=())


def wide_mlp_bucket(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, bucket: Tensor, protos: Tensor,
                    group_size: int, activation: str = "silu", config: Optional[dict] = None) -> Tensor:
    """x [..., D]; w_gate, w_up [F, D]; w_down [D, F] (= down_proj.weight); bucket [...] int (the prototype id of
    each token); protos [P, G] bool (G = F // group_size) -> [..., D]: wide_mlp with mask = protos[bucket].

    Bucket ids must lie in [0, P) (the router's argmax does). Checked here on the host for CPU tensors; on a GPU
    a check would cost a device sync, so an id out of range gives that token a NaN row instead.
    activation: one of reference.ACTIVATIONS. config: tile overrides (bucket_mlp.CONFIG_KEYS)."""
    if bucket.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"wide_mlp_bucket: bucket must be an int32 or int64 tensor of prototype ids, got "
                         f"{bucket.dtype}")
    if tuple(bucket.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"wide_mlp_bucket: bucket must have x's leading shape {tuple(x.shape[:-1])} (one id per "
                         f"token), got {tuple(bucket.shape)}")
    D = x.shape[-1]
    xf, bf = x.reshape(-1, D), bucket.reshape(-1)
    check_inputs(xf, w_gate, w_up, w_down, bf, protos, group_size, activation)
    if bf.device.type == "cpu" and bf.numel() and not torch.compiler.is_compiling():
        lo, hi = int(bf.min()), int(bf.max())
        if lo < 0 or hi >= protos.shape[0]:
            raise ValueError(f"wide_mlp_bucket: bucket ids must lie in [0, P) = [0, {protos.shape[0]}), got ids in "
                             f"[{lo}, {hi}]")
    cfg = json.dumps(config, sort_keys=True) if config else ""
    out = torch.ops.wide.mlp_bucket(xf, w_gate, w_up, w_down, bf, protos, int(group_size), activation, cfg)
    return out.reshape(x.shape)
