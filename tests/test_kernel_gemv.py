"""One-token GEMVs (wide_compile/kernels/gemv.py): the MLP, q_proj and o_proj kernels against float64 oracles, on
the CPU under the Triton interpreter (TRITON_INTERPRET=1, conftest's default) or compiled on a CUDA GPU
(TRITON_INTERPRET=0: the same cases plus GPU-sized ones at every swept tile).

Tolerances (relative L2 error over the output row): fp32 <= 1e-5 against a float64 oracle of the same rounded
inputs; bf16 <= 2e-2 against it and <= 1e-2 against the reference.py function (which rounds as the kernel does).
An all-off mask gives exact zeros (o_proj: its bias), q_proj exact zeros on inactive groups' columns, a prototype
id outside [0, P) a NaN row. Every buffer the kernels must write (h, the group list, the split partials, the
output) is NaN/garbage-poisoned first (reorder.POISON).

The oracle matrices (shape x mask kind x dtype x layout / bias) run in full on a GPU; under the interpreter every
shape meets every mask kind, and each (shape, kind) case takes one dtype / layout / bias combination in turn, so
each shape and each mask kind still meets each of them (kernel_checks.covering).
"""
import pytest
import torch
import torch.nn.functional as F
from kernel_checks import DEV, case_id, covering, needs_device, poison_buffers, rel  # noqa: F401 (the fixture)

import wide_compile.kernels  # noqa: F401  (registers torch.ops.wide.*)
from wide_compile.kernels import bucket_mlp as BK
from wide_compile.kernels import gemv as GV
from wide_compile.kernels import reference as R
from wide_compile.kernels.bucket_attn import o_proj_bucket_triton, q_proj_bucket_triton
from wide_compile.kernels.compact_attn import o_proj_triton, q_proj_triton
from wide_compile.kernels.compact_mlp import mlp_triton
from wide_compile.kernels.tuning import table_for

pytestmark = [needs_device, pytest.mark.usefixtures("poison_buffers")]
gpu_only = pytest.mark.skipif(DEV != "cuda", reason="GPU-sized shapes: compiled on a CUDA GPU only")

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
ACTS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda v: F.gelu(v, approximate="tanh")}


def make_mask(G, kind, gen):
    """[1, G] bool: random (about half on), on, off, one (a single group: the last), first (only group 0)."""
    if kind == "on":
        return torch.ones(1, G, dtype=torch.bool)
    if kind == "off":
        return torch.zeros(1, G, dtype=torch.bool)
    if kind == "one":
        return torch.arange(G)[None, :] == G - 1
    if kind == "first":
        return torch.arange(G)[None, :] == 0
    return torch.rand(1, G, generator=gen) < 0.5


def make_weights(D, G, gs, dtype, gen):
    Fi = G * gs
    x = torch.randn(1, D, generator=gen).to(dtype)
    wg = (torch.randn(Fi, D, generator=gen) / D ** 0.5).to(dtype)
    wu = (torch.randn(Fi, D, generator=gen) / D ** 0.5).to(dtype)
    wd = (torch.randn(D, Fi, generator=gen) / Fi ** 0.5).to(dtype)     # down_proj.weight [D, F]
    return [t.to(DEV) for t in (x, wg, wu, wd)]


def oracle_f64(x, wg, wu, wd, mask_row, gs, act="silu"):
    """float64, with the inactive groups removed from the weights (down_proj's columns zeroed), not through
    reference.mlp_ref: [1, D]."""
    d = torch.float64
    x, wg, wu, wd = (t.to(d).cpu() for t in (x, wg, wu, wd))
    keep = mask_row.cpu().repeat_interleave(gs).to(d)                    # [F]
    return ((ACTS[act](x @ wg.T) * (x @ wu.T)) @ (wd * keep[None, :]).T)


def check(out, x, wg, wu, wd, mask_row, gs, act="silu"):
    dtype = x.dtype
    assert out.shape == (1, x.shape[1]) and out.dtype == dtype
    if not mask_row.any():
        assert (out == 0).all(), "an all-off mask gives exact zeros"
        return
    assert rel(out, oracle_f64(x, wg, wu, wd, mask_row, gs, act)) <= TOL[dtype]
    if dtype != torch.float32:
        ref = R.mlp_ref(x, wg, wu, wd.t(), mask_row[None, :], gs, act)
        assert rel(out, ref) <= 1e-2


SHAPES = [(40, 6, 16), (33, 3, 24), (64, 4, 32), (17, 7, 8), (100, 5, 12)]   # (D, G, group size): odd sizes too
KINDS = ["random", "on", "off", "one", "first"]
LAYOUTS = ["k_contiguous", "d_contiguous"]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("D,G,gs,kind,dtype,layout",
                         covering(SHAPES, KINDS, [(d, lay) for d in DTYPES for lay in LAYOUTS]), ids=case_id)
def test_gemv_matches_oracle(D, G, gs, kind, dtype, layout):
    gen = torch.Generator().manual_seed(D * 31 + G)
    x, wg, wu, wd = make_weights(D, G, gs, dtype, gen)
    mask = make_mask(G, kind, gen).to(DEV)
    w_nk = wd if layout == "k_contiguous" else wd.t().contiguous().t()    # the free op's w_down_t, as W[d, k]
    assert GV.layout(w_nk) == layout
    out = GV.mlp_gemv_triton(x, wg, wu, w_nk, mask, None, gs)
    check(out, x, wg, wu, wd, mask[0], gs)


@pytest.mark.parametrize("D,G,gs,kind,layout", covering(SHAPES, KINDS, LAYOUTS))
def test_gemv_without_prefetch(D, G, gs, kind, layout):
    """The loops that load each tile in its own iteration (gu_prefetch = gd_prefetch = 0; the interpreter's
    default is the prefetching form, which the other tests run)."""
    gen = torch.Generator().manual_seed(D * 31 + G)
    x, wg, wu, wd = make_weights(D, G, gs, torch.float32, gen)
    mask = make_mask(G, kind, gen).to(DEV)
    w_nk = wd if layout == "k_contiguous" else wd.t().contiguous().t()
    for cfg in (dict(gu_prefetch=0, gd_prefetch=0), dict(gu_prefetch=0, gd_prefetch=1, gd_split=1),
                dict(gu_prefetch=1, gd_prefetch=0, gd_split=4, gd_bk=8)):
        check(GV.mlp_gemv_triton(x, wg, wu, w_nk, mask, None, gs, config=cfg), x, wg, wu, wd, mask[0], gs)


@pytest.mark.parametrize("config", [dict(gd_split=1), dict(gd_split=4, gd_bk=8), dict(gu_bn=4, gu_bk=32),
                                    dict(gu_bn=32, gd_bn=32, gd_split=8), dict(gu_bk=128, gd_bk=128)])
@pytest.mark.parametrize("layout", ["k_contiguous", "d_contiguous"])
def test_gemv_tiles(config, layout):
    gen = torch.Generator().manual_seed(7)
    x, wg, wu, wd = make_weights(45, 9, 24, torch.float32, gen)
    w_nk = wd if layout == "k_contiguous" else wd.t().contiguous().t()
    for kind in ("random", "one", "on"):
        mask = make_mask(9, kind, gen).to(DEV)
        check(GV.mlp_gemv_triton(x, wg, wu, w_nk, mask, None, 24, config=config), x, wg, wu, wd, mask[0], 24)


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh"])
def test_gemv_activations(act):
    gen = torch.Generator().manual_seed(3)
    x, wg, wu, wd = make_weights(40, 6, 16, torch.float32, gen)
    mask = make_mask(6, "random", gen).to(DEV)
    check(GV.mlp_gemv_triton(x, wg, wu, wd, mask, None, 16, act), x, wg, wu, wd, mask[0], 16, act)


def test_gemv_strided_inputs():
    """x a row of a wider tensor, gate / up weights column slices of wider ones."""
    gen = torch.Generator().manual_seed(5)
    x, wg, wu, wd = make_weights(40, 6, 16, torch.float32, gen)
    xw = torch.cat([x, torch.randn_like(x)], 1)[:, :40]
    wgw = torch.cat([wg, torch.randn_like(wg)], 1)[:, :40]
    wuw = torch.cat([torch.randn_like(wu), wu], 1)[:, 40:]
    mask = make_mask(6, "random", gen).to(DEV)
    check(GV.mlp_gemv_triton(xw, wgw, wuw, wd, mask, None, 16), x, wg, wu, wd, mask[0], 16)


@pytest.mark.parametrize("b", [0, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bucket_row(b, dtype):
    """The token's row of a prototype table: prototype 0 all-off, 1 all-on, the rest random."""
    gen = torch.Generator().manual_seed(11 + b)
    x, wg, wu, wd = make_weights(33, 7, 16, dtype, gen)
    protos = torch.rand(5, 7, generator=gen) < 0.5
    protos[0], protos[1] = False, True
    protos = protos.to(DEV)
    bucket = torch.tensor([b], dtype=torch.int32, device=DEV)
    out = GV.mlp_gemv_triton(x, wg, wu, wd, protos, bucket, 16)
    check(out, x, wg, wu, wd, protos[b], 16)


@pytest.mark.parametrize("b", [-1, 5, 1000])
def test_bucket_out_of_range_gives_nan(b):
    gen = torch.Generator().manual_seed(2)
    x, wg, wu, wd = make_weights(33, 7, 16, torch.float32, gen)
    protos = (torch.rand(5, 7, generator=gen) < 0.5).to(DEV)
    for split in (1, 4):
        out = GV.mlp_gemv_triton(x, wg, wu, wd, protos, torch.tensor([b], device=DEV), 16,
                                 config=dict(gd_split=split))
        assert out.isnan().all()


def test_free_op_runs_the_gemv_when_the_tuning_says_so(monkeypatch):
    """compact_mlp.mlp_triton and torch.ops.wide.mlp take the GEMVs at T = 1 with one_token="gemv" (and only at
    T = 1), with w_down_t [F, D] read as its transpose."""
    calls = []
    real = GV.mlp_gemv_triton
    monkeypatch.setattr(GV, "mlp_gemv_triton", lambda *a, **k: calls.append(a[3].shape) or real(*a, **k))
    gen = torch.Generator().manual_seed(9)
    x, wg, wu, wd = make_weights(40, 6, 16, torch.float32, gen)
    mask = make_mask(6, "random", gen).to(DEV)
    out = mlp_triton(x, wg, wu, wd.t().contiguous(), mask, 16, config={"one_token": "gemv"})
    assert calls == [(40, 96)]
    check(out, x, wg, wu, wd, mask[0], 16)
    tuning = table_for().with_overrides(decode={"one_token": "gemv"}).to_json()
    out = torch.ops.wide.mlp(x, wg, wu, wd.t().contiguous(), mask, 16, tuning, "silu")
    if DEV == "cuda":  # on the CPU the op runs its PyTorch reference
        assert len(calls) == 2
    check(out, x, wg, wu, wd, mask[0], 16)
    x3 = torch.cat([x, x, x])
    mlp_triton(x3, wg, wu, wd.t().contiguous(), mask.expand(3, 6), 16, config={"one_token": "gemv"})
    assert len(calls) == (2 if DEV == "cuda" else 1), "three tokens do not take the one-token GEMVs"


def test_bucket_op_runs_the_gemv_for_one_token(monkeypatch):
    calls = []
    real = GV.mlp_gemv_triton
    monkeypatch.setattr(GV, "mlp_gemv_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    gen = torch.Generator().manual_seed(4)
    x, wg, wu, wd = make_weights(33, 7, 16, torch.float32, gen)
    protos = (torch.rand(5, 7, generator=gen) < 0.5).to(DEV)
    bucket = torch.tensor([3], dtype=torch.int32, device=DEV)
    check(BK.mlp_bucket_triton(x, wg, wu, wd, bucket, protos, 16), x, wg, wu, wd, protos[3], 16)
    assert calls == [1]
    check(BK.mlp_bucket_triton(x, wg, wu, wd, bucket, protos, 16, config={"one_token": "union"}),
          x, wg, wu, wd, protos[3], 16)
    assert calls == [1], "one_token='union' keeps the union block"
    with pytest.raises(ValueError, match="one_token"):
        BK.mlp_bucket_triton(x, wg, wu, wd, bucket, protos, 16, config={"one_token": "gemm"})


def test_config_takes_its_own_keys_only():
    """The free op hands its whole tuning row in: its dn_* / up_* tiles must not reach the GEMVs."""
    base = GV.config_for("k_contiguous")
    assert GV.config_for("k_contiguous", dict(dn_bn=64, dn_split=8, up_bn=64, gd_split=1)) == dict(base, gd_split=1)
    with pytest.raises(ValueError, match="power of two"):
        GV.config_for("k_contiguous", dict(gd_split=3))


def fake_gpu(monkeypatch, tmp_path, name="Fake GPU 9000"):
    """The tuned-file lookup as on a CUDA GPU called `name`, its files under tmp_path."""
    monkeypatch.setattr(GV, "interpreting", lambda: False)
    monkeypatch.setattr(GV, "TUNED_DIR", tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda idx=None: name)
    GV._tuned_file.cache_clear()
    return tmp_path / "Fake_GPU_9000.json"


def test_tuned_file_gives_each_op_its_kernels_tiles(monkeypatch, tmp_path):
    """A GPU's tuned file: the MLP takes gate_up + down[layout], q_proj its own gated-kernel tiles, o_proj
    o_proj[layout]; the built-in tiles fill what the file leaves out; overrides win; a foreign key is an error."""
    import json

    path = fake_gpu(monkeypatch, tmp_path)
    cuda = GV.CONFIGS["cuda"]
    try:
        assert GV.config_for("k_contiguous", device="cuda") == cuda["k_contiguous"], "no file: built-in tiles"
        path.write_text(json.dumps(dict(
            device="Fake GPU 9000", gate_up=dict(gu_bn=4, gu_bk=512, gu_warps=1), q_proj=dict(gu_bn=16, gu_warps=4),
            down=dict(k_contiguous=dict(gd_bn=4, gd_split=16), d_contiguous=dict(gd_bn=128)),
            o_proj=dict(k_contiguous=dict(gd_bn=32, gd_split=2)))))
        GV._tuned_file.cache_clear()
        k = cuda["k_contiguous"]
        assert GV.config_for("k_contiguous", op="mlp", device="cuda") == dict(
            k, gu_bn=4, gu_bk=512, gu_warps=1, gd_bn=4, gd_split=16)
        assert GV.config_for("d_contiguous", op="mlp", device="cuda") == dict(
            cuda["d_contiguous"], gu_bn=4, gu_bk=512, gu_warps=1, gd_bn=128)
        assert GV.config_for("k_contiguous", op="q_proj", device="cuda") == dict(k, gu_bn=16, gu_warps=4)
        assert GV.config_for("k_contiguous", op="o_proj", device="cuda") == dict(k, gd_bn=32, gd_split=2)
        assert GV.config_for("d_contiguous", op="o_proj", device="cuda") == cuda["d_contiguous"]
        assert GV.config_for("k_contiguous", dict(gd_split=1), op="o_proj", device="cuda")["gd_split"] == 1
        assert GV.config_for("k_contiguous", op="mlp", device="cpu") == k, "a CPU tensor takes no GPU's file"
        with pytest.raises(ValueError, match="op must be"):
            GV.config_for("k_contiguous", op="mlp_bucket")
        path.write_text(json.dumps(dict(gate_up=dict(up_bn=4))))
        GV._tuned_file.cache_clear()
        with pytest.raises(ValueError, match="unknown GEMV config keys"):
            GV.config_for("k_contiguous", device="cuda")
    finally:
        GV._tuned_file.cache_clear()


# ----------------------------------------------------------------------------- q_proj / o_proj

def make_proj(D, G, gs, dtype, gen, bias):
    """x [1, D], w_q [Nq, D], b_q, a [1, Nq], w_o [D, Nq] (o_proj.weight), b_o; Nq = G * gs."""
    Nq = G * gs
    r = lambda *sh: torch.randn(*sh, generator=gen)  # noqa: E731
    t = [r(1, D), r(Nq, D) / D ** 0.5, r(Nq) if bias else None, r(1, Nq), r(D, Nq) / Nq ** 0.5,
         r(D) if bias else None]
    return [v.to(dtype).to(DEV) if v is not None else None for v in t]


def q_oracle(x, w_q, b_q, mask_row, gs):
    d = torch.float64
    y = x.to(d).cpu() @ w_q.to(d).cpu().T + (b_q.to(d).cpu() if b_q is not None else 0)
    return y * mask_row.cpu().repeat_interleave(gs).to(d)[None, :]


def o_oracle(a, w_o, b_o, mask_row, gs):
    d = torch.float64
    keep = mask_row.cpu().repeat_interleave(gs).to(d)
    return (a.to(d).cpu() * keep[None, :]) @ w_o.to(d).cpu().T + (b_o.to(d).cpu() if b_o is not None else 0)


def check_q(out, x, w_q, b_q, mask_row, gs):
    assert out.shape == (1, w_q.shape[0]) and out.dtype == x.dtype
    off = ~mask_row.cpu().repeat_interleave(gs)
    assert (out.cpu()[0, off] == 0).all(), "inactive groups' columns are exactly 0"
    if mask_row.any():
        assert rel(out, q_oracle(x, w_q, b_q, mask_row, gs)) <= TOL[x.dtype]
        if x.dtype != torch.float32:
            assert rel(out, R.q_proj_ref(x, w_q, b_q, mask_row[None, :], gs)) <= 1e-2


def check_o(out, a, w_o, b_o, mask_row, gs):
    assert out.shape == (1, w_o.shape[0]) and out.dtype == a.dtype
    if not mask_row.any() and b_o is None:
        assert (out == 0).all()
        return
    assert rel(out, o_oracle(a, w_o, b_o, mask_row, gs)) <= TOL[a.dtype]
    if a.dtype != torch.float32:
        assert rel(out, R.o_proj_ref(a, w_o.t(), b_o, mask_row[None, :], gs)) <= 1e-2


PROJ_SHAPES = [(40, 4, 16), (33, 3, 24), (24, 5, 12), (64, 2, 32)]


@pytest.mark.parametrize("D,G,gs,kind,dtype,bias",
                         covering(PROJ_SHAPES, KINDS, [(d, b) for d in DTYPES for b in (False, True)]),
                         ids=case_id)
def test_projections_match_oracle(D, G, gs, kind, dtype, bias):
    gen = torch.Generator().manual_seed(D + 7 * G)
    x, w_q, b_q, a, w_o, b_o = make_proj(D, G, gs, dtype, gen, bias)
    mask = make_mask(G, kind, gen).to(DEV)
    for cfg in (None, dict(gu_prefetch=0)):
        check_q(GV.q_proj_gemv_triton(x, w_q, b_q, mask, None, gs, cfg), x, w_q, b_q, mask[0], gs)
    for w_nk in (w_o, w_o.t().contiguous().t()):                         # o_proj.weight, the free op's w_o_t
        for cfg in (None, dict(gd_split=1), dict(gd_split=8, gd_bk=8), dict(gd_prefetch=0),
                    dict(gd_prefetch=0, gd_split=1)):
            check_o(GV.o_proj_gemv_triton(a, w_nk, b_o, mask, None, gs, cfg), a, w_o, b_o, mask[0], gs)


def test_projection_tiles_and_strides():
    """Tiles narrower and wider than a group (a column tile across two groups), a strided a."""
    gen = torch.Generator().manual_seed(1)
    x, w_q, b_q, a, w_o, b_o = make_proj(30, 5, 12, torch.float32, gen, True)
    for kind in ("random", "one"):
        mask = make_mask(5, kind, gen).to(DEV)
        for cfg in (dict(gu_bn=8, gu_bk=8), dict(gu_bn=32, gu_bk=64), dict(gu_bn=4)):
            check_q(GV.q_proj_gemv_triton(x, w_q, b_q, mask, None, 12, cfg), x, w_q, b_q, mask[0], 12)
        a_wide = torch.stack([a[0], torch.randn_like(a[0])], 1).reshape(1, -1)[:, ::2]   # column stride 2
        assert a_wide.stride(1) == 2 and torch.equal(a_wide, a)
        for cfg in (dict(gd_bn=4, gd_bk=8), dict(gd_bk=64, gd_split=1), dict(gd_bk=4, gd_split=4)):
            check_o(GV.o_proj_gemv_triton(a_wide, w_o, b_o, mask, None, 12, cfg), a, w_o, b_o, mask[0], 12)


@pytest.mark.parametrize("b", [0, 1, 3, -1, 4])
def test_projection_bucket_rows(b):
    """The bucketed projections at one token run the GEMVs on the token's prototype; ids outside [0, P) NaN."""
    gen = torch.Generator().manual_seed(20 + b)
    x, w_q, b_q, a, w_o, b_o = make_proj(40, 4, 16, torch.float32, gen, True)
    protos = torch.rand(4, 4, generator=gen) < 0.5
    protos[0], protos[1] = False, True
    protos = protos.to(DEV)
    bucket = torch.tensor([b], dtype=torch.int32, device=DEV)
    q = q_proj_bucket_triton(x, w_q, b_q, bucket, protos, 16)
    o = o_proj_bucket_triton(a, w_o, b_o, bucket, protos, 16)
    if not 0 <= b < 4:
        assert q.isnan().all() and o.isnan().all()
        return
    check_q(q, x, w_q, b_q, protos[b], 16)
    check_o(o, a, w_o, b_o, protos[b], 16)


def test_free_projection_ops_run_the_gemv_when_the_tuning_says_so(monkeypatch):
    calls = []
    for name in ("q_proj_gemv_triton", "o_proj_gemv_triton"):
        real = getattr(GV, name)
        monkeypatch.setattr(f"wide_compile.kernels.compact_attn.{name}",
                            lambda *a, _r=real, _n=name, **k: calls.append(_n) or _r(*a, **k))
    gen = torch.Generator().manual_seed(8)
    x, w_q, b_q, a, w_o, b_o = make_proj(40, 4, 16, torch.float32, gen, True)
    mask = make_mask(4, "random", gen).to(DEV)
    cfg = {"one_token": "gemv"}
    check_q(q_proj_triton(x, w_q, b_q, mask, 16, config=cfg), x, w_q, b_q, mask[0], 16)
    check_o(o_proj_triton(a, w_o.t().contiguous(), b_o, mask, 16, config=cfg), a, w_o, b_o, mask[0], 16)
    assert calls == ["q_proj_gemv_triton", "o_proj_gemv_triton"]
    q_proj_triton(x, w_q, b_q, mask, 16)                                 # the shipped table: no one_token
    assert len(calls) == 2


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_projections_large(dtype):  # pragma: no cover
    gen = torch.Generator().manual_seed(0)
    x, w_q, b_q, a, w_o, b_o = make_proj(4096, 8, 512, dtype, gen, False)
    for kind in ("random", "on", "off", "one"):
        mask = make_mask(8, kind, gen).to(DEV)
        for cfg in (None,) + GV.GEMV_SWEEP["k_contiguous"]:
            check_q(GV.q_proj_gemv_triton(x, w_q, b_q, mask, None, 512, cfg), x, w_q, b_q, mask[0], 512)
        for w_nk, sweep in ((w_o, "k_contiguous"), (w_o.t().contiguous().t(), "d_contiguous")):
            for cfg in (None,) + GV.GEMV_SWEEP[sweep]:
                check_o(GV.o_proj_gemv_triton(a, w_nk, b_o, mask, None, 512, cfg), a, w_o, b_o, mask[0], 512)


@gpu_only
@pytest.mark.parametrize("layout", ["k_contiguous", "d_contiguous"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_large_every_swept_tile(layout, dtype):  # pragma: no cover
    gen = torch.Generator().manual_seed(0)
    x, wg, wu, wd = make_weights(4096, 224, 64, dtype, gen)
    w_nk = wd if layout == "k_contiguous" else wd.t().contiguous().t()
    for kind in ("random", "on", "off", "one"):
        mask = make_mask(224, kind, gen).to(DEV)
        for cfg in (None,) + GV.GEMV_SWEEP[layout]:
            check(GV.mlp_gemv_triton(x, wg, wu, w_nk, mask, None, 64, config=cfg), x, wg, wu, wd, mask[0], 64)
