"""torch.library registration of the bucketed ops (namespace ``wide``), the pattern of attn_ops.py:

* ``wide::mlp_bucket``: the MLP of structured (codebook / nested) masks, tokens sorted by prototype
  (bucket_mlp.py); ``wide::q_proj_bucket`` / ``wide::o_proj_bucket``: the attention projections of structured
  head-group masks (bucket_attn.py). CUDA tensors run the Triton kernels through ``torch.library.wrap_triton`` inside
  ``torch.library.triton_op`` (Inductor sees the kernels); any other device runs the PyTorch reference.
* Fake/meta: ``triton_op`` registers the same body as the fake impl; the outputs ([T, D], [T, Nq]) and the list
  and h buffers are static functions of the input shapes, no host sync.
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

from .bucket_attn import o_proj_bucket_ref, o_proj_bucket_triton, q_proj_bucket_ref, q_proj_bucket_triton
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


def _check_ids_on_host(bucket: Tensor, protos: Tensor, name: str) -> None:
    """Bucket ids in [0, P), checked for CPU tensors only: on a GPU the check would cost a device sync, and the
    kernels give an out-of-range id's token a NaN row instead."""
    if bucket.device.type == "cpu" and bucket.numel() and not torch.compiler.is_compiling():
        lo, hi = int(bucket.min()), int(bucket.max())
        if lo < 0 or hi >= protos.shape[0]:
            raise ValueError(f"{name}: bucket ids must lie in [0, P) = [0, {protos.shape[0]}), got ids in "
                             f"[{lo}, {hi}]")


def _flat_bucket(x: Tensor, bucket: Tensor, name: str) -> Tensor:
    if bucket.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: bucket must be an int32 or int64 tensor of prototype ids, got {bucket.dtype}")
    if tuple(bucket.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"{name}: bucket must have the input's leading shape {tuple(x.shape[:-1])} (one id per "
                         f"token), got {tuple(bucket.shape)}")
    return bucket.reshape(-1)


def wide_mlp_bucket(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, bucket: Tensor, protos: Tensor,
                    group_size: int, activation: str = "silu", config: Optional[dict] = None) -> Tensor:
    """x [..., D]; w_gate, w_up [F, D]; w_down [D, F] (= down_proj.weight); bucket [...] int (the prototype id of
    each token); protos [P, G] bool (G = F // group_size) -> [..., D]: wide_mlp with mask = protos[bucket].

    Bucket ids must lie in [0, P) (the router's argmax does). Checked here on the host for CPU tensors; on a GPU
    a check would cost a device sync, so an id out of range gives that token a NaN row instead.
    activation: one of reference.ACTIVATIONS. config: tile overrides (bucket_mlp.CONFIG_KEYS)."""
    bf = _flat_bucket(x, bucket, "wide_mlp_bucket")
    D = x.shape[-1]
    xf = x.reshape(-1, D)
    check_inputs(xf, w_gate, w_up, w_down, bf, protos, group_size, activation)
    _check_ids_on_host(bf, protos, "wide_mlp_bucket")
    cfg = json.dumps(config, sort_keys=True) if config else ""
    out = torch.ops.wide.mlp_bucket(xf, w_gate, w_up, w_down, bf, protos, int(group_size), activation, cfg)
    return out.reshape(x.shape)


def _q_proj_bucket_impl(x: Tensor, w_q: Tensor, b_q: Optional[Tensor], bucket: Tensor, protos: Tensor,
                        group_size: int, config: str = "") -> Tensor:
    if x.device.type == "cuda":
        return q_proj_bucket_triton(x, w_q, b_q, bucket, protos, group_size, config=_config(config), wrap=True)
    return q_proj_bucket_ref(x, w_q, b_q, bucket, protos, group_size)


def _o_proj_bucket_impl(a: Tensor, w_o: Tensor, b_o: Optional[Tensor], bucket: Tensor, protos: Tensor,
                        group_size: int, config: str = "") -> Tensor:
    if a.device.type == "cuda":
        return o_proj_bucket_triton(a, w_o, b_o, bucket, protos, group_size, config=_config(config), wrap=True)
    return o_proj_bucket_ref(a, w_o, b_o, bucket, protos, group_size)


q_proj_bucket_op = triton_op("wide::q_proj_bucket", _q_proj_bucket_impl, mutates_args=())
o_proj_bucket_op = triton_op("wide::o_proj_bucket", _o_proj_bucket_impl, mutates_args=())


def wide_q_proj_bucket(x: Tensor, w_q: Tensor, b_q: Optional[Tensor], bucket: Tensor, protos: Tensor,
                       group_size: int, config: Optional[dict] = None) -> Tensor:
    """x [..., D]; w_q [Nq, D]; b_q [Nq] or None; bucket [...] int; protos [P, G] bool (G = Nq // group_size)
    -> [..., Nq]: wide_q_proj with mask = protos[bucket] (inactive groups' columns exactly 0). Ids as in
    wide_mlp_bucket."""
    bf = _flat_bucket(x, bucket, "wide_q_proj_bucket")
    _check_ids_on_host(bf, protos, "wide_q_proj_bucket")
    cfg = json.dumps(config, sort_keys=True) if config else ""
    out = torch.ops.wide.q_proj_bucket(x.reshape(-1, x.shape[-1]), w_q, b_q, bf, protos, int(group_size), cfg)
    return out.reshape(*x.shape[:-1], w_q.shape[0])


def wide_o_proj_bucket(a: Tensor, w_o: Tensor, b_o: Optional[Tensor], bucket: Tensor, protos: Tensor,
                       group_size: int, config: Optional[dict] = None) -> Tensor:
    """a [..., Nq]; w_o [D, Nq] (= o_proj.weight); b_o [D] or None (added once); bucket [...] int; protos [P, G]
    bool (G = Nq // group_size) -> [..., D]: wide_o_proj with mask = protos[bucket]. Ids as in wide_mlp_bucket."""
    bf = _flat_bucket(a, bucket, "wide_o_proj_bucket")
    _check_ids_on_host(bf, protos, "wide_o_proj_bucket")
    cfg = json.dumps(config, sort_keys=True) if config else ""
    out = torch.ops.wide.o_proj_bucket(a.reshape(-1, a.shape[-1]), w_o, b_o, bf, protos, int(group_size), cfg)
    return out.reshape(*a.shape[:-1], w_o.shape[0])
