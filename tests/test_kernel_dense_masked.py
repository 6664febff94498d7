"""The dense-masked MLP's elementwise middle (wide_compile/kernels/dense_masked.py): `_gated_select_kernel` against
its PyTorch form `gated_select_ref` and a float64 oracle, on the CPU under the Triton interpreter
(TRITON_INTERPRET=1, conftest's default) or compiled on a CUDA GPU (TRITON_INTERPRET=0).

Tolerances (relative L2 over the tensor): against gated_select_ref (the same fp32 math; in bf16 rounded the way
the kernel rounds where it runs: see rounded_as_the_kernel) fp32 <= 1e-6, bf16 <= 1e-3 (the two sigmoids / erfs
may round an element the other way, and gelu's tail 1 + erf(x) cancels in fp32 in both); against the float64
oracle fp32 <= 1e-5, bf16 <= 1e-2. Inactive groups' columns are exactly 0 even where g or u is NaN / inf; the output buffer is
NaN-poisoned first, so a column the kernel does not write fails.
"""
import pytest
import torch
import torch.nn.functional as F
from kernel_checks import DEV, INTERPRET, needs_device, poison_buffers, rel  # noqa: F401 (the fixture)

from wide_compile.kernels import dense_masked as DM
from wide_compile.kernels import reference as R

pytestmark = [needs_device, pytest.mark.usefixtures("poison_buffers")]
ORACLE = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda v: F.gelu(v, approximate="tanh")}


def make(T, G, gs, kind, dtype, gen):
    g = (torch.randn(T, G * gs, generator=gen) * 3).to(DEV, dtype)
    u = torch.randn(T, G * gs, generator=gen).to(DEV, dtype)
    if kind == "random":
        m = torch.rand(T, G, generator=gen) < 0.5
    elif kind == "on":
        m = torch.ones(T, G, dtype=torch.bool)
    elif kind == "off":
        m = torch.zeros(T, G, dtype=torch.bool)
    else:  # one group per token, a different one for each
        m = torch.nn.functional.one_hot(torch.arange(T) % G, G).bool()
    return g, u, m.to(DEV)


def rounded_as_the_kernel(f32: torch.Tensor, dtype) -> torch.Tensor:
    """fp32 -> dtype as the kernel rounds it: to nearest even when compiled; the Triton interpreter truncates
    fp32 -> bf16 (it drops the low 16 bits, whatever fp_downcast_rounding says)."""
    if INTERPRET and dtype == torch.bfloat16:
        return (f32.contiguous().view(torch.int32) & ~0xFFFF).view(torch.float32).to(dtype)
    return f32.to(dtype)


def check(h, g, u, m, gs, act):
    keep = m.repeat_interleave(gs, dim=1)
    assert h.shape == g.shape and h.dtype == g.dtype
    assert (h[~keep] == 0).all(), "inactive groups' columns are exactly 0"
    ref = DM.gated_select_ref(g, u, m, gs, act)
    if g.dtype != torch.float32:  # the same math, rounded the kernel's way
        ref = torch.where(keep, rounded_as_the_kernel(R.activation(g.float(), act) * u.float(), g.dtype), 0)
    oracle = torch.where(keep.cpu(), ORACLE[act](g.double().cpu()) * u.double().cpu(), 0)
    if g.dtype == torch.float32:
        assert rel(h, ref) <= 1e-6 and rel(h, oracle) <= 1e-5
    else:
        assert rel(h, ref) <= 1e-3 and rel(h, oracle) <= 1e-2


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["random", "on", "off", "one"])
@pytest.mark.parametrize("T,G,gs", [(1, 5, 16), (7, 3, 24), (5, 40, 33), (9, 3, 512)])
def test_gated_select_matches_reference(T, G, gs, kind, dtype, act):
    """Odd sizes: a group of 33 columns (program blocks end inside groups), F = 1536 (two programs per row)."""
    gen = torch.Generator().manual_seed(T * 131 + G)
    g, u, m = make(T, G, gs, kind, dtype, gen)
    check(DM.gated_select_triton(g, u, m, gs, act), g, u, m, gs, act)


def test_gated_select_keeps_non_finite_values_of_inactive_groups_out():
    gen = torch.Generator().manual_seed(3)
    g, u, m = make(6, 4, 16, "random", torch.float32, gen)
    keep = m.repeat_interleave(16, dim=1)
    g[~keep] = float("nan")
    u[~keep] = float("inf")
    h = DM.gated_select_triton(g, u, m, 16, "silu")
    assert torch.isfinite(h).all()
    check(h, g, u, m, 16, "silu")
    with pytest.raises(ValueError, match="unknown activation"):
        DM.gated_select_triton(g, u, m, 16, "relu")


def test_gated_select_takes_uint8_masks_and_row_strides():
    """A uint8 mask, g / u as row slices of wider buffers (torch.mm writes them contiguous; the kernel takes any
    row stride), no tokens at all."""
    gen = torch.Generator().manual_seed(5)
    g, u, m = make(4, 6, 8, "random", torch.float32, gen)
    gw = torch.cat([g, torch.randn_like(g)], 1)[:, : g.shape[1]]
    assert gw.stride(0) == 2 * g.shape[1] and torch.equal(gw, g)
    check(DM.gated_select_triton(gw, u, m.to(torch.uint8), 8, "silu"), g, u, m, 8, "silu")
    e = torch.empty(0, 48, device=DEV)
    assert DM.gated_select_triton(e, e, torch.zeros(0, 6, dtype=torch.bool, device=DEV), 8).shape == (0, 48)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mlp_dense_masked_matches_reference(dtype):
    """The whole dense-masked MLP (two GEMMs, the select kernel, the down GEMM) against reference.mlp_ref."""
    gen = torch.Generator().manual_seed(11)
    T, D, G, gs = 5, 40, 6, 16
    r = lambda *s: (torch.randn(*s, generator=gen) * 0.2).to(DEV, dtype)  # noqa: E731
    x, wg, wu, wd_t = r(T, D), r(G * gs, D), r(G * gs, D), r(G * gs, D)
    for kind in ("random", "on", "off", "one"):
        m = make(T, G, gs, kind, dtype, gen)[2]
        out = DM.mlp_dense_masked(x, wg, wu, wd_t, m, gs)
        ref = R.mlp_ref(x, wg, wu, wd_t, m, gs)
        if not m.any():
            assert (out == 0).all()
            continue
        assert rel(out, ref) <= (1e-5 if dtype == torch.float32 else 2e-2)
