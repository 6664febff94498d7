"""Decode attention that reads only the KV heads of active head groups (flash-decoding, split over the
context), with its PyTorch reference beside it.

One query token per sequence attends over a (static) KV cache. A head group is `group_size` consecutive
query heads; with GQA, `n_rep = Hq // Hkv` query heads share one KV head. A KV head is read only when one
of its query heads belongs to an active group of that sequence, so at attention capacity c with KV-aligned
groups (`group_size = n_rep`) the kernel reads about c of the cache's bytes. An inactive group's output rows
are exactly 0 (the o_proj rewrite drops them anyway). K and V stay complete: this reads the cache, it never
skips writing it.

Two launches, both with grids that are static functions of the shapes (CUDA-graph friendly, no host sync):
  1. `_decode_split_kernel`, grid (B * Hkv, S): program (b, kv, s) returns at once when no query head of
     (b, kv) is active; otherwise it runs an online softmax over its slice of the keys for the n_rep query
     heads of that KV head (padded to a 16-row dot) and stores the normalised partial output and its
     log-sum-exp (base 2) per head.
  2. `_decode_combine_kernel`, grid (B * Hq,): an inactive head writes 0; an active head merges its S partials.
`key_mask` ([B, L] bool, True = attend; None = every key) covers a static cache's unwritten tail or padding.
A query with no visible key gets 0 (SDPA would give NaN there).
"""
from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Optional

import torch
import triton
import triton.language as tl

from .reorder import _mask_bytes, _launcher
from .tuning import cuda_device_key, interpreting

MIN_BLOCK_H = 16        # a tl.dot needs at least 16 rows: the n_rep query heads of one KV head, padded
# block_n: keys per inner step; programs_per_sm: the context is split until each SM has about this many
# (b, kv, split) programs, active or not; num_warps / num_stages of the split kernel
DEFAULT_CONFIG = {"block_n": 128, "programs_per_sm": 8, "num_warps": 4, "num_stages": 2}
BLOCK_N = DEFAULT_CONFIG["block_n"]
# A GPU with a tuned file (configs/attn_decode/<GPU name>.json, written by benchmarks/attention_decode.py
# --sweep --write-config: the sweep's fastest config per swept shape) runs each call with the config of the swept
# shape nearest to it in (log sequences x KV heads, log context); DEFAULT_CONFIG is the fallback.
TUNED_DIR = Path(__file__).with_name("configs") / "attn_decode"


def nearest_config(rows, B: int, Hkv: int, L: int) -> dict:
    """rows: [{"B", "Hkv", "ctx", "config"}] -> the config of the row nearest to (B * Hkv, L) in log2 units
    (ties: the larger swept shape); {} without rows."""
    if not rows:
        return {}

    def dist(r):
        return (abs(math.log2(r["B"] * r["Hkv"] / (B * Hkv))) + abs(math.log2(r["ctx"] / L)),
                -r["B"] * r["Hkv"], -r["ctx"])
    return dict(min(rows, key=dist)["config"])


def check_tuned(d: dict, where: str) -> list:
    """A tuned file's rows, checked: each names B, Hkv, ctx (positive ints) and a config of DEFAULT_CONFIG's keys."""
    rows = d.get("rows")
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"{where}: a decode attention tuned file needs a non-empty 'rows' list (regenerate it with "
                         "benchmarks/attention_decode.py --sweep --write-config)")
    for r in rows:
        if not all(isinstance(r.get(k), int) and r[k] > 0 for k in ("B", "Hkv", "ctx")):
            raise ValueError(f"{where}: row {r} needs positive integers B, Hkv and ctx")
        bad = sorted(set(r.get("config", {})) - set(DEFAULT_CONFIG)) if isinstance(r.get("config"), dict) else ["?"]
        if bad:
            raise ValueError(f"{where}: row {r} has config keys {bad} outside {sorted(DEFAULT_CONFIG)}")
    return rows


@functools.lru_cache(maxsize=None)
def _tuned_rows(key: str) -> tuple:
    path = TUNED_DIR / f"{key}.json"
    if not path.exists():
        return ()
    with open(path) as f:
        return tuple(check_tuned(json.load(f), str(path)))


def tuned_config(B: int, Hkv: int, L: int, device) -> dict:
    """The tuned file's config for this shape on `device`: {} under the interpreter, off CUDA or without a file."""
    key = None if interpreting() else cuda_device_key(device)
    return nearest_config(_tuned_rows(key), B, Hkv, L) if key is not None else {}


def check_groups(num_heads: int, num_kv_heads: int, group_size: int, who: str = "") -> int:
    """n_rep = Hq // Hkv, after checking that the query heads share the KV heads evenly and that no head group
    straddles two KV heads (the rule of both attention kernels; `who` prefixes the error, e.g. "attn_prefill: ")."""
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"{who}the query heads ({num_heads}) must be a multiple of the KV heads ({num_kv_heads})")
    n_rep = num_heads // num_kv_heads
    if group_size < 1 or num_heads % group_size:
        raise ValueError(f"{who}head group size {group_size} does not divide the {num_heads} query heads")
    if group_size % n_rep and n_rep % group_size:
        raise ValueError(f"{who}a head group of {group_size} query heads would span part of two KV heads ({n_rep} "
                         f"query heads share one KV head); head groups must not straddle KV heads: use a group "
                         f"size that divides {n_rep} or is a multiple of it (WideConfig(head_group_size='kv') "
                         "aligns groups with KV heads)")
    return n_rep


def attn_decode_ref(q, k, v, head_mask, group_size: int, key_mask: Optional[torch.Tensor] = None,
                    scale: Optional[float] = None) -> torch.Tensor:
    """q [B, Hq, 1, d], k / v [B, Hkv, L, d], head_mask [B, G] bool, key_mask [B, L] bool or None
    -> [B, Hq, 1, d]: softmax attention in fp32 (float64 for float64 inputs), inactive groups' rows = 0."""
    B, Hq, _, d = q.shape
    n_rep = check_groups(Hq, k.shape[1], group_size)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    kf = k.to(acc).repeat_interleave(n_rep, dim=1)                       # [B, Hq, L, d]
    vf = v.to(acc).repeat_interleave(n_rep, dim=1)
    s = (q.to(acc) @ kf.transpose(-1, -2)) * scale                       # [B, Hq, 1, L]
    if key_mask is not None:
        s = s.masked_fill(~key_mask.bool()[:, None, None, :], float("-inf"))
    seen = torch.isfinite(s).any(-1, keepdim=True)                       # a query with no visible key -> 0
    p = torch.softmax(s.masked_fill(~seen, 0.0), dim=-1)
    out = (p @ vf).to(q.dtype)
    keep = head_mask.bool().repeat_interleave(group_size, dim=1)[:, :, None, None] & seen
    return torch.where(keep, out, torch.zeros((), dtype=out.dtype, device=out.device))


@triton.jit
def _decode_split_kernel(q_ptr, k_ptr, v_ptr, hm_ptr, km_ptr, po_ptr, plse_ptr,
                         L, split_len, qk_scale,
                         sq_b, sq_h, sk_b, sk_h, sk_l, sv_b, sv_h, sv_l, shm_b, skm_b,
                         Hkv: tl.constexpr, n_rep: tl.constexpr, group_size: tl.constexpr,
                         D: tl.constexpr, S: tl.constexpr, HAS_KEY_MASK: tl.constexpr,
                         DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    # (b, kv) varies fastest, so the programs that exit at once are spread evenly over the launch order
    bkv = tl.program_id(0)
    s_id = tl.program_id(1)
    # Inductor types a Python float argument of a user kernel as fp64: the softmax state stays fp32
    qk_scale = tl.cast(qk_scale, tl.float32)
    b = bkv // Hkv
    kv = bkv % Hkv
    rh = tl.arange(0, BLOCK_H)
    head = kv * n_rep + rh                                               # query heads of this KV head
    hvalid = rh < n_rep
    active = tl.load(hm_ptr + b * shm_b + head // group_size, mask=hvalid, other=0) != 0
    if tl.max(active.to(tl.int32), axis=0) == 0:
        return
    rd = tl.arange(0, BLOCK_D)
    dvalid = rd < D
    q = tl.load(q_ptr + b * sq_b + head[:, None] * sq_h + rd[None, :],
                mask=hvalid[:, None] & dvalid[None, :], other=0.0)               # [BLOCK_H, BLOCK_D]
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
    lo = s_id * split_len
    hi = tl.minimum(lo + split_len, L)
    k_base = k_ptr + b * sk_b + kv * sk_h
    v_base = v_ptr + b * sv_b + kv * sv_h
    for start in range(lo, hi, BLOCK_N):
        rn = start + tl.arange(0, BLOCK_N)
        nvalid = rn < hi
        if HAS_KEY_MASK:
            nvalid = nvalid & (tl.load(km_ptr + b * skm_b + rn, mask=rn < hi, other=0) != 0)
        kt = tl.load(k_base + rn[None, :] * sk_l + rd[:, None], mask=(rn < hi)[None, :] & dvalid[:, None],
                     other=0.0)                                          # [BLOCK_D, BLOCK_N]
        # scores in log2 units: the scale times log2(e) is applied in fp32, so the softmax runs on exp2
        if UPCAST:  # the Triton CPU interpreter mis-computes bf16 dots: exact upcast to fp32
            sc = tl.dot(q.to(tl.float32), kt.to(tl.float32), input_precision="ieee") * qk_scale
        else:
            sc = tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_H, BLOCK_N]
        sc = tl.where(nvalid[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)            # no visible key yet: keep sums at 0
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(sc - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # masked keys' values are not loaded: 0 * inf from a garbage cache slot would poison the row
        vt = tl.load(v_base + rn[:, None] * sv_l + rd[None, :], mask=nvalid[:, None] & dvalid[None, :],
                     other=0.0)                                          # [BLOCK_N, BLOCK_D]
        pv = p.to(vt.dtype)                                              # rounded as flash attention does
        if UPCAST:
            acc = acc * alpha[:, None] + tl.dot(pv.to(tl.float32), vt.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(pv, vt, input_precision=DOT_PRECISION)
        m_i = m_new
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    row = (b * Hkv * n_rep + head) * S + s_id                            # partials: [B, Hq, S, (D)]
    tl.store(po_ptr + row[:, None] * D + rd[None, :], out, mask=hvalid[:, None] & dvalid[None, :])
    tl.store(plse_ptr + row, lse, mask=hvalid)


@triton.jit
def _decode_combine_kernel(po_ptr, plse_ptr, hm_ptr, o_ptr, so_b, so_h, shm_b,
                           Hq: tl.constexpr, group_size: tl.constexpr, D: tl.constexpr, S: tl.constexpr,
                           BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    bh = tl.program_id(0)
    b = bh // Hq
    h = bh % Hq
    rd = tl.arange(0, BLOCK_D)
    dvalid = rd < D
    active = tl.load(hm_ptr + b * shm_b + h // group_size) != 0
    o_row = o_ptr + b * so_b + h * so_h + rd
    if not active:
        tl.store(o_row, tl.zeros((BLOCK_D,), tl.float32).to(o_ptr.dtype.element_ty), mask=dvalid)
        return
    rs = tl.arange(0, BLOCK_S)
    svalid = rs < S
    lse = tl.load(plse_ptr + bh * S + rs, mask=svalid, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)                                                 # 0 for splits with no visible key
    part = tl.load(po_ptr + (bh * S + rs)[:, None] * D + rd[None, :], mask=svalid[:, None] & dvalid[None, :],
                   other=0.0)
    part = tl.where((w > 0)[:, None], part, 0.0)                          # skipped splits were never written
    tot = tl.sum(w, axis=0)
    out = tl.sum(part * w[:, None], axis=0) / tl.where(tot > 0, tot, 1.0)
    tl.store(o_row, out.to(o_ptr.dtype.element_ty), mask=dvalid)


def num_splits(B: int, Hkv: int, L: int, device: torch.device, block_n: int = BLOCK_N,
               programs_per_sm: int = DEFAULT_CONFIG["programs_per_sm"]) -> tuple[int, int]:
    """(S, split_len): split the context so the (b, kv, split) programs fill the GPU; a static function of
    the shapes and the device (so a CUDA graph replays the same grid)."""
    if interpreting() or device.type != "cuda":
        n_sm = 1
    else:
        n_sm = torch.cuda.get_device_properties(device).multi_processor_count
    blocks = triton.cdiv(L, block_n)
    S = max(1, min(blocks, triton.cdiv(programs_per_sm * n_sm, B * Hkv)))
    split_len = triton.cdiv(blocks, S) * block_n
    return triton.cdiv(L, split_len), split_len


def _partials(B: int, Hq: int, S: int, D: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per split: the normalised partial output [B, Hq, S, D] and its base-2 log-sum-exp [B, Hq, S]."""
    return (torch.empty((B, Hq, S, D), dtype=torch.float32, device=device),
            torch.empty((B, Hq, S), dtype=torch.float32, device=device))


def attn_decode_triton(q, k, v, head_mask, group_size: int, key_mask: Optional[torch.Tensor] = None,
                       scale: Optional[float] = None, *, config: Optional[dict] = None,
                       wrap: bool = False) -> torch.Tensor:
    """q [B, Hq, 1, d], k / v [B, Hkv, L, d] (last dim contiguous), head_mask [B, G] bool, key_mask [B, L]
    bool or None -> [B, Hq, 1, d] (see the module docstring). config: fields to change in the shape's config
    (DEFAULT_CONFIG, then the GPU's tuned file: `tuned_config`)."""
    B, Hq, Tq, D = q.shape
    if Tq != 1:
        raise ValueError(f"attn_decode takes one query token per sequence, got {Tq}")
    Hkv, L = k.shape[1], k.shape[2]
    cfg = {**DEFAULT_CONFIG, **tuned_config(B, Hkv, L, q.device), **(config or {})}
    n_rep = check_groups(Hq, Hkv, group_size)
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("attn_decode needs K / V with a contiguous last (head_dim) dimension")
    q3 = q.reshape(B, Hq, D).contiguous()
    hm = _mask_bytes(head_mask)                                            # [B, G]
    km = _mask_bytes(key_mask) if key_mask is not None else hm
    S, split_len = num_splits(B, Hkv, L, q.device, cfg["block_n"], cfg["programs_per_sm"])
    po, plse = _partials(B, Hq, S, D, q.device)
    out = torch.empty((B, Hq, 1, D), dtype=q.dtype, device=q.device)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    BLOCK_D = triton.next_power_of_2(D)
    BLOCK_H = max(MIN_BLOCK_H, triton.next_power_of_2(n_rep))
    _launcher(_decode_split_kernel, wrap)[(B * Hkv, S)](
        q3, k, v, hm, km, po, plse, L, split_len, scale * 1.4426950408889634,
        q3.stride(0), q3.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        hm.stride(0), km.stride(0),
        Hkv=Hkv, n_rep=n_rep, group_size=group_size, D=D, S=S, HAS_KEY_MASK=key_mask is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=interpreting() and q.dtype == torch.bfloat16,
        BLOCK_H=BLOCK_H, BLOCK_N=cfg["block_n"], BLOCK_D=BLOCK_D,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    _launcher(_decode_combine_kernel, wrap)[(B * Hq,)](
        po, plse, hm, out, out.stride(0), out.stride(1), hm.stride(0),
        Hq=Hq, group_size=group_size, D=D, S=S, BLOCK_S=triton.next_power_of_2(S), BLOCK_D=BLOCK_D,
        num_warps=4)
    return out
