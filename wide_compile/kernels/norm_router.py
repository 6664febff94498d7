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

A linear router (and a pair router, which is one linear map: compose_pair; the pass composes it at compile time)
runs in one launch at any size: its rows split over S programs per token row (row_splits), each computing the
whole row's statistic, its own rows' logits over the whole width, and its slice of the normalized output; at
prefill (many token rows) one program per row. An "mlp" router has a SiLU between its layers, so it splits the
width instead (num_splits): S programs per row each compute the statistic and their columns' y and first-layer
sums, and a second launch adds the S partial sums and finishes the router. Either way the row is read from
memory once (the other reads hit L1/L2); at decode one program would leave the GPU idle while it reads the
router's weights.

The add form (``add_rmsnorm_router``) also takes the residual add that precedes a decoder block's norm:
x = a + b (rounded to a's dtype, as the model's own add), written out as the new residual stream, then the norm
and the router of x. Inductor fuses that add into its own norm kernel; a norm it cannot see into would leave the
add as one more launch per block, which at a small model's decode step costs more than routing saves.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .dots import exact_dot
from .reorder import _launcher
from .tuning import interpreting

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


def compose_pair(w1, b1, w2, b2):
    """A pair router as the linear map it is (no nonlinearity between its layers): margin = h @ W^T + c with
    W = (w2[1::2] - w2[0::2]) @ w1 [G, D] and c = (w2[1::2] - w2[0::2]) @ b1 + b2[1::2] - b2[0::2], composed in
    float64 and stored fp32. Its logits differ from the two-layer form's by rounding only."""
    d = w2[1::2].double() - w2[0::2].double()                      # [G, R]: execute minus skip
    W = d @ w1.double()
    c = torch.zeros(W.shape[0], dtype=torch.float64, device=W.device)
    if b1 is not None:
        c += d @ b1.double()
    if b2 is not None:
        c += b2[1::2].double() - b2[0::2].double()
    return W.float(), c.float()


def rmsnorm_router_ref(x, w_norm, eps: float, router_input: str, kind: str, w1, b1, w2=None, b2=None):
    """x [T, D] -> (y [T, D] in x's dtype, mask [T, G] bool): the norm, then the router on y or on x."""
    y = rmsnorm_ref(x, w_norm, eps)
    h = y if router_input == "normed" else x
    return y, router_logits_ref(h, kind, w1, b1, w2, b2) > 0


def add_rmsnorm_router_ref(a, b, w_norm, eps: float, router_input: str, kind: str, w1, b1, w2=None, b2=None):
    """a, b [T, D] -> (x = a + b [T, D], y, mask): the residual add, then rmsnorm_router_ref of x."""
    x = a + b
    return (x, *rmsnorm_router_ref(x, w_norm, eps, router_input, kind, w1, b1, w2, b2))


# ----------------------------------------------------------------------------- Triton

@triton.jit
def _load_row(x_ptr, r_ptr, off, dv, HAS_ADD: tl.constexpr):
    # the block's input over one column tile: x, or x + r rounded to x's dtype (the model's residual add)
    xin = tl.load(x_ptr + off, mask=dv, other=0.0)
    if HAS_ADD:
        rin = tl.load(r_ptr + off, mask=dv, other=0.0)
        xin = (xin.to(tl.float32) + rin.to(tl.float32)).to(xin.dtype)
    return xin


@triton.jit
def _store_mask(acc, row, r, rv, m_ptr, b1_ptr, w2_ptr, b2_ptr, R: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                KIND: tl.constexpr, HAS_B1: tl.constexpr, HAS_B2: tl.constexpr):
    # acc [RP]: the router's first layer without its bias -> the row's mask (logits > 0)
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


@triton.jit
def _row_rstd(x_ptr, r_ptr, row, stride_x, D, eps, BD: tl.constexpr, HAS_ADD: tl.constexpr):
    # 1 / RMS of the block's input row (x, or x + r), in fp32: each program of a split reads the row (L2 keeps it)
    offs = tl.arange(0, BD)
    ss = tl.zeros([BD], dtype=tl.float32)
    for d0 in range(0, D, BD):
        d = d0 + offs
        xv = _load_row(x_ptr, r_ptr, row * stride_x + d, d < D, HAS_ADD).to(tl.float32)
        ss += xv * xv
    return tl.rsqrt(tl.sum(ss, axis=0) / D + eps)


@triton.jit
def _norm_tile(x_ptr, r_ptr, xs_ptr, nw_ptr, y_ptr, row, stride_x, stride_y, d, dv, own, rstd,
               RESIDUAL: tl.constexpr, HAS_ADD: tl.constexpr):
    # one column tile: the norm output (and the sum) stored where `own`, and the router's input h in fp32
    xin = _load_row(x_ptr, r_ptr, row * stride_x + d, dv, HAS_ADD)
    if HAS_ADD:
        tl.store(xs_ptr + row * stride_x + d, xin, mask=own)
    xn = (xin.to(tl.float32) * rstd).to(xin.dtype)
    nw = tl.load(nw_ptr + d, mask=dv, other=0.0)
    y = (nw.to(tl.float32) * xn.to(tl.float32)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * stride_y + d, y, mask=own)
    if RESIDUAL:
        h = xin.to(tl.float32)
    else:
        h = y.to(tl.float32)
    return h


@triton.jit
def _rmsnorm_router_kernel(x_ptr, r_ptr, xs_ptr, nw_ptr, y_ptr, m_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, part_ptr,
                           D, split_d, stride_x, stride_y, eps,
                           R: tl.constexpr, G: tl.constexpr, RP: tl.constexpr, GP: tl.constexpr,
                           BD: tl.constexpr, S: tl.constexpr, KIND: tl.constexpr, RESIDUAL: tl.constexpr,
                           HAS_B1: tl.constexpr, HAS_B2: tl.constexpr, HAS_ADD: tl.constexpr):
    # program (row, s): the norm and the router's first layer over columns [s * split_d, (s + 1) * split_d);
    # HAS_ADD: the input is x + r (r and the sum xs share x's row stride), and this program writes its columns of
    # the sum
    # Inductor types a Python float argument of a user kernel as fp64: the statistic stays fp32 as in HF
    eps = tl.cast(eps, tl.float32)
    row = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    offs = tl.arange(0, BD)
    rstd = _row_rstd(x_ptr, r_ptr, row, stride_x, D, eps, BD, HAS_ADD)
    # y over this program's columns, and the router's first layer over h (y or x): acc [RP] = w1 @ h
    r = tl.arange(0, RP)
    rv = r < R
    acc = tl.zeros([RP], dtype=tl.float32)
    lo = s * split_d
    hi = tl.minimum(lo + split_d, D)
    for d0 in range(lo, hi, BD):
        d = d0 + offs
        dv = d < hi
        h = _norm_tile(x_ptr, r_ptr, xs_ptr, nw_ptr, y_ptr, row, stride_x, stride_y, d, dv, dv, rstd, RESIDUAL,
                       HAS_ADD)
        w = tl.load(w1_ptr + r[:, None] * D + d[None, :], mask=rv[:, None] & dv[None, :], other=0.0)
        acc += tl.sum(w * h[None, :], axis=1)
    if S == 1:  # the whole row in one program: the logits and the mask here
        _store_mask(acc, row, r, rv, m_ptr, b1_ptr, w2_ptr, b2_ptr, R, G, GP, KIND, HAS_B1, HAS_B2)
    else:  # partial sums [T, S, RP] for _router_finish_kernel
        tl.store(part_ptr + (row * S + s) * RP + r, acc)


@triton.jit
def _rmsnorm_router_rows_kernel(x_ptr, r_ptr, xs_ptr, nw_ptr, y_ptr, m_ptr, w_ptr, b_ptr, D, cols, stride_x, stride_y,
                                eps, G: tl.constexpr, GB: tl.constexpr, BD: tl.constexpr, RESIDUAL: tl.constexpr,
                                HAS_B: tl.constexpr, HAS_ADD: tl.constexpr):
    # program (row, s) of a linear router: the whole row's statistic, the logits of router rows
    # [s * GB, (s + 1) * GB) over the whole width, and the norm output (and the sum) of columns
    # [s * cols, (s + 1) * cols)
    eps = tl.cast(eps, tl.float32)
    row = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    offs = tl.arange(0, BD)
    rstd = _row_rstd(x_ptr, r_ptr, row, stride_x, D, eps, BD, HAS_ADD)
    g = s * GB + tl.arange(0, GB)
    gv = g < G
    acc = tl.zeros([GB], dtype=tl.float32)
    lo = s * cols
    for d0 in range(0, D, BD):
        d = d0 + offs
        dv = d < D
        own = dv & (d >= lo) & (d < lo + cols)
        h = _norm_tile(x_ptr, r_ptr, xs_ptr, nw_ptr, y_ptr, row, stride_x, stride_y, d, dv, own, rstd, RESIDUAL,
                       HAS_ADD)
        w = tl.load(w_ptr + g[:, None] * D + d[None, :], mask=gv[:, None] & dv[None, :], other=0.0)
        acc += tl.sum(w * h[None, :], axis=1)
    if HAS_B:
        acc += tl.load(b_ptr + g, mask=gv, other=0.0)
    tl.store(m_ptr + row * G + g, acc > 0, mask=gv)


@triton.jit
def _router_tile_dot(acc, h, w_ptr, g, gv, d, dv, D, SPLIT_BF16: tl.constexpr, UPCAST: tl.constexpr):
    # acc [BT, BG] += h [BT, BD] @ w[g, d]^T, the fp32 weight tile [BD, BG] read once for the BT rows.
    # SPLIT_BF16 (bf16 h): two bf16 tensor-core dots over the tile held as a bf16 pair hi + lo (about 16 mantissa
    # bits; a bf16 x bf16 product is exact in fp32), the arithmetic of split_routers' GEMM; else one fp32 dot.
    # UPCAST: under the Triton CPU interpreter (dots.exact_dot)
    wt = tl.load(w_ptr + g[None, :] * D + d[:, None], mask=dv[:, None] & gv[None, :], other=0.0)
    if SPLIT_BF16:
        hi = wt.to(tl.bfloat16)
        lo = (wt - hi.to(tl.float32)).to(tl.bfloat16)
        hb = h.to(tl.bfloat16)
        acc = exact_dot(hb, hi, acc, UPCAST)
        acc = exact_dot(hb, lo, acc, UPCAST)
    else:
        acc = tl.dot(h.to(tl.float32), wt, acc, input_precision="ieee")
    return acc


@triton.jit
def _rmsnorm_router_tiles_kernel(x_ptr, r_ptr, xs_ptr, nw_ptr, y_ptr, m_ptr, w_ptr, b_ptr, T, D, stride_x, stride_y,
                                 eps, G: tl.constexpr, BT: tl.constexpr, BG: tl.constexpr, BD: tl.constexpr,
                                 RESIDUAL: tl.constexpr, HAS_B: tl.constexpr, HAS_ADD: tl.constexpr,
                                 SPLIT_BF16: tl.constexpr, UPCAST: tl.constexpr, ONE_PASS: tl.constexpr,
                                 DOT_BD: tl.constexpr):
    # program (row tile, router tile) of a linear router at prefill: rows [i * BT, (i + 1) * BT), router rows
    # [j * BG, (j + 1) * BG). Every program computes its rows' statistic; the programs of router tile 0 write the
    # norm output (and the sum). Pass 1 reads the rows for the statistic (and a residual router's dots), pass 2
    # (L2) for the norm output (and a normed router's dots, which need the statistic first). ONE_PASS (BD >= D:
    # a narrow model's whole rows in one tile): pass 1 is one read of the whole row tile, pass 2 (every router's
    # dots) steps of DOT_BD; otherwise DOT_BD is BD
    eps = tl.cast(eps, tl.float32)
    rows = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    rv = rows < T
    g = tl.program_id(1) * BG + tl.arange(0, BG)
    gv = g < G
    offs = tl.arange(0, BD)
    ss = tl.zeros([BT], dtype=tl.float32)
    acc = tl.zeros([BT, BG], dtype=tl.float32)
    if ONE_PASS:
        # the statistic from one read of the whole row tile (one wait on loads instead of one per column step); the
        # norm output and every router's dots then in column steps of DOT_BD (L1 / L2 hits), which keep the weight
        # tile small
        dv = offs < D
        xin = _load_row(x_ptr, r_ptr, rows[:, None] * stride_x + offs[None, :], rv[:, None] & dv[None, :], HAS_ADD)
        xf = xin.to(tl.float32)
        ss = tl.sum(xf * xf, axis=1)
    else:
        for d0 in range(0, D, BD):
            d = d0 + offs
            dv = d < D
            xin = _load_row(x_ptr, r_ptr, rows[:, None] * stride_x + d[None, :], rv[:, None] & dv[None, :], HAS_ADD)
            xf = xin.to(tl.float32)
            ss += tl.sum(xf * xf, axis=1)
            if RESIDUAL:
                acc = _router_tile_dot(acc, xin, w_ptr, g, gv, d, dv, D, SPLIT_BF16, UPCAST)
    rstd = tl.rsqrt(ss / D + eps)[:, None]
    offk = tl.arange(0, DOT_BD)
    col0 = tl.zeros([BT, DOT_BD], dtype=tl.int64)  # _norm_tile's column offsets as a full [BT, DOT_BD] tile
    if RESIDUAL and not ONE_PASS:  # the dots are done: router tile 0 writes the norm output
        if tl.program_id(1) == 0:
            for d0 in range(0, D, DOT_BD):
                d = col0 + (d0 + offk)[None, :]
                m = rv[:, None] & (d < D)
                _norm_tile(x_ptr, r_ptr, xs_ptr, nw_ptr, y_ptr, rows[:, None], stride_x, stride_y, d, m, m, rstd,
                           RESIDUAL, HAS_ADD)
    else:
        for d0 in range(0, D, DOT_BD):
            d = d0 + offk
            dk = d < D  # [DOT_BD]: pass 1's dv may be a whole row's
            m = rv[:, None] & dk[None, :]
            h = _norm_tile(x_ptr, r_ptr, xs_ptr, nw_ptr, y_ptr, rows[:, None], stride_x, stride_y, col0 + d[None, :],
                           m, m & (col0 == tl.program_id(1)), rstd, RESIDUAL, HAS_ADD)
            acc = _router_tile_dot(acc, h, w_ptr, g, gv, d, dk, D, SPLIT_BF16, UPCAST)
    if HAS_B:
        acc += tl.load(b_ptr + g, mask=gv, other=0.0)[None, :]
    tl.store(m_ptr + rows[:, None] * G + g[None, :], acc > 0, mask=rv[:, None] & gv[None, :])


@triton.jit
def _router_finish_kernel(part_ptr, m_ptr, b1_ptr, w2_ptr, b2_ptr,
                          R: tl.constexpr, G: tl.constexpr, RP: tl.constexpr, GP: tl.constexpr,
                          S: tl.constexpr, SP: tl.constexpr, KIND: tl.constexpr,
                          HAS_B1: tl.constexpr, HAS_B2: tl.constexpr):
    # program (row,): the S partial first-layer sums, then the logits and the mask
    row = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, RP)
    rv = r < R
    sp = tl.arange(0, SP)
    part = tl.load(part_ptr + (row * S + sp)[:, None] * RP + r[None, :], mask=(sp < S)[:, None], other=0.0)
    _store_mask(tl.sum(part, axis=0), row, r, rv, m_ptr, b1_ptr, w2_ptr, b2_ptr, R, G, GP, KIND, HAS_B1, HAS_B2)


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


def check_residual(x, r) -> None:
    """One ValueError unless the residual term r has x's shape and dtype (the add form's two terms)."""
    if r.shape != x.shape or r.dtype != x.dtype:
        raise ValueError(f"add_rmsnorm_router: the residual must match x, got {tuple(r.shape)} {r.dtype} against "
                         f"{tuple(x.shape)} {x.dtype}")


# One program per row reads the router's first layer (w1: R x D fp32) alone: at decode that is one SM pulling
# up to a couple of MB (8B shape, 112 linear groups: 1.8 MB), latency-bound. An "mlp" router above this many w1
# bytes per row splits its width over programs until about SPLIT_PROGRAMS programs run, and a second launch adds
# their partial sums (a static function of the shapes and the device, so a CUDA graph replays the same grids); a
# linear router's rows spread at any size (row_splits).
SPLIT_MIN_BYTES = 64 * 1024
SPLIT_PROGRAMS = 256


def num_splits(T: int, D: int, R: int, BD: int, split: Optional[int] = None) -> tuple[int, int]:
    """(S, split_d): programs per row and the columns each covers (a multiple of BD)."""
    blocks = triton.cdiv(D, BD)
    if split is None:
        split = 1 if R * D * 4 < SPLIT_MIN_BYTES else max(1, SPLIT_PROGRAMS // max(T, 1))
    S = max(1, min(split, blocks))
    split_d = triton.cdiv(blocks, S) * BD
    return triton.cdiv(D, split_d), split_d


def row_splits(T: int, D: int, G: int, split: Optional[int] = None) -> tuple[int, int]:
    """(S, GB) of a linear router: S programs per token row, GB router rows each (a power of two), until about
    SPLIT_PROGRAMS programs run, whatever the router's size (`split` forces the programs per row, for tests).
    Splitting rows costs no second launch (each program reads the whole row for its logits and writes its own
    columns of the norm), so even a small router spreads: one program reading SmolLM2's 24 x 576 fp32 router alone
    was slower than the unfused norm and router it replaces (results/lean-h100, the fourth run's profile)."""
    if split is None:
        split = max(1, SPLIT_PROGRAMS // max(T, 1))
    GB = triton.next_power_of_2(triton.cdiv(G, max(1, min(split, G))))
    return triton.cdiv(G, GB), GB


# From this many token rows on (a prefill), a linear router runs as tiles of rows (_rmsnorm_router_tiles_kernel): the
# one-program-per-row form reads the router's whole weight once per row, which at 2048 rows of SmolLM2's FFN router
# (24 x 576 fp32) is over 100 MB from L2 per launch, where the tiles read it once per tile of rows and run the
# router's dots on tensor cores (bf16 inputs).
TILE_MIN_T = 128
TILE_ROWS = (16, 32)
TILE_PROGRAMS = 256
# A bf16 row of at most this many columns (rounded up to a power of two) can be one column tile (ONE_PASS): pass 1
# reads the whole row tile once for the statistic instead of in column steps that each wait on their loads; pass 2
# (the norm output and the dots) keeps column steps of DOT_STEP, because dots over a whole-row tile put the [BD, BG]
# weight tile and the rows on a local-memory stack when compiled for sm_90 (benchmarks/results/lean-h100/README.md,
# seventh run). Only a forced tile takes it (the sweeps), until it is timed.
DOT_STEP = 64
ONE_PASS_D = 1024


def tile_sizes(T: int, D: int, G: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BT, BG, BD) of the tiles form: BG router rows (16 to 64: a dot's smallest and a register tile's largest);
    BT rows, 32 where that still gives about TILE_PROGRAMS programs, else 16 (a small router's tiles are the rows
    alone: SmolLM2's 2048 rows are 64 programs of 32); BD columns per step (fp32 rows and fp32 dots take twice the
    registers of bf16 ones)."""
    BG = max(16, min(64, triton.next_power_of_2(G)))
    BT = TILE_ROWS[1] if triton.cdiv(T, TILE_ROWS[1]) * triton.cdiv(G, BG) >= TILE_PROGRAMS else TILE_ROWS[0]
    BD = max(16, min(triton.next_power_of_2(D), 64 if dtype in (torch.bfloat16, torch.float16) else 32))
    return BT, BG, BD


def tile_warps(BT: int, BG: int, BD: int) -> int:
    # 8 warps where the accumulator or a one-pass row tile would crowd 4 warps' registers
    return 4 if BT * BG <= 2048 and BT * BD <= 8192 else 8


def _launch_tiles(x, r, xs, y, mask, w_norm, eps, router_input, w, b, wrap, tile=None):
    # a linear router at prefill: programs over (row tiles, router tiles), one launch; tile: (BT, BG), or
    # (BT, BG, BD) or (BT, BG, BD, warps), forced
    T, D = x.shape
    G = w.shape[0]
    BT, BG, BD = tile_sizes(T, D, G, x.dtype)
    warps = None
    if tile is not None:
        BT, BG, *rest = tile
        if min(BT, BG) < 16 or BT & (BT - 1) or BG & (BG - 1):
            raise ValueError(f"rmsnorm_router: tile (rows, router rows) must be powers of two >= 16, got {tile}")
        if rest:
            BD, *warps = rest
            warps = warps[0] if warps else None
            if BD < 16 or BD & (BD - 1):
                raise ValueError(f"rmsnorm_router: a tile's column step must be a power of two >= 16, got {tile}")
    _launcher(_rmsnorm_router_tiles_kernel, wrap)[(triton.cdiv(T, BT), triton.cdiv(G, BG))](
        x, r if r is not None else x, xs if xs is not None else y, w_norm.contiguous(), y, mask, w.contiguous(),
        b if b is not None else w, T, D, x.stride(0), y.stride(0), float(eps), G=G, BT=BT, BG=BG, BD=BD,
        RESIDUAL=router_input == "residual", HAS_B=b is not None, HAS_ADD=r is not None,
        SPLIT_BF16=x.dtype == torch.bfloat16, UPCAST=interpreting(), ONE_PASS=BD >= D,
        DOT_BD=min(BD, DOT_STEP) if BD >= D else BD,
        num_warps=warps or tile_warps(BT, BG, BD))


def _launch_rows(x, r, xs, y, mask, w_norm, eps, router_input, w, b, wrap, split, block_d):
    # a linear router: one launch, its rows over S programs per token row
    T, D = x.shape
    G = w.shape[0]
    S, GB = row_splits(T, D, G, split)
    BD = block_d or max(16, min(triton.next_power_of_2(D), 8192 // GB))  # the w tile [GB, BD] in registers
    _launcher(_rmsnorm_router_rows_kernel, wrap)[(T, S)](
        x, r if r is not None else x, xs if xs is not None else y, w_norm.contiguous(), y, mask, w.contiguous(),
        b if b is not None else w, D, triton.cdiv(D, S), x.stride(0), y.stride(0), float(eps), G=G, GB=GB, BD=BD,
        RESIDUAL=router_input == "residual", HAS_B=b is not None, HAS_ADD=r is not None,
        num_warps=4 if GB * BD <= 4096 else 8)


def _launch(x, r, w_norm, eps: float, router_input: str, kind: str, w1, b1, w2, b2, wrap: bool,
            split: Optional[int], block_d: Optional[int], tiles: Optional[bool] = None, tile=None):
    # (x + r or None, y, mask): the kernel on x's rows, with the residual add when r is given; tiles: a linear
    # router's form (None: the tiles from TILE_MIN_T rows on); tile: the tiles form's (BT, BG)
    T, D = x.shape
    G = check_router(kind, router_input, D, w1, b1, w2, b2)
    R = w1.shape[0]
    x = x.contiguous()
    xs = None
    if r is not None:
        check_residual(x, r)
        r = r.contiguous()
        xs = torch.empty_like(x)
    y = torch.empty((T, D), dtype=x.dtype, device=x.device)
    mask = torch.empty((T, G), dtype=torch.bool, device=x.device)
    if kind == "linear":
        if (T >= TILE_MIN_T and split is None) if tiles is None else tiles:
            _launch_tiles(x, r, xs, y, mask, w_norm, eps, router_input, w1, b1, wrap, tile)
        else:
            _launch_rows(x, r, xs, y, mask, w_norm, eps, router_input, w1, b1, wrap, split, block_d)
        return xs, y, mask
    RP, GP = triton.next_power_of_2(R), triton.next_power_of_2(G)
    BD = block_d or max(16, min(triton.next_power_of_2(D), 8192 // RP))  # the w1 tile [RP, BD] in registers
    S, split_d = num_splits(T, D, R, BD, split)
    part = torch.empty((T, S, RP), dtype=torch.float32, device=x.device) if S > 1 else mask
    w1c, w2_ = w1.contiguous(), (w2.contiguous() if w2 is not None else w1)
    b1_, b2_ = (b1 if b1 is not None else w1), (b2 if b2 is not None else w1)
    flags = dict(R=R, G=G, RP=RP, GP=GP, KIND=_KIND_IDS[kind], HAS_B1=b1 is not None, HAS_B2=b2 is not None)
    _launcher(_rmsnorm_router_kernel, wrap)[(T, S)](
        x, r if r is not None else x, xs if xs is not None else y, w_norm.contiguous(), y, mask, w1c, b1_, w2_, b2_,
        part, D, split_d, x.stride(0), y.stride(0), float(eps), BD=BD, S=S, RESIDUAL=router_input == "residual",
        HAS_ADD=r is not None, num_warps=4 if RP * BD <= 4096 else 8, **flags)
    if S > 1:
        _launcher(_router_finish_kernel, wrap)[(T,)](part, mask, b1_, w2_, b2_, S=S,
                                                     SP=triton.next_power_of_2(S), num_warps=4, **flags)
    return xs, y, mask


def rmsnorm_router_triton(x, w_norm, eps: float, router_input: str, kind: str, w1, b1=None, w2=None, b2=None,
                          wrap: bool = False, split: Optional[int] = None, block_d: Optional[int] = None,
                          tiles: Optional[bool] = None, tile=None):
    """x [T, D] (any float dtype), w_norm [D] -> (y [T, D] in x's dtype, mask [T, G] bool): one launch, or two
    where w1 is large (num_splits; `split` forces the programs per row and `block_d` the column tile, for
    tests). A linear router from TILE_MIN_T rows on runs as tiles of rows, its dots on tensor cores where x is bf16
    (`tiles` forces the form and `tile` its (rows, router rows) per program, for tests and sweeps)."""
    _, y, mask = _launch(x, None, w_norm, eps, router_input, kind, w1, b1, w2, b2, wrap, split, block_d, tiles,
                         tile)
    return y, mask


def add_rmsnorm_router_triton(a, b, w_norm, eps: float, router_input: str, kind: str, w1, b1=None, w2=None,
                              b2=None, wrap: bool = False, split: Optional[int] = None,
                              block_d: Optional[int] = None, tiles: Optional[bool] = None, tile=None):
    """a, b [T, D] (one dtype) -> (x = a + b, y = RMSNorm(x), mask = router(y or x)): the residual add in the
    same launch(es) as rmsnorm_router_triton."""
    return _launch(a, b, w_norm, eps, router_input, kind, w1, b1, w2, b2, wrap, split, block_d, tiles, tile)


def rmsnorm_router_dispatch(x, w_norm, eps, router_input, kind, w1, b1: Optional[torch.Tensor] = None,
                            w2: Optional[torch.Tensor] = None, b2: Optional[torch.Tensor] = None, wrap=False):
    """The Triton kernel on CUDA, the reference elsewhere (the op's body, norm_router_ops.py)."""
    if x.device.type == "cuda":
        return rmsnorm_router_triton(x, w_norm, eps, router_input, kind, w1, b1, w2, b2, wrap=wrap)
    check_router(kind, router_input, x.shape[1], w1, b1, w2, b2)
    return rmsnorm_router_ref(x, w_norm, eps, router_input, kind, w1, b1, w2, b2)


def add_rmsnorm_router_dispatch(a, b, w_norm, eps, router_input, kind, w1, b1: Optional[torch.Tensor] = None,
                                w2: Optional[torch.Tensor] = None, b2: Optional[torch.Tensor] = None, wrap=False):
    """add_rmsnorm_router's body: the Triton kernel on CUDA, the reference elsewhere."""
    if a.device.type == "cuda":
        return add_rmsnorm_router_triton(a, b, w_norm, eps, router_input, kind, w1, b1, w2, b2, wrap=wrap)
    check_router(kind, router_input, a.shape[1], w1, b1, w2, b2)
    check_residual(a, b)
    return add_rmsnorm_router_ref(a, b, w_norm, eps, router_input, kind, w1, b1, w2, b2)
