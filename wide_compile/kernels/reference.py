"""Plain PyTorch reference implementations of the WIDE kernels.

These are the CPU implementations of the ``torch.ops.wide.*`` ops and the test
oracle for the Triton kernels.  They compute dense and mask afterwards (so
inactive groups contribute exactly 0), in the input dtype with fp32 accumulation:

* MLP: ``h = act(x @ Wg^T) * (x @ Wu^T)`` in fp32 (act: silu, gelu or gelu with the tanh approximation,
  ``ACTIVATIONS``), rounded to the input dtype
  (the Triton kernels keep ``h`` in the input dtype too), zeroed on inactive
  groups, then ``h @ Wd^T`` accumulated in fp32 and rounded once.
* q_proj: ``(x @ Wq^T + b)`` in fp32, inactive groups' columns set to exactly 0.
* o_proj: ``(a * mask) @ Wo^T + b`` in fp32 (b added once, always).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def expand_mask(mask: torch.Tensor, group_size: int) -> torch.Tensor:
    """[T, G] bool -> [T, G*group_size] bool (each group covers group_size consecutive channels)."""
    return mask.repeat_interleave(group_size, dim=-1)


# the gate activations of wide.mlp: SwiGLU (Llama, ...) and GeGLU (Gemma: gelu with the tanh approximation)
ACTIVATIONS = ("silu", "gelu", "gelu_tanh")


def activation(g: torch.Tensor, act: str) -> torch.Tensor:
    """The gate activation `act` (one of ACTIVATIONS) applied to g."""
    if act == "silu":
        return F.silu(g)
    if act == "gelu":
        return F.gelu(g)
    if act == "gelu_tanh":
        return F.gelu(g, approximate="tanh")
    raise ValueError(f"wide.mlp: unknown activation {act!r}; choose one of {ACTIVATIONS}")


def mlp_ref(x, w_gate, w_up, w_down_t, mask, group_size: int, act: str = "silu") -> torch.Tensor:
    acc = _acc_dtype(x.dtype)
    xf = x.to(acc)
    g = xf @ w_gate.to(acc).t()
    u = xf @ w_up.to(acc).t()
    h = (activation(g, act) * u).to(x.dtype)
    h = torch.where(expand_mask(mask, group_size), h, torch.zeros((), dtype=h.dtype, device=h.device))
    out = h.to(acc) @ w_down_t.to(acc)
    return out.to(x.dtype)


def q_proj_ref(x, w_q, b_q: Optional[torch.Tensor], mask, group_size: int) -> torch.Tensor:
    acc = _acc_dtype(x.dtype)
    q = x.to(acc) @ w_q.to(acc).t()
    if b_q is not None:
        q = q + b_q.to(acc)
    q = q.to(x.dtype)
    return torch.where(q_column_mask(mask, group_size, q.shape[-1]), q, torch.zeros((), dtype=q.dtype,
                                                                                    device=q.device))


def q_column_mask(mask, group_size: int, n: int) -> torch.Tensor:
    """wide.q_proj's mask [T, G] -> its columns' [T, n] bool: the first G groups' columns as the mask says, every
    column after them on (K / V rows in q's launch)."""
    return expand_mask(groups_past_on(mask, n // group_size).to(torch.bool), group_size)


def groups_past_on(mask, groups: int) -> torch.Tensor:
    """A q mask (or prototype table) [..., G'] of the first G' <= groups groups -> [..., groups], the groups
    past G' on: wide.q_proj's contract for K / V rows run in q's launch, for the paths that read every group."""
    if mask.shape[-1] >= groups:  # as given (bool or uint8): nothing to pad, no cast
        return mask
    return torch.nn.functional.pad(mask.to(torch.bool), (0, groups - mask.shape[-1]), value=True)


def o_proj_ref(a, w_o_t, b_o: Optional[torch.Tensor], mask, group_size: int) -> torch.Tensor:
    acc = _acc_dtype(a.dtype)
    am = torch.where(expand_mask(mask, group_size), a, torch.zeros((), dtype=a.dtype, device=a.device))
    out = am.to(acc) @ w_o_t.to(acc)
    if b_o is not None:
        out = out + b_o.to(acc)
    return out.to(a.dtype)


def mask_reorder_ref(mask: torch.Tensor, block_m: int) -> Tuple[torch.Tensor, ...]:
    """Reference for ``mask_reorder`` (see ``reorder.py`` for the layout).

    Returns (tile_groups, tile_counts, sorted_token_ids, block_groups, num_tokens_post_padded).
    Pure tensor ops, no host sync, static worst-case sizes.
    """
    T, G = mask.shape
    dev = mask.device
    n_tiles = (T + block_m - 1) // block_m
    n_blocks = G * n_tiles
    P = n_blocks * block_m
    m = mask.to(torch.int32)
    # --- tile lists: active groups of each tile of block_m tokens first (ascending), then inactive.
    pad = n_tiles * block_m - T
    mp = torch.cat([m, m.new_zeros(pad, G)], 0) if pad else m
    act = mp.view(n_tiles, block_m, G).amax(1)  # [n_tiles, G]
    tile_counts = act.sum(1).to(torch.int32)
    key = (1 - act) * G + torch.arange(G, device=dev, dtype=torch.int32)
    tile_groups = torch.argsort(key, dim=1).to(torch.int32)
    # --- group-major block-aligned token lists
    counts = m.sum(0)  # [G]
    padded = (counts + block_m - 1) // block_m * block_m
    offs = torch.cumsum(padded, 0) - padded  # exclusive
    total = padded.sum()
    # position of token t inside group g's list
    rank = torch.cumsum(m, 0) - m  # [T, G]
    pos = offs[None, :] + rank  # [T, G]
    sorted_ids = torch.full((P + 1,), T, dtype=torch.int32, device=dev)
    tok = torch.arange(T, device=dev, dtype=torch.int32)[:, None].expand(T, G)
    dst = torch.where(mask, pos, torch.full_like(pos, P))  # inactive -> dump slot P
    sorted_ids.scatter_(0, dst.reshape(-1).to(torch.int64), tok.reshape(-1))
    sorted_ids = sorted_ids[:P].clone()
    # block -> group
    bstart = torch.arange(n_blocks, device=dev) * block_m
    ends = torch.cumsum(padded, 0)
    bg = torch.searchsorted(ends, bstart, right=True).to(torch.int32)
    block_groups = torch.where(bstart < total, bg, torch.full_like(bg, -1))
    ntpp = total.to(torch.int32).reshape(1)
    return tile_groups, tile_counts, sorted_ids, block_groups, ntpp
