"""Bucketed MLP (wide_compile/kernels/bucket_mlp.py, torch.ops.wide.mlp_bucket): the Triton kernels against the
float64 references, on the CPU under the Triton interpreter (TRITON_INTERPRET=1, conftest's default) or compiled
on a CUDA GPU (TRITON_INTERPRET=0: same cases and tolerances, plus GPU-sized ones).

Tolerances (relative L2 error over the whole output): fp32 <= 1e-4 against the float64 reference of the same
rounded inputs; bf16 <= 2e-2 against both the reference that rounds h to bf16 as the kernel does and the
float64 one. Rows of tokens whose prototype is all-off must be exactly 0. Every buffer the kernels must write
(the lists, h, the output) is NaN/garbage-poisoned first (reorder.POISON), so an unwritten element, or a read
of an unwritten h element, fails.

The T x mode x prototypes x dtype matrices run in full on a GPU; under the interpreter every (T, mode) pair runs,
each with one (prototypes, dtype) combination in turn (kernel_checks.covering).
"""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from kernel_checks import DEV, case_id, covering, needs_device, poison_buffers, rel  # noqa: F401 (the fixture)

import wide_compile.kernels  # noqa: F401  (registers torch.ops.wide.mlp_bucket)
from wide_compile.kernels import bucket_attn as BAT
from wide_compile.kernels import bucket_mlp as BK
from wide_compile.kernels import reference as R
from wide_compile.kernels.bucket_ops import wide_mlp_bucket, wide_o_proj_bucket, wide_q_proj_bucket

pytestmark = [needs_device, pytest.mark.usefixtures("poison_buffers")]
gpu_only = pytest.mark.skipif(DEV != "cuda", reason="GPU-sized shapes: compiled on a CUDA GPU only")

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def make_protos(P, G, kind, gen):
    """[P, G] bool prototypes. mixed: all-off, all-on, one group, then random rows; nested: prefixes of a
    shuffled order (the nested structure's masks); on / off: every row all-on / all-off."""
    if kind == "on":
        return torch.ones(P, G, dtype=torch.bool)
    if kind == "off":
        return torch.zeros(P, G, dtype=torch.bool)
    if kind == "nested":
        order = torch.randperm(G, generator=gen)
        widths = torch.linspace(0, G, P).round().long()
        m = torch.arange(G)[None, :] < widths[:, None]
        return torch.zeros(P, G, dtype=torch.bool).scatter_(1, order.expand(P, G), m)
    m = torch.rand(P, G, generator=gen) < 0.5
    if kind == "mixed":
        rows = [torch.zeros(G, dtype=torch.bool), torch.ones(G, dtype=torch.bool),
                torch.arange(G) == G // 2]
        for i, r in enumerate(rows[:P]):
            m[i] = r
    return m


def make_bucket(T, P, kind, gen):
    """[T] int32 ids. random: uniform; skewed: ~3/4 of the tokens in the last bucket (a bucket longer than
    the block, and empty buckets); one: every token in bucket 0."""
    if kind == "one":
        return torch.zeros(T, dtype=torch.int32)
    b = torch.randint(0, P, (T,), generator=gen, dtype=torch.int32)
    if kind == "skewed":
        b = torch.where(torch.rand(T, generator=gen) < 0.75, P - 1, b).to(torch.int32)
    return b


def make_case(T, D, G, gs, P, dtype, protos_kind="mixed", bucket_kind="random", seed=0):
    gen = torch.Generator().manual_seed(seed)
    Fi = G * gs
    x = torch.randn(T, D, generator=gen).to(dtype)
    wg = (torch.randn(Fi, D, generator=gen) / D ** 0.5).to(dtype)
    wu = (torch.randn(Fi, D, generator=gen) / D ** 0.5).to(dtype)
    wd = (torch.randn(D, Fi, generator=gen) / Fi ** 0.5).to(dtype)
    protos = make_protos(P, G, protos_kind, gen)
    bucket = make_bucket(T, P, bucket_kind, gen)
    return [t.to(DEV) for t in (x, wg, wu, wd, bucket, protos)]


def oracle_f64(x, wg, wu, wd, bucket, protos, gs, act):
    """Independent float64 oracle, per token, with the inactive groups removed from the WEIGHTS (the DESIGN
    oracle: down_proj columns of inactive groups zeroed), not through reference.mlp_ref."""
    d = torch.float64
    fn = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda v: F.gelu(v, approximate="tanh")}[act]
    x, wg, wu, wd = (t.to(d).cpu() for t in (x, wg, wu, wd))
    keep = protos.cpu().repeat_interleave(gs, dim=-1).to(d)[bucket.cpu().long()]   # [T, F]
    return torch.stack([(fn(x[t] @ wg.T) * (x[t] @ wu.T)) @ (wd * keep[t][None, :]).T for t in range(x.shape[0])])


def mode_config(T, mode):
    """Tile overrides that run T tokens as the default does ("default": one token on gemv's GEMVs, a few as
    one union block, more as bucket lists), or the other way ("other": bucket lists for one or a few tokens, one
    union block for more), or "few" (few tokens the other way: dense GEMMs with their masks applied where the
    default is the union block, and the other way round), or "union_blocks" (more tokens unpadded, in blocks over
    their prototypes' union), or "global" / "union_global" (h_layout="global": the gate/up kernel over the full
    width's column tiles, block-fastest, h at the groups' own columns; bucket lists / union blocks, any T)."""
    if mode == "default":
        return None
    if mode == "union_blocks":  # more tokens as blocks of width-ordered tokens over their prototypes' union
        return dict(prefill_lists="union")
    if mode == "global":  # h at the groups' own columns, programs block-fastest (bucket lists)
        return dict(h_layout="global", union_max_t=0, one_token="union")
    if mode == "union_global":  # the same over union blocks
        return dict(h_layout="global", prefill_lists="union", union_max_t=0, one_token="union")
    if mode == "few":  # few tokens the other way than the device's default (union block / dense GEMMs + masks)
        default = BK.config_for(max(T, 2), 16, torch.float32, DEV)["few_tokens"]
        return dict(few_tokens="dense" if default == "union" else "union")
    if T <= BK.CONFIGS["interpreter"]["union_max_t"]:
        return dict(union_max_t=0, one_token="union")
    bm = max(16, 1 << (T - 1).bit_length())
    return dict(block_m=bm, union_max_t=bm)


def run_case(T, D, G, gs, P, dtype, protos_kind="mixed", bucket_kind="random", act="silu", config=None, seed=0):
    x, wg, wu, wd, bucket, protos = make_case(T, D, G, gs, P, dtype, protos_kind, bucket_kind, seed)
    out = BK.mlp_bucket_triton(x, wg, wu, wd, bucket, protos, gs, act, config=config)
    assert out.shape == (T, D) and out.dtype == dtype
    mask = protos[bucket.long()]                                          # [T, G]
    ref64 = R.mlp_ref(x.double(), wg.double(), wu.double(), wd.double().t(), mask, gs, act)  # wide.mlp's reference
    assert rel(out, ref64) <= TOL[dtype], rel(out, ref64)
    if dtype != torch.float32:  # same intermediate rounding as the kernel (h in bf16)
        assert rel(out, BK.mlp_bucket_ref(x, wg, wu, wd, bucket, protos, gs, act)) <= TOL[dtype]
    assert (out[~mask.any(1)] == 0).all(), "tokens of an all-off prototype must get exact 0 rows"
    return out, (x, wg, wu, wd, bucket, protos)


# ----------------------------------------------------------------------------- token lists

@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("T,P,kind", [(1, 1, "random"), (1, 5, "random"), (3, 4, "one"), (17, 3, "random"),
                                      (70, 4, "skewed"), (70, 9, "random"), (33, 40, "random")])
def test_lists_match_reference(T, P, kind, block_m):
    gen = torch.Generator().manual_seed(T * 31 + P)
    bucket = make_bucket(T, P, kind, gen).to(DEV)
    protos = make_protos(P, 7, "mixed", gen).to(DEV)
    got = BK.bucket_lists_triton(bucket, protos, block_m)
    exp = BK.bucket_lists_ref(bucket, protos, block_m)
    for g, e, name in zip(got, exp, ("sorted_ids", "block_bucket", "proto_groups", "proto_counts")):
        assert g.dtype == torch.int32, name
        assert torch.equal(g, e), name
    sorted_ids, block_bucket = exp[0], exp[1]
    assert torch.equal(torch.sort(sorted_ids[sorted_ids < T]).values, torch.arange(T, device=DEV, dtype=torch.int32))
    assert block_bucket.shape[0] == BK.n_blocks(T, P, block_m)


@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("T,P", [(1, 1), (1, 6), (3, 4), (16, 5), (11, 40)])
def test_union_lists_match_reference(T, P, block_m):
    gen = torch.Generator().manual_seed(T * 7 + P)
    bucket = make_bucket(T, P, "random", gen).to(DEV)
    if T > 2:
        bucket[1] = P  # an id out of range adds no group
    protos = make_protos(P, 9, "mixed", gen).to(DEV)
    got = BK.union_lists_triton(bucket, protos, block_m)
    exp = BK.union_lists_ref(bucket, protos, block_m)
    for g, e, name in zip(got, exp, ("sorted_ids", "block_bucket", "proto_groups", "proto_counts")):
        assert g.dtype == torch.int32 and torch.equal(g, e), name
    ok = bucket[(bucket >= 0) & (bucket < P)].long()
    assert int(exp[3]) == int(protos[ok].any(0).sum())


@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("T,P", [(17, 3), (40, 5), (64, 1), (33, 40)])
def test_union_blocks_match_reference(T, P, block_m):
    gen = torch.Generator().manual_seed(T + P)
    protos = make_protos(P, 7, "mixed", gen).to(DEV)
    bucket = make_bucket(T, P, "skewed", gen).to(DEV)
    bucket[T // 2] = P + 3                                               # an out-of-range id
    order = BK.width_order(bucket, protos)
    got = BK.union_lists_triton(bucket, protos, block_m, order=order)
    exp = BK.union_lists_ref(bucket, protos, block_m, order)
    for g, e in zip(got, exp):
        assert torch.equal(g.cpu(), e.cpu())
    # the order: a permutation, each prototype's tokens contiguous, widths non-decreasing, bad ids last
    o = order.long().cpu()
    assert sorted(o.tolist()) == list(range(T))
    b = bucket.cpu()[o]
    ok = (b >= 0) & (b < P)
    w = protos.cpu().sum(1)[torch.where(ok, b, 0).long()]
    assert ok[: int(ok.sum())].all() and (w[ok][1:] >= w[ok][:-1]).all()
    runs = [k for k, _ in __import__("itertools").groupby(b[ok].tolist())]
    assert len(runs) == len(set(runs)), "a prototype's tokens are contiguous"


def test_lists_out_of_range_ids_form_their_own_bucket():
    bucket = torch.tensor([0, -1, 2, 7, 1, 2], dtype=torch.int64, device=DEV)
    protos = make_protos(3, 5, "mixed", torch.Generator().manual_seed(0)).to(DEV)
    got = BK.bucket_lists_triton(bucket, protos, 16)
    for g, e in zip(got, BK.bucket_lists_ref(bucket, protos, 16)):
        assert torch.equal(g, e)
    sorted_ids, block_bucket, _, counts = got
    last = int((block_bucket >= 0).sum()) - 1
    assert int(block_bucket[last]) == 3 and int(counts[3]) == 0
    assert sorted_ids[last * 16:last * 16 + 2].tolist() == [1, 3]


# ----------------------------------------------------------------------------- the MLP

MODES = ["default", "other", "few", "union_blocks", "global", "union_global"]
PROTOS_DTYPES = [(k, d) for k in ("mixed", "nested") for d in (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("T,mode,protos_kind,dtype", covering([1, 3, 17, 70], MODES, PROTOS_DTYPES), ids=case_id)
def test_mlp_bucket(T, protos_kind, dtype, mode):
    """Bucket lists and the union block (mode_config), each on both sides of the default switch."""
    run_case(T, D=27, G=5, gs=16, P=4, dtype=dtype, protos_kind=protos_kind, config=mode_config(T, mode), seed=T)


@pytest.mark.parametrize("protos_kind,P", [("on", 1), ("off", 1), ("mixed", 1), ("mixed", 3), ("on", 3),
                                           ("off", 2)])
@pytest.mark.parametrize("bucket_kind", ["random", "skewed", "one"])
def test_mlp_bucket_prototype_kinds(protos_kind, P, bucket_kind):
    """all-on / all-off / single-group prototypes, P = 1, empty buckets, a bucket longer than the block."""
    out, _ = run_case(37, D=20, G=4, gs=16, P=P, dtype=torch.float32, protos_kind=protos_kind,
                      bucket_kind=bucket_kind, seed=P)
    if protos_kind == "off":
        assert (out == 0).all()


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mlp_bucket_activations(act, dtype):
    out, args = run_case(21, D=24, G=4, gs=16, P=3, dtype=dtype, act=act, seed=3)
    assert rel(out, oracle_f64(*args, 16, act)) <= TOL[dtype]
    if act != "silu":  # the activation really changes the result (well beyond the tolerances)
        assert rel(out, BK.mlp_bucket_triton(*args, 16, "silu")) > 0.05


@pytest.mark.parametrize("gs,config", [
    (24, None),                                                   # a column tile spans two groups
    (40, dict(up_bn=32, dn_bk=32)),                               # group size not a multiple of the K tile
    (16, dict(block_m=32, up_bn=32, up_bk=32, dn_bn=32, group_m=1)),
    (48, dict(dn_bk=64, up_bk=64, group_m=3)),                    # a K tile wider than the group
    (24, dict(up_fuse=True)),                                     # gate and up in one dot
    (24, dict(up_fuse=True, h_layout="global", prefill_lists="union", union_max_t=0)),
])
def test_mlp_bucket_tiles_and_group_sizes(gs, config):
    out, args = run_case(45, D=33, G=3, gs=gs, P=5, dtype=torch.float32, bucket_kind="skewed", config=config, seed=gs)
    assert rel(out, oracle_f64(*args, gs, "silu")) <= TOL[torch.float32]


def test_mlp_bucket_strided_weights():
    """Weights given as transposed views (any strides) compute the same result."""
    x, wg, wu, wd, bucket, protos = make_case(19, 24, 4, 16, 3, torch.float32)
    out = BK.mlp_bucket_triton(x, wg.t().contiguous().t(), wu, wd.t().contiguous().t(), bucket, protos, 16)
    assert rel(out, BK.mlp_bucket_ref(x.double(), wg.double(), wu.double(), wd.double(), bucket, protos, 16)) <= 1e-4


@pytest.mark.parametrize("mode", MODES)
def test_out_of_range_ids_give_nan_rows_on_the_kernel_path(mode):
    x, wg, wu, wd, bucket, protos = make_case(9, 16, 3, 16, 2, torch.float32)
    bucket[2], bucket[5] = 2, -1
    ref = BK.mlp_bucket_ref(x.double(), wg.double(), wu.double(), wd.double(), bucket, protos, 16)
    out = BK.mlp_bucket_triton(x, wg, wu, wd, bucket, protos, 16, config=mode_config(9, mode))
    bad = torch.zeros(9, dtype=torch.bool, device=DEV)
    bad[[2, 5]] = True
    assert torch.isnan(out[bad]).all() and torch.isnan(ref[bad]).all()
    assert rel(out[~bad], ref[~bad]) <= 1e-4


# ----------------------------------------------------------------------------- the op

def test_op_and_wrapper_match_the_oracle_in_float64():
    """On the CPU the op runs the reference: float64 against the independent oracle, leading dims [2, 3]."""
    x, wg, wu, wd, bucket, protos = (t.cpu() for t in make_case(6, 12, 4, 8, 3, torch.float32))
    x, wg, wu, wd = (t.double() for t in (x, wg, wu, wd))
    exp = oracle_f64(x, wg, wu, wd, bucket, protos, 8, "gelu")
    out = wide_mlp_bucket(x.view(2, 3, 12), wg, wu, wd, bucket.view(2, 3), protos, 8, activation="gelu")
    assert out.shape == (2, 3, 12) and out.dtype == torch.float64
    assert torch.allclose(out.view(6, 12), exp, rtol=1e-12, atol=1e-12)
    op = torch.ops.wide.mlp_bucket(x, wg, wu, wd, bucket, protos, 8, "gelu", "")
    assert torch.equal(op, out.view(6, 12))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_and_fake_shape(dtype):
    x, wg, wu, wd, bucket, protos = (t.cpu() for t in make_case(5, 16, 4, 8, 3, dtype))
    torch.library.opcheck(torch.ops.wide.mlp_bucket.default, (x, wg, wu, wd, bucket, protos, 8, "silu", ""))
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        fx = torch.empty(37, 16, dtype=dtype)
        fw, fd = torch.empty(32, 16, dtype=dtype), torch.empty(16, 32, dtype=dtype)
        out = torch.ops.wide.mlp_bucket(fx, fw, fw, fd, torch.empty(37, dtype=torch.int64),
                                        torch.empty(3, 4, dtype=torch.bool), 8, "silu", "")
    assert out.shape == (37, 16) and out.dtype == dtype


def test_wrapper_under_torch_compile():
    """The public wrapper traces into one graph (no host check while compiling) and matches eager."""
    x, wg, wu, wd, bucket, protos = (t.cpu() for t in make_case(7, 16, 4, 8, 3, torch.float32))
    fn = torch.compile(lambda *a: wide_mlp_bucket(*a, 8), backend="aot_eager", fullgraph=True)
    assert torch.equal(fn(x, wg, wu, wd, bucket, protos), wide_mlp_bucket(x, wg, wu, wd, bucket, protos, 8))


@pytest.mark.skipif(DEV != "cpu", reason="the traced CUDA body runs in a CPU-only subprocess")
def test_cuda_body_traces_with_fake_tensors():
    """The ops' CUDA bodies traced with fake CUDA tensors (as Inductor traces a triton_op): three kernel launches
    for the MLP, two for each projection (one token, on the GEMVs over the Linear's own reduction weight, no split
    over K: two for the MLP, one for q, one for o), static shapes. Runs in a subprocess without TRITON_INTERPRET
    (compiled-mode Triton functions)."""
    code = """
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from wide_compile.kernels.bucket_attn import o_proj_bucket_triton, q_proj_bucket_triton
from wide_compile.kernels.bucket_mlp import mlp_bucket_triton
for T in (1, 300):
    with FakeTensorMode(allow_non_fake_inputs=True):
        shapes = [((T, 64), torch.bfloat16), ((256, 64), torch.bfloat16), ((256, 64), torch.bfloat16),
                  ((64, 256), torch.bfloat16), ((T,), torch.int32), ((16, 4), torch.bool)]
        args = [torch.empty(s, device="cuda", dtype=d) for s, d in shapes]
        bq = torch.empty(256, device="cuda", dtype=torch.bfloat16)
        a = torch.empty(T, 256, device="cuda", dtype=torch.bfloat16)
    gm = make_fx(lambda *a: mlp_bucket_triton(*a, 64, "silu", wrap=True), tracing_mode="fake")(*args)
    launches = sum(1 for n in gm.graph.nodes if "triton_kernel_wrapper" in str(n.target))
    out = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
    assert launches == (2 if T == 1 else 3), launches
    assert tuple(out.meta["val"].shape) == (T, 64), out.meta["val"].shape
    for fn, inputs, shape, n in ((q_proj_bucket_triton, (args[0], args[1], bq), (T, 256), 1 if T == 1 else 2),
                                 (o_proj_bucket_triton, (a, args[3], None), (T, 64), 1 if T == 1 else 2)):
        gm = make_fx(lambda *a, fn=fn: fn(*a, 64, wrap=True), tracing_mode="fake")(*inputs, args[4], args[5])
        launches = sum(1 for n in gm.graph.nodes if "triton_kernel_wrapper" in str(n.target))
        out = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
        assert launches == n and tuple(out.meta["val"].shape) == shape, (fn.__name__, launches)
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]


# ----------------------------------------------------------------------------- bad input

def test_bad_input_errors():
    x, wg, wu, wd, bucket, protos = (t.cpu() for t in make_case(4, 16, 4, 8, 3, torch.float32))
    with pytest.raises(ValueError, match=r"bucket ids must lie in \[0, P\) = \[0, 3\)"):
        wide_mlp_bucket(x, wg, wu, wd, torch.tensor([0, 1, 3, 0]), protos, 8)
    with pytest.raises(ValueError, match="bucket must be an int32 or int64"):
        wide_mlp_bucket(x, wg, wu, wd, bucket.float(), protos, 8)
    with pytest.raises(ValueError, match="leading shape"):
        wide_mlp_bucket(x, wg, wu, wd, bucket[:3], protos, 8)
    with pytest.raises(ValueError, match="unknown activation 'relu'"):
        wide_mlp_bucket(x, wg, wu, wd, bucket, protos, 8, activation="relu")
    with pytest.raises(ValueError, match=r"w_down \[16, 32\] \(down_proj.weight\)"):
        wide_mlp_bucket(x, wg, wu, wd.t(), bucket, protos, 8)
    with pytest.raises(ValueError, match="protos must be bool"):
        wide_mlp_bucket(x, wg, wu, wd, bucket, protos.float(), 8)
    with pytest.raises(ValueError, match="G = F // group_size = 4"):
        wide_mlp_bucket(x, wg, wu, wd, bucket, protos[:, :3], 8)
    with pytest.raises(ValueError, match="group_size 5 must divide"):
        wide_mlp_bucket(x, wg, wu, wd, bucket, protos, 5)
    with pytest.raises(ValueError, match="unknown keys"):
        BK.config_for(4, 8, torch.float32, overrides={"BLOCK_M": 16})
    with pytest.raises(ValueError, match="power of two"):
        BK.config_for(4, 8, torch.float32, overrides={"block_m": 24})


# ----------------------------------------------------------------------------- GPU-sized (compiled only)

@gpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("protos_kind", ["mixed", "nested"])
@pytest.mark.parametrize("T", [1, 16, 300, 2048])
def test_mlp_bucket_large(T, protos_kind, dtype):
    run_case(T, D=576, G=24, gs=64, P=16, dtype=dtype, protos_kind=protos_kind, bucket_kind="skewed", seed=T)


@gpu_only
@pytest.mark.parametrize("T,config", [(T, c) for T, ph in ((5, "decode"), (1000, "prefill")) for c in BK.SWEEP[ph]])
def test_mlp_bucket_sweep_configs_large(T, config):
    run_case(T, D=1024, G=16, gs=64, P=8, dtype=torch.bfloat16, config=config, seed=7)


@gpu_only
def test_lists_large():
    gen = torch.Generator().manual_seed(1)
    bucket = make_bucket(8192, 32, "skewed", gen).to(DEV)
    protos = make_protos(32, 224, "mixed", gen).to(DEV)
    for block_m in (64, 128):
        for g, e in zip(BK.bucket_lists_triton(bucket, protos, block_m), BK.bucket_lists_ref(bucket, protos, block_m)):
            assert torch.equal(g, e)


def test_padding_rows_of_h_are_zero_and_read_no_x_row():
    """Padding entries (sentinel T) gather no x row: with x a view whose next rows are NaN, the padding rows of
    h are exactly 0 (act(0) * 0), so whole blocks of h are finite wherever their bucket's width reaches."""
    T, D, gs = 21, 16, 16
    x, wg, wu, wd, bucket, protos = make_case(T, D, 3, gs, 3, torch.float32, protos_kind="on")
    big = torch.full((T + 16, D), float("nan"), device=DEV)
    big[:T] = x
    cfg = BK.config_for(T, gs, torch.float32, overrides=dict(block_m=16, union_max_t=0))
    lists = BK.make_lists(bucket, protos, cfg)
    h = BK.gate_up_triton(big[:T], wg, wu, lists, gs, "silu", cfg)
    used = (lists.block_bucket >= 0).repeat_interleave(16)               # rows of used blocks
    pad = used & (lists.sorted_ids == T)
    assert pad.any() and torch.isfinite(h[used]).all()
    assert (h[pad] == 0).all()
    out = BK.down_triton(h, wd, lists, T, gs, cfg)
    assert rel(out, BK.mlp_bucket_ref(x.double(), wg.double(), wu.double(), wd.double(), bucket, protos, gs)) <= 1e-4


def test_cuda_config_table(monkeypatch):
    """The CUDA table (read on the CPU): decode rows up to DECODE_T tokens, prefill rows above; the down K tile
    capped at the group; every row, in bf16 and fp32, within Hopper's shared memory (compact_mlp's model)."""
    from wide_compile.kernels import compact_mlp
    from wide_compile.kernels.tuning import DECODE_T

    monkeypatch.setattr(BK, "interpreting", lambda: False)
    assert BK.config_for(1, 64, torch.bfloat16) == BK.CONFIGS["cuda"]["decode"]
    assert BK.config_for(DECODE_T, 64, torch.bfloat16)["block_m"] == BK.CONFIGS["cuda"]["decode"]["block_m"]
    assert BK.config_for(DECODE_T + 1, 64, torch.bfloat16) == BK.CONFIGS["cuda"]["prefill"]
    assert BK.config_for(4096, 16, torch.bfloat16)["dn_bk"] == 16
    assert BK.config_for(4096, 16, torch.bfloat16, overrides=dict(dn_bk=64))["dn_bk"] == 64
    for T in (1, 4096):
        for dtype in (torch.bfloat16, torch.float32):
            cfg = BK.config_for(T, 64, dtype)
            view = dict(cfg, up_bm=cfg["block_m"], dn_bm=cfg["block_m"])
            need = compact_mlp.shared_memory_need(view, torch.empty((), dtype=dtype).element_size())
            assert max(need) <= compact_mlp.SMEM_FALLBACK, (T, dtype, need)


# ----------------------------------------------------------------------------- attention projections

def proj_case(T, D, G, cols, P, dtype, bias, protos_kind="mixed", seed=0):
    gen = torch.Generator().manual_seed(seed)
    Nq = G * cols
    x = torch.randn(T, D, generator=gen).to(dtype)
    wq = (torch.randn(Nq, D, generator=gen) / D ** 0.5).to(dtype)
    bq = torch.randn(Nq, generator=gen).to(dtype) if bias else None
    a = torch.randn(T, Nq, generator=gen).to(dtype)
    wo = (torch.randn(D, Nq, generator=gen) / Nq ** 0.5).to(dtype)
    bo = torch.randn(D, generator=gen).to(dtype) if bias else None
    protos = make_protos(P, G, protos_kind, gen)
    bucket = make_bucket(T, P, "skewed" if seed % 2 else "random", gen)
    return [None if t is None else t.to(DEV) for t in (x, wq, bq, a, wo, bo, bucket, protos)]


@pytest.mark.parametrize("T,mode,protos_kind,dtype", covering([1, 3, 17, 70], MODES, PROTOS_DTYPES), ids=case_id)
def test_attention_projections(T, protos_kind, dtype, mode):
    """q_proj / o_proj with bucketed head-group masks against the float64 references (wide.q_proj / wide.o_proj
    with mask = protos[bucket]); inactive q columns exactly 0; inactive a columns (NaN here) never read."""
    x, wq, bq, a, wo, bo, bucket, protos = proj_case(T, 24, 4, 16, 3, dtype, bias=T % 2 == 1, protos_kind=protos_kind,
                                                     seed=T)
    mask = protos[bucket.long()]
    d = torch.float64
    cfg = mode_config(T, mode)
    q = BAT.q_proj_bucket_triton(x, wq, bq, bucket, protos, 16, config=cfg)
    assert q.shape == (T, 64) and q.dtype == dtype
    assert rel(q, R.q_proj_ref(x.to(d), wq.to(d), None if bq is None else bq.to(d), mask, 16)) <= TOL[dtype]
    assert (q[R.expand_mask(~mask, 16)] == 0).all(), "inactive q columns must be exactly 0"
    a_nan = a.clone()
    a_nan[R.expand_mask(~mask, 16)] = float("nan")
    o = BAT.o_proj_bucket_triton(a_nan, wo, bo, bucket, protos, 16, config=cfg)
    assert o.shape == (T, 24) and o.dtype == dtype
    assert rel(o, R.o_proj_ref(a.to(d), wo.t().to(d), None if bo is None else bo.to(d), mask, 16)) <= TOL[dtype]


@pytest.mark.parametrize("union", [False, True])
def test_attention_projections_tiles_and_bad_ids(union):
    """A column tile spanning groups (cols 24), a bigger block, and ids outside [0, P): NaN rows."""
    x, wq, bq, a, wo, bo, bucket, protos = proj_case(37, 20, 5, 24, 4, torch.float32, bias=True, seed=1)
    cfg = dict(block_m=64 if union else 32, up_bn=32, dn_bn=16, dn_bk=16, union_max_t=64 if union else 0)
    bucket[[3, 8]] = torch.tensor([4, -2], dtype=bucket.dtype, device=DEV)
    bad = torch.zeros(37, dtype=torch.bool, device=DEV)
    bad[[3, 8]] = True
    d = torch.float64
    for got, exp in ((BAT.q_proj_bucket_triton(x, wq, bq, bucket, protos, 24, config=cfg),
                      BAT.q_proj_bucket_ref(x.to(d), wq.to(d), bq.to(d), bucket, protos, 24)),
                     (BAT.o_proj_bucket_triton(a, wo, bo, bucket, protos, 24, config=cfg),
                      BAT.o_proj_bucket_ref(a.to(d), wo.to(d), bo.to(d), bucket, protos, 24))):
        assert torch.isnan(got[bad]).all() and torch.isnan(exp[bad]).all()
        assert rel(got[~bad], exp[~bad]) <= 1e-4


def test_projection_ops_opcheck_and_wrappers():
    x, wq, bq, a, wo, bo, bucket, protos = (None if t is None else t.cpu()
                                            for t in proj_case(6, 12, 4, 8, 3, torch.float32, bias=True))
    for args in ((x, wq, bq, bucket, protos, 8, ""), (x, wq, None, bucket, protos, 8, "")):
        torch.library.opcheck(torch.ops.wide.q_proj_bucket.default, args)
    for args in ((a, wo, bo, bucket, protos, 8, ""), (a, wo, None, bucket, protos, 8, "")):
        torch.library.opcheck(torch.ops.wide.o_proj_bucket.default, args)
    d = torch.float64
    keep = protos.repeat_interleave(8, dim=-1).to(d)[bucket.long()]      # [T, Nq], the DESIGN oracle's zeroing
    q = wide_q_proj_bucket(x.to(d).view(2, 3, 12), wq.to(d), bq.to(d), bucket.view(2, 3), protos, 8)
    assert torch.allclose(q.view(6, 32), (x.to(d) @ wq.to(d).T + bq.to(d)) * keep, rtol=1e-12, atol=1e-12)
    o = wide_o_proj_bucket(a.to(d).view(2, 3, 32), wo.to(d), bo.to(d), bucket.view(2, 3), protos, 8)
    assert torch.allclose(o.view(6, 12), (a.to(d) * keep) @ wo.to(d).T + bo.to(d), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"bucket ids must lie in \[0, P\)"):
        wide_o_proj_bucket(a, wo, bo, torch.full((6,), 3), protos, 8)
    with pytest.raises(ValueError, match="group_size 5 must divide the grouped size 32"):
        wide_q_proj_bucket(x, wq, bq, bucket, protos, 5)
    with pytest.raises(ValueError, match=r"bias must be \[12\]"):
        wide_o_proj_bucket(a, wo, bq, bucket, protos, 8)
    with pytest.raises(ValueError, match="the weight \\[N, K\\]"):
        wide_o_proj_bucket(a, wo.t(), bo, bucket, protos, 8)


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 16, 517, 2048])
def test_attention_projections_large(T, dtype):
    x, wq, bq, a, wo, bo, bucket, protos = proj_case(T, 576, 9, 64, 8, dtype, bias=T % 2 == 1, seed=T)
    mask = protos[bucket.long()]
    d = torch.float64
    q = BAT.q_proj_bucket_triton(x, wq, bq, bucket, protos, 64)
    assert rel(q, R.q_proj_ref(x.to(d), wq.to(d), None if bq is None else bq.to(d), mask, 64)) <= TOL[dtype]
    o = BAT.o_proj_bucket_triton(a, wo, bo, bucket, protos, 64)
    assert rel(o, R.o_proj_ref(a.to(d), wo.t().to(d), None if bo is None else bo.to(d), mask, 64)) <= TOL[dtype]
