"""Compact (group-sparse) MLP kernels.

Two generic Triton kernels, shared with the attention projections (compact_attn.py):

``_ngather_kernel`` -- output columns are grouped (gate/up rows of W [F, D], q rows of Wq):
  * tile mode (SORTED=False): program (m, j, sub) handles token tile m (BM consecutive tokens)
    and the j-th group active for any token of the tile (``tile_groups``); weights of a group are
    read once per tile, inactive (token, group) pairs are masked at the store. With T <= BM this
    is the decode gather-GEMV: only active groups' weight rows are read, nothing is copied.
  * sorted mode (SORTED=True): program (b, sub) handles block b of the group-major padded token
    list (``sorted_token_ids``/``block_groups``): an "expert" GEMM with indirect row loads of x,
    N = group size.  Only active (token, group) pairs are computed (prefill, random masks).
  GATED: out = act(x W1^T) * (x W2^T), act = silu / gelu / gelu-tanh (ACT 0 / 1 / 2); else out = x W1^T + b.

``_kskip_kernel`` -- reduction side (down_proj over K=F, o_proj over K=Nq): token-major GEMM,
  program (m, n, s) loops over the groups active for any token of tile m (split s of them when
  SPLIT > 1, fp32 atomics) and skips the rest; per-token activity is applied as a load mask on
  the A rows (so unwritten/garbage A values of inactive pairs are never read).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from .activations import ACT_IDS, gated_act
from .dense_masked import mlp_dense_masked
from .reorder import _mask_bytes, _launcher, alloc, tile_lists_triton, group_lists_triton
from .tuning import DECODE_T, interpreting, resolve, with_phase_overrides  # noqa: F401  (DECODE_T: re-exported)


@triton.jit
def _gate_up_one_dot(a_rows, w1_rows, w2_rows, rvalid, cvalid, D, stride_ak, stride_wk,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    # gather_gemm's FUSE_GU: the gate and up rows interleaved into one [2 BN, BK] tile (row 2c gate channel c,
    # 2c + 1 up channel c), one dot of N = 2 BN per K step, the accumulator split back into (gate, up) at the end
    w_rows = tl.reshape(tl.join(w1_rows, w2_rows), [2 * BN, 1])
    cv2 = tl.reshape(tl.join(cvalid, cvalid), [2 * BN])
    acc = tl.zeros([BM, 2 * BN], dtype=tl.float32)
    for k0 in range(0, D, BK):
        k = k0 + tl.arange(0, BK)
        kv = k < D
        a = tl.load(a_rows + k[None, :] * stride_ak, mask=rvalid[:, None] & kv[None, :], other=0.0)      # [BM, BK]
        w = tl.load(w_rows + k[None, :] * stride_wk, mask=cv2[:, None] & kv[None, :], other=0.0)        # [2BN, BK]
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=PREC)
    return tl.split(tl.reshape(acc, [BM, BN, 2]))


@triton.jit
def gather_gemm(a_rows, w1_rows, w2_rows, rvalid, cvalid, D, stride_ak, stride_w1k, stride_w2k,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GATED: tl.constexpr, PREC: tl.constexpr,
                UPCAST: tl.constexpr, FUSE_GU: tl.constexpr):
    # a_rows [BM, 1]: pointers to the gathered input rows, w1_rows / w2_rows [BN, 1]: to the gathered weight
    # rows; over K = D -> (acc1 = a @ w1^T, acc2 = a @ w2^T when GATED, else zeros), fp32 [BM, BN]: the K loop of
    # the gather GEMMs (compact_mlp's and bucket_mlp's). FUSE_GU (GATED, both weights with stride_w1k): gate and up
    # in one dot per K step (_gate_up_one_dot)
    acc1 = tl.zeros([BM, BN], dtype=tl.float32)
    acc2 = tl.zeros([BM, BN], dtype=tl.float32)
    if GATED and FUSE_GU:
        acc1, acc2 = _gate_up_one_dot(a_rows, w1_rows, w2_rows, rvalid, cvalid, D, stride_ak, stride_w1k,
                                      BM, BN, BK, PREC, UPCAST)
    else:
        for k0 in range(0, D, BK):
            k = k0 + tl.arange(0, BK)
            kv = k < D
            a = tl.load(a_rows + k[None, :] * stride_ak, mask=rvalid[:, None] & kv[None, :], other=0.0)  # [BM, BK]
            w1 = tl.load(w1_rows + k[None, :] * stride_w1k, mask=cvalid[:, None] & kv[None, :], other=0.0)  # [BN, BK]
            if UPCAST:  # the Triton CPU interpreter mis-computes half-precision dots: exact upcast to fp32
                a = a.to(tl.float32)
                w1 = w1.to(tl.float32)
            acc1 = tl.dot(a, tl.trans(w1), acc1, input_precision=PREC)
            if GATED:
                w2 = tl.load(w2_rows + k[None, :] * stride_w2k, mask=cvalid[:, None] & kv[None, :], other=0.0)
                if UPCAST:
                    w2 = w2.to(tl.float32)
                acc2 = tl.dot(a, tl.trans(w2), acc2, input_precision=PREC)
    return acc1, acc2


@triton.jit(do_not_specialize=["T"])
def _ngather_kernel(x_ptr, w1_ptr, w2_ptr, b_ptr, out_ptr, mask_ptr,
                    idx_ptr, cnt_ptr, sorted_ptr, ntpp_ptr,
                    T, D, stride_x, stride_w, stride_o,
                    G: tl.constexpr, GS: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    SORTED: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
                    ZERO_INACTIVE: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
                    GROUP_G: tl.constexpr, LISTS: tl.constexpr, ACT: tl.constexpr, FUSE_GU: tl.constexpr):
    if SORTED:
        # program -> (group g, k-th block of g's token list), swizzled in super-blocks of GROUP_G
        # groups so that concurrent programs share weights (same g) and x rows (same k range).
        pid = tl.program_id(0)
        sub = tl.program_id(1)
        num_k = tl.cdiv(T, BM)
        per_super = GROUP_G * num_k
        first_g = (pid // per_super) * GROUP_G
        gsz = tl.minimum(G - first_g, GROUP_G)
        inner = pid % per_super
        g = first_g + inner % gsz
        kb = inner // gsz
        if kb >= tl.load(cnt_ptr + G + g):
            return
        b = tl.load(cnt_ptr + g) + kb
        rows = tl.load(sorted_ptr + b * BM + tl.arange(0, BM))
        rvalid = rows < T
        smask = rvalid
    else:
        m = tl.program_id(0)
        j = tl.program_id(1)
        sub = tl.program_id(2)
        rows = m * BM + tl.arange(0, BM)
        rvalid = rows < T
        if LISTS:  # program j -> the tile's j-th active group (mask_reorder's tile list)
            cnt = tl.load(cnt_ptr + m)
            if j >= cnt:
                return
            g = tl.load(idx_ptr + m * G + j)
        else:  # program j -> group j (no reorder launch)
            g = j
        act = tl.load(mask_ptr + rows * G + g, mask=rvalid, other=0) != 0
        if not LISTS:  # gone at once when no token of the tile uses group j
            if tl.max(act.to(tl.int32), axis=0) == 0:
                return
        if ZERO_INACTIVE:
            smask = rvalid
        else:
            smask = rvalid & act
    cin = sub * BN + tl.arange(0, BN)
    cvalid = cin < GS
    cols = g * GS + cin
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)
    acc1, acc2 = gather_gemm(x_ptr + rows64[:, None] * stride_x, w1_ptr + cols64[:, None] * stride_w,
                             w2_ptr + cols64[:, None] * stride_w, rvalid, cvalid, D, 1, 1, 1,
                             BM, BN, BK, GATED, PREC, UPCAST, FUSE_GU)
    if GATED:
        y = gated_act(acc1, acc2, ACT)
    else:
        y = acc1
        if HAS_BIAS:
            y += tl.load(b_ptr + cols, mask=cvalid, other=0.0).to(tl.float32)[None, :]
    y = y.to(out_ptr.dtype.element_ty)
    if not SORTED:
        if ZERO_INACTIVE:
            y = tl.where(act[:, None], y, 0.0)
    tl.store(out_ptr + rows64[:, None] * stride_o + cols64[None, :], y,
             mask=smask[:, None] & cvalid[None, :])


@triton.jit(do_not_specialize=["T"])
def _kskip_kernel(a_ptr, w_ptr, b_ptr, out_ptr, mask_ptr, tg_ptr, tc_ptr,
                  T, N, stride_a, stride_w, stride_o,
                  G: tl.constexpr, GS: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
                  HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr, PREC: tl.constexpr,
                  UPCAST: tl.constexpr, GROUP_M: tl.constexpr, LISTS: tl.constexpr):
    # grouped (L2-friendly) ordering of the (m, n) tiles: GROUP_M token tiles sweep the n blocks
    pid = tl.program_id(0)
    s = tl.program_id(1)
    num_m = tl.cdiv(T, BM)
    num_n = tl.cdiv(N, BN)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    gsz = tl.minimum(num_m - first_m, GROUP_M)
    m = first_m + (pid % per_group) % gsz
    n = (pid % per_group) // gsz
    rows = m * BM + tl.arange(0, BM)
    rvalid = rows < T
    rows64 = rows.to(tl.int64)
    cols = n * BN + tl.arange(0, BN)
    cvalid = cols < N
    if LISTS:  # the tile's active groups from mask_reorder's tile list
        n_iter = tl.load(tc_ptr + m)
    else:  # every group, with the loads of a group no token of the tile uses predicated off (no reorder
        n_iter = G  # launch; the loop stays branch-free so it still pipelines)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for j in range(s, n_iter, SPLIT):
        if LISTS:
            g = tl.load(tg_ptr + m * G + j)
        else:
            g = j
        act = tl.load(mask_ptr + rows * G + g, mask=rvalid, other=0) != 0
        if not LISTS:
            n_used = tl.max(act.to(tl.int32), axis=0)  # 1 when any token of the tile uses group g
        for kk in tl.static_range(0, GS, BK):
            kin = kk + tl.arange(0, BK)
            kv = kin < GS
            k = (g * GS + kin).to(tl.int64)
            a = tl.load(a_ptr + rows64[:, None] * stride_a + k[None, :],
                        mask=act[:, None] & kv[None, :], other=0.0)
            if not LISTS:  # a listed group is always used; an unlisted unused one reads no weights
                kv = kv & ((tl.zeros([BK], dtype=tl.int32) + n_used) > 0)
            w = tl.load(w_ptr + k[:, None] * stride_w + cols[None, :],
                        mask=kv[:, None] & cvalid[None, :], other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(a, w, acc, input_precision=PREC)
    if HAS_BIAS:
        bias = tl.load(b_ptr + cols, mask=cvalid, other=0.0).to(tl.float32)
        acc += tl.where(s == 0, bias, 0.0)[None, :]
    optr = out_ptr + rows64[:, None] * stride_o + cols[None, :]
    omask = rvalid[:, None] & cvalid[None, :]
    if ATOMIC:
        tl.atomic_add(optr, acc, mask=omask)
    else:
        tl.store(optr, acc.to(out_ptr.dtype.element_ty), mask=omask)


# ----------------------------------------------------------------------------- configs

def _prec(dtype):
    return "ieee" if (dtype == torch.float32 or _interpret()) else "tf32"


def _interpret():
    return interpreting()


def kernel_config(T: int, D: int, F: int, group_size: int, N_out: int, overrides: Optional[dict] = None,
                  elem_size: int = 2, device=None, tuning=None) -> dict:
    """The tuning table's row for T (tuning.resolve: the device's table by default) fitted to the device's
    shared memory for this element size, then the tuning's phase overrides, then the caller's `overrides`
    (tests, sweeps) unchanged."""
    table = resolve(tuning, device)
    cfg = table.row(T, group_size)
    if not _interpret():
        cfg = fit_shared_memory(cfg, elem_size, shared_memory_bytes(device))
    phase = "decode" if T <= DECODE_T else "prefill"
    cfg = with_phase_overrides(cfg, table.overrides.get(phase))
    cfg.update(overrides or {})
    return cfg


# Hopper's opt-in shared memory per block; used when the device cannot be asked.
SMEM_FALLBACK = 232448


def shared_memory_bytes(device=None) -> int:
    dev = torch.device(device) if device is not None else None
    if not torch.cuda.is_available() or (dev is not None and dev.type != "cuda"):
        return SMEM_FALLBACK
    return _cuda_smem(dev.index if dev is not None and dev.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_smem(index: int) -> int:
    props = torch.cuda.get_device_properties(index)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or SMEM_FALLBACK)


def stage_bytes(cfg: dict, elem_size: int) -> tuple[int, int]:
    """Shared memory one pipeline stage of each kernel holds: the gather GEMM stages an x tile and a gate
    and an up weight tile, the K-skip GEMM an a tile and a weight tile."""
    up = (cfg["up_bm"] * cfg["up_bk"] + 2 * cfg["up_bn"] * cfg["up_bk"]) * elem_size
    dn = (cfg["dn_bm"] * cfg["dn_bk"] + cfg["dn_bk"] * cfg["dn_bn"]) * elem_size
    return up, dn


def shared_memory_need(cfg: dict, elem_size: int) -> tuple[int, int]:
    """Shared memory the gather and the K-skip kernel need with this config: Triton keeps num_stages - 1
    stages of the software pipeline resident (checked against the compiler: tests/test_kernel_aot_sm90.py)."""
    up, dn = stage_bytes(cfg, elem_size)
    return up * max(1, cfg["up_stages"] - 1), dn * max(1, cfg["dn_stages"] - 1)


def fit_shared_memory(cfg: dict, elem_size: int, limit: int) -> dict:
    """Cut pipeline stages (to 2), then K tiles, until each kernel's shared memory fits `limit`.

    The tiles are tuned for bf16; the same tiles in fp32 need twice the shared memory, and a kernel over
    the limit fails to compile. Configs that fit come back unchanged."""
    cfg = dict(cfg)
    for i, (bk, st) in enumerate((("up_bk", "up_stages"), ("dn_bk", "dn_stages"))):
        while shared_memory_need(cfg, elem_size)[i] > limit and cfg[st] > 2:
            cfg[st] -= 1
        while shared_memory_need(cfg, elem_size)[i] > limit and cfg[bk] > 16:
            cfg[bk] //= 2
    return cfg


def default_config(T: int, D: int, F: int, group_size: int, N_out: int, tuning=None) -> dict:
    """The tuning table's row for T tokens (the device's shipped table unless `tuning` is given), before the
    shared-memory fit and the overrides (kernel_config applies those)."""
    return resolve(tuning).row(T, group_size)


def uses_tile_lists(cfg: dict) -> bool:
    """False for the reorder-free tile path (config lists="none"), where the kernels read the mask themselves."""
    return cfg.get("lists", "kernel") != "none"


def _tile_lists(cfg, mask8, bm, wrap, lists):
    """(use_lists, tg, tc) for a tile-path launch: the given or freshly built tile lists, or, without lists,
    the mask as placeholder pointers the kernel never reads (no reorder launch)."""
    if not uses_tile_lists(cfg):
        return False, mask8, mask8
    tg, tc = lists if lists is not None else tile_lists_triton(mask8, bm, wrap)
    return True, tg, tc


def ngather(x, w1, w2, bias, out, mask8, G, GS, cfg, gated, zero_inactive, wrap, lists=None, act="silu"):
    """Launch the grouped-output kernel; ``out`` [T, G*GS] is written for active pairs
    (and zeros for inactive tokens of visited groups when zero_inactive). act: the gate activation (gated)."""
    act_id = ACT_IDS[act]
    T, D = x.shape
    bm, bn, bk = cfg["up_bm"], cfg["up_bn"], cfg["up_bk"]
    nsub = triton.cdiv(GS, bn)
    prec = _prec(x.dtype)
    k = _launcher(_ngather_kernel, wrap)
    w2_ = w2 if w2 is not None else w1
    b_ = bias if bias is not None else w1
    # config up_fuse: gate and up in one dot per K step (gather_gemm's FUSE_GU); the kernel reads both weights
    # with w1's row stride and unit column stride, as it always does
    fuse_gu = bool(gated and cfg.get("up_fuse", False))
    if cfg["path"] == "sorted":
        sorted_ids, bgroups, ntpp, gblk = group_lists_triton(mask8, bm, wrap, True)
        k[(bgroups.shape[0], nsub)](
            x, w1, w2_, b_, out, mask8, bgroups, gblk, sorted_ids, ntpp,
            T, D, x.stride(0), w1.stride(0), out.stride(0),
            G=G, GS=GS, BM=bm, BN=bn, BK=bk, SORTED=True, GATED=gated, HAS_BIAS=bias is not None,
            ZERO_INACTIVE=zero_inactive, PREC=prec, UPCAST=_interpret(), GROUP_G=cfg["group_g"], LISTS=True,
            ACT=act_id, FUSE_GU=fuse_gu, num_warps=cfg["up_warps"], num_stages=cfg["up_stages"])
    else:
        use_lists, tg, tc = _tile_lists(cfg, mask8, bm, wrap, lists)
        k[(triton.cdiv(T, bm), G, nsub)](
            x, w1, w2_, b_, out, mask8, tg, tc, tg, tc,
            T, D, x.stride(0), w1.stride(0), out.stride(0),
            G=G, GS=GS, BM=bm, BN=bn, BK=bk, SORTED=False, GATED=gated, HAS_BIAS=bias is not None,
            ZERO_INACTIVE=zero_inactive, PREC=prec, UPCAST=_interpret(), GROUP_G=cfg["group_g"], LISTS=use_lists,
            ACT=act_id, FUSE_GU=fuse_gu, num_warps=cfg["up_warps"], num_stages=cfg["up_stages"])


def kskip(a, w_t, bias, mask8, G, GS, cfg, out_dtype, wrap, lists=None):
    """out[T, N] = sum over active groups of a[:, grp] @ w_t[grp] (+ bias once)."""
    if w_t.stride(1) != 1:  # the kernel reads w_t's rows: a transposed view (one-token graphs' weight) is laid out
        w_t = w_t.contiguous()
    T = a.shape[0]
    N = w_t.shape[1]
    bm, bn, bk, split = cfg["dn_bm"], cfg["dn_bn"], cfg["dn_bk"], cfg["dn_split"]
    use_lists, tg, tc = _tile_lists(cfg, mask8, bm, wrap, lists)
    atomic = split > 1
    if atomic:
        out = torch.zeros((T, N), dtype=torch.float32, device=a.device)
    else:
        out = alloc((T, N), out_dtype, a.device)
    b_ = bias if bias is not None else w_t
    _launcher(_kskip_kernel, wrap)[(triton.cdiv(T, bm) * triton.cdiv(N, bn), split)](
        a, w_t, b_, out, mask8, tg, tc, T, N, a.stride(0), w_t.stride(0), out.stride(0),
        G=G, GS=GS, BM=bm, BN=bn, BK=bk, SPLIT=split, HAS_BIAS=bias is not None, ATOMIC=atomic,
        PREC=_prec(a.dtype), UPCAST=_interpret(), GROUP_M=cfg["group_m"], LISTS=use_lists,
        num_warps=cfg["dn_warps"], num_stages=cfg["dn_stages"])
    return out.to(out_dtype) if atomic else out


def mlp_triton(x, w_gate, w_up, w_down_t, mask, group_size: int, *, config: Optional[dict] = None,
               tuning=None, wrap: bool = False, act: str = "silu"):
    """x [T, D], w_gate/w_up [F, D], w_down_t [F, D], mask [T, G] bool -> [T, D]. `tuning`: the table
    (tuning.resolve; default the device's), `config`: fields that override its row (sweeps, tests), `act`: the
    gate activation (reference.ACTIVATIONS)."""
    if act not in ACT_IDS:
        raise ValueError(f"wide.mlp: unknown activation {act!r}; choose one of {tuple(ACT_IDS)}")
    T, D = x.shape
    F = w_gate.shape[0]
    G = F // group_size
    cfg = kernel_config(T, D, F, group_size, D, config, elem_size=x.element_size(), device=x.device,
                        tuning=tuning)
    x = x.contiguous()
    if T == 1 and cfg.get("one_token") == "gemv":  # a batch-1 decode step: gemv's two GEMVs
        from .gemv import mlp_gemv_triton  # gemv imports this module's gated epilogue

        return mlp_gemv_triton(x, w_gate, w_up, w_down_t.t(), mask, None, group_size, act, cfg, wrap)
    if cfg["path"] == "dense":  # small batches: every weight row is needed by some token anyway
        return mlp_dense_masked(x, w_gate, w_up, w_down_t, mask, group_size, act, wrap)
    mask8 = _mask_bytes(mask)
    if cfg.get("down") == "dense":  # h zero on inactive pairs, then cuBLAS over K = F
        h = torch.zeros((T, F), dtype=x.dtype, device=x.device)
        ngather(x, w_gate, w_up, None, h, mask8, G, group_size, cfg, gated=True, zero_inactive=False, wrap=wrap,
                act=act)
        return torch.mm(h, w_down_t)
    h = alloc((T, F), x.dtype, x.device)
    lists = None
    if cfg["path"] != "sorted" and cfg["up_bm"] == cfg["dn_bm"] and uses_tile_lists(cfg):
        # one mask reorder for both kernels
        lists = tile_lists_triton(mask8, cfg["up_bm"], wrap)
    ngather(x, w_gate, w_up, None, h, mask8, G, group_size, cfg, gated=True, zero_inactive=False, wrap=wrap,
            lists=lists, act=act)
    return kskip(h, w_down_t, None, mask8, G, group_size, cfg, x.dtype, wrap, lists=lists)
