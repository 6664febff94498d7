"""The router inside the select: a split-bf16 linear router's logits, threshold and the group select of the tensor
it routes, in one launch.

Where a block runs its dense-masked path (kernels/dense_masked.py: every column computed, the inactive groups'
selected away before the reduction GEMM), the mask is read by one elementwise kernel only: the MLP's act(g) * u
select, or the select of o_proj's input. Unfused, the router is a GEMM launch of its own (router_fns.split_logits)
whose fp32 logits that select then reads. This kernel computes the logits of its own rows on tensor cores, from the
router input the block already holds (h @ [hi; lo]^T, fp32 accumulation, then hi + lo + bias, as split_logits) and
applies the threshold and the select in the same program: the routing adds no launch to the block.

Program (i, j): rows i BT .. i BT + BT - 1, columns j BN .. j BN + BN - 1. The logits of every group of its rows
([BT, BG], BG >= G) come from K steps of BK columns of h (two tl.dot, hi and lo); the programs of one row tile
recompute them (a [BT, D] x [D, 2 BG] product, small against the [BT, BN] tiles each one selects). The decisions
reach the columns through a second small dot: on [BT, BG] (0 / 1) times the one-hot [BG, BNS] of each column's
group gives each column's decision, exact in any float type, for any group size. The program then walks its
columns in sub-blocks of BNS, each a [BT, BNS] tile of a (and u) read only where its group is on.

Same semantics as dense_masked.gated_select_ref / _select on the mask router_fns.split_router_mask gives: inactive
groups are exactly 0 (a select: g, u, a of an inactive group are not read), act(g) * u in fp32, rounded once. The
logits are split_logits' up to the summation order of the fp32 dot (the products of bf16 values are exact in fp32).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..routing.router_fns import split_router_mask
from .activations import ACT_IDS, gated_act
from .dots import exact_dot
from .dense_masked import _select, gated_select_ref
from .reorder import _launcher, alloc
from .tuning import interpreting

ROWS = 32  # BT: rows per program (T = 2048: 64 row tiles)
COLS = 512  # BN: columns per program (SmolLM2's FFN, 1536 columns: 3 programs per row tile; its attention: 2)
SUB_COLS = 128  # BNS: columns per step inside a program
K_STEP = 64  # BK: columns of h per dot step


@triton.jit
def _routed_select_kernel(a_ptr, u_ptr, h_ptr, w_ptr, b_ptr, y_ptr, m_ptr, T, N, D, G, Gp,
                          stride_at, stride_ut, stride_ht, stride_wg, stride_yt, stride_mt,
                          GS: tl.constexpr, BT: tl.constexpr, BG: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
                          BNS: tl.constexpr, GLU: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
                          STORE_MASK: tl.constexpr, UPCAST: tl.constexpr):
    # a (GLU: the gate g), u: [T, N = G GS]; h: [T, D] bf16; w: [2 Gp, D] bf16 (hi rows, then lo rows); b: [G] fp32
    # y: [T, N] in a's dtype; m: [T, G] uint8, written by the first column program of each row tile (STORE_MASK)
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    rv = rows < T
    rows = rows.to(tl.int64)
    gi = tl.arange(0, BG)
    gv = gi < G
    acc_hi = tl.zeros((BT, BG), dtype=tl.float32)
    acc_lo = tl.zeros((BT, BG), dtype=tl.float32)
    for k0 in range(0, D, BK):
        kk = k0 + tl.arange(0, BK)
        kv = kk < D
        x = tl.load(h_ptr + rows[:, None] * stride_ht + kk[None, :], mask=rv[:, None] & kv[None, :], other=0.0)
        wmask = gv[None, :] & kv[:, None]
        w_hi = tl.load(w_ptr + gi[None, :] * stride_wg + kk[:, None], mask=wmask, other=0.0)  # [BK, BG]
        w_lo = tl.load(w_ptr + (Gp + gi)[None, :] * stride_wg + kk[:, None], mask=wmask, other=0.0)
        acc_hi = exact_dot(x, w_hi, acc_hi, UPCAST)
        acc_lo = exact_dot(x, w_lo, acc_lo, UPCAST)
    z = acc_hi + acc_lo  # split_logits' order: hi + lo, then the bias
    if HAS_BIAS:
        z = z + tl.load(b_ptr + gi, mask=gv, other=0.0)[None, :]
    on = (z > 0) & gv[None, :]  # [BT, BG]
    if STORE_MASK:
        if tl.program_id(1) == 0:
            tl.store(m_ptr + rows[:, None] * stride_mt + gi[None, :], on.to(tl.uint8), mask=rv[:, None] & gv[None, :])
    on_f = on.to(tl.float16)
    for c0 in range(0, BN, BNS):
        cols = tl.program_id(1) * BN + c0 + tl.arange(0, BNS)
        cv = cols < N
        onehot = ((cols[None, :] // GS) == gi[:, None]).to(tl.float16)  # [BG, BNS]: each column's group
        # [BT, BNS]: 1.0 where the column's group is on (one product of 1s in a sum of 0s: exact)
        col_on = exact_dot(on_f, onehot, tl.zeros((BT, BNS), dtype=tl.float32), UPCAST)
        keep = rv[:, None] & cv[None, :]
        ld = keep & (col_on > 0.5)
        av = tl.load(a_ptr + rows[:, None] * stride_at + cols[None, :], mask=ld, other=0.0)
        if GLU:
            uv = tl.load(u_ptr + rows[:, None] * stride_ut + cols[None, :], mask=ld, other=0.0)
            y = gated_act(av.to(tl.float32), uv.to(tl.float32), ACT).to(y_ptr.dtype.element_ty)
        else:
            y = av.to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + rows[:, None] * stride_yt + cols[None, :], tl.where(ld, y, 0.0).to(y_ptr.dtype.element_ty),
                 mask=keep)


def check_routed_select(a, u, h, w2, b, group_size: int, act: str) -> None:
    """One clear error for inputs the kernel cannot take."""
    if a.dim() != 2 or h.dim() != 2 or w2.dim() != 2 or a.shape[0] != h.shape[0]:
        raise ValueError(f"routed_select: expected a [T, N], h [T, D], w2 [2 Gp, D]; got {tuple(a.shape)}, "
                         f"{tuple(h.shape)}, {tuple(w2.shape)}")
    if u is not None and u.shape != a.shape:
        raise ValueError(f"routed_select: u {tuple(u.shape)} must have g's shape {tuple(a.shape)}")
    if w2.shape[1] != h.shape[1] or w2.shape[0] % 2:
        raise ValueError(f"routed_select: w2 {tuple(w2.shape)} must be a bf16 pair [2 Gp, D] over h's width "
                         f"{h.shape[1]} (routers.split_bf16)")
    if h.dtype != torch.bfloat16 or w2.dtype != torch.bfloat16:
        raise ValueError(f"routed_select: h and w2 must be bfloat16 (got {h.dtype}, {w2.dtype}): the pair's "
                         "products are exact in fp32 only for bf16 inputs")
    G = b.shape[0] if b is not None else w2.shape[0] // 2
    if G > w2.shape[0] // 2 or G * group_size != a.shape[1]:
        raise ValueError(f"routed_select: {G} groups of {group_size} columns do not cover a's {a.shape[1]} columns "
                         f"(or exceed the pair's {w2.shape[0] // 2} rows)")
    if act not in ACT_IDS:
        raise ValueError(f"routed_select: unknown activation {act!r}; choose one of {tuple(ACT_IDS)}")


def routed_select_ref(a, h, w2, b: Optional[torch.Tensor], group_size: int, u: Optional[torch.Tensor] = None,
                      act: str = "silu") -> torch.Tensor:
    """a [T, N], h [T, D], w2 [2 Gp, D], b [G] or None -> [T, N]: the mask split_router_mask(h, w2, b), then the
    select of a (u None) or act(a) * u selected (gated_select_ref)."""
    mask = split_router_mask(h, w2, b)
    return _select(a, mask, group_size) if u is None else gated_select_ref(a, u, mask, group_size, act)


def routed_select_triton(a, h, w2, b: Optional[torch.Tensor], group_size: int, u: Optional[torch.Tensor] = None,
                         act: str = "silu", wrap: bool = False, return_mask: bool = False, rows: int = ROWS,
                         cols: int = COLS, sub_cols: int = SUB_COLS, num_warps: int = 4):
    """routed_select_ref in one Triton launch; return_mask also returns the decisions [T, G] (uint8) the kernel
    took (tests compare them with the float64 logits). rows / cols: each program's tile; sub_cols: the columns of
    one step inside it (powers of two, sub_cols dividing cols)."""
    check_routed_select(a, u, h, w2, b, group_size, act)
    if cols % sub_cols or any(v & (v - 1) or v < 16 for v in (rows, sub_cols)):
        raise ValueError(f"routed_select: rows {rows} and sub_cols {sub_cols} must be powers of two >= 16 and "
                         f"sub_cols must divide cols {cols}")
    a = a if a.stride(-1) == 1 else a.contiguous()
    u = None if u is None else (u if u.stride(-1) == 1 else u.contiguous())
    h = h if h.stride(-1) == 1 else h.contiguous()
    w2 = w2.contiguous()
    T, N = a.shape
    D = h.shape[1]
    Gp = w2.shape[0] // 2
    G = b.shape[0] if b is not None else Gp
    y = alloc((T, N), a.dtype, a.device)
    m = alloc((T, G), torch.uint8, a.device) if return_mask else y
    if T > 0:
        bn = min(cols, triton.cdiv(N, sub_cols) * sub_cols)
        _launcher(_routed_select_kernel, wrap)[(triton.cdiv(T, rows), triton.cdiv(N, bn))](
            a, u if u is not None else a, h, w2, b if b is not None else w2, y, m, T, N, D, G, Gp,
            a.stride(0), (u if u is not None else a).stride(0), h.stride(0), w2.stride(0), y.stride(0),
            m.stride(0) if return_mask else 0,
            GS=group_size, BT=rows, BG=max(16, triton.next_power_of_2(G)),
            BK=max(16, min(K_STEP, triton.next_power_of_2(D))), BN=bn, BNS=sub_cols, GLU=u is not None,
            ACT=ACT_IDS[act], HAS_BIAS=b is not None, STORE_MASK=return_mask, UPCAST=interpreting(),
            num_warps=num_warps)
    return (y, m) if return_mask else y


def routed_select_dispatch(a, h, w2, b, group_size: int, u=None, act: str = "silu", wrap: bool = False):
    """The ops' body: the Triton kernel on CUDA, the reference elsewhere (the kernel tests run it on the CPU under
    the Triton interpreter through routed_select_triton)."""
    if a.device.type == "cuda":
        return routed_select_triton(a, h, w2, b, group_size, u, act, wrap=wrap)
    check_routed_select(a, u, h, w2, b, group_size, act)
    return routed_select_ref(a, h, w2, b, group_size, u, act)
