"""The router-in-the-select kernel (kernels/routed_select.py) against float64: on the CPU under the Triton interpreter
(TRITON_INTERPRET=1), compiled on a CUDA GPU when the run sets TRITON_INTERPRET=0 (same cases and tolerances, plus
SmolLM2- and 8B-sized rows).

Tolerances:
- decisions: the kernel's mask equals the float64 logit's sign wherever that logit is further than 2^-16 of the sum
  of |products| (+ |bias|) from 0: the pair's products are exact in fp32, the fp32 sum of D of them is within
  about D 2^-24 of that sum, so closer logits may go either way (as in any fp32 GEMM);
- outputs, computed on the kernel's own decisions: the select (o_proj's input) bit for bit; act(g) * u within one
  ulp of its dtype of the float64 product rounded once (bf16 2^-7, fp32 2^-20 relative: the sigmoid's and erf's
  own error; 1e-6 absolute where the product is near 0);
  inactive groups exactly 0, also where they hold NaN / inf.
"""
import pytest
import torch
from kernel_checks import DEV, needs_device, poison_buffers  # noqa: F401 (the fixture)

from wide_compile.kernels import routed_select as RS
from wide_compile.kernels.reference import activation
from wide_compile.routing.routers import split_bf16

pytestmark = [needs_device, pytest.mark.usefixtures("poison_buffers")]  # an unwritten output element is NaN
gpu_only = pytest.mark.skipif(DEV != "cuda", reason="model-sized rows: compiled on a CUDA GPU only")
ULP = {torch.bfloat16: 2.0 ** -7, torch.float32: 2.0 ** -20}


def make(T, D, G, GS, dtype, glu, seed=0, bias=True, bias_shift=0.0, pad_to=4, poison=False):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(T, D, generator=gen).to(torch.bfloat16)
    w = torch.randn(G, D, generator=gen) / D ** 0.5
    b = (torch.randn(G, generator=gen) * 0.3 + bias_shift) if bias else None
    w2 = split_bf16(w, pad_to=pad_to if bias else 1)
    a = (torch.randn(T, G * GS, generator=gen) * 2).to(dtype)
    u = (torch.randn(T, G * GS, generator=gen) * 2).to(dtype) if glu else None
    return h, w2, b, a, u


def logits64(h, w2, b, G):
    Gp = w2.shape[0] // 2
    w = w2[:G].double() + w2[Gp:Gp + G].double()
    z = h.double() @ w.t() + (b.double() if b is not None else 0.0)
    bound = 2.0 ** -16 * (h.double().abs() @ w.abs().t() + (b.double().abs() if b is not None else 0.0))
    return z, bound


def check(T, D, G, GS, dtype=torch.bfloat16, glu=True, act="silu", poison=False, **kw):
    launch = {k: kw.pop(k) for k in ("rows", "cols", "sub_cols", "num_warps") if k in kw}
    h, w2, b, a, u = make(T, D, G, GS, dtype, glu, **kw)
    z, bound = logits64(h, w2, b, G)
    if poison:  # NaN / inf in the columns of every group the float64 router turns off
        cols = (z <= 0).repeat_interleave(GS, dim=1)
        a = a.masked_fill(cols, float("nan"))
        if u is not None:
            u = u.masked_fill(cols, float("inf"))
    dev = [None if t is None else t.to(DEV) for t in (a, h, w2, b, u)]
    y, m = RS.routed_select_triton(dev[0], dev[1], dev[2], dev[3], GS, dev[4], act, return_mask=True, **launch)
    y, m = y.cpu(), m.cpu().bool()
    assert y.dtype == dtype and y.shape == a.shape and m.shape == (T, G)
    clear = z.abs() > bound
    assert torch.equal(m[clear], (z > 0)[clear]), "decisions differ from float64 away from 0"
    if poison:
        m = m & (z > 0)  # the check: poisoned groups must be off (none of them is within rounding of 0 here)
        assert not (m & ~(z > 0)).any()
    on = m.repeat_interleave(GS, dim=1)
    assert (y[~on] == 0).all(), "an inactive group's column is not exactly 0"
    if not glu:
        assert torch.equal(y[on], a[on])
        return m
    want = (activation(a.double(), act) * u.double()).to(dtype)
    torch.testing.assert_close(y[on].double(), want[on].double(), atol=1e-6, rtol=ULP[dtype])
    return m


@pytest.mark.parametrize("glu", [True, False])
@pytest.mark.parametrize("T,D,G,GS", [(1, 16, 1, 16), (37, 96, 9, 16), (33, 70, 3, 12), (5, 576, 24, 64),
                                      (19, 130, 11, 8)])
def test_kernel_matches_float64(T, D, G, GS, glu):
    """Odd widths (D 70, 130: K steps past the end), ragged row tiles, several column programs (24 x 64 columns),
    group sizes not a power of two (12) or smaller than a column step (8), one row, one group."""
    check(T, D, G, GS, glu=glu, seed=T)


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh"])
def test_gate_activations(act):
    check(23, 64, 5, 16, act=act, seed=2)


def test_fp32_tensors_with_a_bf16_router():
    check(21, 80, 6, 16, dtype=torch.float32, seed=4)
    check(21, 80, 6, 16, dtype=torch.float32, glu=False, seed=4)


@pytest.mark.parametrize("shift,want", [(1e4, True), (-1e4, False)])
def test_all_on_and_all_off(shift, want):
    m = check(18, 64, 7, 16, bias_shift=shift, seed=5)
    assert (m == want).all()


def test_without_a_bias_the_pair_says_G():
    check(17, 48, 6, 16, bias=False, seed=6)
    check(17, 48, 6, 16, bias=False, glu=False, seed=6)


@pytest.mark.parametrize("glu", [True, False])
def test_inactive_groups_holding_nan_stay_zero(glu):
    check(29, 64, 9, 16, glu=glu, poison=True, seed=7)


@pytest.mark.parametrize("rows,cols,sub_cols", [(16, 16, 16), (32, 48, 16), (64, 512, 128), (16, 64, 32)])
def test_launch_shapes(rows, cols, sub_cols):
    """Row tiles of 16 to 64, column programs of 16 to 512 columns (a last program past the end, sub-blocks that
    split a group or hold several) select the same."""
    check(70, 96, 10, 12, rows=rows, cols=cols, sub_cols=sub_cols, seed=8)


def test_bad_inputs_say_what_to_do():
    h, w2, b, a, u = make(4, 32, 2, 16, torch.bfloat16, True)
    with pytest.raises(ValueError, match="bfloat16"):
        RS.routed_select_triton(a, h.float(), w2, b, 16, u)
    with pytest.raises(ValueError, match="do not cover"):
        RS.routed_select_triton(a[:, :24], h, w2, b, 16)
    with pytest.raises(ValueError, match="unknown activation"):
        RS.routed_select_triton(a, h, w2, b, 16, u, act="relu")
    with pytest.raises(ValueError, match="bf16 pair"):
        RS.routed_select_triton(a, h, w2[:, :16], b, 16, u)
    with pytest.raises(ValueError, match="powers of two"):
        RS.routed_select_triton(a, h, w2, b, 16, u, rows=24)


def test_reference_is_the_split_router_then_the_select():
    """routed_select_ref (what the ops run on a CPU) equals split_router_mask, then gated_select_ref / the select."""
    from wide_compile.kernels.dense_masked import gated_select_ref
    from wide_compile.routing.router_fns import split_router_mask

    h, w2, b, a, u = make(13, 64, 5, 16, torch.bfloat16, True, seed=9)
    m = split_router_mask(h, w2, b)
    assert torch.equal(RS.routed_select_ref(a, h, w2, b, 16, u), gated_select_ref(a, u, m, 16))
    assert torch.equal(RS.routed_select_ref(a, h, w2, b, 16), a * m.repeat_interleave(16, dim=1))


@gpu_only
@pytest.mark.parametrize("D,G,GS,glu", [(576, 24, 64, True), (576, 9, 64, False), (4096, 8, 512, False),
                                        (4096, 112, 128, True)])
def test_model_sized_rows(D, G, GS, glu):
    check(2048, D, G, GS, glu=glu, seed=10)


def test_gate_and_up_as_halves_of_one_gemm_output():
    """g and u as the two column halves of one [T, 2N] tensor (fuse_gate_up's GEMM output: row stride 2N) select
    as the same values held apart."""
    h, w2, b, a, u = make(27, 64, 6, 16, torch.bfloat16, True, seed=11)
    gu = torch.cat([a, u], dim=1)
    dev = [t.to(DEV) for t in (gu, h, w2, b)]
    got = RS.routed_select_triton(dev[0][:, :96], dev[1], dev[2], dev[3], 16, dev[0][:, 96:]).cpu()
    want = RS.routed_select_triton(a.to(DEV), dev[1], dev[2], dev[3], 16, u.to(DEV)).cpu()
    assert torch.equal(got, want)
