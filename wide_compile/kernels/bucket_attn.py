"""Bucketed attention projections for structured (codebook / nested) head-group masks: the kernels of
bucket_mlp.py without the gate (the pattern of compact_attn.py over compact_mlp.py).

Semantics: exactly ``wide.q_proj`` / ``wide.o_proj`` (reference.py) with the per-token mask ``protos[bucket]``:

    q_proj: x [T, D], w_q [Nq, D], b_q [Nq] or None -> [T, Nq]: x W_q^T + b on the groups of the token's
            prototype (rounded once), exactly 0 on its other groups' columns;
    o_proj: a [T, Nq], w_o [D, Nq] (o_proj.weight as is), b_o [D] or None -> [T, D]: a's columns of the token's
            groups times W_o's matching columns, + b_o once.

Tokens are sorted by bucket on the device (bucket_mlp.make_lists; a few tokens form one block over the
union of their prototypes instead). q_proj: program (block, column tile
over the prototype's groups, active ones first) gathers x rows by token id and W_q rows of the groups, and
scatters to the tokens' rows at the groups' own columns; tiles past the active width write the inactive groups'
zeros, so every element is written once. o_proj: program (block, tile of D) loops K over the prototype's active
groups only, reading a by token id, and stores each token's row at its position. A bucket id outside [0, P)
gives a NaN row (as bucket_mlp). One token runs as one GEMV each (gemv.py; config one_token), and few tokens
optionally as dense GEMMs with their masks applied (config few_tokens), as bucket_mlp.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import reference as _ref
from .bucket_mlp import (check_bucket, config_for, gather_k_triton, gather_n_triton, make_lists, mask_and_valid,
                         nan_rows, uses_dense)
from .dense_masked import o_proj_dense_masked, q_proj_dense_masked
from .gemv import o_proj_gemv_triton, q_proj_gemv_triton
from .reorder import alloc


def check_proj_inputs(inp, w, bias, bucket, protos, group_size: int, name: str, grouped_in: bool) -> tuple:
    """inp [T, K], w [N, K], bias [N] or None; the groups split w's rows (q_proj) or its columns (grouped_in,
    o_proj). q_proj's prototypes may cover only its first groups (the groups after them always on: K / V rows in
    q's launch). Returns (T, K, N, G, P), G the prototypes' groups."""
    if inp.dim() != 2 or w.dim() != 2 or inp.shape[1] != w.shape[1]:
        raise ValueError(f"{name}: the input must be [T, K] and the weight [N, K] (the Linear's weight), got "
                         f"{tuple(inp.shape)} and {tuple(w.shape)}")
    T, K = inp.shape
    N = w.shape[0]
    split = K if grouped_in else N
    if group_size < 1 or split % group_size:
        raise ValueError(f"{name}: group_size {group_size} must divide the grouped size {split}")
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"{name}: bias must be [{N}] or None, got {tuple(bias.shape)}")
    G = split // group_size
    if not grouped_in and protos.dim() == 2 and 0 < protos.shape[1] < G:
        G = protos.shape[1]
    P = check_bucket(bucket, protos, T, G, name, f"G = {split // group_size} head groups"
                     + ("" if grouped_in else " (q_proj: at most)"))
    tensors = [inp, w, bucket, protos] + ([bias] if bias is not None else [])
    if len({t.device for t in tensors}) > 1:
        raise ValueError(f"{name}: every tensor must be on one device")
    if len({t.dtype for t in (inp, w) + ((bias,) if bias is not None else ())}) > 1:
        raise ValueError(f"{name}: the input, weight and bias must share one dtype")
    return T, K, N, G, P


def q_proj_bucket_ref(x, w_q, b_q: Optional[torch.Tensor], bucket, protos, group_size: int) -> torch.Tensor:
    """reference.q_proj_ref with mask = protos[bucket]; ids outside [0, P) give NaN rows."""
    check_proj_inputs(x, w_q, b_q, bucket, protos, group_size, "q_proj_bucket", grouped_in=False)
    mask, valid = mask_and_valid(bucket, protos)
    return nan_rows(_ref.q_proj_ref(x, w_q, b_q, mask, group_size), valid)


def o_proj_bucket_ref(a, w_o, b_o: Optional[torch.Tensor], bucket, protos, group_size: int) -> torch.Tensor:
    """reference.o_proj_ref (w_o [D, Nq] = o_proj.weight) with mask = protos[bucket]; ids outside [0, P) give
    NaN rows."""
    check_proj_inputs(a, w_o, b_o, bucket, protos, group_size, "o_proj_bucket", grouped_in=True)
    mask, valid = mask_and_valid(bucket, protos)
    return nan_rows(_ref.o_proj_ref(a, w_o.t(), b_o, mask, group_size), valid)


def _float_dtype(t, name):
    if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"{name}: inputs must be float16, bfloat16 or float32, got {t.dtype} (the *_ref functions "
                         "compute any dtype)")


def q_proj_bucket_triton(x, w_q, b_q, bucket, protos, group_size: int, *, config: Optional[dict] = None,
                         wrap: bool = False) -> torch.Tensor:
    """x [T, D], w_q [Nq, D], b_q [Nq] or None, bucket [T], protos [P, G], G <= Nq // group_size (the groups
    after the table's always on) -> [T, Nq]."""
    T, D, Nq, G, P = check_proj_inputs(x, w_q, b_q, bucket, protos, group_size, "q_proj_bucket", grouped_in=False)
    _float_dtype(x, "q_proj_bucket_triton")
    cfg = config_for(T, group_size, x.dtype, x.device, config)
    if T == 1 and cfg["one_token"] == "gemv":  # reads the table's G groups, runs the groups after them
        return q_proj_gemv_triton(x, w_q, b_q, protos, bucket, group_size, cfg, wrap)
    protos = _ref.groups_past_on(protos, Nq // group_size)  # the dense and tile paths read every group
    if uses_dense(T, cfg):
        mask, valid = mask_and_valid(bucket, protos)
        return nan_rows(q_proj_dense_masked(x, w_q, b_q, mask, group_size), valid)
    out = alloc((T, Nq), x.dtype, x.device)
    if T == 0:
        return out
    lists = make_lists(bucket, protos, cfg, wrap)
    return gather_n_triton(x, w_q, None, b_q, out, lists, group_size, cfg, gated=False, scatter=True, wrap=wrap)


def o_proj_bucket_triton(a, w_o, b_o, bucket, protos, group_size: int, *, config: Optional[dict] = None,
                         wrap: bool = False) -> torch.Tensor:
    """a [T, Nq], w_o [D, Nq], b_o [D] or None, bucket [T], protos [P, Nq // group_size] -> [T, D]."""
    T, Nq, D, G, P = check_proj_inputs(a, w_o, b_o, bucket, protos, group_size, "o_proj_bucket", grouped_in=True)
    _float_dtype(a, "o_proj_bucket_triton")
    a = a if a.stride(1) == 1 else a.contiguous()  # the kernel reads a's rows as contiguous columns
    cfg = config_for(T, group_size, a.dtype, a.device, config)
    if T == 0:
        return alloc((T, D), a.dtype, a.device)
    if T == 1 and cfg["one_token"] == "gemv":
        return o_proj_gemv_triton(a, w_o, b_o, protos, bucket, group_size, cfg, wrap)
    if uses_dense(T, cfg):
        mask, valid = mask_and_valid(bucket, protos)
        return nan_rows(o_proj_dense_masked(a, w_o.t(), b_o, mask, group_size), valid)
    lists = make_lists(bucket, protos, cfg, wrap)
    return gather_k_triton(a, w_o, b_o, lists, T, group_size, cfg, compact_a=False, wrap=wrap)
