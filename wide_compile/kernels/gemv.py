"""One token (a batch-1 decode step) as GEMVs over the token's active groups, at the bandwidth limit: the MLP,
q_proj and o_proj of wide.mlp / wide.q_proj / wide.o_proj and their bucketed twins.

Semantics: exactly the references (reference.mlp_ref / q_proj_ref / o_proj_ref) for T = 1, with the token's mask
row either given (free masks: ``mask [1, G]``) or picked from a prototype table (structured masks:
``protos[bucket[0]]``). Reduction-side weights are read as W[d, k] with any strides (down_proj.weight /
o_proj.weight as they are, or the free ops' transposed copies):

    MLP:    x [1, D], w_gate / w_up [F, D], W [D, F] -> W[:, active] @ (act(x Wg[active]^T) * (x Wu[active]^T))
    q_proj: x [1, D], w_q [Nq, D], b_q -> x W_q^T + b on the active groups' columns, exactly 0 on the others
    o_proj: a [1, Nq], W [D, Nq], b_o -> W[:, active] @ a[active] + b_o

At one token every weight byte is used once, so the work is reading the active groups' weights, nothing else,
in as few launches as possible:

1. ``_gemv_n_kernel`` (grouped output columns). Gated (gate/up): program n owns compact columns
   [n BN, (n + 1) BN) of the token's active groups (compact column c = column c % GS of the (c // GS)-th active
   group, found from the mask row in registers: no reorder launch), streams those gate and up weight rows once
   over D with fp32 products, and writes h[c] = act(g) * u rounded to x's dtype, plus each of its groups' id into
   the group list; programs past the active width exit at once. Not gated (q_proj): program n owns full-width
   columns [n BN, (n + 1) BN) and writes zeros for the inactive groups' columns without reading their weights.
2. ``_gemv_k_kernel`` (grouped reduction): program (n, s) owns output columns [n BN, (n + 1) BN) and every
   SPLIT-th K tile of the compact range (the active groups' columns of W: from the group list after the gated
   kernel, else found in registers); SPLIT = 1 writes the output, else fp32 partials [SPLIT, N] that
   ``_split_sum_kernel`` adds up (no atomics, no zero fill). The bias is added once.
A prototype id outside [0, P) gives a NaN output row (as the bucketed references); an all-off mask gives exact
zeros (plus the o_proj bias). The tiles carry no tensor-core constraint (no tl.dot): products and sums in fp32
registers.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Optional

import torch
import triton
import triton.language as tl

from .activations import ACT_IDS, gated_act
from .reorder import _mask_bytes, _launcher, alloc
from .tuning import cuda_device_key, interpreting

# Built-in tiles per device class and per layout of the reduction-side weight ("k_contiguous": W[d, k] rows
# contiguous over k, as down_proj.weight / o_proj.weight; "d_contiguous": the transposed copies the free ops hold).
# gu_* tile the grouped-output kernel (BN columns x BK of D), gd_* the reduction kernel (BN output columns x BK
# compact K, SPLIT slices). A GPU with a tuned file (configs/gemv/<GPU name>.json, written by
# benchmarks/bench_gemv.py --write-config from its sweep) takes its tiles per kernel from there; these are the
# fallback. The CUDA tiles are the best of bench_bucket_mlp.py --sweep's GEMV_SWEEP rows on an H200
# (benchmarks/results/one-token-h200/): small programs win because these loads are not pipelined, so the programs
# in flight hide the latency; the k_contiguous reduction tile (one launch: no split over K) is the H100 sweep's best
# for down_proj (benchmarks/results/gemv-h100/), the layout one-token graphs read (passes/base.reduction_weight).
# gu_prefetch / gd_prefetch = 1 issue each K tile's loads one iteration ahead (register
# double buffering: Triton does not pipeline loads that feed no tl.dot), so a program keeps two tiles in flight; the
# interpreter runs that form by default and the tests run both.
CONFIGS = {
    "cuda": {
        "k_contiguous": dict(gu_bn=8, gu_bk=256, gu_warps=2, gu_stages=3, gu_prefetch=0, gd_bn=4, gd_bk=512,
                             gd_split=1, gd_warps=2, gd_stages=3, gd_prefetch=1),
        "d_contiguous": dict(gu_bn=8, gu_bk=256, gu_warps=2, gu_stages=3, gu_prefetch=0, gd_bn=64, gd_bk=128,
                             gd_split=16, gd_warps=8, gd_stages=3, gd_prefetch=0),
    },
    "interpreter": dict(gu_bn=8, gu_bk=16, gu_warps=1, gu_stages=1, gu_prefetch=1, gd_bn=8, gd_bk=16, gd_split=2,
                        gd_warps=1, gd_stages=1, gd_prefetch=1),
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
        dict(gu_bn=8, gu_bk=256, gu_warps=2, gu_prefetch=1, gd_bn=8, gd_bk=256, gd_split=8, gd_warps=2,
             gd_prefetch=1),
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


def layout(w_nk: torch.Tensor) -> str:
    """A reduction-side weight's layout as W[d, k]: rows contiguous over k (the Linear's weight) or columns over d
    (its transposed copy)."""
    return "k_contiguous" if w_nk.stride(1) == 1 else "d_contiguous"


# A tuned file's entries: which of its kernels' tiles each op takes (gated kernel keys gu_*, reduction keys gd_*,
# the reduction per layout), per op.
TUNED_DIR = Path(__file__).with_name("configs") / "gemv"
TUNED_KERNELS = {"mlp": ("gate_up", "down"), "q_proj": ("q_proj", None), "o_proj": (None, "o_proj")}
LAYOUTS = ("k_contiguous", "d_contiguous")


@functools.lru_cache(maxsize=None)
def _tuned_file(key: str) -> dict:
    """The tuned tiles of a GPU by its device_key ({} without a file), checked: every entry names only GEMV keys."""
    path = TUNED_DIR / f"{key}.json"
    if not path.exists():
        return {}
    with open(path) as f:
        d = json.load(f)
    entries = [d.get("gate_up", {}), d.get("q_proj", {})]
    entries += [d.get(k, {}).get(lay, {}) for k in ("down", "o_proj") for lay in LAYOUTS]
    bad = sorted({k for e in entries for k in e if k not in CONFIG_KEYS})
    if bad:
        raise ValueError(f"{path}: unknown GEMV config keys {bad}; the keys are {CONFIG_KEYS} (regenerate the file "
                         "with benchmarks/bench_gemv.py --write-config)")
    return d


def tuned(op: str, kind: str, device=None) -> dict:
    """The tuned file's tiles for `op` ("mlp", "q_proj", "o_proj") with a reduction weight of layout `kind` on
    `device` (default: the current CUDA device): {} under the interpreter, without a GPU or without a file."""
    key = None if interpreting() else cuda_device_key(device)
    if key is None:
        return {}
    d = _tuned_file(key)
    n_kernel, k_kernel = TUNED_KERNELS[op]
    out = dict(d.get(n_kernel, {})) if n_kernel else {}
    if k_kernel:
        out.update(d.get(k_kernel, {}).get(kind, {}))
    return out


def config_for(kind: str, overrides: Optional[dict] = None, op: str = "mlp", device=None) -> dict:
    """The tile config of `op` for a reduction weight of layout `kind`: the built-in tiles (the interpreter's under
    TRITON_INTERPRET=1), then the GPU's tuned file (`tuned`), then the `overrides` that name GEMV keys (other
    keys are the callers' own and pass by)."""
    if op not in TUNED_KERNELS:
        raise ValueError(f"one-token GEMV config: op must be one of {tuple(TUNED_KERNELS)}, got {op!r}")
    cfg = dict(CONFIGS["interpreter"] if interpreting() else CONFIGS["cuda"][kind])
    cfg.update(tuned(op, kind, device))
    cfg.update({k: v for k, v in (overrides or {}).items() if k in CONFIG_KEYS})
    for k in ("gu_bn", "gu_bk", "gd_bn", "gd_bk", "gd_split"):
        if cfg[k] < 1 or cfg[k] & (cfg[k] - 1):
            raise ValueError(f"one-token GEMV config: {k} must be a power of two, got {cfg[k]}")
    return cfg


# ----------------------------------------------------------------------------- kernels

@triton.jit
def _mask_row(mask_ptr, bucket_ptr, P, G: tl.constexpr, BUCKET: tl.constexpr):
    # (pointer to the token's mask row, the value its outputs get added: 0, or NaN for a prototype id outside
    # [0, P))
    if BUCKET:
        b = tl.load(bucket_ptr).to(tl.int64)
        ok = (b >= 0) & (b < P)
        row = mask_ptr + tl.where(ok, b, 0) * G
        fill = tl.where(ok, 0.0, float("nan"))
    else:
        row = mask_ptr
        fill = 0.0
    return row, fill


@triton.jit
def _row_bits(row, G: tl.constexpr, GP2: tl.constexpr):
    # the mask row as int32 [GP2] (0 past G) and each group's index among the active ones: read once per program
    gs = tl.arange(0, GP2)
    act = (tl.load(row + gs, mask=gs < G, other=0) != 0).to(tl.int32)
    return act, tl.cumsum(act, axis=0) - act


@triton.jit
def _nth_active(act, excl, j, GP2: tl.constexpr):
    # the j-th active group of the row (_row_bits' act, excl), for each j of a vector ([n] -> [n])
    gs = tl.arange(0, GP2)
    hit = (act[None, :] != 0) & (excl[None, :] == j[:, None])           # [n, GP2]
    return tl.sum(tl.where(hit, gs[None, :], 0), axis=1)


@triton.jit
def _n_tile(w1_rows, w2_rows, on, k0, D, stride_w1k, stride_w2k, BK: tl.constexpr, GATED: tl.constexpr):
    # the [BN, BK] weight tiles at D offset k0 (nothing read past D or on columns that are off); w2's is w1's
    # when not gated
    k = k0 + tl.arange(0, BK)
    wm = on[:, None] & (k < D)[None, :]
    w1 = tl.load(w1_rows + k[None, :] * stride_w1k, mask=wm, other=0.0)
    if GATED:
        w2 = tl.load(w2_rows + k[None, :] * stride_w2k, mask=wm, other=0.0)
    else:
        w2 = w1
    return w1, w2


@triton.jit
def _k_tile(a_ptr, w_cols, cvalid, glist_ptr, act, excl, k0, width, stride_wk, GS: tl.constexpr,
            GP2: tl.constexpr, BK: tl.constexpr, COMPACT_A: tl.constexpr, RUN: tl.constexpr):
    # the [BN, BK] tile of W over compact K offset k0 (W's columns from the group list or the mask row) and the
    # matching [BK] slice of a, fp32; zeros past the active width
    kc = k0 + tl.arange(0, BK)
    kv = kc < width
    if COMPACT_A:
        g = tl.load(glist_ptr + kc // GS, mask=kv, other=0)
    else:
        g = _nth_active(act, excl, kc // GS, GP2)
    kf = (g * GS + kc % GS).to(tl.int64)                                 # [BK] W's columns
    # W's columns come in runs of RUN (min(BK, the largest power of two dividing GS)) consecutive columns, each run
    # starting at a multiple of RUN: group and tile boundaries are both multiples of RUN. Said to the compiler, the
    # gathered loads become vector loads.
    kf = tl.max_contiguous(tl.multiple_of(kf, RUN), RUN)
    if COMPACT_A:
        av = tl.load(a_ptr + kc, mask=kv, other=0.0).to(tl.float32)
    else:
        av = tl.load(a_ptr + kf, mask=kv, other=0.0).to(tl.float32)
    w = tl.load(w_cols + kf[None, :] * stride_wk, mask=cvalid[:, None] & kv[None, :], other=0.0)      # [BN, BK]
    return w, av


@triton.jit(do_not_specialize=["P"])
def _gemv_n_kernel(x_ptr, w1_ptr, w2_ptr, b_ptr, out_ptr, glist_ptr, mask_ptr, bucket_ptr, P, D, N, stride_xk,
                   stride_w1n, stride_w1k, stride_w2n, stride_w2k, G: tl.constexpr, GP2: tl.constexpr,
                   GS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
                   BUCKET: tl.constexpr, ACT: tl.constexpr, PREFETCH: tl.constexpr):
    # GATED: compact columns, h = act(x W1^T) * (x W2^T) and the group list; else full-width columns, x W1^T + b
    # on the active groups and exact zeros on the others
    n = tl.program_id(0)
    row, fill = _mask_row(mask_ptr, bucket_ptr, P, G, BUCKET)
    c = n * BN + tl.arange(0, BN)                                        # [BN]
    if GATED:
        act, excl = _row_bits(row, G, GP2)
        width = tl.sum(act, axis=0) * GS
        if n * BN >= width:
            return
        on = c < width
        j = c // GS
        g = _nth_active(act, excl, j, GP2)                               # [BN] the j-th active group
        rows = (g * GS + c % GS).to(tl.int64)
    else:  # the mask row covers groups [0, G); the groups after them are always on (K / V rows in q's launch)
        cvalid = c < N
        grp = c // GS
        on = cvalid & ((grp >= G) | (tl.load(row + grp, mask=cvalid & (grp < G), other=0) != 0))
        if tl.max(on.to(tl.int32), axis=0) == 0:  # only inactive groups' columns: zeros, no weights read
            tl.store(out_ptr + c, (tl.zeros([BN], dtype=tl.float32) + fill).to(out_ptr.dtype.element_ty),
                     mask=cvalid)
            return
        rows = c.to(tl.int64)
    w1_rows = w1_ptr + rows[:, None] * stride_w1n                      # [BN, 1] row starts
    w2_rows = w2_ptr + rows[:, None] * stride_w2n
    acc1 = tl.zeros([BN, BK], dtype=tl.float32)
    acc2 = tl.zeros([BN, BK], dtype=tl.float32)
    if PREFETCH:  # the first tile's loads, before the loop
        w1n, w2n = _n_tile(w1_rows, w2_rows, on, 0, D, stride_w1k, stride_w2k, BK, GATED)
    for k0 in range(0, D, BK):
        k = k0 + tl.arange(0, BK)
        xv = tl.load(x_ptr + k * stride_xk, mask=k < D, other=0.0).to(tl.float32)                     # [BK]
        if PREFETCH:  # issue the next tile's loads before this tile's products wait on its own
            w1, w2 = w1n, w2n
            w1n, w2n = _n_tile(w1_rows, w2_rows, on, k0 + BK, D, stride_w1k, stride_w2k, BK, GATED)
        else:
            w1, w2 = _n_tile(w1_rows, w2_rows, on, k0, D, stride_w1k, stride_w2k, BK, GATED)
        acc1 += w1.to(tl.float32) * xv[None, :]
        if GATED:
            acc2 += w2.to(tl.float32) * xv[None, :]
    if GATED:
        h = gated_act(tl.sum(acc1, axis=1), tl.sum(acc2, axis=1), ACT)
        tl.store(out_ptr + c, h.to(out_ptr.dtype.element_ty), mask=on)
        tl.store(glist_ptr + j, g, mask=on & (c % GS == 0))
    else:
        y = tl.sum(acc1, axis=1)
        if HAS_BIAS:
            y += tl.load(b_ptr + c, mask=on, other=0.0).to(tl.float32)
        y = y.to(out_ptr.dtype.element_ty)  # rounded once, then exact zeros on the inactive groups' columns
        y = tl.where(on, y, 0.0).to(tl.float32) + fill
        tl.store(out_ptr + c, y.to(out_ptr.dtype.element_ty), mask=cvalid)


@triton.jit(do_not_specialize=["P"])
def _gemv_k_kernel(a_ptr, w_ptr, b_ptr, out_ptr, part_ptr, glist_ptr, mask_ptr, bucket_ptr, P, N, stride_wn,
                   stride_wk, G: tl.constexpr, GP2: tl.constexpr, GS: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, SPLIT: tl.constexpr, COMPACT_A: tl.constexpr, HAS_BIAS: tl.constexpr,
                   BUCKET: tl.constexpr, PREFETCH: tl.constexpr, RUN: tl.constexpr):
    # out[:N] = W[:, active] @ a[active] (+ b). COMPACT_A: a is the compact h of the gated kernel and the group
    # list says whose columns it holds; else a is full width and each K tile's groups are found in registers
    n = tl.program_id(0)
    s = tl.program_id(1)
    row, fill = _mask_row(mask_ptr, bucket_ptr, P, G, BUCKET)
    act, excl = _row_bits(row, G, GP2)
    width = tl.sum(act, axis=0) * GS
    cols = n * BN + tl.arange(0, BN)
    cvalid = cols < N
    cols64 = cols.to(tl.int64)
    w_cols = w_ptr + cols64[:, None] * stride_wn                        # [BN, 1] W's rows
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    if PREFETCH:
        wn, an = _k_tile(a_ptr, w_cols, cvalid, glist_ptr, act, excl, s * BK, width, stride_wk, GS, GP2, BK,
                         COMPACT_A, RUN)
    for k0 in range(s * BK, width, SPLIT * BK):  # compact K tiles s, s + SPLIT, ...
        if PREFETCH:  # the next tile's loads go out before this tile's products
            w, av = wn, an
            wn, an = _k_tile(a_ptr, w_cols, cvalid, glist_ptr, act, excl, k0 + SPLIT * BK, width, stride_wk, GS,
                             GP2, BK, COMPACT_A, RUN)
        else:
            w, av = _k_tile(a_ptr, w_cols, cvalid, glist_ptr, act, excl, k0, width, stride_wk, GS, GP2, BK,
                            COMPACT_A, RUN)
        acc += w.to(tl.float32) * av[None, :]
    y = tl.sum(acc, axis=1)
    if SPLIT == 1:
        if HAS_BIAS:
            y += tl.load(b_ptr + cols, mask=cvalid, other=0.0).to(tl.float32)
        tl.store(out_ptr + cols, (y + fill).to(out_ptr.dtype.element_ty), mask=cvalid)
    else:
        tl.store(part_ptr + s * N + cols, y, mask=cvalid)


@triton.jit(do_not_specialize=["P"])
def _split_sum_kernel(part_ptr, b_ptr, out_ptr, mask_ptr, bucket_ptr, P, N, G: tl.constexpr, SPLIT: tl.constexpr,
                      BN: tl.constexpr, HAS_BIAS: tl.constexpr, BUCKET: tl.constexpr):
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    cvalid = cols < N
    _, fill = _mask_row(mask_ptr, bucket_ptr, P, G, BUCKET)
    s = tl.arange(0, SPLIT)
    part = tl.load(part_ptr + s[:, None] * N + cols[None, :], mask=cvalid[None, :], other=0.0)     # [SPLIT, BN]
    y = tl.sum(part, axis=0)
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=cvalid, other=0.0).to(tl.float32)
    tl.store(out_ptr + cols, (y + fill).to(out_ptr.dtype.element_ty), mask=cvalid)


# ----------------------------------------------------------------------------- launchers

def _row_args(mask8, bucket):
    """(mask as bytes [P, G] (bool or uint8), the bucket pointer or a placeholder the kernels never read, P, BUCKET)."""
    mask8 = _mask_bytes(mask8)
    use_bucket = bucket is not None
    return mask8, (bucket.contiguous() if use_bucket else mask8), mask8.shape[0], use_bucket


def _reduce(a, w_nk, bias, glist, mask8, bk, P, use_bucket, G, group_size, cfg, compact_a, wrap):
    """out [1, N] = W[:, active] @ a[active] (+ bias): _gemv_k_kernel, then _split_sum_kernel when split."""
    N = w_nk.shape[0]
    out = alloc((1, N), a.dtype, a.device)
    split = cfg["gd_split"]
    part = alloc((split, N), torch.float32, a.device) if split > 1 else out
    b_ = bias if bias is not None else w_nk
    _launcher(_gemv_k_kernel, wrap)[(triton.cdiv(N, cfg["gd_bn"]), split)](
        a, w_nk, b_, out, part, glist, mask8, bk, P, N, w_nk.stride(0), w_nk.stride(1),
        G=G, GP2=triton.next_power_of_2(G), GS=group_size, BN=cfg["gd_bn"], BK=cfg["gd_bk"], SPLIT=split,
        COMPACT_A=compact_a, HAS_BIAS=bias is not None, BUCKET=use_bucket, PREFETCH=cfg["gd_prefetch"],
        RUN=min(cfg["gd_bk"], group_size & -group_size),
        num_warps=cfg["gd_warps"],
        num_stages=cfg["gd_stages"])
    if split > 1:
        bn = min(1024, triton.next_power_of_2(N))
        _launcher(_split_sum_kernel, wrap)[(triton.cdiv(N, bn),)](
            part, b_, out, mask8, bk, P, N, G=G, SPLIT=split, BN=bn, HAS_BIAS=bias is not None, BUCKET=use_bucket,
            num_warps=4)
    return out


def mlp_gemv_triton(x, w_gate, w_up, w_down_nk, mask8, bucket: Optional[torch.Tensor], group_size: int,
                    act: str = "silu", config: Optional[dict] = None, wrap: bool = False) -> torch.Tensor:
    """x [1, D], w_gate / w_up [F, D], w_down_nk [D, F] as W[d, k] (any strides: down_proj.weight, or
    w_down_t.t()), mask8 uint8 / bool [P, G] with bucket int [1] (the token's row is mask8[bucket[0]]) or [1, G]
    with bucket None -> [1, D]. Shapes are the callers' to check (compact_mlp.mlp_triton, bucket_mlp); config:
    overrides of CONFIG_KEYS (other keys ignored)."""
    _, D = x.shape
    F = w_gate.shape[0]
    G = F // group_size
    cfg = config_for(layout(w_down_nk), config, "mlp", x.device)
    mask8, bk, P, use_bucket = _row_args(mask8, bucket)
    h = alloc((F,), x.dtype, x.device)
    glist = alloc((G,), torch.int32, x.device)
    _gate_up(x, w_gate, w_up, h, glist, mask8, bk, P, use_bucket, G, group_size, act, cfg, wrap)
    return _reduce(h, w_down_nk, None, glist, mask8, bk, P, use_bucket, G, group_size, cfg, True, wrap)


def _gate_up(x, w_gate, w_up, h, glist, mask8, bk, P, use_bucket, G, group_size, act, cfg, wrap):
    """The gated _gemv_n_kernel into h [F] (compact) and glist [G]: mlp_gemv_triton's first launch."""
    F, D = w_gate.shape
    _launcher(_gemv_n_kernel, wrap)[(triton.cdiv(F, cfg["gu_bn"]),)](
        x, w_gate, w_up, w_gate, h, glist, mask8, bk, P, D, F, x.stride(1), w_gate.stride(0), w_gate.stride(1),
        w_up.stride(0), w_up.stride(1), G=G, GP2=triton.next_power_of_2(G), GS=group_size, BN=cfg["gu_bn"],
        BK=cfg["gu_bk"], GATED=True, HAS_BIAS=False, BUCKET=use_bucket, ACT=ACT_IDS[act],
        PREFETCH=cfg["gu_prefetch"], num_warps=cfg["gu_warps"],
        num_stages=cfg["gu_stages"])


def q_proj_gemv_triton(x, w_q, b_q, mask8, bucket: Optional[torch.Tensor], group_size: int,
                       config: Optional[dict] = None, wrap: bool = False) -> torch.Tensor:
    """x [1, D], w_q [Nq, D], b_q [Nq] or None, mask8 / bucket as in mlp_gemv_triton -> [1, Nq]: x W_q^T + b on
    the token's groups (rounded once), exactly 0 on the others. The mask's G groups are the first G of Nq //
    group_size; the groups after them are always on. One launch."""
    _, D = x.shape
    Nq = w_q.shape[0]
    cfg = config_for("k_contiguous", config, "q_proj", x.device)
    mask8, bk, P, use_bucket = _row_args(mask8, bucket)
    G = mask8.shape[1]
    out = alloc((1, Nq), x.dtype, x.device)
    _launcher(_gemv_n_kernel, wrap)[(triton.cdiv(Nq, cfg["gu_bn"]),)](
        x, w_q, w_q, b_q if b_q is not None else w_q, out, mask8, mask8, bk, P, D, Nq, x.stride(1), w_q.stride(0),
        w_q.stride(1), w_q.stride(0), w_q.stride(1), G=G, GP2=triton.next_power_of_2(G), GS=group_size,
        BN=cfg["gu_bn"], BK=cfg["gu_bk"], GATED=False, HAS_BIAS=b_q is not None, BUCKET=use_bucket, ACT=0,
        PREFETCH=cfg["gu_prefetch"],
        num_warps=cfg["gu_warps"], num_stages=cfg["gu_stages"])
    return out


def o_proj_gemv_triton(a, w_o_nk, b_o, mask8, bucket: Optional[torch.Tensor], group_size: int,
                       config: Optional[dict] = None, wrap: bool = False) -> torch.Tensor:
    """a [1, Nq] (any column stride), w_o_nk [D, Nq] as W[d, k] (any strides: o_proj.weight, or w_o_t.t()),
    b_o [D] or None, mask8 / bucket as in mlp_gemv_triton -> [1, D]: W[:, active] @ a[active] + b_o."""
    Nq = a.shape[1]
    G = Nq // group_size
    cfg = config_for(layout(w_o_nk), config, "o_proj", a.device)
    mask8, bk, P, use_bucket = _row_args(mask8, bucket)
    a = a if a.stride(1) == 1 else a.contiguous()
    return _reduce(a, w_o_nk, b_o, mask8, mask8, bk, P, use_bucket, G, group_size, cfg, False, wrap)
