"""Mask reorder: turn a per-token group mask [T, G] into index structures.

Layout of ``mask_reorder(mask, block_m)`` (all int32, static worst-case sizes, no host sync):

* ``tile_groups`` [n_tiles, G], n_tiles = ceil(T / block_m): for each tile of ``block_m``
  consecutive tokens, the ids of the groups active for at least one token of the tile, ascending,
  followed by the inactive groups (ascending) -- every row is a permutation of 0..G-1.
  With ``block_m == 1`` this is the per-token compact list of active group ids (decode).
* ``tile_counts`` [n_tiles]: number of active groups in each tile (the valid prefix length).
* ``sorted_token_ids`` [n_blocks * block_m], n_blocks = G * n_tiles: group-major token lists, each
  group's list padded to a multiple of block_m with the sentinel T (like vLLM's
  moe_align_block_size, written from scratch); entries past ``num_tokens_post_padded`` are T.
* ``block_groups`` [n_blocks]: group id of each block of block_m entries, -1 past the end.
* ``num_tokens_post_padded`` [1]: total padded length actually used.

The token-major kernels (decode GEMV, down/o K-skipping GEMM) use the tile lists; the
group-major gather GEMM (prefill gate/up/q) uses the sorted lists.
"""
from __future__ import annotations

import triton
import triton.language as tl
import torch


@triton.jit(do_not_specialize=["T"])
def _tile_lists_kernel(mask_ptr, tg_ptr, tc_ptr, T, G: tl.constexpr, BM: tl.constexpr, GP2: tl.constexpr):
    m = tl.program_id(0)
    rows = m * BM + tl.arange(0, BM)
    gs = tl.arange(0, GP2)
    gvalid = gs < G
    ld = tl.load(mask_ptr + rows[:, None] * G + gs[None, :],
                 mask=(rows[:, None] < T) & gvalid[None, :], other=0).to(tl.int32)
    act = tl.max(ld, axis=0)  # [GP2]
    act = tl.where(gvalid, act, 0)
    incl = tl.cumsum(act, axis=0)
    excl = incl - act
    cnt = tl.sum(act, axis=0)
    pos = tl.where(act > 0, excl, cnt + gs - excl)
    tl.store(tg_ptr + m * G + pos, gs.to(tl.int32), mask=gvalid)
    tl.store(tc_ptr + m, cnt.to(tl.int32))


@triton.jit(do_not_specialize=["T"])
def _group_counts_kernel(mask_ptr, cnt_ptr, T, G: tl.constexpr, BT: tl.constexpr):
    g = tl.program_id(0)
    acc = tl.zeros([BT], dtype=tl.int32)
    for t0 in range(0, T, BT):
        t = t0 + tl.arange(0, BT)
        acc += tl.load(mask_ptr + t * G + g, mask=t < T, other=0).to(tl.int32)
    tl.store(cnt_ptr + g, tl.sum(acc, axis=0))


@triton.jit(do_not_specialize=["T", "P"])
def _group_lists_kernel(mask_ptr, cnt_ptr, sorted_ptr, bgroup_ptr, ntpp_ptr, gblk_ptr, T, P,
                        G: tl.constexpr, GP2: tl.constexpr, BM: tl.constexpr, BT: tl.constexpr):
    g = tl.program_id(0)
    gs = tl.arange(0, GP2)
    c = tl.load(cnt_ptr + gs, mask=gs < G, other=0)
    padded = (c + BM - 1) // BM * BM
    total = tl.sum(padded, axis=0)
    off = tl.sum(tl.where(gs < g, padded, 0), axis=0)
    my_c = tl.sum(tl.where(gs == g, c, 0), axis=0)
    my_p = tl.sum(tl.where(gs == g, padded, 0), axis=0)
    # scatter this group's active tokens, in token order
    base = off
    for t0 in range(0, T, BT):
        t = t0 + tl.arange(0, BT)
        a = tl.load(mask_ptr + t * G + g, mask=t < T, other=0).to(tl.int32)
        r = tl.cumsum(a, axis=0) - a
        tl.store(sorted_ptr + base + r, t.to(tl.int32), mask=a > 0)
        base += tl.sum(a, axis=0)
    # padding of this group's list
    for p0 in range(off + my_c, off + my_p, BT):
        p = p0 + tl.arange(0, BT)
        tl.store(sorted_ptr + p, tl.zeros([BT], dtype=tl.int32) + T, mask=p < off + my_p)
    # block -> group
    for b0 in range(off // BM, (off + my_p) // BM, BT):
        b = b0 + tl.arange(0, BT)
        tl.store(bgroup_ptr + b, tl.zeros([BT], dtype=tl.int32) + g, mask=b < (off + my_p) // BM)
    # tail past the used length, shared round-robin between the programs
    nb = P // BM
    for b0 in range(total // BM + g * BT, nb, G * BT):
        b = b0 + tl.arange(0, BT)
        tl.store(bgroup_ptr + b, tl.zeros([BT], dtype=tl.int32) - 1, mask=b < nb)
    for p0 in range(total + g * BT, P, G * BT):
        p = p0 + tl.arange(0, BT)
        tl.store(sorted_ptr + p, tl.zeros([BT], dtype=tl.int32) + T, mask=p < P)
    # per-group first block and number of blocks (used by the swizzled gather GEMM)
    tl.store(gblk_ptr + g, (off // BM).to(tl.int32))
    tl.store(gblk_ptr + G + g, (my_p // BM).to(tl.int32))
    if g == 0:
        tl.store(ntpp_ptr, total.to(tl.int32))


# Tests set this to True: every buffer a kernel is supposed to write is NaN/garbage-filled first,
# so an unwritten element (or a read of an unwritten intermediate) fails the comparison.
POISON = False


def alloc(shape, dtype, device):
    t = torch.empty(shape, dtype=dtype, device=device)
    if POISON:
        if dtype.is_floating_point:
            t.fill_(float("nan"))
        else:  # -12345, or the largest value of an integer type too narrow for it (a uint8 mask: 255)
            info = torch.iinfo(dtype)
            t.fill_(-12345 if info.min <= -12345 else info.max)
    return t


def _launcher(kernel, wrap):
    if not wrap:
        return kernel
    try:
        from torch.library import wrap_triton
        return wrap_triton(kernel)
    except Exception:
        return kernel


def _mask_bytes(mask: torch.Tensor) -> torch.Tensor:
    # A mask of one byte per entry, as the kernels read it (each loads an entry and compares it with 0): bool or
    # uint8 pass as they are. No conversion: where the mask is an opaque kernel's output (the fused norm + router)
    # Inductor cannot fuse one into its producer, and each would be a launch of its own per op. Other dtypes
    # become bool with .to(), never .view() (Inductor cannot lower aten.view.dtype to or from bool in a triton_op).
    return mask.contiguous() if mask.dtype in (torch.bool, torch.uint8) else mask.contiguous().to(torch.bool)


def tile_lists_triton(mask: torch.Tensor, block_m: int, wrap: bool = False):
    T, G = mask.shape
    n_tiles = triton.cdiv(T, block_m)
    m8 = _mask_bytes(mask)
    tg = alloc((n_tiles, G), torch.int32, mask.device)
    tc = alloc((n_tiles,), torch.int32, mask.device)
    _launcher(_tile_lists_kernel, wrap)[(n_tiles,)](
        m8, tg, tc, T, G=G, BM=block_m, GP2=triton.next_power_of_2(G))
    return tg, tc


def group_lists_triton(mask: torch.Tensor, block_m: int, wrap: bool = False, with_group_blocks: bool = False):
    T, G = mask.shape
    n_tiles = triton.cdiv(T, block_m)
    P = G * n_tiles * block_m
    m8 = _mask_bytes(mask)
    cnt = alloc((G,), torch.int32, mask.device)
    sorted_ids = alloc((P,), torch.int32, mask.device)
    bgroups = alloc((G * n_tiles,), torch.int32, mask.device)
    ntpp = alloc((1,), torch.int32, mask.device)
    gblk = alloc((2 * G,), torch.int32, mask.device)
    BT = min(1024, max(16, triton.next_power_of_2(T)))
    _launcher(_group_counts_kernel, wrap)[(G,)](m8, cnt, T, G=G, BT=BT)
    _launcher(_group_lists_kernel, wrap)[(G,)](
        m8, cnt, sorted_ids, bgroups, ntpp, gblk, T, P, G=G, GP2=triton.next_power_of_2(G), BM=block_m, BT=BT)
    if with_group_blocks:
        return sorted_ids, bgroups, ntpp, gblk
    return sorted_ids, bgroups, ntpp


def mask_reorder_triton(mask: torch.Tensor, block_m: int, wrap: bool = False):
    tg, tc = tile_lists_triton(mask, block_m, wrap)
    s, b, n = group_lists_triton(mask, block_m, wrap)
    return tg, tc, s, b, n
