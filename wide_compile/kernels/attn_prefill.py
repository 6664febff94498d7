"""Query-sparse causal prefill attention: only the active (token, head-group) pairs are computed.

Semantics (DESIGN.md): query heads form groups of ``group_size`` consecutive heads; ``mask[b, t, g]`` says
whether group g runs for token t. K and V are complete (every token), so an active query row attends to
every earlier key exactly as SDPA does; an inactive row of the output is exactly 0.

    q [B, Hq, T, d], k, v [B, Hkv, T, d] (after RoPE), mask [B, T, G] bool, G = Hq // group_size
    -> out [B, Hq, T, d]: out[b, h, t] = SDPA(causal, window)[b, h, t] if mask[b, t, h // group_size] else 0

GQA: n_rep = Hq // Hkv query heads share one KV head; a group never spans part of two KV heads
(group_size divides n_rep, or n_rep divides group_size). Sliding window (Mistral): key j is visible to
query i iff i - window < j <= i; window None = full causal.

Kernel (flash-attention forward, fp32 accumulation, online softmax in base 2, no atomics):

1. Mask reordering on the device (``active_order_triton``): per (batch, group) a permutation of the tokens,
   the active ones first in ascending order, then the inactive ones, and the active count. No host sync.
2. A "unit" is the H_PACK = min(group_size, n_rep) query heads that share one KV head and one mask row. A
   tile packs BLOCK_T = BLOCK_M // H_PACK consecutive entries of the unit's permutation times its H_PACK
   heads into the M dimension (row r = token slot r // H_PACK, head r % H_PACK), so each K/V tile loaded
   serves H_PACK heads, as GQA flash kernels do.
3. The grid is static and worst case: B * (Hq / H_PACK) * cdiv(T, BLOCK_T) programs. A tile at or past
   the active count writes zeros to its (inactive) rows and ends; the others gather q rows, loop over key
   blocks from the window start of their first query to their last query, and scatter the output rows.
   Key blocks visible to every row of the tile run without masks; only the stretch between the first and
   the last query (and the window edge) is masked per row. Every output element is written exactly once,
   so the output needs no zero fill. Tiles run heaviest first, with the units of one KV head adjacent so
   that they read the same K/V blocks at the same time (L2).

The output has SDPA's flash layout: [B, Hq, T, d] viewing a [B, T, Hq, d]-contiguous buffer, so the
usual ``out.transpose(1, 2).reshape(B, T, Hq * d)`` before o_proj is free.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from .attn_decode import check_groups
from .reorder import _launcher
from .tuning import interpreting

# Tile configs by head dim on a CUDA GPU (Hopper first), and one for the CPU interpreter (small tiles so
# that the tests' tiny shapes still run several tiles and several key blocks). benchmarks/bench_attention.py
# --sweep times the candidates in SWEEP on the GPU it runs on.
CONFIGS = {
    "cuda": {
        16: dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
        32: dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3),
        64: dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3),
        128: dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
        256: dict(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=2),
    },
    "interpreter": dict(BLOCK_M=16, BLOCK_N=16, num_warps=1, num_stages=1),
}
# Candidates for d = 128 on Hopper that compile for sm_90 without register spills (tests/test_kernel_attn_prefill.py
# compiles the defaults ahead of time); 128 x 128 with 3 stages sits at the shared-memory limit.
SWEEP = (
    dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=4),
    dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2),
    dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3),
    dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
    dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=4),
    dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=2),
    dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=4),
)
CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")
LOG2E = 1.4426950408889634


def config_for(head_dim: int, overrides: Optional[dict] = None) -> dict:
    """The tile config for this head dim (the interpreter's under TRITON_INTERPRET=1), then `overrides`."""
    if interpreting():
        cfg = dict(CONFIGS["interpreter"])
    else:
        table = CONFIGS["cuda"]
        cfg = dict(table[min((d for d in table if d >= head_dim), default=max(table))])
    if overrides:
        bad = [k for k in overrides if k not in CONFIG_KEYS]
        if bad:
            raise ValueError(f"attn_prefill config: unknown keys {bad}; the keys are {CONFIG_KEYS}")
        cfg.update(overrides)
    for k in ("BLOCK_M", "BLOCK_N"):
        if cfg[k] < 16 or cfg[k] & (cfg[k] - 1):
            raise ValueError(f"attn_prefill config: {k} must be a power of two >= 16 (tl.dot), got {cfg[k]}")
    return cfg


# ----------------------------------------------------------------------------- validation + reference

def check_inputs(q, k, v, mask, group_size: int, window: Optional[int]) -> tuple:
    """Validates shapes and the GQA/grouping rule; returns (B, Hq, Hkv, T, d, G, n_rep)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"attn_prefill: q, k, v must be [B, H, T, d], got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    B, Hq, T, d = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[2] != T or k.shape[3] != d:
        raise ValueError(f"attn_prefill: k and v must be [B, Hkv, T, d] = [{B}, Hkv, {T}, {d}] like q "
                         f"{tuple(q.shape)}, got {tuple(k.shape)}, {tuple(v.shape)}")
    Hkv = k.shape[1]
    n_rep = check_groups(Hq, Hkv, group_size, "attn_prefill: ")
    G = Hq // group_size
    if tuple(mask.shape) != (B, T, G):
        raise ValueError(f"attn_prefill: mask must be [B, T, G] = [{B}, {T}, {G}] (G = Hq // group_size), "
                         f"got {tuple(mask.shape)}")
    if window is not None and window < 1:
        raise ValueError(f"attn_prefill: window must be >= 1 (or None for full causal), got {window}")
    if len({q.device, k.device, v.device, mask.device}) > 1:
        raise ValueError(f"attn_prefill: q, k, v and mask must be on one device, got {q.device}, {k.device}, "
                         f"{v.device}, {mask.device}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"attn_prefill: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    return B, Hq, Hkv, T, d, G, n_rep


def visible_keys(T: int, window: Optional[int], device=None) -> torch.Tensor:
    """[T, T] bool: key j visible to query i (causal, and i - window < j when window is set)."""
    i = torch.arange(T, device=device)[:, None]
    j = torch.arange(T, device=device)[None, :]
    vis = j <= i
    if window is not None:
        vis = vis & (j > i - window)
    return vis


def row_mask(mask: torch.Tensor, group_size: int) -> torch.Tensor:
    """mask [B, T, G] -> [B, Hq, T, 1] bool: is the (head, token) row active."""
    return mask.to(torch.bool).transpose(1, 2).repeat_interleave(group_size, dim=1)[..., None]


def attn_prefill_ref(q, k, v, mask, group_size: int, window: Optional[int] = None,
                     scale: Optional[float] = None) -> torch.Tensor:
    """Plain PyTorch reference: softmax attention over every row (float64 for float64 inputs, else float32),
    rounded to q's dtype, inactive rows replaced by exact zeros with torch.where (NaN/inf in an inactive
    row cannot leak)."""
    B, Hq, Hkv, T, d, G, n_rep = check_inputs(q, k, v, mask, group_size, window)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    kf = k.to(acc).repeat_interleave(n_rep, dim=1)                    # [B, Hq, T, d]
    vf = v.to(acc).repeat_interleave(n_rep, dim=1)
    scores = (q.to(acc) @ kf.transpose(-1, -2)) * scale               # [B, Hq, T, T]
    scores = scores.masked_fill(~visible_keys(T, window, q.device), float("-inf"))
    out = (torch.softmax(scores, dim=-1) @ vf).to(q.dtype)            # [B, Hq, T, d]
    return torch.where(row_mask(mask, group_size), out, torch.zeros((), dtype=q.dtype, device=q.device))


def active_order_ref(mask: torch.Tensor):
    """mask [B, T, G] -> (order [B, G, T] int32: per (batch, group) the active tokens ascending, then the
    inactive ones ascending; counts [B, G] int32: the number of active tokens)."""
    m = mask.to(torch.bool).transpose(1, 2)                           # [B, G, T]
    order = torch.sort((~m).to(torch.uint8), dim=-1, stable=True).indices
    return order.to(torch.int32), m.sum(-1, dtype=torch.int32)


# ----------------------------------------------------------------------------- mask reordering

@triton.jit(do_not_specialize=["T"])
def _active_order_kernel(mask_ptr, order_ptr, cnt_ptr, T, G: tl.constexpr, BT: tl.constexpr):
    # one program per (batch, group): count, then scatter active tokens to [0, count) and the inactive ones
    # to [count, T), both in token order
    pid = tl.program_id(0)
    b = pid // G
    g = pid % G
    m_row = mask_ptr + b.to(tl.int64) * T * G + g
    o_row = order_ptr + pid.to(tl.int64) * T
    total = tl.zeros([BT], dtype=tl.int32)
    for t0 in range(0, T, BT):
        t = t0 + tl.arange(0, BT)
        total += tl.load(m_row + t * G, mask=t < T, other=0).to(tl.int32)
    count = tl.sum(total, axis=0)
    before = count * 0  # active tokens before this chunk
    for t0 in range(0, T, BT):
        t = t0 + tl.arange(0, BT)
        a = tl.load(m_row + t * G, mask=t < T, other=0).to(tl.int32)
        active_before = before + tl.cumsum(a, axis=0) - a
        dest = tl.where(a > 0, active_before, count + t - active_before)
        tl.store(o_row + dest, t, mask=t < T)
        before += tl.sum(a, axis=0)
    tl.store(cnt_ptr + pid, count)


def active_order_triton(mask: torch.Tensor, wrap: bool = False):
    """Triton version of active_order_ref (same outputs, one launch, no host sync)."""
    B, T, G = mask.shape
    mask = mask if mask.dtype == torch.bool else mask.to(torch.bool)  # read as is: no conversion launch
    mask = mask.contiguous()
    order = torch.empty((B, G, T), dtype=torch.int32, device=mask.device)
    counts = torch.empty((B, G), dtype=torch.int32, device=mask.device)
    BT = min(1024, max(16, triton.next_power_of_2(T)))
    _launcher(_active_order_kernel, wrap)[(B * G,)](mask, order, counts, T, G=G, BT=BT)
    return order, counts


# ----------------------------------------------------------------------------- attention kernel

@triton.jit
def _attend_blocks(acc, l_i, m_i, q, qpos, q_after, k_base, v_base, skt, skd, svt, svd, start, end, T, qk_scale,
                   HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                   HAS_WINDOW: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, STAGES: tl.constexpr):
    # key blocks [start, end) in steps of BLOCK_N; MASKED: per-row causal/window masks and key bounds
    # (unmasked blocks lie below every row's position and inside every row's window); a row sees the keys
    # in (q_after, qpos]
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for n0 in tl.range(start, end, BLOCK_N, num_stages=STAGES):
        kpos = n0 + offs_n
        k_ptrs = k_base + kpos[:, None] * skt + offs_d[None, :] * skd
        v_ptrs = v_base + kpos[:, None] * svt + offs_d[None, :] * svd
        if MASKED:
            k = tl.load(k_ptrs, mask=(kpos < T)[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
        if UPCAST:
            k = k.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=PREC)           # [BLOCK_M, BLOCK_N]
        if MASKED:
            vis = kpos[None, :] <= qpos[:, None]
            if HAS_WINDOW:
                vis = vis & (kpos[None, :] > q_after[:, None])
            qk = tl.where(vis, qk * qk_scale, float("-inf"))
            m_ij = tl.maximum(m_i, tl.max(qk, 1))
            if HAS_WINDOW:  # a row may have seen no key yet: subtract 0 instead of -inf (no NaN)
                m_sub = tl.where(m_ij == float("-inf"), 0.0, m_ij)
            else:
                m_sub = m_ij
            p = tl.math.exp2(qk - m_sub[:, None])
        else:
            m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            m_sub = m_ij
            p = tl.math.exp2(qk * qk_scale - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if MASKED:
            v = tl.load(v_ptrs, mask=(kpos < T)[:, None], other=0.0)
        else:
            v = tl.load(v_ptrs)
        p_lo = p.to(v_base.dtype.element_ty)
        if UPCAST:
            p_lo = p_lo.to(tl.float32)
            v = v.to(tl.float32)
        acc = tl.dot(p_lo, v, acc, input_precision=PREC)
        m_i = m_ij
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["T", "n_tiles", "window"])
def _attn_prefill_kernel(q_ptr, k_ptr, v_ptr, o_ptr, order_ptr, cnt_ptr,
                         sqb, sqh, sqt, sqd, skb, skh, skt, skd, svb, svh, svt, svd, sob, soh, sot, sod,
                         T, n_tiles, qk_scale, window,
                         G: tl.constexpr, HKV: tl.constexpr, GROUP_SIZE: tl.constexpr, N_REP: tl.constexpr,
                         H_PACK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
                         PREC: tl.constexpr, UPCAST: tl.constexpr, STAGES: tl.constexpr):
    # program -> (batch, KV head, tile, unit of that KV head); units of one KV head adjacent, tiles reversed
    # (heaviest first)
    UNITS_PER_KV: tl.constexpr = N_REP // H_PACK
    # Inductor types a Python float argument of a user kernel as fp64: fp32 keeps the softmax state (and the
    # dot accumulator it scales) in fp32
    qk_scale = tl.cast(qk_scale, tl.float32)
    pid = tl.program_id(0)
    sub = pid % UNITS_PER_KV
    rest = pid // UNITS_PER_KV
    tile = n_tiles - 1 - rest % n_tiles
    rest = rest // n_tiles
    kvh = rest % HKV
    b = rest // HKV
    head0 = (kvh * UNITS_PER_KV + sub) * H_PACK
    g = head0 // GROUP_SIZE
    order_row = order_ptr + (b * G + g).to(tl.int64) * T
    count = tl.load(cnt_ptr + b * G + g)

    rows = tl.arange(0, BLOCK_M)                                        # row = token slot * H_PACK + head
    slot = tile * BLOCK_T + rows // H_PACK
    in_tile = (rows // H_PACK < BLOCK_T) & (slot < T)
    active = in_tile & (slot < count)
    tok = tl.load(order_row + slot, mask=in_tile, other=0)
    head = (head0 + rows % H_PACK).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    o_ptrs = (o_ptr + b.to(tl.int64) * sob + head[:, None] * soh + tok.to(tl.int64)[:, None] * sot
              + offs_d[None, :] * sod)
    tile_start = tile * BLOCK_T
    if tile_start >= count:  # only inactive tokens: their rows are 0
        tl.store(o_ptrs, tl.zeros([BLOCK_M, HEAD_DIM], dtype=o_ptr.dtype.element_ty), mask=in_tile[:, None])
    else:
        p_min = tl.load(order_row + tile_start)
        p_max = tl.load(order_row + tl.minimum(tile_start + BLOCK_T, count) - 1)
        qpos = tl.where(active, tok, p_max)  # padding rows act as the last query (finite, never stored)
        q_after = qpos - window
        q = tl.load(q_ptr + b.to(tl.int64) * sqb + head[:, None] * sqh + tok.to(tl.int64)[:, None] * sqt
                    + offs_d[None, :] * sqd, mask=active[:, None], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        k_base = k_ptr + b.to(tl.int64) * skb + kvh.to(tl.int64) * skh
        v_base = v_ptr + b.to(tl.int64) * svb + kvh.to(tl.int64) * svh
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        hi = p_max + 1
        full_hi = (p_min + 1) // BLOCK_N * BLOCK_N        # blocks ending at or before the first query
        if HAS_WINDOW:
            lo = tl.maximum(p_min - window + 1, 0) // BLOCK_N * BLOCK_N
            full_lo = tl.cdiv(tl.maximum(p_max - window + 1, 0), BLOCK_N) * BLOCK_N  # inside every window
        else:
            lo = 0
            full_lo = 0
        u_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
        u_hi = tl.minimum(tl.maximum(full_hi, u_lo), hi)
        # the window edge (short: not pipelined), the blocks every row sees whole, the causal edge
        if HAS_WINDOW:
            acc, l_i, m_i = _attend_blocks(acc, l_i, m_i, q, qpos, q_after, k_base, v_base, skt, skd, svt, svd,
                                           lo, u_lo, T, qk_scale, HEAD_DIM, BLOCK_N, True, HAS_WINDOW, PREC,
                                           UPCAST, 1)
        acc, l_i, m_i = _attend_blocks(acc, l_i, m_i, q, qpos, q_after, k_base, v_base, skt, skd, svt, svd,
                                       u_lo, u_hi, T, qk_scale, HEAD_DIM, BLOCK_N, False, HAS_WINDOW, PREC,
                                       UPCAST, STAGES)
        acc, l_i, m_i = _attend_blocks(acc, l_i, m_i, q, qpos, q_after, k_base, v_base, skt, skd, svt, svd,
                                       u_hi, hi, T, qk_scale, HEAD_DIM, BLOCK_N, True, HAS_WINDOW, PREC,
                                       UPCAST, STAGES)
        out = acc / l_i[:, None]
        out = tl.where(active[:, None], out, 0.0)
        tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=in_tile[:, None])


def empty_output(q: torch.Tensor) -> torch.Tensor:
    """[B, Hq, T, d] viewing a [B, T, Hq, d]-contiguous buffer (the layout SDPA's flash backend returns)."""
    B, Hq, T, d = q.shape
    return torch.empty((B, T, Hq, d), dtype=q.dtype, device=q.device).transpose(1, 2)


def kernel_constants(Hq: int, Hkv: int, d: int, group_size: int, window: Optional[int], dtype: torch.dtype,
                     cfg: dict) -> dict:
    """The constexpr arguments of _attn_prefill_kernel for this shape and tile config (the launcher's and the
    ahead-of-time compile test's)."""
    n_rep = Hq // Hkv
    h_pack = min(group_size, n_rep)
    block_t = cfg["BLOCK_M"] // h_pack
    if block_t < 1:
        raise ValueError(f"attn_prefill_triton: BLOCK_M {cfg['BLOCK_M']} is smaller than the {h_pack} heads a "
                         "tile packs")
    return dict(G=Hq // group_size, HKV=Hkv, GROUP_SIZE=group_size, N_REP=n_rep, H_PACK=h_pack, HEAD_DIM=d,
                BLOCK_M=cfg["BLOCK_M"], BLOCK_T=block_t, BLOCK_N=cfg["BLOCK_N"], HAS_WINDOW=window is not None,
                PREC="ieee" if (dtype == torch.float32 or interpreting()) else "tf32",
                UPCAST=interpreting() and dtype in (torch.bfloat16, torch.float16),  # interpreter half dots: inexact
                STAGES=cfg["num_stages"])


def attn_prefill_triton(q, k, v, mask, group_size: int, window: Optional[int] = None,
                        scale: Optional[float] = None, *, config: Optional[dict] = None,
                        wrap: bool = False) -> torch.Tensor:
    """q [B, Hq, T, d], k, v [B, Hkv, T, d], mask [B, T, G] bool -> [B, Hq, T, d] (module docstring).
    Any strides; d a power of two >= 16. config: tile overrides (CONFIG_KEYS)."""
    B, Hq, Hkv, T, d, G, n_rep = check_inputs(q, k, v, mask, group_size, window)
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"attn_prefill_triton: q, k, v must be float16, bfloat16 or float32, got {q.dtype} "
                         "(attn_prefill_ref computes any dtype)")
    if d < 16 or d & (d - 1):
        raise ValueError(f"attn_prefill_triton: head dim must be a power of two >= 16, got {d}")
    cfg = config_for(d, config)
    consts = kernel_constants(Hq, Hkv, d, group_size, window, q.dtype, cfg)
    out = empty_output(q)
    if B * T == 0:
        return out
    order, counts = active_order_triton(mask, wrap)
    n_tiles = triton.cdiv(T, consts["BLOCK_T"])
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    grid = (B * Hkv * (n_rep // consts["H_PACK"]) * n_tiles,)
    _launcher(_attn_prefill_kernel, wrap)[grid](
        q, k, v, out, order, counts, *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        T, n_tiles, scale * LOG2E, 0 if window is None else window,
        **consts, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out
