"""Bucketed (codebook / nested) MLP: tokens sorted by prototype, each bucket's work tile-shaped.

Semantics: exactly ``wide.mlp`` (reference.mlp_ref) with the per-token mask ``protos[bucket]``:

    x [T, D], w_gate / w_up [F, D], w_down [D, F] (down_proj.weight as is), bucket [T] integer (prototype id
    per token), protos [P, G] bool (G = F // group_size) -> out [T, D]
    out[t] = down(act(x[t] Wg^T) * (x[t] Wu^T) on the groups of protos[bucket[t]], 0 elsewhere)

A bucket id outside [0, P) gives a NaN output row (here and in the reference alike): checking the ids on
the host would cost a device sync, and NaN cannot pass for a result. The router's argmax never produces one.

Three launches, no host sync, every buffer a static function of (T, P, F) and the block size BM:

1. ``_bucket_lists_kernel`` (one program per bucket, plus one for out-of-range ids): a counting sort of the
   tokens by bucket (moe_align-style): each bucket's token list, in token order, padded to a multiple of BM
   with the sentinel T; the bucket of every block of BM entries (-1 past the end); per prototype its active
   group ids ascending (then the inactive ones) and their count. At most n_blocks(T, P, BM) blocks are used.
2. ``_bucket_gather_n_kernel`` (gated): program (block, column tile of the bucket's compact width) gathers the
   block's x rows by token id and the gate/up weight rows of the prototype's groups, accumulates in fp32 and
   writes h = act(g) * u, rounded to x's dtype once, into the bucket-compact buffer H [n_blocks * BM, F]
   (column block j of a row = the j-th active group of its prototype). Programs past the width exit.
3. ``_bucket_gather_k_kernel``: program (block, tile of D) loops K over the prototype's active groups only
   (H's compact columns, W_down's matching columns), fp32 accumulation, and stores each token's output row
   at its original position. Every token is in exactly one bucket, so every output element is written
   exactly once: no atomics, no zero fill; an all-off prototype writes exact zeros.
The two GEMM kernels also serve the attention projections (bucket_attn.py: bias, q's scatter, o's gathered
input).

With config prefill_lists="union" (the GPU default) the tokens are not padded per bucket: they are sorted by their
prototype's width (then id, width_order), cut into blocks of BM consecutive tokens, and each block runs over the
union of its tokens' prototypes, the (token, group) pairs off a token's own prototype masked to 0 (the union block
below, per block). Trained routers fill many buckets far smaller than a block, which the padded lists pad to whole
blocks (benchmarks/results/bucket-padding/, benchmarks/results/gemv-h100/bucket-recorded/).

With config h_layout="global" the gate/up kernel's programs run over (global column tile, block), the block
index fastest, and write h at the groups' own columns (a tile no token of the block needs exits at once); the down
kernel reads h there and runs its programs block-fastest too (the attention's q projection, which stores at the
groups' own columns anyway, takes the same program order). Every block that needs a weight tile then reads it
while the tile is in L2. In the compact layout column tile j of two blocks of different prototypes holds different
groups, so each block reads its prototype's weights from memory: a prefill of many blocks reads the gate/up
weights about once per block where the dense layer reads them once (benchmarks/KERNELS_NOTES.md, "Weight traffic
of the bucketed prefill").

One token (a batch-1 decode step) runs on gemv's two GEMVs over its prototype's groups (config one_token).
Few tokens (T <= union_max_t, a decode step) take one block instead (or, with config few_tokens="dense", dense
GEMMs with their masks applied, as wide.mlp's small-batch path) ("union" lists, ``_union_lists_kernel``):
all T tokens over the union of their prototypes' groups, each group's weights read once for every token, and
the (token, group) pairs off a token's own prototype masked to 0 (as wide.mlp's tile path). Sorting a decode
batch into buckets would read the weights of every bucket's prototype separately.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from . import reference as _ref
from . import gemv
from .activations import ACT_IDS, gated_act
from .compact_mlp import fit_shared_memory, gather_gemm, shared_memory_bytes
from .dense_masked import mlp_dense_masked
from .reorder import _mask_bytes, _launcher, alloc
from .tuning import DECODE_T, interpreting

# Tile configs per device class and phase (decode: T <= DECODE_T). block_m is the token block both GEMMs and the
# token lists share; union_max_t the largest T that runs as one union block (T <= block_m too); up_* tile the
# gate/up kernel (N over the compact width, K over D), dn_* the down kernel (N over D, K over the active groups).
# one_token: "gemv" runs a single token on gemv's two GEMVs (its own tiles, gemv.CONFIG_KEYS, may be
# given as overrides too), "union" as a one-token union block. few_tokens: what runs the tokens of a union block
# (2 <= T, uses_union): "union" the block, "dense" dense GEMMs with the mask applied (dense_masked.py). On the
# GPU few tokens run dense: at 8 and 16 tokens the union block is slower than dense GEMMs plus the mask
# (benchmarks/results/one-token-h200/). The interpreter keeps the union block as its default, so the tests'
# default mode runs it (their "few" mode runs the other). The interpreter's tiles are small so the tests'
# tiny shapes still span several blocks and tiles. prefill_lists: "union" on the GPU (on trained routers' buckets the
# padded lists compute several times the asked work: benchmarks/results/gemv-h100/bucket-recorded/); the
# interpreter's default stays "padded", so the tests' default mode runs the bucket lists (their "union_blocks" mode
# runs the other). h_layout: "compact" (h's column block j = the block's j-th group) everywhere until a sweep row
# of "global" (the module docstring) is timed faster. benchmarks/bench_bucket_mlp.py --sweep times SWEEP[phase].
CONFIGS = {
    "cuda": {
        "decode": dict(block_m=16, up_bn=32, up_bk=128, up_warps=4, up_stages=4,
                       dn_bn=32, dn_bk=64, dn_warps=4, dn_stages=4, group_m=1, union_max_t=DECODE_T,
                       one_token="gemv", few_tokens="dense", prefill_lists="union", h_layout="compact",
                       up_fuse=False),
        "prefill": dict(block_m=128, up_bn=128, up_bk=64, up_warps=8, up_stages=3,
                        dn_bn=128, dn_bk=64, dn_warps=8, dn_stages=4, group_m=8, union_max_t=DECODE_T,
                        one_token="gemv", few_tokens="dense", prefill_lists="union", h_layout="compact",
                        up_fuse=False),
    },
    "interpreter": dict(block_m=16, up_bn=16, up_bk=16, up_warps=1, up_stages=1,
                        dn_bn=16, dn_bk=16, dn_warps=1, dn_stages=1, group_m=2, union_max_t=DECODE_T,
                        one_token="gemv", few_tokens="union", prefill_lists="padded", h_layout="compact",
                        up_fuse=False),
}
CONFIG_KEYS = tuple(CONFIGS["interpreter"])
SWEEP = {
    "decode": (
        dict(block_m=16, up_bn=32, up_bk=128, up_warps=4, up_stages=4, dn_bn=32, dn_bk=64, dn_warps=4, dn_stages=4),
        dict(block_m=16, up_bn=64, up_bk=128, up_warps=4, up_stages=3, dn_bn=64, dn_bk=64, dn_warps=4, dn_stages=4),
        dict(block_m=16, up_bn=16, up_bk=256, up_warps=4, up_stages=3, dn_bn=16, dn_bk=64, dn_warps=2, dn_stages=6),
        dict(block_m=16, up_bn=32, up_bk=64, up_warps=2, up_stages=6, dn_bn=32, dn_bk=64, dn_warps=2, dn_stages=6),
        dict(union_max_t=0),  # bucket lists instead of the union block: what sorting a decode batch costs
    ),
    "prefill": (
        dict(block_m=128, up_bn=128, up_bk=64, up_warps=8, up_stages=3, dn_bn=128, dn_bk=64, dn_warps=8, dn_stages=4),
        dict(block_m=128, up_bn=64, up_bk=64, up_warps=4, up_stages=4, dn_bn=128, dn_bk=64, dn_warps=8, dn_stages=3),
        dict(block_m=64, up_bn=128, up_bk=64, up_warps=4, up_stages=4, dn_bn=128, dn_bk=64, dn_warps=4, dn_stages=4),
        dict(block_m=64, up_bn=64, up_bk=64, up_warps=4, up_stages=4, dn_bn=64, dn_bk=64, dn_warps=4, dn_stages=4),
        dict(block_m=128, up_bn=128, up_bk=64, up_warps=8, up_stages=4, dn_bn=256, dn_bk=64, dn_warps=8, dn_stages=3),
        # h over the groups' own columns, programs block-fastest (the module docstring's h_layout="global")
        dict(h_layout="global"),
        dict(h_layout="global", up_bn=64, up_warps=4, up_stages=4),
        dict(h_layout="global", block_m=64, up_bn=64, up_warps=4, up_stages=4, dn_warps=4),
        # gate and up in one dot (compact_mlp.gather_gemm's FUSE_GU)
        dict(up_fuse=True), dict(h_layout="global", up_fuse=True, up_bn=64, up_warps=8, up_stages=3),
    ),
}
H_LAYOUTS = ("compact", "global")


def phase(T: int) -> str:
    return "decode" if T <= DECODE_T else "prefill"


def config_for(T: int, group_size: int, dtype: torch.dtype, device=None, overrides: Optional[dict] = None) -> dict:
    """The tile config for T tokens (the interpreter's under TRITON_INTERPRET=1), its down K tile capped at the
    group (a K tile never spans two groups' columns of h), fitted to the device's shared memory for this dtype,
    then `overrides` (sweeps, tests) unchanged."""
    if interpreting():
        cfg = dict(CONFIGS["interpreter"])
    else:
        cfg = dict(CONFIGS["cuda"][phase(T)])
        cfg["dn_bk"] = min(cfg["dn_bk"], max(16, triton.next_power_of_2(group_size)))
        view = dict(cfg, up_bm=cfg["block_m"], dn_bm=cfg["block_m"])
        fitted = fit_shared_memory(view, torch.empty((), dtype=dtype).element_size(), shared_memory_bytes(device))
        cfg.update({k: fitted[k] for k in cfg})
    if overrides:
        bad = [k for k in overrides if k not in CONFIG_KEYS + gemv.CONFIG_KEYS]
        if bad:
            raise ValueError(f"mlp_bucket config: unknown keys {bad}; the keys are "
                             f"{CONFIG_KEYS + gemv.CONFIG_KEYS}")
        cfg.update(overrides)
    if cfg["one_token"] not in ("gemv", "union"):
        raise ValueError(f"mlp_bucket config: one_token must be 'gemv' or 'union', got {cfg['one_token']!r}")
    if cfg["prefill_lists"] not in ("padded", "union"):
        raise ValueError(f"mlp_bucket config: prefill_lists must be 'padded' or 'union', got "
                         f"{cfg['prefill_lists']!r}")
    if cfg["h_layout"] not in H_LAYOUTS:
        raise ValueError(f"mlp_bucket config: h_layout must be one of {H_LAYOUTS}, got {cfg['h_layout']!r}")
    if cfg["few_tokens"] not in ("union", "dense"):
        raise ValueError(f"mlp_bucket config: few_tokens must be 'union' or 'dense', got {cfg['few_tokens']!r}")
    for k in ("block_m", "up_bn", "up_bk", "dn_bn", "dn_bk"):
        if cfg[k] < 16 or cfg[k] & (cfg[k] - 1):
            raise ValueError(f"mlp_bucket config: {k} must be a power of two >= 16 (tl.dot), got {cfg[k]}")
    return cfg


def uses_union(T: int, cfg: dict) -> bool:
    """One block over the union of the tokens' prototypes (few tokens) instead of bucket lists."""
    return T <= min(cfg["union_max_t"], cfg["block_m"])


def uses_dense(T: int, cfg: dict) -> bool:
    """Dense GEMMs with the tokens' masks applied instead of the union block (config few_tokens="dense")."""
    return 2 <= T and uses_union(T, cfg) and cfg["few_tokens"] == "dense"


def mask_and_valid(bucket: torch.Tensor, protos: torch.Tensor) -> tuple:
    """(mask [T, G] = protos[bucket], all-off for ids outside [0, P); valid [T]: the id is in [0, P))."""
    P = protos.shape[0]
    valid = (bucket >= 0) & (bucket < P)
    return protos[torch.where(valid, bucket, 0).long()] & valid[:, None], valid


def nan_rows(out: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """out with NaN rows where the token's id is outside [0, P)."""
    return torch.where(valid[:, None], out, torch.full((), float("nan"), dtype=out.dtype, device=out.device))


def n_blocks(T: int, P: int, block_m: int) -> int:
    """Worst-case number of token blocks: k non-empty buckets (out-of-range ids counted as one more) hold T
    tokens in at most cdiv(T, BM) + k - 1 blocks, and k <= min(P + 1, T)."""
    return triton.cdiv(T, block_m) + max(0, min(P, T - 1))


# ----------------------------------------------------------------------------- validation + references

def check_bucket(bucket, protos, T: int, G: int, name: str, groups: str) -> int:
    """The bucket ids and the prototype table of one call (`groups` says what G counts, for the error);
    returns P."""
    if protos.dim() != 2 or protos.shape[1] != G or protos.shape[0] < 1 or protos.dtype != torch.bool:
        raise ValueError(f"{name}: protos must be bool [P, G] with P >= 1 and {groups}, got {protos.dtype} "
                         f"{tuple(protos.shape)}")
    if tuple(bucket.shape) != (T,) or bucket.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: bucket must be int32 or int64 [T] = [{T}] (one prototype id per token), got "
                         f"{bucket.dtype} {tuple(bucket.shape)}")
    return protos.shape[0]


def check_inputs(x, w_gate, w_up, w_down, bucket, protos, group_size: int, act: str) -> tuple:
    """Shapes, dtypes and devices of one wide.mlp_bucket call; returns (T, D, F, G, P)."""
    if act not in ACT_IDS:
        raise ValueError(f"mlp_bucket: unknown activation {act!r}; choose one of {tuple(ACT_IDS)}")
    if x.dim() != 2 or w_gate.dim() != 2 or w_down.dim() != 2:
        raise ValueError(f"mlp_bucket: x must be [T, D], w_gate / w_up [F, D], w_down [D, F]; got x "
                         f"{tuple(x.shape)}, w_gate {tuple(w_gate.shape)}, w_down {tuple(w_down.shape)}")
    T, D = x.shape
    F = w_gate.shape[0]
    if group_size < 1 or F % group_size:
        raise ValueError(f"mlp_bucket: group_size {group_size} must divide the intermediate size F = {F}")
    G = F // group_size
    if tuple(w_gate.shape) != (F, D) or tuple(w_up.shape) != (F, D) or tuple(w_down.shape) != (D, F):
        raise ValueError(f"mlp_bucket: with x [T, {D}] the weights must be w_gate / w_up [{F}, {D}] and w_down "
                         f"[{D}, {F}] (down_proj.weight), got {tuple(w_gate.shape)}, {tuple(w_up.shape)}, "
                         f"{tuple(w_down.shape)}")
    check_bucket(bucket, protos, T, G, "mlp_bucket", f"G = F // group_size = {G}")
    if len({x.device, w_gate.device, w_up.device, w_down.device, bucket.device, protos.device}) > 1:
        raise ValueError("mlp_bucket: x, the weights, bucket and protos must be on one device")
    if len({x.dtype, w_gate.dtype, w_up.dtype, w_down.dtype}) > 1:
        raise ValueError(f"mlp_bucket: x and the weights must share one dtype, got {x.dtype}, {w_gate.dtype}, "
                         f"{w_up.dtype}, {w_down.dtype}")
    return T, D, F, G, protos.shape[0]


def mlp_bucket_ref(x, w_gate, w_up, w_down, bucket, protos, group_size: int, act: str = "silu") -> torch.Tensor:
    """Plain PyTorch reference: reference.mlp_ref (fp32 accumulation, float64 for float64 inputs, h rounded to
    x's dtype) with mask = protos[bucket]; a token whose bucket id is outside [0, P) gets a NaN row."""
    T, D, F, G, P = check_inputs(x, w_gate, w_up, w_down, bucket, protos, group_size, act)
    mask, valid = mask_and_valid(bucket, protos)                         # [T, G], [T]
    return nan_rows(_ref.mlp_ref(x, w_gate, w_up, w_down.t(), mask, group_size, act), valid)


def bucket_lists_ref(bucket: torch.Tensor, protos: torch.Tensor, block_m: int) -> tuple:
    """Reference for _bucket_lists_kernel: (sorted_ids [NB * BM], block_bucket [NB], proto_groups [P + 1, G],
    proto_counts [P + 1]), int32, NB = n_blocks(T, P, BM). Bucket P holds the out-of-range ids and has no
    groups; row p of proto_groups is p's active groups ascending, then its inactive ones ascending."""
    T = bucket.shape[0]
    P, G = protos.shape
    dev = bucket.device
    nb = n_blocks(T, P, block_m)
    b = torch.where((bucket >= 0) & (bucket < P), bucket, P).long()      # [T], P = out of range
    counts = torch.bincount(b, minlength=P + 1)                          # [P + 1]
    padded = (counts + block_m - 1) // block_m * block_m
    offs = torch.cumsum(padded, 0) - padded
    order = torch.sort(b, stable=True).indices                           # tokens by bucket, in token order
    rank = torch.arange(T, device=dev) - (torch.cumsum(counts, 0) - counts)[b[order]]
    sorted_ids = torch.full((nb * block_m,), T, dtype=torch.int32, device=dev)
    sorted_ids[offs[b[order]] + rank] = order.to(torch.int32)
    starts = torch.arange(nb, device=dev) * block_m
    owner = torch.searchsorted(torch.cumsum(padded, 0), starts, right=True)
    block_bucket = torch.where(starts < padded.sum(), owner, -1).to(torch.int32)
    on = torch.cat([protos, protos.new_zeros(1, G)]).to(torch.int64)     # [P + 1, G]
    key = (1 - on) * G + torch.arange(G, device=dev)
    return sorted_ids, block_bucket, torch.argsort(key, dim=1).to(torch.int32), on.sum(1).to(torch.int32)


def union_lists_ref(bucket: torch.Tensor, protos: torch.Tensor, block_m: int,
                    order: Optional[torch.Tensor] = None) -> tuple:
    """Reference for _union_lists_kernel. Without `order` (T <= block_m): one block holding every token in order
    (sentinel T after them); with `order` (a permutation of the T tokens): cdiv(T, block_m) blocks of consecutive
    tokens of `order`. Each block's group list is the union of its tokens' prototypes (ids outside [0, P)
    contribute none), active groups ascending, then the others: (sorted_ids [NB * BM], block_bucket [NB] = block
    ids, proto_groups [NB, G], proto_counts [NB]), int32."""
    T = bucket.shape[0]
    P, G = protos.shape
    dev = bucket.device
    tok = torch.arange(T, device=dev) if order is None else order.long()
    nb = 1 if order is None else -(-T // block_m)
    sorted_ids = torch.full((nb * block_m,), T, dtype=torch.int32, device=dev)
    sorted_ids[:T] = tok.to(torch.int32)
    valid = (bucket >= 0) & (bucket < P)
    mask = protos[torch.where(valid, bucket, 0).long()] & valid[:, None]                    # [T, G]
    padded = torch.cat([mask[tok], mask.new_zeros(nb * block_m - T, G)])
    on = padded.view(nb, block_m, G).any(1).to(torch.int64)                                 # [NB, G]
    key = (1 - on) * G + torch.arange(G, device=dev)
    return (sorted_ids, torch.arange(nb, dtype=torch.int32, device=dev), torch.argsort(key, dim=1).to(torch.int32),
            on.sum(1).to(torch.int32))


# ----------------------------------------------------------------------------- kernels

@triton.jit(do_not_specialize=["T", "P", "NB"])
def _bucket_lists_kernel(bucket_ptr, protos_ptr, sorted_ptr, bblock_ptr, pgroups_ptr, pcount_ptr, T, P, NB,
                         G: tl.constexpr, GP2: tl.constexpr, PP2: tl.constexpr, BM: tl.constexpr,
                         BT: tl.constexpr):
    # program p: bucket p's token list, blocks and group list; program P: the out-of-range ids (no groups)
    p = tl.program_id(0)
    bins = tl.arange(0, PP2)
    counts = tl.zeros([PP2], dtype=tl.int32)
    for t0 in range(0, T, BT):
        t = t0 + tl.arange(0, BT)
        b = tl.load(bucket_ptr + t, mask=t < T, other=0)
        b = tl.where((b >= 0) & (b < P), b, P).to(tl.int32)
        hit = (b[:, None] == bins[None, :]) & (t < T)[:, None]          # [BT, PP2]
        counts += tl.sum(hit.to(tl.int32), axis=0)
    padded = (counts + BM - 1) // BM * BM
    total = tl.sum(padded, axis=0)
    off = tl.sum(tl.where(bins < p, padded, 0), axis=0)
    my_c = tl.sum(tl.where(bins == p, counts, 0), axis=0)
    my_p = tl.sum(tl.where(bins == p, padded, 0), axis=0)
    base = off
    for t0 in range(0, T, BT):  # this bucket's tokens, in token order
        t = t0 + tl.arange(0, BT)
        b = tl.load(bucket_ptr + t, mask=t < T, other=0)
        b = tl.where((b >= 0) & (b < P), b, P)
        a = ((b == p) & (t < T)).to(tl.int32)
        r = tl.cumsum(a, axis=0) - a
        tl.store(sorted_ptr + base + r, t.to(tl.int32), mask=a > 0)
        base += tl.sum(a, axis=0)
    for q0 in range(off + my_c, off + my_p, BT):  # sentinel padding of the list
        q = q0 + tl.arange(0, BT)
        tl.store(sorted_ptr + q, tl.zeros([BT], dtype=tl.int32) + T, mask=q < off + my_p)
    for k0 in range(off // BM, (off + my_p) // BM, BT):  # block -> bucket
        k = k0 + tl.arange(0, BT)
        tl.store(bblock_ptr + k, tl.zeros([BT], dtype=tl.int32) + p, mask=k < (off + my_p) // BM)
    for k0 in range(total // BM + p * BT, NB, (P + 1) * BT):  # unused blocks, shared round-robin
        k = k0 + tl.arange(0, BT)
        tl.store(bblock_ptr + k, tl.zeros([BT], dtype=tl.int32) - 1, mask=k < NB)
    for q0 in range(total + p * BT, NB * BM, (P + 1) * BT):
        q = q0 + tl.arange(0, BT)
        tl.store(sorted_ptr + q, tl.zeros([BT], dtype=tl.int32) + T, mask=q < NB * BM)
    # the prototype's groups: active ones ascending, then the inactive ones
    gs = tl.arange(0, GP2)
    gvalid = gs < G
    n_read = tl.where(p < P, G, 0)  # bucket P has no prototype row
    on = tl.load(protos_ptr + p * G + gs, mask=gs < n_read, other=0).to(tl.int32)
    on = tl.where(gvalid & (on != 0), 1, 0)
    excl = tl.cumsum(on, axis=0) - on
    cnt = tl.sum(on, axis=0)
    tl.store(pgroups_ptr + p * G + tl.where(on > 0, excl, cnt + gs - excl), gs.to(tl.int32), mask=gvalid)
    tl.store(pcount_ptr + p, cnt.to(tl.int32))


@triton.jit(do_not_specialize=["T", "P"])
def _union_lists_kernel(bucket_ptr, protos_ptr, order_ptr, sorted_ptr, bblock_ptr, pgroups_ptr, pcount_ptr, T, P,
                        G: tl.constexpr, GP2: tl.constexpr, BM: tl.constexpr, ORDERED: tl.constexpr):
    # program m: block m holds the tokens order[m BM : (m + 1) BM] (ORDERED; else tokens m BM, ...), its group list
    # is the union of their prototypes (ids outside [0, P) add none); sentinel T past the last token
    m = tl.program_id(0)
    rows = m * BM + tl.arange(0, BM)
    tvalid = rows < T
    if ORDERED:
        tok = tl.load(order_ptr + rows, mask=tvalid, other=0)
    else:
        tok = rows
    b = tl.load(bucket_ptr + tok, mask=tvalid, other=0)
    ok = tvalid & (b >= 0) & (b < P)
    gs = tl.arange(0, GP2)
    on = tl.load(protos_ptr + b.to(tl.int64)[:, None] * G + gs[None, :], mask=ok[:, None] & (gs < G)[None, :],
                 other=0).to(tl.int32)                                 # [BM, GP2]
    act = tl.where((gs < G) & (tl.max(on, axis=0) != 0), 1, 0)
    excl = tl.cumsum(act, axis=0) - act
    cnt = tl.sum(act, axis=0)
    tl.store(pgroups_ptr + m * G + tl.where(act > 0, excl, cnt + gs - excl), gs.to(tl.int32), mask=gs < G)
    tl.store(pcount_ptr + m, cnt.to(tl.int32))
    tl.store(sorted_ptr + rows, tl.where(tvalid, tok, T).to(tl.int32))
    tl.store(bblock_ptr + m, m)


@triton.jit
def _block_and_tile(NB, num_n, GROUP_M: tl.constexpr):
    # program -> (block m, tile n): GROUP_M blocks sweep the n tiles together (shared weight tiles in L2)
    pid = tl.program_id(0)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    gsz = tl.minimum(NB - first_m, GROUP_M)
    m = first_m + (pid % per_group) % gsz
    n = (pid % per_group) // gsz
    return m, n


@triton.jit(do_not_specialize=["T", "P", "NB"])
def _bucket_gather_n_kernel(x_ptr, w1_ptr, w2_ptr, b_ptr, out_ptr, sorted_ptr, bblock_ptr, pgroups_ptr, pcount_ptr,
                            bucket_ptr, protos_ptr, T, D, P, NB, stride_xm, stride_xk, stride_w1n, stride_w1k,
                            stride_w2n, stride_w2k, stride_om, G: tl.constexpr, GS: tl.constexpr, BM: tl.constexpr,
                            BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, GATED: tl.constexpr,
                            HAS_BIAS: tl.constexpr, SCATTER: tl.constexpr, UNION: tl.constexpr, ACT: tl.constexpr,
                            PREC: tl.constexpr, UPCAST: tl.constexpr, GLOBAL: tl.constexpr, FUSE_GU: tl.constexpr):
    # N = the bucket's groups' output columns. GATED: act(x W1^T) * (x W2^T) (the MLP's gate/up), else x W1^T + b.
    # SCATTER=False: compact store (column block j = the prototype's j-th active group) at the block's rows;
    # SCATTER=True: store at the tokens' rows and the groups' own columns, zeros on the inactive groups (q_proj).
    # UNION: the block's groups are the union of its tokens' prototypes; pairs off a token's own one give 0.
    # GLOBAL: programs over (column tile n of the full width, block m), m fastest. Compact h: stored at the groups'
    # own columns, only those some token of the block needs; SCATTER: a tile no token needs is stored as zeros
    # without its GEMM
    if GLOBAL:
        m = tl.program_id(0) % NB
        n = tl.program_id(0) // NB
    else:
        m, n = _block_and_tile(NB, tl.cdiv(G * GS, BN), GROUP_M)
    p = tl.load(bblock_ptr + m)
    if p < 0:  # past the used blocks
        return
    width = tl.load(pcount_ptr + p) * GS
    if not SCATTER:
        if n * BN >= width and not GLOBAL:  # past the bucket's compact width
            return
    slots = m * BM + tl.arange(0, BM)
    tok = tl.load(sorted_ptr + slots)                                   # [BM], sentinel T = padding
    tvalid = tok < T
    tok64 = tok.to(tl.int64)
    c = n * BN + tl.arange(0, BN)                                       # compact (GLOBAL: the full width's) columns
    if GLOBAL:
        grp = c // GS
        wrow = c.to(tl.int64)
        cvalid = c < G * GS
        if not UNION:  # the bucket's prototype's groups (bucket P, the out-of-range ids, has none)
            cvalid = cvalid & (c * 0 + p < P)  # [BN] (a scalar term in a mask trips the Triton interpreter)
            cvalid = cvalid & (tl.load(protos_ptr + p * G + grp, mask=cvalid, other=0) != 0)
    else:
        cvalid = c < width
        grp = tl.load(pgroups_ptr + p * G + c // GS, mask=c < G * GS, other=0)  # active groups, then inactive ones
        wrow = (grp * GS + c % GS).to(tl.int64)                         # [BN] weight rows of those columns
    fill = tl.zeros([BM, BN], dtype=tl.float32)
    if not UNION:  # bucket P: ids outside [0, P) (union blocks check each token's id instead)
        fill += tl.where(p == P, float("nan"), 0.0)
    if UNION:
        bt = tl.load(bucket_ptr + tok, mask=tvalid, other=0)
        id_ok = (bt >= 0) & (bt < P)
        fill += tl.where(id_ok, 0.0, float("nan"))[:, None]
        on = tl.load(protos_ptr + bt.to(tl.int64)[:, None] * G + grp[None, :],
                     mask=(tvalid & id_ok)[:, None] & cvalid[None, :], other=0) != 0   # [BM, BN]: own groups
        if GLOBAL:  # the columns some token of the block needs
            cvalid = cvalid & (tl.max(on.to(tl.int32), axis=0) != 0)
    if GLOBAL:  # no token of the block needs this tile (the out-of-range ids' bucket needs none)
        skip = tl.max(cvalid.to(tl.int32), axis=0) == 0
    else:  # past the active width: only inactive groups' columns
        skip = n * BN >= width
    if SCATTER:
        optrs = out_ptr + tok64[:, None] * stride_om + wrow[None, :]
        omask = tvalid[:, None] & (c < G * GS)[None, :]
        if skip:
            tl.store(optrs, fill.to(out_ptr.dtype.element_ty), mask=omask)
            return
    else:
        if skip:  # (the compact layout returned above already)
            return
        optrs = out_ptr + slots.to(tl.int64)[:, None] * stride_om + c[None, :]
        omask = cvalid[None, :]  # padding rows too (act(0) * 0 = 0): the down kernel reads whole blocks
    acc1, acc2 = gather_gemm(x_ptr + tok64[:, None] * stride_xm, w1_ptr + wrow[:, None] * stride_w1n,
                             w2_ptr + wrow[:, None] * stride_w2n, tvalid, cvalid, D, stride_xk, stride_w1k,
                             stride_w2k, BM, BN, BK, GATED, PREC, UPCAST, FUSE_GU)
    if GATED:
        y = gated_act(acc1, acc2, ACT)
    else:
        y = acc1
        if HAS_BIAS:
            y += tl.load(b_ptr + wrow, mask=cvalid, other=0.0).to(tl.float32)[None, :]
    y = y.to(out_ptr.dtype.element_ty)  # rounded once, then exact zeros on the inactive groups' columns
    if UNION:
        y = tl.where(on, y, fill.to(out_ptr.dtype.element_ty))
    if SCATTER:
        y = tl.where(cvalid[None, :], y, fill.to(out_ptr.dtype.element_ty))
    tl.store(optrs, y, mask=omask)


@triton.jit(do_not_specialize=["T", "P", "NB"])
def _bucket_gather_k_kernel(a_ptr, w_ptr, b_ptr, out_ptr, sorted_ptr, bblock_ptr, pgroups_ptr, pcount_ptr,
                            bucket_ptr, protos_ptr, T, N, P, NB, stride_am, stride_wn, stride_wk, stride_om,
                            G: tl.constexpr, GS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                            GROUP_M: tl.constexpr, COMPACT_A: tl.constexpr, HAS_BIAS: tl.constexpr,
                            UNION: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, GLOBAL: tl.constexpr):
    # out[tok, :N] = a[tok, the prototype's groups] @ W[:, those groups]^T (+ b), K over the active groups only.
    # COMPACT_A: a is the bucket-compact h (rows = the block's slots, column block j = j-th active group), else
    # a full-width [T, G * GS] input gathered by token and group (o_proj). UNION: the block's groups are the
    # union of its tokens' prototypes; a full-width input is read only on each token's own groups. GLOBAL (with
    # COMPACT_A): h by the block's slots at the groups' own columns, programs block-fastest
    if GLOBAL:
        m = tl.program_id(0) % NB
        n = tl.program_id(0) // NB
    else:
        m, n = _block_and_tile(NB, tl.cdiv(N, BN), GROUP_M)
    p = tl.load(bblock_ptr + m)
    if p < 0:
        return
    n_groups = tl.load(pcount_ptr + p)
    slots = m * BM + tl.arange(0, BM)
    tok = tl.load(sorted_ptr + slots)
    tvalid = tok < T
    if UNION:
        bt = tl.load(bucket_ptr + tok, mask=tvalid, other=0)
        id_ok = (bt >= 0) & (bt < P)
    if COMPACT_A:
        a_rows = a_ptr + slots.to(tl.int64)[:, None] * stride_am
    else:
        a_rows = a_ptr + tok.to(tl.int64)[:, None] * stride_am
    cols = n * BN + tl.arange(0, BN)
    cvalid = cols < N
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    # K = the prototype's active groups only, KT tiles of BK per group, as one flat loop: the pipeliner then
    # buffers one A and one W tile per stage (a static loop over a group's tiles would buffer all of them)
    KT: tl.constexpr = (GS + BK - 1) // BK
    for i in range(0, n_groups * KT):
        j = i // KT
        g = tl.load(pgroups_ptr + p * G + j)
        kin = (i % KT) * BK + tl.arange(0, BK)
        kv = kin < GS
        if COMPACT_A:
            acol = g * GS + kin if GLOBAL else j * GS + kin
            a = tl.load(a_rows + acol[None, :], mask=kv[None, :], other=0.0)                            # [BM, BK]
        else:
            use = tvalid
            if UNION:
                use = use & id_ok & (tl.load(protos_ptr + bt * G + g, mask=tvalid & id_ok, other=0) != 0)
            a = tl.load(a_rows + (g * GS + kin)[None, :], mask=use[:, None] & kv[None, :], other=0.0)
        w = tl.load(w_ptr + cols[None, :].to(tl.int64) * stride_wn + (g * GS + kin)[:, None] * stride_wk,
                    mask=kv[:, None] & cvalid[None, :], other=0.0)                                    # [BK, BN]
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PREC)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cvalid, other=0.0).to(tl.float32)[None, :]
    if not UNION:  # bucket P: ids outside [0, P)
        acc = tl.where(p == P, float("nan"), acc)
    if UNION:
        acc = tl.where(id_ok[:, None], acc, float("nan"))
    tl.store(out_ptr + tok.to(tl.int64)[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=tvalid[:, None] & cvalid[None, :])


# ----------------------------------------------------------------------------- launchers

def bucket_lists_triton(bucket: torch.Tensor, protos: torch.Tensor, block_m: int, wrap: bool = False) -> tuple:
    """The device-side lists of bucket_lists_ref (same outputs), one launch of P + 1 programs."""
    T = bucket.shape[0]
    P, G = protos.shape
    nb = n_blocks(T, P, block_m)
    dev = bucket.device
    sorted_ids = alloc((nb * block_m,), torch.int32, dev)
    block_bucket = alloc((nb,), torch.int32, dev)
    proto_groups = alloc((P + 1, G), torch.int32, dev)
    proto_counts = alloc((P + 1,), torch.int32, dev)
    pp2 = triton.next_power_of_2(P + 1)
    bt = min(1024, max(16, triton.next_power_of_2(T)), max(16, 16384 // pp2))  # [BT, PP2] histogram tile
    _launcher(_bucket_lists_kernel, wrap)[(P + 1,)](
        bucket.contiguous(), _mask_bytes(protos), sorted_ids, block_bucket, proto_groups, proto_counts, T, P, nb,
        G=G, GP2=triton.next_power_of_2(G), PP2=pp2, BM=block_m, BT=bt)
    return sorted_ids, block_bucket, proto_groups, proto_counts


def union_lists_triton(bucket: torch.Tensor, protos: torch.Tensor, block_m: int, wrap: bool = False,
                       order: Optional[torch.Tensor] = None) -> tuple:
    """The device-side lists of union_lists_ref: one block of every token in order (T <= block_m), or with
    `order` (a permutation of the tokens) cdiv(T, block_m) blocks of consecutive tokens of `order`; one program
    per block."""
    T = bucket.shape[0]
    P, G = protos.shape
    dev = bucket.device
    nb = 1 if order is None else triton.cdiv(T, block_m)
    sorted_ids = alloc((nb * block_m,), torch.int32, dev)
    block_bucket = alloc((nb,), torch.int32, dev)
    proto_groups = alloc((nb, G), torch.int32, dev)
    proto_counts = alloc((nb,), torch.int32, dev)
    _launcher(_union_lists_kernel, wrap)[(nb,)](
        bucket.contiguous(), _mask_bytes(protos), order if order is not None else bucket, sorted_ids, block_bucket,
        proto_groups, proto_counts, T, P, G=G, GP2=triton.next_power_of_2(G), BM=block_m, ORDERED=order is not None)
    return sorted_ids, block_bucket, proto_groups, proto_counts


def width_order(bucket: torch.Tensor, protos: torch.Tensor) -> torch.Tensor:
    """int32 [T]: the tokens sorted by their prototype's width, then its id (ids outside [0, P) last), stable:
    tokens of one prototype are contiguous and prototypes of similar width sit side by side. A device sort, no
    host sync."""
    P = protos.shape[0]
    valid = (bucket >= 0) & (bucket < P)
    b = torch.where(valid, bucket, 0).long()
    width = torch.gather(protos.to(torch.int64).sum(1), 0, b)  # gather, not [b]: its fake-tensor form is device-free
    key = torch.where(valid, width * (P + 1) + b, (P + 1) * (protos.shape[1] + 1))
    return torch.argsort(key, stable=True).to(torch.int32)


@dataclass(frozen=True)
class BucketLists:
    """What the GEMM kernels read: the token lists (bucket_lists_triton's or union_lists_triton's), P, and for
    the union block the ids and prototypes (each token's own groups)."""
    sorted_ids: torch.Tensor
    block_bucket: torch.Tensor
    proto_groups: torch.Tensor
    proto_counts: torch.Tensor
    P: int
    union: bool
    bucket: torch.Tensor
    protos8: torch.Tensor

    def args(self) -> tuple:
        return (self.sorted_ids, self.block_bucket, self.proto_groups, self.proto_counts, self.bucket, self.protos8)


def make_lists(bucket: torch.Tensor, protos: torch.Tensor, cfg: dict, wrap: bool = False) -> BucketLists:
    """The union block for few tokens (uses_union); else the padded bucket lists, or with config
    prefill_lists="union" blocks of consecutive tokens in width_order, each over the union of its prototypes."""
    bucket, protos8 = bucket.contiguous(), _mask_bytes(protos)
    if uses_union(bucket.shape[0], cfg):
        lists, union = union_lists_triton(bucket, protos8, cfg["block_m"], wrap), True
    elif cfg["prefill_lists"] == "union":
        order = width_order(bucket, protos)
        lists, union = union_lists_triton(bucket, protos8, cfg["block_m"], wrap, order), True
    else:
        lists, union = bucket_lists_triton(bucket, protos8, cfg["block_m"], wrap), False
    return BucketLists(*lists, P=protos.shape[0], union=union, bucket=bucket, protos8=protos8)


def _prec(dtype: torch.dtype) -> str:
    return "ieee" if (dtype == torch.float32 or interpreting()) else "tf32"


def gather_n_triton(x, w1, w2, bias, out, lists: BucketLists, group_size: int, cfg: dict, *, gated: bool,
                    scatter: bool, act: str = "silu", wrap: bool = False):
    """Launch _bucket_gather_n_kernel into `out`: [NB * BM, F] bucket-compact (scatter=False) or [T, F] full width
    (scatter=True: zeros on each token's inactive groups)."""
    T, D = x.shape
    F = w1.shape[0]
    w2 = w2 if w2 is not None else w1
    nb = lists.block_bucket.shape[0]
    _launcher(_bucket_gather_n_kernel, wrap)[(nb * triton.cdiv(F, cfg["up_bn"]),)](
        x, w1, w2, bias if bias is not None else w1, out, *lists.args(),
        T, D, lists.P, nb, x.stride(0), x.stride(1), w1.stride(0), w1.stride(1), w2.stride(0), w2.stride(1),
        out.stride(0), G=F // group_size, GS=group_size, BM=cfg["block_m"], BN=cfg["up_bn"], BK=cfg["up_bk"],
        GROUP_M=cfg["group_m"], GATED=gated, HAS_BIAS=bias is not None, SCATTER=scatter, UNION=lists.union,
        ACT=ACT_IDS[act], PREC=_prec(x.dtype), UPCAST=_upcast(x.dtype),
        GLOBAL=cfg["h_layout"] == "global", FUSE_GU=bool(gated and cfg["up_fuse"] and w1.stride(1) == w2.stride(1)),
        num_warps=cfg["up_warps"], num_stages=cfg["up_stages"])
    return out


def gather_k_triton(a, w, bias, lists: BucketLists, T: int, group_size: int, cfg: dict, *, compact_a: bool,
                    wrap: bool = False):
    """out [T, N] = each token's a over its prototype's groups @ w[:, those groups]^T (+ bias), w [N, K]; `a` is
    the bucket-compact h (compact_a) or a full-width [T, K] input."""
    N, K = w.shape
    out = alloc((T, N), a.dtype, a.device)
    nb = lists.block_bucket.shape[0]
    _launcher(_bucket_gather_k_kernel, wrap)[(nb * triton.cdiv(N, cfg["dn_bn"]),)](
        a, w, bias if bias is not None else w, out, *lists.args(),
        T, N, lists.P, nb, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        G=K // group_size, GS=group_size, BM=cfg["block_m"], BN=cfg["dn_bn"], BK=cfg["dn_bk"], GROUP_M=cfg["group_m"],
        COMPACT_A=compact_a, HAS_BIAS=bias is not None, UNION=lists.union, PREC=_prec(a.dtype),
        UPCAST=_upcast(a.dtype), GLOBAL=compact_a and cfg["h_layout"] == "global", num_warps=cfg["dn_warps"],
        num_stages=cfg["dn_stages"])
    return out


def gate_up_triton(x, w_gate, w_up, lists: BucketLists, group_size: int, act: str, cfg: dict, wrap: bool = False):
    """The bucket-compact h [NB * BM, F] of the gate/up kernel: row r = the r-th entry of the sorted token list,
    column block j = the j-th group of the row's block (columns past its width are not written); with config
    h_layout="global" column block g = group g (columns of groups the row's block does not need are not
    written)."""
    h = alloc((lists.block_bucket.shape[0] * cfg["block_m"], w_gate.shape[0]), x.dtype, x.device)
    return gather_n_triton(x, w_gate, w_up, None, h, lists, group_size, cfg, gated=True, scatter=False, act=act,
                           wrap=wrap)


def down_triton(h, w_down, lists: BucketLists, T: int, group_size: int, cfg: dict, wrap: bool = False):
    """out [T, D]: each token's row of h @ W_down^T over its prototype's groups, stored at its position."""
    return gather_k_triton(h, w_down, None, lists, T, group_size, cfg, compact_a=True, wrap=wrap)


def _upcast(dtype: torch.dtype) -> bool:
    return interpreting() and dtype != torch.float32  # the interpreter's half-precision dots are inexact


def mlp_bucket_triton(x, w_gate, w_up, w_down, bucket, protos, group_size: int, act: str = "silu", *,
                      config: Optional[dict] = None, wrap: bool = False) -> torch.Tensor:
    """x [T, D], w_gate / w_up [F, D], w_down [D, F], bucket [T] int, protos [P, G] bool -> [T, D] (module
    docstring). Any strides. config: tile overrides (CONFIG_KEYS)."""
    T, D, F, G, P = check_inputs(x, w_gate, w_up, w_down, bucket, protos, group_size, act)
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"mlp_bucket_triton: x must be float16, bfloat16 or float32, got {x.dtype} "
                         "(mlp_bucket_ref computes any dtype)")
    cfg = config_for(T, group_size, x.dtype, x.device, config)
    if T == 0:
        return alloc((T, D), x.dtype, x.device)
    if T == 1 and cfg["one_token"] == "gemv":
        return gemv.mlp_gemv_triton(x, w_gate, w_up, w_down, protos, bucket, group_size, act, cfg, wrap)
    if uses_dense(T, cfg):
        mask, valid = mask_and_valid(bucket, protos)
        return nan_rows(mlp_dense_masked(x, w_gate, w_up, w_down.t(), mask, group_size, act, wrap), valid)
    lists = make_lists(bucket, protos, cfg, wrap)
    h = gate_up_triton(x, w_gate, w_up, lists, group_size, act, cfg, wrap)
    return down_triton(h, w_down, lists, T, group_size, cfg, wrap)
