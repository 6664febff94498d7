"""Triton WIDE kernels vs the float64 reference: on the CPU under the Triton interpreter (TRITON_INTERPRET=1,
tests/conftest.py's default), compiled on a CUDA GPU when the run sets TRITON_INTERPRET=0 (same cases and
tolerances, plus larger shapes that only the GPU runs: `TRITON_INTERPRET=0 pytest tests/test_kernel_triton.py`).

Tolerances (relative L2 error against a float64 reference computed from the same rounded inputs):
fp32 <= 1e-4 (interpreter dots are exact fp32; on GPU fp32 uses ieee dots), bf16 <= 2e-2.
Every buffer a kernel must write is NaN/garbage-poisoned first (mask_reorder.POISON), including
the MLP intermediate h, so an unwritten output or a read of an unwritten h element fails.

The larger matrices (T x density x dtype, T x group size x path, ...) run in full on a GPU; under the interpreter
every pair of their two main axes runs, each with one value of the third in turn (kernel_checks.covering).
"""
import importlib

import pytest
import torch
from kernel_checks import DEV, case_id, covering, needs_device, poison_buffers, rel  # noqa: F401 (the fixture)

from wide_compile.kernels import reference as R
from wide_compile.kernels.compact_attn import o_proj_triton, q_proj_triton
from wide_compile.kernels.compact_mlp import mlp_triton

MR = importlib.import_module("wide_compile.kernels.reorder")

pytestmark = [needs_device, pytest.mark.usefixtures("poison_buffers")]
gpu_only = pytest.mark.skipif(DEV != "cuda", reason="larger shapes: compiled on a CUDA GPU only (TRITON_INTERPRET=0)")


def on_dev(*ts):
    """The CPU-generated case (same values on every machine) on the device under test."""
    return [None if t is None else t.to(DEV) for t in ts]

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
DENSITIES = [0.0, "one", 0.3, 0.5, 0.9, 1.0]
DTYPES = [torch.float32, torch.bfloat16]


def make_mask(T, G, density, gen):
    if density == "one":
        m = torch.zeros(T, G, dtype=torch.bool)
        m[torch.arange(T), torch.randint(0, G, (T,), generator=gen)] = True
        return m
    return torch.rand(T, G, generator=gen) < density


def check(out, ref, dtype):
    e = rel(out, ref)
    assert e <= TOL[dtype], e


def mlp_case(T, D, G, gs, density, dtype, config, seed=0, act="silu"):
    gen = torch.Generator().manual_seed(seed)
    F = G * gs
    x = torch.randn(T, D, generator=gen).to(dtype)
    wg = (torch.randn(F, D, generator=gen) / D ** 0.5).to(dtype)
    wu = (torch.randn(F, D, generator=gen) / D ** 0.5).to(dtype)
    wd = (torch.randn(F, D, generator=gen) / F ** 0.5).to(dtype)
    m = make_mask(T, G, density, gen)
    x, wg, wu, wd, m = on_dev(x, wg, wu, wd, m)
    out = mlp_triton(x, wg, wu, wd, m, gs, config=config, act=act)
    assert out.shape == (T, D) and out.dtype == dtype
    if dtype == torch.float32:
        ref = R.mlp_ref(x.double(), wg.double(), wu.double(), wd.double(), m, gs, act)
    else:  # same intermediate rounding as the kernel (h in bf16), fp64 math otherwise
        ref = R.mlp_ref(x, wg, wu, wd, m, gs, act).double()
        ref64 = R.mlp_ref(x.double(), wg.double(), wu.double(), wd.double(), m, gs, act)
        check(out, ref64, dtype)
    check(out, ref, dtype)
    if not m.any():
        assert (out == 0).all()
    return out


# T 4 and 16: the default small-batch path is "dense"
@pytest.mark.parametrize("T,density,dtype", covering([1, 3, 4, 16, 17, 130], DENSITIES, DTYPES), ids=case_id)
def test_mlp_default_path(T, density, dtype):
    mlp_case(T, D=48, G=4, gs=32, density=density, dtype=dtype, config=None)


@pytest.mark.parametrize("path,gs,T", covering(["decode", "tile", "sorted", "sorted+dense_down", "dense"],
                                              [16, 64, 24], [1, 17, 130]))
def test_mlp_paths_group_sizes(T, gs, path):
    G = max(2, 128 // gs)
    cfg = {"path": "sorted", "down": "dense"} if path == "sorted+dense_down" else {"path": path}
    mlp_case(T, D=40, G=G, gs=gs, density=0.5, dtype=torch.float32, config=cfg, seed=T + gs)


@pytest.mark.parametrize("path,dtype,T,act", covering(
    ["decode", "tile", "sorted", "sorted+dense_down", "dense"],
    [(torch.float32, 3), (torch.float32, 37), (torch.bfloat16, 37)], ["gelu", "gelu_tanh"]), ids=case_id)
def test_mlp_geglu_activations(T, dtype, path, act):
    """GeGLU (Gemma): the gate activation is a parameter of every path, checked against the float64 reference
    (whose gelu is torch's, an independent implementation of the kernels' erf / tanh formulas)."""
    cfg = {"path": "sorted", "down": "dense"} if path == "sorted+dense_down" else {"path": path}
    out = mlp_case(T, D=40, G=4, gs=24, density=0.5, dtype=dtype, config=cfg, seed=T, act=act)
    silu = mlp_case(T, D=40, G=4, gs=24, density=0.5, dtype=dtype, config=cfg, seed=T)
    assert rel(out, silu) > 0.05  # the activation really changes the result (well beyond the tolerances)


def test_mlp_unknown_activation_is_an_error():
    x = torch.randn(2, 8)
    w = torch.randn(16, 8)
    with pytest.raises(ValueError, match="unknown activation 'relu'"):
        mlp_triton(x, w, w, w, torch.ones(2, 2, dtype=torch.bool), 8, act="relu")


@pytest.mark.parametrize("cfg", [
    dict(path="tile", up_bm=32, up_bn=16, up_bk=16, dn_bm=32, dn_bn=16, dn_bk=16, dn_split=1),
    dict(path="sorted", up_bm=16, up_bn=64, up_bk=64, dn_bm=16, dn_bn=64, dn_bk=32, dn_split=3),
    dict(path="decode", up_bm=16, up_bn=16, up_bk=128, dn_bm=16, dn_bn=16, dn_bk=64, dn_split=4),
])
def test_mlp_configs_odd_sizes(cfg):
    # odd D (not a multiple of BK), group size not a multiple of the tile, T not a multiple of BM
    mlp_case(T=37, D=27, G=3, gs=48, density=0.5, dtype=torch.float32, config=cfg)


@pytest.mark.parametrize("T,path,density,dtype", covering(
    [(3, "sorted"), (37, "sorted"), (130, "sorted"), (37, "tile"), (1, "decode")], DENSITIES, DTYPES), ids=case_id)
def test_mlp_gate_and_up_in_one_dot(T, path, density, dtype):
    """Config up_fuse: the gate and up rows interleaved into one weight tile, one dot per K step, the accumulator
    split back into the pair; odd D, a group size not a multiple of the column tile, every density (all-off
    included), with the GeGLU activation too."""
    cfg = {"path": path, "up_fuse": True, "up_bn": 16}
    mlp_case(T, D=27, G=3, gs=24, density=density, dtype=dtype, config=cfg, seed=T)
    if T == 37:
        mlp_case(T, D=27, G=3, gs=24, density=0.5, dtype=dtype, config=cfg, seed=T, act="gelu_tanh")


@pytest.mark.parametrize("T,path,density,dtype", covering(
    [(1, "decode"), (3, "decode"), (16, "decode"), (17, "tile"), (130, "tile")], DENSITIES, DTYPES), ids=case_id)
def test_mlp_without_reorder_lists(T, path, density, dtype):
    # lists="none": the kernels read the mask themselves (no tile-list launch); inactive groups exit or
    # are predicated off, so the result must equal the reference for every density, all-off included
    mlp_case(T, D=48, G=5, gs=32, density=density, dtype=dtype, config={"path": path, "lists": "none"}, seed=T)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 4, 9, 16, 37])
def test_dense_path_never_reads_inactive_groups(T, dtype):
    # the small-batch dense path selects inactive groups away: a non-finite gate weight of a group no
    # token uses must not reach the output (NaN in inactive o_proj input columns: attn_case, path "dense")
    gen = torch.Generator().manual_seed(T)
    D, G, gs = 24, 6, 16
    x = torch.randn(T, D, generator=gen).to(dtype)
    wg = (torch.randn(G * gs, D, generator=gen) / D ** 0.5).to(dtype)
    wu = (torch.randn(G * gs, D, generator=gen) / D ** 0.5).to(dtype)
    wd = (torch.randn(G * gs, D, generator=gen) / (G * gs) ** 0.5).to(dtype)
    m = make_mask(T, G, 0.5, gen)
    m[:, 2] = False
    wg_bad = wg.clone()
    wg_bad[2 * gs:3 * gs] = float("inf")
    x, wg, wu, wd, m, wg_bad = on_dev(x, wg, wu, wd, m, wg_bad)
    out = mlp_triton(x, wg_bad, wu, wd, m, gs, config={"path": "dense"})
    check(out, R.mlp_ref(x.double(), wg.double(), wu.double(), wd.double(), m, gs), dtype)


def attn_case(T, D, G, cols, density, dtype, bias, config=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    Nq = G * cols
    x = torch.randn(T, D, generator=gen).to(dtype)
    wq = (torch.randn(Nq, D, generator=gen) / D ** 0.5).to(dtype)
    bq = torch.randn(Nq, generator=gen).to(dtype) if bias else None
    a = torch.randn(T, Nq, generator=gen).to(dtype)
    wo = (torch.randn(Nq, D, generator=gen) / Nq ** 0.5).to(dtype)
    bo = torch.randn(D, generator=gen).to(dtype) if bias else None
    m = make_mask(T, G, density, gen)
    x, wq, bq, a, wo, bo, m = on_dev(x, wq, bq, a, wo, bo, m)
    d = torch.float64
    q = q_proj_triton(x, wq, bq, m, cols, config=config)
    assert q.shape == (T, Nq)
    check(q, R.q_proj_ref(x.to(d), wq.to(d), None if bq is None else bq.to(d), m, cols), dtype)
    assert (q[R.expand_mask(~m, cols)] == 0).all(), "inactive q columns must be exactly 0"
    o = o_proj_triton(a, wo, bo, m, cols, config=config)
    assert o.shape == (T, D)
    check(o, R.o_proj_ref(a.to(d), wo.to(d), None if bo is None else bo.to(d), m, cols), dtype)
    # poison inactive input columns of a: they must never be read
    a2 = a.clone()
    a2[R.expand_mask(~m, cols)] = float("nan")
    o2 = o_proj_triton(a2, wo, bo, m, cols, config=config)
    check(o2, R.o_proj_ref(a.to(d), wo.to(d), None if bo is None else bo.to(d), m, cols), dtype)


@pytest.mark.parametrize("T,density,dtype", covering([1, 3, 4, 16, 17, 130], DENSITIES, DTYPES), ids=case_id)
def test_attn_proj(T, density, dtype):
    attn_case(T, D=40, G=4, cols=32, density=density, dtype=dtype, bias=(T % 2 == 1), seed=T)


@pytest.mark.parametrize("density", DENSITIES)
@pytest.mark.parametrize("T", [1, 5, 19])
def test_attn_proj_without_reorder_lists(T, density):
    attn_case(T, D=40, G=4, cols=32, density=density, dtype=torch.bfloat16, bias=(T % 2 == 1), seed=T,
              config={"path": "decode" if T <= 16 else "tile", "lists": "none"})


@pytest.mark.parametrize("path", ["decode", "tile", "sorted", "sorted+dense_down", "dense"])
@pytest.mark.parametrize("cols", [16, 48, 128])
def test_attn_paths_cols(cols, path):
    cfg = {"path": "sorted", "down": "dense"} if path == "sorted+dense_down" else {"path": path}
    attn_case(T=19, D=24, G=3, cols=cols, density=0.5, dtype=torch.float32, bias=True,
              config=cfg, seed=cols)


@pytest.mark.parametrize("T,G,density,block_m", covering([(1, 5), (3, 7), (17, 12), (130, 24)], DENSITIES,
                                                        [1, 4, 16, 64]))
def test_mask_reorder_triton(T, G, density, block_m):
    gen = torch.Generator().manual_seed(T * 7 + G)
    (m,) = on_dev(make_mask(T, G, density, gen))
    got = MR.mask_reorder_triton(m, block_m)
    exp = R.mask_reorder_ref(m, block_m)
    for g, e, name in zip(got, exp, ["tile_groups", "tile_counts", "sorted_token_ids", "block_groups", "ntpp"]):
        assert g.dtype == torch.int32, name
        assert torch.equal(g, e), name


# --- larger shapes, compiled on the GPU only (the interpreter would take minutes per case) --------------
@gpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("density", [0.0, "one", 0.5, 1.0])
@pytest.mark.parametrize("T", [1, 8, 300, 2048])
def test_mlp_default_path_large(T, density, dtype):
    mlp_case(T, D=576, G=24, gs=64, density=density, dtype=dtype, config=None, seed=T)


@gpu_only
@pytest.mark.parametrize("cfg", [dict(path="sorted", up_fuse=True), dict(path="sorted", up_fuse=True, up_warps=8),
                                 dict(path="sorted", up_fuse=True, up_bm=64), dict(path="tile", up_fuse=True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mlp_gate_and_up_in_one_dot_large(cfg, dtype):
    mlp_case(1000, D=1024, G=44, gs=64, density=0.5, dtype=dtype, config=cfg, seed=3)


@gpu_only
@pytest.mark.parametrize("path", ["decode", "tile", "sorted", "sorted+dense_down", "dense"])
@pytest.mark.parametrize("T", [3, 1000])
def test_mlp_paths_large(T, path):
    cfg = {"path": "sorted", "down": "dense"} if path == "sorted+dense_down" else {"path": path}
    mlp_case(T, D=1024, G=44, gs=64, density=0.5, dtype=torch.bfloat16, config=cfg, seed=T)


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 8, 517, 2048])
def test_attn_proj_large(T, dtype):
    attn_case(T, D=576, G=9, cols=64, density=0.5, dtype=dtype, bias=(T % 2 == 1), seed=T)


@gpu_only
@pytest.mark.parametrize("block_m", [1, 64, 128])
@pytest.mark.parametrize("T,G", [(2048, 224), (4099, 32)])
def test_mask_reorder_triton_large(T, G, block_m):
    gen = torch.Generator().manual_seed(T + G)
    (m,) = on_dev(make_mask(T, G, 0.5, gen))
    for g, e in zip(MR.mask_reorder_triton(m, block_m), R.mask_reorder_ref(m, block_m)):
        assert torch.equal(g, e)
