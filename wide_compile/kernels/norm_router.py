"""Fused RMSNorm + router: one launch reads a block's input row once, writes the RMSNorm output the block
needs and the router's hard mask for that row.

    y    = w_norm * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)       (HF LlamaRMSNorm / gpt-fast RMSNorm)
    h    = y (router_input "normed") or x (router_input "residual": the stream before the norm), in fp32
    mask = logits(h) > 0, logits one of the routers of routing/router_fns.py that fuse:
           linear  h @ w1^T + b1                                            (GroupRouter)
           mlp     silu(h @ w1^T + b1) @ w2^T + b2                           (GroupRouter with a hidden layer)
           pair    z = (h @ w1^T + b1) @ w2^T + b2 [G, 2]; z[:, 1] - z[:, 0]  (PairRouter, the method's recipe)

The router weights are fp32 (as trained) and the router's sums run in fp32, as in the reference: the fused
mask differs from it only where a logit lies within fp32 summation-order rounding of 0, the same freedom any
compiled fp32 GEMM has. Routers in another dtype, codebook / nested / constant / replay routers and split-bf16
routers do not fuse (passes/fuse_norm_router.py leaves them).

One program per token row: decode rows (the case this exists for) are one program each; the row is read
twice from L1/L2 (the statistic, then the normalized output and the router sums), once from memory.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .reorder import _launcher

KINDS = ("linear", "mlp", "pair")
ROUTER_INPUTS = ("normed", "residual")
_KIND_IDS = {k: i for i, k in enumerate(KINDS)}


# ----------------------------------------------------------------------------- reference

def rmsnorm_ref(x: torch.Tensor, w_norm: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [T, D], w_norm: [D] -> [T, D] in x's dtype (HF LlamaRMSNorm's arithmetic)
    xf = x.float()
    xn = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w_norm * xn.to(x.dtype)


def router_logits_ref(h: torch.Tensor, kind: str, w1, b1, w2=None, b2=None) -> torch.Tensor:
    # h: [T, D] -> fp32 logits [T, G]; the arithmetic of routing/router_fns.py
    z = F.linear(h.to(w1.dtype), w1, b1)
    if kind == "linear":
        return z
    if kind == "mlp":
        return F.linear(F.silu(z), w2, b2)
    z = F.linear(z, w2, b2).unflatten(-1, (-1, 2))
    return z[..., 1] - z[..., 0]


def rmsnorm_router_ref(x, w_norm, eps: float, router_input: str, kind: str, w1, b1, w2=None, b2=None):
    """x [T, D] -> (y [T, D] in x's dtype, mask [T, G] bool): the norm, then the router on y or on x."""
    y = rmsnorm_ref(x, w_norm, eps)
    h = y if router_input == "normed" else x
    return y, router_logits_ref(h, kind, w1, b1, w2, b2) > 0


# ----------------------------------------------------------------------------- Triton

@triton.jit
def _rmsnorm_router_kernel(x_ptr, nw_ptr, y_ptr, m_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr,
                           D, stride_x, stride_y, eps,
                           R: tl.constexpr, G: tl.constexpr, RP: tl.constexpr, GP: tl.constexpr,
                           BD: tl.constexpr, KIND: tl.constexpr, RESIDUAL: tl.constexpr,
                           HAS_B1: tl.constexpr, HAS_B2: tl.constexpr):
    # Inductor types a Python float argument of a user kernel as fp64: the statistic stays fp32 as in HF
    eps = tl.cast(eps, tl.float32)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BD)
    # pass 1: the row's mean square, in fp32
    ss = tl.zeros([BD], dtype=tl.float32)
    for d0 in range(0, D, BD):
        d = d0 + offs
        xv = tl.load(x_ptr + row * stride_x + d, mask=d < D, other=0.0).to(tl.float32)
        ss += xv * xv
    rstd = tl.rsqrt(tl.sum(ss, axis=0) / D + eps)
    # pass 2: y, and the router's first layer over h (y or x): acc [RP] = w1 @ h
    r = tl.arange(0, RP)
    rv = r < R
    acc = tl.zeros([RP], dtype=tl.float32)
    for d0 in range(0, D, BD):
        d = d0 + offs
        dv = d < D
        xin = tl.load(x_ptr + row * stride_x + d, mask=dv, other=0.0)
        xn = (xin.to(tl.float32) * rstd).to(xin.dtype)
        nw = tl.load(nw_ptr + d, mask=dv, other=0.0)
        y = (nw.to(tl.float32) * xn.to(tl.float32)).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + row * stride_y + d, y, mask=dv)
        if RESIDUAL:
            h = xin.to(tl.float32)
        else:
            h = y.to(tl.float32)
        w = tl.load(w1_ptr + r[:, None] * D + d[None, :], mask=rv[:, None] & dv[None, :], other=0.0)
        acc += tl.sum(w * h[None, :], axis=1)
    if HAS_B1:
        acc += tl.load(b1_ptr + r, mask=rv, other=0.0)
    g = tl.arange(0, GP)
    gv = g < G
    if KIND == 0:  # linear: R == G, the first layer's output is the logits
        logit = acc
    elif KIND == 1:  # mlp: silu hidden layer, then [G, R]
        z = acc * tl.sigmoid(acc)
        w2 = tl.load(w2_ptr + g[:, None] * R + r[None, :], mask=gv[:, None] & rv[None, :], other=0.0)
        logit = tl.sum(w2 * z[None, :], axis=1)
        if HAS_B2:
            logit += tl.load(b2_ptr + g, mask=gv, other=0.0)
    else:  # pair: rows 2g (skip) and 2g + 1 (execute) of [2G, R]; the margin execute - skip
        w_skip = tl.load(w2_ptr + (2 * g)[:, None] * R + r[None, :], mask=gv[:, None] & rv[None, :], other=0.0)
        w_exec = tl.load(w2_ptr + (2 * g + 1)[:, None] * R + r[None, :], mask=gv[:, None] & rv[None, :], other=0.0)
        z_skip = tl.sum(w_skip * acc[None, :], axis=1)
        z_exec = tl.sum(w_exec * acc[None, :], axis=1)
        if HAS_B2:
            z_skip += tl.load(b2_ptr + 2 * g, mask=gv, other=0.0)
            z_exec += tl.load(b2_ptr + 2 * g + 1, mask=gv, other=0.0)
        logit = z_exec - z_skip
    tl.store(m_ptr + row * G + g, logit > 0, mask=gv)


def check_router(kind: str, router_input: str, D: int, w1, b1, w2, b2) -> int:
    """G of a fusable router given as (kind, its tensors); one ValueError saying what is wrong otherwise."""
    if kind not in KINDS or router_input not in ROUTER_INPUTS:
        raise ValueError(f"rmsnorm_router: kind must be one of {KINDS} and router_input one of {ROUTER_INPUTS}, "
                         f"got {kind!r}, {router_input!r}")
    ts = [t for t in (w1, b1, w2, b2) if t is not None]
    if any(t.dtype != torch.float32 for t in ts):
        raise ValueError("rmsnorm_router: the router's weights must be float32 (as trained); other dtypes round "
                         "their logits differently and do not fuse")
    if w1.dim() != 2 or w1.shape[1] != D or (kind != "linear") != (w2 is not None):
        raise ValueError(f"rmsnorm_router: a {kind} router needs w1 [R, {D}]" +
                         (" and w2" if kind != "linear" else " and no w2") + f", got w1 {tuple(w1.shape)}")
    R = w1.shape[0]
    if kind == "linear":
        return R
    if w2.dim() != 2 or w2.shape[1] != R or (kind == "pair" and w2.shape[0] % 2):
        raise ValueError(f"rmsnorm_router: w2 of a {kind} router is [{'2G' if kind == 'pair' else 'G'}, {R}], "
                         f"got {tuple(w2.shape)}")
    return w2.shape[0] // 2 if kind == "pair" else w2.shape[0]


def rmsnorm_router_triton(x, w_norm, eps: float, router_input: str, kind: str, w1, b1=None, w2=None, b2=None,
                          wrap: bool = False):
    """x [T, D] (any float dtype), w_norm [D] -> (y [T, D] in x's dtype, mask [T, G] bool), one launch."""
    T, D = x.shape
    G = check_router(kind, router_input, D, w1, b1, w2, b2)
    R = w1.shape[0]
    x = x.contiguous()
    y = torch.empty((T, D), dtype=x.dtype, device=x.device)
    mask = torch.empty((T, G), dtype=torch.bool, device=x.device)
    RP, GP = triton.next_power_of_2(R), triton.next_power_of_2(G)
    BD = max(16, min(triton.next_power_of_2(D), 8192 // RP))  # the w1 tile [RP, BD] stays in registers
    w2_ = w2.contiguous() if w2 is not None else w1
    _launcher(_rmsnorm_router_kernel, wrap)[(T,)](
        x, w_norm.contiguous(), y, mask, w1.contiguous(), b1 if b1 is not None else w1, w2_,
        b2 if b2 is not None else w1, D, x.stride(0), y.stride(0), float(eps),
        R=R, G=G, RP=RP, GP=GP, BD=BD, KIND=_KIND_IDS[kind], RESIDUAL=router_input == "residual",
        HAS_B1=b1 is not None, HAS_B2=b2 is not None, num_warps=4 if RP * BD <= 4096 else 8)
    return y, mask


def rmsnorm_router_dispatch(x, w_norm, eps, router_input, kind, w1, b1: Optional[torch.Tensor] = None,
                            w2: Optional[torch.Tensor] = None, b2: Optional[torch.Tensor] = None, wrap=False):
    """The Triton kernel on CUDA, the reference elsewhere (the op's body, norm_router_ops.py)."""
    if x.device.type == "cuda":
        return rmsnorm_router_triton(x, w_norm, eps, router_input, kind, w1, b1, w2, b2, wrap=wrap)
    check_router(kind, router_input, x.shape[1], w1, b1, w2, b2)
    return rmsnorm_router_ref(x, w_norm, eps, router_input, kind, w1, b1, w2, b2)
