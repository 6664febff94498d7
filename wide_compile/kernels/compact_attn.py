"""Compact attention projections (q_proj / o_proj) over head groups.

Attention itself stays dense (SDPA over all heads; K, V always dense): only q_proj computes the
active head groups' columns (inactive columns are written as exactly 0) and o_proj reads only the
active groups' input columns / rows of o_proj.weight.T. Small decode batches (path="dense") and the
prefill o_proj (down="dense") run dense GEMMs with the mask applied (dense_masked.py); one token runs as one
GEMV each (gemv.py) when the tuning says one_token="gemv". See
benchmarks/KERNELS_NOTES.md for what dense attention costs next to the projections.
"""
from __future__ import annotations

from typing import Optional

import torch

from .compact_mlp import kernel_config, ngather, kskip
from .dense_masked import o_proj_dense_masked, q_proj_dense_masked
from .gemv import o_proj_gemv_triton, q_proj_gemv_triton
from .reference import groups_past_on
from .reorder import _mask_bytes


def q_proj_triton(x, w_q, b_q: Optional[torch.Tensor], mask, group_size: int, *,
                  config: Optional[dict] = None, tuning=None, wrap: bool = False):
    """x [T, D], w_q [Nq, D], b_q [Nq] or None, mask [T, G'] -> [T, Nq] (inactive columns = 0): the mask covers
    the first G' <= G = Nq // group_size groups, the groups after them are always on."""
    T, D = x.shape
    Nq = w_q.shape[0]
    G = Nq // group_size
    cfg = kernel_config(T, D, Nq, group_size, Nq, config, elem_size=x.element_size(), device=x.device,
                        tuning=tuning)
    x = x.contiguous()
    if T == 1 and cfg.get("one_token") == "gemv":  # a batch-1 decode step: one GEMV launch (gemv.py)
        return q_proj_gemv_triton(x, w_q, b_q, mask, None, group_size, cfg, wrap)
    if cfg["path"] == "dense":  # small batches (the tuning table's dense rows): nothing left to skip
        return q_proj_dense_masked(x, w_q, b_q, mask, group_size)
    mask8 = _mask_bytes(groups_past_on(mask, G))  # the tile kernels read G groups per token
    out = torch.zeros((T, Nq), dtype=x.dtype, device=x.device)
    ngather(x, w_q, None, b_q, out, mask8, G, group_size, cfg, gated=False,
            zero_inactive=False, wrap=wrap)
    return out


def o_proj_triton(a, w_o_t, b_o: Optional[torch.Tensor], mask, group_size: int, *,
                  config: Optional[dict] = None, tuning=None, wrap: bool = False):
    """a [T, Nq], w_o_t [Nq, D], b_o [D] or None, mask [T, G] -> [T, D]."""
    T, Nq = a.shape
    D = w_o_t.shape[1]
    G = Nq // group_size
    cfg = kernel_config(T, D, Nq, group_size, D, config, elem_size=a.element_size(), device=a.device,
                        tuning=tuning)
    a = a.contiguous()
    if T == 1 and cfg.get("one_token") == "gemv":  # a batch-1 decode step: the reduction GEMV (gemv.py)
        return o_proj_gemv_triton(a, w_o_t.t(), b_o, mask, None, group_size, cfg, wrap)
    if cfg["path"] == "dense" or cfg.get("down") == "dense":  # small batches, prefill: mask, one cuBLAS GEMM
        return o_proj_dense_masked(a, w_o_t, b_o, mask, group_size)
    mask8 = _mask_bytes(mask)
    return kskip(a, w_o_t, b_o, mask8, G, group_size, cfg, a.dtype, wrap)
