"""torch.library registration of ``wide::routed_select`` and ``wide::routed_gated_select`` (routed_select.py: a
split-bf16 linear router's logits, threshold and group select in one launch): the Triton kernel on CUDA tensors
(through ``wrap_triton`` inside ``triton_op``, so Inductor sees it), the PyTorch reference elsewhere; the fake impl
is the same body (the output has the routed tensor's shape)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.library import triton_op

from .routed_select import routed_select_dispatch


def _routed_select_impl(a: Tensor, h: Tensor, w2: Tensor, b: Optional[Tensor], group_size: int) -> Tensor:
    return routed_select_dispatch(a, h, w2, b, group_size, wrap=True)


def _routed_gated_select_impl(g: Tensor, u: Tensor, h: Tensor, w2: Tensor, b: Optional[Tensor], group_size: int,
                              activation: str) -> Tensor:
    return routed_select_dispatch(g, h, w2, b, group_size, u=u, act=activation, wrap=True)


routed_select_op = triton_op("wide::routed_select", _routed_select_impl, mutates_args=())
routed_gated_select_op = triton_op("wide::routed_gated_select", _routed_gated_select_impl, mutates_args=())


def wide_routed_select(a: Tensor, h: Tensor, w2: Tensor, b: Optional[Tensor], group_size: int) -> Tensor:
    """a [T, G*group_size], h [T, D] bf16 (the router's input), w2 [2 Gp, D] bf16 (routers.split_bf16), b [G] fp32
    or None -> a with the columns of each token's inactive groups exactly 0, the mask being
    router_fns.split_router_mask(h, w2, b), in one launch."""
    return torch.ops.wide.routed_select(a, h, w2, b, int(group_size))


def wide_routed_gated_select(g: Tensor, u: Tensor, h: Tensor, w2: Tensor, b: Optional[Tensor], group_size: int,
                             activation: str = "silu") -> Tensor:
    """g, u [T, G*group_size] -> act(g) * u (fp32, rounded once to g's dtype) on each token's active groups, exactly
    0 on the others, the mask being router_fns.split_router_mask(h, w2, b), in one launch."""
    return torch.ops.wide.routed_gated_select(g, u, h, w2, b, int(group_size), activation)

