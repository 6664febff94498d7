"""The fused RMSNorm + router kernel (kernels/norm_router.py) vs its float64 reference: on the CPU under the
Triton interpreter (TRITON_INTERPRET=1), compiled on a CUDA GPU when the run sets TRITON_INTERPRET=0 (same
cases and tolerances, plus 8B-sized rows).

Tolerances: the norm output y within 1e-5 (fp32) / 1e-2 (bf16) relative L2 of the float64 reference from
the same rounded inputs; the mask equals the float64 reference's decision (computed from the kernel's own y,
so the two compare the router alone) wherever that logit is further than 1e-4 from 0 (closer, fp32
summation order may decide either way, as in any compiled fp32 GEMM), and for linear routers also further than
2^-14 of the sum of |products| (the tiles form's weight as a bf16 pair keeps about 16 bits).
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported; TRITON_INTERPRET=0 compiles it

import pytest  # noqa: E402
import torch  # noqa: E402

from wide_compile.kernels import norm_router as NR  # noqa: E402
from wide_compile.kernels import wide_add_rmsnorm_router, wide_rmsnorm_router  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERPRET else "cuda"
if not INTERPRET and not torch.cuda.is_available():  # pragma: no cover
    pytestmark = pytest.mark.skip("compiled Triton kernels need a CUDA GPU: on a CPU run with TRITON_INTERPRET=1")
gpu_only = pytest.mark.skipif(DEV != "cuda", reason="8B-sized rows: compiled on a CUDA GPU only")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def router(kind, D, G, R, gen, bias_shift=0.0):
    """(w1, b1, w2, b2) of a random fp32 router; bias_shift moves every logit (+-: all groups on / off)."""
    w1 = torch.randn(G if kind == "linear" else R, D, generator=gen) / D ** 0.5
    b1 = torch.randn(w1.shape[0], generator=gen) * 0.1
    if kind == "linear":
        return w1, b1 + bias_shift, None, None
    w2 = torch.randn(2 * G if kind == "pair" else G, R, generator=gen) / R ** 0.5
    b2 = torch.randn(w2.shape[0], generator=gen) * 0.1
    if kind == "pair":
        b2.view(G, 2)[:, 1] += bias_shift  # the execute logits
    else:
        b2 += bias_shift
    return w1, b1, w2, b2


def check(T, D, G, R, kind, router_input, dtype, seed=0, bias_shift=0.0, add=False, **launch):
    """add=True: the add form, x = a + b given as its two terms (its sum checked against a + b in dtype: bit for
    bit where the kernel is compiled)."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, D, generator=gen) * 3).to(dtype)
    w_norm = (1 + 0.1 * torch.randn(D, generator=gen)).to(dtype)
    ts = router(kind, D, G, R, gen, bias_shift)
    dev = [None if t is None else t.to(DEV) for t in (x, w_norm, *ts)]
    if add:
        a = (torch.randn(T, D, generator=gen) * 2).to(dtype)
        b = (x.float() - a.float()).to(dtype)  # a + b is close to x: the same logits' scale
        x = a + b
        xs, y, mask = NR.add_rmsnorm_router_triton(a.to(DEV), b.to(DEV), dev[1], 1e-5, router_input, kind, *dev[2:],
                                                   **launch)
        assert xs.dtype == dtype
        if INTERPRET and dtype == torch.bfloat16:  # the interpreter rounds fp32 -> bf16 toward 0: one ulp apart
            torch.testing.assert_close(xs.cpu(), x, atol=0, rtol=2 ** -7)
        else:  # compiled: round to nearest even, as PyTorch's add
            assert torch.equal(xs.cpu(), x)
        x = xs.cpu()  # the norm and the router below are checked on the kernel's own sum
    else:
        y, mask = NR.rmsnorm_router_triton(dev[0], dev[1], 1e-5, router_input, kind, *dev[2:], **launch)
    assert y.dtype == dtype and y.shape == (T, D) and mask.dtype == torch.bool and mask.shape == (T, G)
    y, mask = y.cpu(), mask.cpu()
    y_ref = NR.rmsnorm_ref(x.double(), w_norm.double(), 1e-5) if dtype == torch.float32 else \
        NR.rmsnorm_ref(x, w_norm, 1e-5).double()
    err = ((y.double() - y_ref).norm() / y_ref.norm()).item()
    assert err <= TOL[dtype], err
    h = (y if router_input == "normed" else x).double()
    logits = NR.router_logits_ref(h, kind, *(None if t is None else t.double() for t in ts))
    slack = 1e-4
    if kind == "linear":  # the tiles form on bf16 rows holds the weight as a bf16 pair: 2^-16 of each product
        slack = slack + 2 ** -14 * (h.abs() @ ts[0].double().abs().T)
    sure = logits.abs() > slack
    assert torch.equal(mask[sure], (logits > 0)[sure])
    return mask


@pytest.mark.parametrize("kind", NR.KINDS)
@pytest.mark.parametrize("router_input", NR.ROUTER_INPUTS)
@pytest.mark.parametrize("T", [1, 2, 7, 33, 70])
def test_fp32_odd_width(kind, router_input, T):
    check(T, 37, 6, 5, kind, router_input, torch.float32, seed=T)


@pytest.mark.parametrize("kind", NR.KINDS)
@pytest.mark.parametrize("router_input", NR.ROUTER_INPUTS)
def test_bf16(kind, router_input):
    check(9, 72, 12, 8, kind, router_input, torch.bfloat16)


@pytest.mark.parametrize("kind", NR.KINDS)
@pytest.mark.parametrize("router_input", NR.ROUTER_INPUTS)
@pytest.mark.parametrize("T,D,split", [(1, 37, 3), (2, 100, 4), (5, 64, 2), (3, 40, 7)])
def test_width_split_over_programs(kind, router_input, T, D, split):
    """The two-launch form (each row's width over `split` programs, 16-column tiles, their partial sums added by
    the finish kernel): odd widths, a last program with a short slice, more programs asked than tiles."""
    check(T, D, 6, 5, kind, router_input, torch.float32, seed=D + split, split=split, block_d=16)


@pytest.mark.parametrize("kind", NR.KINDS)
@pytest.mark.parametrize("router_input", NR.ROUTER_INPUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,D,split", [(1, 37, None), (7, 72, None), (2, 100, 4), (3, 40, 7)])
def test_add_form(kind, router_input, dtype, T, D, split):
    """The residual add in the kernel: the sum equals a + b in the inputs' dtype bit for bit, and the norm and
    the mask are those of that sum, in one program per row and split over programs (each writing its slice)."""
    launch = dict(split=split, block_d=16) if split else {}
    check(T, D, 6, 5, kind, router_input, dtype, seed=T + D, add=True, **launch)


@pytest.mark.parametrize("router_input", NR.ROUTER_INPUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("add", [False, True])
@pytest.mark.parametrize("T,D,G", [(1, 37, 6), (33, 100, 24), (70, 72, 70), (129, 40, 9)])
def test_tiles_form(router_input, dtype, add, T, D, G):
    """A linear router's tiles form (rows in tiles of 16 or 32, router rows in tiles of up to 64, bf16 rows
    against the weight as a bf16 pair): ragged last row tiles, odd widths, G over two router tiles (70), one
    row."""
    check(T, D, G, 5, "linear", router_input, dtype, seed=T + D + G, add=add, tiles=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("router_input", NR.ROUTER_INPUTS)
def test_tiles_form_of_32_rows(monkeypatch, dtype, router_input):
    """The 32-row tiles (what the 8B shape's prefill runs): forced here by a program target of 1."""
    monkeypatch.setattr(NR, "TILE_PROGRAMS", 1)
    assert NR.tile_sizes(70, 72, 70, dtype)[0] == 32
    check(70, 72, 70, 5, "linear", router_input, dtype, seed=3, add=True, tiles=True)


@pytest.mark.parametrize("tile", [(16, 16), (32, 128), (64, 32), (16, 32, 16), (32, 16, 32, 8), (16, 16, 128, 4)])
@pytest.mark.parametrize("router_input", NR.ROUTER_INPUTS)
def test_tiles_form_of_forced_tiles(tile, router_input):
    """The sweep's tile choices (rows, router rows, column step, warps per program): one router tile wider than G,
    rows over two, bf16 rows in column steps (two passes) and in one step wider than the row (one pass)."""
    check(70, 40, 70, 5, "linear", router_input, torch.bfloat16, seed=5, add=True, tiles=True, tile=tile)
    with pytest.raises(ValueError, match="powers of two >= 16"):
        check(70, 40, 70, 5, "linear", "residual", torch.bfloat16, tiles=True, tile=(8, 16))
    with pytest.raises(ValueError, match="column step"):
        check(70, 40, 70, 5, "linear", "residual", torch.bfloat16, tiles=True, tile=(16, 16, 24))


@pytest.mark.parametrize("add", [False, True])
@pytest.mark.parametrize("router_input", NR.ROUTER_INPUTS)
def test_tiles_one_pass_at_a_narrow_models_width(router_input, add):
    """bf16 rows of a narrow width (not a power of two) in one column tile (one pass, a forced tile: the sweeps'),
    checked as the same rows in column steps (two passes, the default) are."""
    T, D, G = 45, 72, 24
    assert NR.tile_sizes(T, D, G, torch.bfloat16)[2] < D
    check(T, D, G, 5, "linear", router_input, torch.bfloat16, seed=11, add=add, tiles=True, tile=(16, 32, 128))
    check(T, D, G, 5, "linear", router_input, torch.bfloat16, seed=11, add=add, tiles=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiles_all_on_all_off_and_one_group(dtype):
    assert check(40, 24, 3, 4, "linear", "normed", dtype, bias_shift=100.0, tiles=True).all()
    assert not check(40, 24, 3, 4, "linear", "residual", dtype, bias_shift=-100.0, tiles=True).any()
    assert check(35, 40, 1, 2, "linear", "residual", dtype, tiles=True).shape == (35, 1)


def test_tile_sizes():
    assert NR.tile_sizes(2048, 576, 24, torch.bfloat16) == (16, 32, 64)      # SmolLM2 FFN: 128 programs of 16 rows
    assert NR.tile_sizes(2048, 4096, 224, torch.bfloat16) == (32, 64, 64)    # 8B FFN: 64 x 4 programs of 32 rows
    assert NR.tile_sizes(300, 37, 3, torch.float32) == (16, 16, 32)          # fp32: narrower column steps


def test_prefill_sizes_take_the_tiles_form(monkeypatch):
    """A linear router runs as tiles from TILE_MIN_T rows on (unless a test forces the row split), the rows form
    below; other kinds never."""
    took = []
    real = NR._launch_tiles
    monkeypatch.setattr(NR, "_launch_tiles", lambda *a, **k: (took.append(a[0].shape[0]), real(*a, **k)))
    for T in (NR.TILE_MIN_T - 1, NR.TILE_MIN_T):
        check(T, 24, 5, 4, "linear", "residual", torch.float32)
        check(T, 24, 5, 4, "pair", "residual", torch.float32)
    check(NR.TILE_MIN_T, 24, 5, 4, "linear", "residual", torch.float32, split=2)
    assert took == [NR.TILE_MIN_T]


def test_add_form_needs_matching_terms():
    x, w = torch.randn(2, 8), torch.ones(8)
    w1 = torch.randn(3, 8)
    for r in (torch.randn(2, 7), torch.randn(2, 8).double()):
        with pytest.raises(ValueError, match="residual must match"):
            NR.add_rmsnorm_router_triton(x, r, w, 1e-5, "normed", "linear", w1)


def test_row_splits_of_linear_routers():
    assert NR.row_splits(1, 4096, 112) == (112, 1)    # 8B FFN: 1.8 MB, one router row per program, one launch
    assert NR.row_splits(1, 576, 24) == (24, 1)       # SmolLM2 FFN, 55 KB: spread too (one program was latency-bound)
    assert NR.row_splits(2048, 576, 24) == (1, 32)    # SmolLM2 prefill: one program per token row
    assert NR.row_splits(300, 4096, 112)[0] == 1      # prefill: the token rows fill the GPU
    assert NR.row_splits(1, 100, 6, split=4) == (3, 2)  # 6 rows over 4 programs asked: 3 programs of 2


@pytest.mark.parametrize("bias", [True, False])
def test_compose_pair_is_the_pair_routers_margin(bias):
    gen = torch.Generator().manual_seed(7)
    w1, b1, w2, b2 = router("pair", 30, 5, 8, gen)
    if not bias:
        b1 = b2 = None
    h = torch.randn(11, 30, generator=gen)
    W, c = NR.compose_pair(w1, b1, w2, b2)
    assert W.dtype == c.dtype == torch.float32 and W.shape == (5, 30) and c.shape == (5,)
    ref = NR.router_logits_ref(h.double(), "pair", *(None if t is None else t.double() for t in (w1, b1, w2, b2)))
    torch.testing.assert_close(h.double() @ W.double().T + c.double(), ref, atol=1e-6, rtol=1e-6)


def test_large_routers_split_small_ones_do_not():
    assert NR.num_splits(1, 4096, 112, 64) == (64, 64)        # 8B FFN, linear: 1.8 MB of w1 over 64 programs
    assert NR.num_splits(1, 576, 32, 256)[0] == 3              # SmolLM2 pair router: 74 KB, split too
    assert NR.num_splits(1, 37, 5, 64) == (1, 64)               # a tiny router: one program per row
    assert NR.num_splits(300, 4096, 112, 64)[0] == 1            # prefill: the rows fill the GPU
    assert NR.num_splits(1, 100, 5, 16, split=4) == (4, 32)    # 7 tiles over 4 programs: 2, 2, 2, 1


@pytest.mark.parametrize("kind", NR.KINDS)
def test_all_on_all_off_and_one_group(kind):
    assert check(4, 24, 3, 4, kind, "normed", torch.float32, bias_shift=100.0).all()
    assert not check(4, 24, 3, 4, kind, "residual", torch.float32, bias_shift=-100.0).any()
    assert check(3, 40, 1, 2, kind, "normed", torch.float32).shape == (3, 1)


def test_wide_op_matches_the_kernel_and_keeps_leading_dims():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 20, generator=gen).to(DEV)
    w_norm = torch.randn(20, generator=gen).to(DEV)
    w1, b1, w2, b2 = (t.to(DEV) for t in router("pair", 20, 4, 3, gen))
    y, m = wide_rmsnorm_router(x, w_norm, 1e-6, "residual", "pair", w1, b1, w2, b2)
    y_ref, m_ref = NR.rmsnorm_router_ref(x.reshape(-1, 20), w_norm, 1e-6, "residual", "pair", w1, b1, w2, b2)
    assert y.shape == (2, 3, 20) and m.shape == (2, 3, 4)
    torch.testing.assert_close(y.reshape(-1, 20), y_ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(m.reshape(-1, 4), m_ref)


def test_add_op_matches_the_reference_and_keeps_leading_dims():
    gen = torch.Generator().manual_seed(4)
    a, b = (torch.randn(2, 3, 20, generator=gen).to(DEV) for _ in range(2))
    w_norm = torch.randn(20, generator=gen).to(DEV)
    w1, b1, w2, b2 = (t.to(DEV) for t in router("pair", 20, 4, 3, gen))
    x, y, m = wide_add_rmsnorm_router(a, b, w_norm, 1e-6, "residual", "pair", w1, b1, w2, b2)
    x_ref, y_ref, m_ref = NR.add_rmsnorm_router_ref(a.reshape(-1, 20), b.reshape(-1, 20), w_norm, 1e-6, "residual",
                                                    "pair", w1, b1, w2, b2)
    assert x.shape == y.shape == (2, 3, 20) and m.shape == (2, 3, 4)
    torch.testing.assert_close(x.reshape(-1, 20), x_ref, atol=0, rtol=0)
    torch.testing.assert_close(y.reshape(-1, 20), y_ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(m.reshape(-1, 4), m_ref)


def test_bad_router_is_one_clear_error():
    x, w = torch.randn(2, 8), torch.ones(8)
    with pytest.raises(ValueError, match="float32"):
        NR.rmsnorm_router_triton(x, w, 1e-5, "normed", "linear", torch.randn(3, 8).half())
    with pytest.raises(ValueError, match="w1"):
        NR.rmsnorm_router_triton(x, w, 1e-5, "normed", "pair", torch.randn(3, 8))
    with pytest.raises(ValueError, match="kind must be one of"):
        NR.rmsnorm_router_triton(x, w, 1e-5, "normed", "codebook", torch.randn(3, 8))


@gpu_only
@pytest.mark.parametrize("kind,G", [("linear", 112), ("pair", 32), ("mlp", 224)])
@pytest.mark.parametrize("T", [1, 8, 64])
def test_8b_rows(kind, G, T):
    check(T, 4096, G, 32, kind, "normed" if kind == "linear" else "residual", torch.bfloat16, seed=T)
    if kind == "linear":  # the row split ran (one launch)
        assert NR.row_splits(T, 4096, G)[0] > 1
    else:  # the two-launch form ran
        assert NR.num_splits(T, 4096, 32, 64)[0] > 1


@gpu_only
@pytest.mark.parametrize("G,D", [(224, 4096), (8, 4096), (24, 576), (9, 576)])
@pytest.mark.parametrize("router_input", NR.ROUTER_INPUTS)
def test_prefill_tiles_at_model_sizes(G, D, router_input):
    """The tiles form at 2048 rows on the 8B shape (FFN / KV-aligned attention routers) and SmolLM2's, bf16,
    with the residual add (the form the pass emits)."""
    check(2048, D, G, 32, "linear", router_input, torch.bfloat16, seed=G, add=True)


@pytest.mark.parametrize("kind", NR.KINDS)
def test_opcheck(kind):
    """torch.ops.wide.rmsnorm_router's registration (schema, fake impl, no aliasing) on the device under test."""
    gen = torch.Generator().manual_seed(1)
    x, w_norm = torch.randn(3, 16, generator=gen).to(DEV), torch.randn(16, generator=gen).to(DEV)
    ts = [None if t is None else t.to(DEV) for t in router(kind, 16, 4, 3, gen)]
    torch.library.opcheck(torch.ops.wide.rmsnorm_router.default, (x, w_norm, 1e-5, "normed", kind, *ts))
    torch.library.opcheck(torch.ops.wide.add_rmsnorm_router.default, (x, x * 0.5, w_norm, 1e-5, "residual", kind, *ts))
