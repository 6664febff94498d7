"""torch.library registration of ``wide::rmsnorm_router`` (the fused RMSNorm + router, norm_router.py) and of
``wide::add_rmsnorm_router`` (the same with the residual add before the norm): the
Triton kernel on CUDA tensors (through ``wrap_triton`` inside ``triton_op``, so Inductor sees it), the PyTorch
reference elsewhere; the fake impl is the same body (outputs are [T, D] and [T, G], static in the inputs)."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor
from torch.library import triton_op

from .norm_router import add_rmsnorm_router_dispatch, rmsnorm_router_dispatch


def _rmsnorm_router_impl(x: Tensor, w_norm: Tensor, eps: float, router_input: str, kind: str, w1: Tensor,
                         b1: Optional[Tensor], w2: Optional[Tensor], b2: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    return rmsnorm_router_dispatch(x, w_norm, eps, router_input, kind, w1, b1, w2, b2, wrap=True)


rmsnorm_router_op = triton_op("wide::rmsnorm_router", _rmsnorm_router_impl, mutates_args=())


def wide_rmsnorm_router(x: Tensor, w_norm: Tensor, eps: float, router_input: str, kind: str, w1: Tensor,
                        b1: Optional[Tensor] = None, w2: Optional[Tensor] = None,
                        b2: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """x [..., D], w_norm [D] -> (RMSNorm(x) [..., D] in x's dtype, router mask [..., G] bool) in one launch.
    router_input "normed" (the router reads the norm's output) or "residual" (it reads x); kind "linear"
    (w1 [G, D], b1), "mlp" (w1 [R, D], b1, w2 [G, R], b2, SiLU between) or "pair" (w1 [R, D], b1,
    w2 [2G, R], b2: the margin of each (skip, execute) pair); the router's tensors are float32."""
    D = x.shape[-1]
    y, mask = torch.ops.wide.rmsnorm_router(x.reshape(-1, D), w_norm, float(eps), router_input, kind, w1, b1, w2, b2)
    return y.reshape(x.shape), mask.reshape(*x.shape[:-1], mask.shape[-1])


def _add_rmsnorm_router_impl(a: Tensor, b: Tensor, w_norm: Tensor, eps: float, router_input: str, kind: str,
                             w1: Tensor, b1: Optional[Tensor], w2: Optional[Tensor],
                             b2: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
    return add_rmsnorm_router_dispatch(a, b, w_norm, eps, router_input, kind, w1, b1, w2, b2, wrap=True)


add_rmsnorm_router_op = triton_op("wide::add_rmsnorm_router", _add_rmsnorm_router_impl, mutates_args=())


def wide_add_rmsnorm_router(a: Tensor, b: Tensor, w_norm: Tensor, eps: float, router_input: str, kind: str,
                            w1: Tensor, b1: Optional[Tensor] = None, w2: Optional[Tensor] = None,
                            b2: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """a, b [..., D] (one shape and dtype) -> (x = a + b, RMSNorm(x), router mask [..., G]) in one launch: the
    residual add, then wide_rmsnorm_router of x (router_input "residual" reads x)."""
    D = a.shape[-1]
    x, y, mask = torch.ops.wide.add_rmsnorm_router(a.reshape(-1, D), b.reshape(-1, D), w_norm, float(eps),
                                                   router_input, kind, w1, b1, w2, b2)
    return x.reshape(a.shape), y.reshape(a.shape), mask.reshape(*a.shape[:-1], mask.shape[-1])
