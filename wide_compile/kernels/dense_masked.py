"""Dense GEMMs with the group mask applied to their result: the path for what compact kernels cannot skip.

Used where per-token masks leave nothing to skip:
* small batches of decode tokens (the tuning tables' path="dense" rows, 4 to 16 tokens): with per-token masks
  the union of the groups that 4 tokens need covers 1 - (1 - c)^4 of the weight rows (94 % at capacity
  0.5), so the gather GEMV reads almost every row anyway and loses to cuBLAS (benchmarks/results/);
  one dense GEMM plus a select costs what dense costs;
* the prefill o_proj (config down="dense"): no 128-token tile leaves a head group inactive (the prefill MLP's
  reduction side is a dense GEMM too, over the h its gather kernel zero-fills: compact_mlp.mlp_triton).

Same semantics as reference.py: inactive groups contribute exactly 0 (a select, never a multiply, so a
non-finite value in an inactive group cannot leak), h is rounded to the input dtype once, after
act(g) * u in fp32, like the Triton kernels.

Called eagerly, the MLP's elementwise middle (act(g) * u in fp32, rounded, then the mask's select) is one Triton
launch, ``_gated_select_kernel``, where eager PyTorch would launch one kernel per cast, the activation, the product
and the select: in a decode step every launch costs about as much as reading a small layer's weights. Traced for
Inductor (the ops' `wrap`), the PyTorch form ``gated_select_ref`` stays, because Inductor fuses it into one kernel
itself. ``gated_select_ref`` is also what runs on a CPU outside the Triton interpreter.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .activations import ACT_IDS, gated_act
from .reference import activation, groups_past_on
from .reorder import _mask_bytes, _launcher, alloc
from .tuning import interpreting

SELECT_BLOCK = 1024  # h columns per program of _gated_select_kernel


@triton.jit
def _gated_select_kernel(g_ptr, u_ptr, m_ptr, h_ptr, F, stride_gt, stride_ut, stride_mt, stride_ht,
                         GS: tl.constexpr, BLOCK: tl.constexpr, ACT: tl.constexpr):
    # program (t, j): h[t, j BLOCK : (j + 1) BLOCK] = act(g) * u in fp32, rounded to h's dtype, where the column's
    # group is on for token t, else exactly 0 (g and u of an inactive group are not read)
    t = tl.program_id(0).to(tl.int64)
    f = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    fv = f < F
    on = fv & (tl.load(m_ptr + t * stride_mt + f // GS, mask=fv, other=0) != 0)
    g = tl.load(g_ptr + t * stride_gt + f, mask=on, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + t * stride_ut + f, mask=on, other=0.0).to(tl.float32)
    h = gated_act(g, u, ACT).to(h_ptr.dtype.element_ty)
    tl.store(h_ptr + t * stride_ht + f, tl.where(on, h, 0.0).to(h_ptr.dtype.element_ty), mask=fv)


def gated_select_ref(g, u, mask, group_size: int, act: str = "silu") -> torch.Tensor:
    """g, u [T, F], mask [T, G] -> h [T, F] in g's dtype: act(g) * u in fp32, rounded once, exactly 0 on the
    inactive groups' columns."""
    return _select((activation(g.float(), act) * u.float()).to(g.dtype), mask, group_size)


def gated_select_triton(g, u, mask, group_size: int, act: str = "silu", wrap: bool = False) -> torch.Tensor:
    """gated_select_ref in one Triton launch (g, u with unit column stride, as torch.mm writes them)."""
    T, F = g.shape
    if act not in ACT_IDS:
        raise ValueError(f"gated_select: unknown activation {act!r}; choose one of {tuple(ACT_IDS)}")
    m8 = _mask_bytes(mask)
    h = alloc((T, F), g.dtype, g.device)
    if T == 0:
        return h
    _launcher(_gated_select_kernel, wrap)[(T, triton.cdiv(F, SELECT_BLOCK))](
        g, u, m8, h, F, g.stride(0), u.stride(0), m8.stride(0), h.stride(0), GS=group_size, BLOCK=SELECT_BLOCK,
        ACT=ACT_IDS[act], num_warps=4)
    return h


def _select(t: torch.Tensor, mask: torch.Tensor, group: int) -> torch.Tensor:
    """t [T, G*group] where mask [T, G] (bool or uint8) else exactly 0; a [T, G, group] view, no expanded
    mask is built."""
    T, N = t.shape
    G = mask.shape[1]
    # a Python 0, not a 0-d tensor: eager would launch a fill kernel for the tensor on every call
    return torch.where(mask.to(torch.bool).reshape(T, G, 1), t.reshape(T, G, group), 0).view(T, N)


def mlp_dense_masked(x, w_gate, w_up, w_down_t, mask, group_size: int, act: str = "silu",
                     wrap: bool = False) -> torch.Tensor:
    """x [T, D], w_gate/w_up [F, D], w_down_t [F, D], mask [T, G] bool -> [T, D]; act: the gate activation
    (reference.ACTIVATIONS). The elementwise middle is gated_select_triton when called eagerly on a GPU or under
    the Triton interpreter; gated_select_ref on a plain CPU and when traced for Inductor (wrap)."""
    g = torch.mm(x, w_gate.t())  # [T, F]
    u = torch.mm(x, w_up.t())  # [T, F]
    if (x.is_cuda or interpreting()) and not wrap:
        h = gated_select_triton(g, u, mask, group_size, act)
    else:  # traced (wrap): Inductor fuses these elementwise ops into one kernel itself, and into what it sees around
        h = gated_select_ref(g, u, mask, group_size, act)
    return torch.mm(h, w_down_t)


def q_proj_dense_masked(x, w_q, b_q: Optional[torch.Tensor], mask, group_size: int) -> torch.Tensor:
    """x [T, D], w_q [Nq, D], b_q [Nq] or None, mask [T, G'] (G' <= G = Nq // group_size; groups past G' always
    on) -> [T, Nq], inactive columns exactly 0."""
    q = torch.mm(x, w_q.t()) if b_q is None else torch.addmm(b_q, x, w_q.t())
    # groups past the mask are always on (K / V rows): padded here, inlined by Inductor into the select
    return _select(q, groups_past_on(mask, w_q.shape[0] // group_size), group_size)


def o_proj_dense_masked(a, w_o_t, b_o: Optional[torch.Tensor], mask, group_size: int) -> torch.Tensor:
    """a [T, Nq], w_o_t [Nq, D], b_o [D] or None (added once), mask [T, G] -> [T, D]; inactive input
    columns of a are never used (selected away, not multiplied)."""
    am = _select(a, mask, group_size)
    return torch.mm(am, w_o_t) if b_o is None else torch.addmm(b_o, am, w_o_t)
