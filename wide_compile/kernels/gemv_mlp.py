"""One-token MLP (a batch-1 decode step) as two GEMVs over the token's active groups, at the bandwidth limit.

Semantics: exactly ``wide.mlp`` (reference.mlp_ref) for T = 1, with the token's mask row either given
(free masks: ``mask [1, G]``) or picked from a prototype table (structured masks: ``protos[bucket[0]]``):

    x [1, D], w_gate / w_up [F, D], the down weight as W[d, k] (d < D, k < F) with any strides
    (down_proj.weight [D, F] as is, or w_down_t [F, D] transposed) -> out [1, D]
    out = W[:, active] @ (act(x Wg[active]^T) * (x Wu[active]^T))

At one token every weight byte is used once, so the work is reading the active groups' weights, nothing else:

1. ``_gate_up_gemv_kernel``: program n owns compact columns [n BN, (n + 1) BN) of the token's active groups
   (compact column c = column c % GS of the (c // GS)-th active group, found from the mask row in registers:
   no reorder launch), streams those gate and up weight rows once over D with fp32 products, and writes
   h[c] = act(g) * u rounded to x's dtype, plus each of its groups' id into the group list. Programs past the
   active width exit at once.
2. ``_down_gemv_kernel``: program (n, s) owns output columns [n BN, (n + 1) BN) and every SPLIT-th K tile of
   the compact range (the active groups' columns of W, from the group list); SPLIT = 1 writes the output,
   else fp32 partials [SPLIT, D] that ``_split_sum_kernel`` adds up (no atomics, no zero fill).
A prototype id outside [0, P) gives a NaN output row (as mlp_bucket_ref); an all-off mask gives exact zeros.
The tiles carry no tensor-core constraint (no tl.dot): products and sums in fp32 registers.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .compact_mlp import ACT_IDS, gated_act
from .reorder import _as_uint8, _launcher, alloc
from .tuning import interpreting

# Tiles per device class and per layout of the down weight ("k_contiguous": W[d, k] rows contiguous over k, as
# down_proj.weight; "d_contiguous": the transposed copy w_down_t the free op holds). gu_* tile the gate/up
# kernel (BN compact columns x BK of D), gd_* the down kernel (BN output columns x BK compact K, SPLIT slices).
# benchmarks/bench_bucket_mlp.py --sweep times GEMV_SWEEP.
CONFIGS = {
    "cuda": {
        "k_contiguous": dict(gu_bn=16, gu_bk=256, gu_warps=4, gu_stages=3, gd_bn=16, gd_bk=256, gd_split=4,
                             gd_warps=4, gd_stages=3),
        "d_contiguous": dict(gu_bn=16, gu_bk=256, gu_warps=4, gu_stages=3, gd_bn=64, gd_bk=64, gd_split=8,
                             gd_warps=4, gd_stages=3),
    },
    "interpreter": dict(gu_bn=8, gu_bk=16, gu_warps=1, gu_stages=1, gd_bn=8, gd_bk=16, gd_split=2, gd_warps=1,
                        gd_stages=1),
}
CONFIG_KEYS = tuple(CONFIGS["interpreter"])
GEMV_SWEEP = {
    "k_contiguous": (
        dict(gu_bn=16, gu_bk=256, gd_bn=16, gd_bk=256, gd_split=4),
        dict(gu_bn=8, gu_bk=512, gd_bn=8, gd_bk=512, gd_split=2),
        dict(gu_bn=32, gu_bk=128, gu_warps=8, gd_bn=32, gd_bk=128, gd_split=8, gd_warps=8),
        dict(gu_bn=16, gu_bk=512, gu_warps=8, gd_bn=16, gd_bk=512, gd_split=1, gd_warps=8),
        dict(gu_bn=16, gu_bk=256, gu_stages=1, gd_bn=16, gd_bk=256, gd_split=4, gd_stages=1),
        dict(gu_bn=8, gu_bk=256, gu_warps=2, gd_bn=8, gd_bk=256, gd_split=8, gd_warps=2),
    ),
    "d_contiguous": (
        dict(gd_bn=64, gd_bk=64, gd_split=8),
        dict(gd_bn=128, gd_bk=32, gd_split=8),
        dict(gd_bn=64, gd_bk=128, gd_split=16, gd_warps=8),
        dict(gd_bn=256, gd_bk=32, gd_split=16, gd_warps=8),
        dict(gd_bn=32, gd_bk=128, gd_split=4),
        dict(gd_bn=64, gd_bk=64, gd_split=8, gd_stages=1),
    ),
}


def layout(w_down_nk: torch.Tensor) -> str:
    """The down weight's layout as W[d, k]: rows contiguous over k (down_proj.weight) or columns over d."""
    return "k_contiguous" if w_down_nk.stride(1) == 1 else "d_contiguous"


def config_for(kind: str, overrides: Optional[dict] = None) -> dict:
    """The tile config for a down weight of layout `kind` (the interpreter's under TRITON_INTERPRET=1), then
    the `overrides` that name GEMV keys (other keys are the callers' own and pass by)."""
    cfg = dict(CONFIGS["interpreter"] if interpreting() else CONFIGS["cuda"][kind])
    cfg.update({k: v for k, v in (overrides or {}).items() if k in CONFIG_KEYS})
    for k in ("gu_bn", "gu_bk", "gd_bn", "gd_bk", "gd_split"):
        if cfg[k] < 1 or cfg[k] & (cfg[k] - 1):
            raise ValueError(f"one-token MLP config: {k} must be a power of two, got {cfg[k]}")
    return cfg


# ----------------------------------------------------------------------------- kernels

@triton.jit
def _mask_row(mask_ptr, bucket_ptr, P, G: tl.constexpr, GP2: tl.constexpr, BUCKET: tl.constexpr):
    # the token's mask row as int32 [GP2] (0 past G) and the value its outputs get added: 0, or NaN for a
    # prototype id outside [0, P)
    gs = tl.arange(0, GP2)
    if BUCKET:
        b = tl.load(bucket_ptr).to(tl.int64)
        ok = (b >= 0) & (b < P)
        row = tl.where(ok, b, 0) * G
        fill = tl.where(ok, 0.0, float("nan"))
    else:
        row = 0
        fill = 0.0
    act = (tl.load(mask_ptr + row + gs, mask=gs < G, other=0) != 0).to(tl.int32)
    return act, fill


@triton.jit(do_not_specialize=["P"])
def _gate_up_gemv_kernel(x_ptr, w1_ptr, w2_ptr, h_ptr, glist_ptr, mask_ptr, bucket_ptr, P, D, stride_xk,
                         stride_w1n, stride_w1k, stride_w2n, stride_w2k, G: tl.constexpr, GP2: tl.constexpr,
                         GS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BUCKET: tl.constexpr,
                         ACT: tl.constexpr):
    n = tl.program_id(0)
    act, fill = _mask_row(mask_ptr, bucket_ptr, P, G, GP2, BUCKET)
    excl = tl.cumsum(act, axis=0) - act                                  # [GP2] compact index of each group
    width = tl.sum(act, axis=0) * GS
    if n * BN >= width:
        return
    c = n * BN + tl.arange(0, BN)                                        # [BN] compact columns
    cvalid = c < width
    j = c // GS
    gs = tl.arange(0, GP2)
    hit = (act[None, :] != 0) & (excl[None, :] == j[:, None])           # [BN, GP2]
    g = tl.sum(tl.where(hit, gs[None, :], 0), axis=1)                    # [BN] the j-th active group
    rows = (g * GS + c % GS).to(tl.int64)
    acc1 = tl.zeros([BN, BK], dtype=tl.float32)
    acc2 = tl.zeros([BN, BK], dtype=tl.float32)
    for k0 in range(0, D, BK):
        k = k0 + tl.arange(0, BK)
        kv = k < D
        xv = tl.load(x_ptr + k * stride_xk, mask=kv, other=0.0).to(tl.float32)                        # [BK]
        wm = cvalid[:, None] & kv[None, :]
        w1 = tl.load(w1_ptr + rows[:, None] * stride_w1n + k[None, :] * stride_w1k, mask=wm, other=0.0)
        w2 = tl.load(w2_ptr + rows[:, None] * stride_w2n + k[None, :] * stride_w2k, mask=wm, other=0.0)
        acc1 += w1.to(tl.float32) * xv[None, :]
        acc2 += w2.to(tl.float32) * xv[None, :]
    h = gated_act(tl.sum(acc1, axis=1), tl.sum(acc2, axis=1), ACT)
    tl.store(h_ptr + c, h.to(h_ptr.dtype.element_ty), mask=cvalid)
    tl.store(glist_ptr + j, g, mask=cvalid & (c % GS == 0))


@triton.jit(do_not_specialize=["P"])
def _down_gemv_kernel(h_ptr, w_ptr, out_ptr, part_ptr, glist_ptr, mask_ptr, bucket_ptr, P, N, stride_wn,
                      stride_wk, G: tl.constexpr, GP2: tl.constexpr, GS: tl.constexpr, BN: tl.constexpr,
                      BK: tl.constexpr, SPLIT: tl.constexpr, BUCKET: tl.constexpr):
    n = tl.program_id(0)
    s = tl.program_id(1)
    act, fill = _mask_row(mask_ptr, bucket_ptr, P, G, GP2, BUCKET)
    width = tl.sum(act, axis=0) * GS
    cols = n * BN + tl.arange(0, BN)
    cvalid = cols < N
    cols64 = cols.to(tl.int64)
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    for k0 in range(s * BK, width, SPLIT * BK):  # compact K tiles s, s + SPLIT, ...
        kc = k0 + tl.arange(0, BK)
        kv = kc < width
        g = tl.load(glist_ptr + kc // GS, mask=kv, other=0)
        kf = (g * GS + kc % GS).to(tl.int64)                             # [BK] W's columns
        hv = tl.load(h_ptr + kc, mask=kv, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols64[:, None] * stride_wn + kf[None, :] * stride_wk,
                    mask=cvalid[:, None] & kv[None, :], other=0.0)                                    # [BN, BK]
        acc += w.to(tl.float32) * hv[None, :]
    y = tl.sum(acc, axis=1)
    if SPLIT == 1:
        tl.store(out_ptr + cols, (y + fill).to(out_ptr.dtype.element_ty), mask=cvalid)
    else:
        tl.store(part_ptr + s * N + cols, y, mask=cvalid)


@triton.jit(do_not_specialize=["P"])
def _split_sum_kernel(part_ptr, out_ptr, mask_ptr, bucket_ptr, P, N, G: tl.constexpr, GP2: tl.constexpr,
                      SPLIT: tl.constexpr, BN: tl.constexpr, BUCKET: tl.constexpr):
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    cvalid = cols < N
    _, fill = _mask_row(mask_ptr, bucket_ptr, P, G, GP2, BUCKET)
    s = tl.arange(0, SPLIT)
    part = tl.load(part_ptr + s[:, None] * N + cols[None, :], mask=cvalid[None, :], other=0.0)     # [SPLIT, BN]
    tl.store(out_ptr + cols, (tl.sum(part, axis=0) + fill).to(out_ptr.dtype.element_ty), mask=cvalid)


# ----------------------------------------------------------------------------- launcher

def mlp_gemv_triton(x, w_gate, w_up, w_down_nk, mask8, bucket: Optional[torch.Tensor], group_size: int,
                    act: str = "silu", config: Optional[dict] = None, wrap: bool = False) -> torch.Tensor:
    """x [1, D], w_gate / w_up [F, D], w_down_nk [D, F] as W[d, k] (any strides: down_proj.weight, or
    w_down_t.t()), mask8 uint8 [P, G] with bucket int [1] (the token's row is mask8[bucket[0]]) or [1, G] with
    bucket None -> [1, D]. Shapes are the callers' to check (compact_mlp.mlp_triton, bucket_mlp); config:
    overrides of CONFIG_KEYS (other keys ignored)."""
    _, D = x.shape
    F = w_gate.shape[0]
    G = F // group_size
    cfg = config_for(layout(w_down_nk), config)
    mask8 = _as_uint8(mask8)
    use_bucket = bucket is not None
    bk = bucket.contiguous() if use_bucket else mask8     # a pointer the kernels never read without BUCKET
    P = mask8.shape[0]
    gp2 = triton.next_power_of_2(G)
    h = alloc((F,), x.dtype, x.device)
    glist = alloc((G,), torch.int32, x.device)
    _launcher(_gate_up_gemv_kernel, wrap)[(triton.cdiv(F, cfg["gu_bn"]),)](
        x, w_gate, w_up, h, glist, mask8, bk, P, D, x.stride(1), w_gate.stride(0), w_gate.stride(1),
        w_up.stride(0), w_up.stride(1), G=G, GP2=gp2, GS=group_size, BN=cfg["gu_bn"], BK=cfg["gu_bk"],
        BUCKET=use_bucket, ACT=ACT_IDS[act], num_warps=cfg["gu_warps"], num_stages=cfg["gu_stages"])
    out = alloc((1, D), x.dtype, x.device)
    split = cfg["gd_split"]
    part = alloc((split, D), torch.float32, x.device) if split > 1 else out
    _launcher(_down_gemv_kernel, wrap)[(triton.cdiv(D, cfg["gd_bn"]), split)](
        h, w_down_nk, out, part, glist, mask8, bk, P, D, w_down_nk.stride(0), w_down_nk.stride(1),
        G=G, GP2=gp2, GS=group_size, BN=cfg["gd_bn"], BK=cfg["gd_bk"], SPLIT=split, BUCKET=use_bucket,
        num_warps=cfg["gd_warps"], num_stages=cfg["gd_stages"])
    if split > 1:
        bn = min(1024, triton.next_power_of_2(D))
        _launcher(_split_sum_kernel, wrap)[(triton.cdiv(D, bn),)](
            part, out, mask8, bk, P, D, G=G, GP2=gp2, SPLIT=split, BN=bn, BUCKET=use_bucket, num_warps=4)
    return out
