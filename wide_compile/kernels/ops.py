"""torch.library registration of the WIDE ops (namespace ``wide``).

* CUDA tensors: Triton kernels (compact_mlp / compact_attn / reorder), launched through
  ``torch.library.wrap_triton`` inside ``torch.library.triton_op`` so Inductor can see them.
* Any other device (CPU): the plain PyTorch reference (reference.py).
* The last argument, ``tuning``, is the kernels' tile table as JSON ("" = the device's shipped table,
  tuning.py), so a compiled graph keeps the tuning it was compiled with.
* Fake/meta: ``triton_op`` registers the same body as the fake impl; every output shape is a
  static function of the input shapes (worst-case padded index buffers), no host sync.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import reference as _ref
from .tuning import as_arg

from torch.library import triton_op


def _is_cuda(t: Tensor) -> bool:
    return t.device.type == "cuda"


def _mlp_impl(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down_t: Tensor, mask: Tensor,
              group_size: int, tuning: str = "", activation: str = "silu") -> Tensor:
    if _is_cuda(x):
        from .compact_mlp import mlp_triton
        return mlp_triton(x, w_gate, w_up, w_down_t, mask, group_size, tuning=tuning, wrap=True, act=activation)
    return _ref.mlp_ref(x, w_gate, w_up, w_down_t, mask, group_size, activation)


def _q_proj_impl(x: Tensor, w_q: Tensor, b_q: Optional[Tensor], mask: Tensor, group_size: int,
                 tuning: str = "") -> Tensor:
    if _is_cuda(x):
        from .compact_attn import q_proj_triton
        return q_proj_triton(x, w_q, b_q, mask, group_size, tuning=tuning, wrap=True)
    return _ref.q_proj_ref(x, w_q, b_q, mask, group_size)


def _o_proj_impl(a: Tensor, w_o_t: Tensor, b_o: Optional[Tensor], mask: Tensor, group_size: int,
                 tuning: str = "") -> Tensor:
    if _is_cuda(a):
        from .compact_attn import o_proj_triton
        return o_proj_triton(a, w_o_t, b_o, mask, group_size, tuning=tuning, wrap=True)
    return _ref.o_proj_ref(a, w_o_t, b_o, mask, group_size)


def _mask_reorder_impl(mask: Tensor, block_m: int) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    if _is_cuda(mask):
        from .reorder import mask_reorder_triton
        return mask_reorder_triton(mask, block_m, wrap=True)
    return _ref.mask_reorder_ref(mask, block_m)


mlp_op = triton_op("wide::mlp", _mlp_impl, mutates_args=())
q_proj_op = triton_op("wide::q_proj", _q_proj_impl, mutates_args=())
o_proj_op = triton_op("wide::o_proj", _o_proj_impl, mutates_args=())
mask_reorder_op = triton_op("wide::mask_reorder", _mask_reorder_impl, mutates_args=())


# ----------------------------------------------------------------------------- public wrappers

def _flat(t: Tensor, last: int) -> Tensor:
    return t.reshape(-1, last)


def wide_mlp(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down_t: Tensor, mask: Tensor,
             group_size: int, tuning=None, activation: str = "silu") -> Tensor:
    """x [..., D]; w_gate, w_up [F, D]; w_down_t [F, D] (= down_proj.weight.T, contiguous);
    mask [..., G] bool with G = F // group_size -> [..., D]. tuning: the kernels' tile table
    (tuning.resolve; None = the device's shipped table). activation: the gate's, one of
    reference.ACTIVATIONS ("silu": SwiGLU; "gelu" / "gelu_tanh": GeGLU)."""
    if activation not in _ref.ACTIVATIONS:
        raise ValueError(f"wide_mlp: unknown activation {activation!r}; choose one of {_ref.ACTIVATIONS}")
    D = x.shape[-1]
    G = w_gate.shape[0] // group_size
    out = torch.ops.wide.mlp(_flat(x, D), w_gate, w_up, w_down_t, _flat(mask, G).to(torch.bool), int(group_size),
                          as_arg(tuning), activation)
    return out.reshape(x.shape)


def wide_q_proj(x: Tensor, w_q: Tensor, b_q: Optional[Tensor], mask: Tensor, group_size: int,
                tuning=None) -> Tensor:
    """x [..., D]; w_q [Nq, D]; b_q [Nq] or None; mask [..., G], G <= Nq // group_size -> [..., Nq], inactive
    groups' columns exactly 0. The mask covers the first G groups; any after them are always on (K / V rows run in
    q's launch: passes/rewrite_attention.py)."""
    D = x.shape[-1]
    Nq = w_q.shape[0]
    G = mask.shape[-1]
    if Nq % group_size or G * group_size > Nq:
        raise ValueError(f"wide_q_proj: {Nq} output columns are not a whole number of groups of {group_size} "
                         f"covering the mask's {G} groups; pass a mask of at most Nq // group_size groups")
    out = torch.ops.wide.q_proj(_flat(x, D), w_q, b_q, _flat(mask, G).to(torch.bool), int(group_size),
                                as_arg(tuning))
    return out.reshape(*x.shape[:-1], Nq)


def wide_o_proj(a: Tensor, w_o_t: Tensor, b_o: Optional[Tensor], mask: Tensor, group_size: int,
                tuning=None) -> Tensor:
    """a [..., Nq]; w_o_t [Nq, D] (= o_proj.weight.T, contiguous); b_o [D] or None (added once);
    mask [..., G], G = Nq // group_size -> [..., D]."""
    Nq = a.shape[-1]
    D = w_o_t.shape[1]
    G = Nq // group_size
    out = torch.ops.wide.o_proj(_flat(a, Nq), w_o_t, b_o, _flat(mask, G).to(torch.bool), int(group_size),
                                as_arg(tuning))
    return out.reshape(*a.shape[:-1], D)


def mask_reorder(mask: Tensor, block_m: int):
    """mask [..., G] bool, block_m a power of two -> (tile_groups [n_tiles, G], tile_counts [n_tiles],
    sorted_token_ids [G*n_tiles*block_m], block_groups [G*n_tiles], num_tokens_post_padded [1]),
    all int32, n_tiles = ceil(T / block_m).  See reorder.py for the layout."""
    G = mask.shape[-1]
    return torch.ops.wide.mask_reorder(_flat(mask, G).to(torch.bool), int(block_m))
