"""Query-sparse prefill attention (wide_compile/kernels/attn_prefill.py, torch.ops.wide.attn_prefill): the Triton
kernel against the float64 reference, on the CPU under the Triton interpreter (TRITON_INTERPRET=1, conftest's
default) or compiled on a CUDA GPU (TRITON_INTERPRET=0, same cases and tolerances).

Tolerances (relative L2 error over the whole output against a float64 reference computed from the same rounded
inputs; inactive rows must be exactly 0 in every case): fp32 <= 1e-5, fp16 <= 2e-3, bf16 <= 1e-2 (the kernel
rounds the softmax weights to the input dtype before the P @ V product, as flash attention does).
The output buffer is NaN-poisoned before the kernel runs, so an element the kernel leaves unwritten fails.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import wide_compile.kernels.attn_ops  # noqa: E402,F401  (registers torch.ops.wide.attn_prefill)
from wide_compile.kernels import attn_prefill as AP  # noqa: E402
from wide_compile.kernels.attn_ops import wide_attn_prefill  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERPRET else "cuda"
if not INTERPRET and not torch.cuda.is_available():  # pragma: no cover
    pytestmark = pytest.mark.skip("compiled Triton kernels need a CUDA GPU: on a CPU run with TRITON_INTERPRET=1")

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
MASK_KINDS = ("off", "on", 0.3, 0.7, "one", "group0", "ragged")


@pytest.fixture(autouse=True)
def _poison_output(monkeypatch):
    real = AP.empty_output

    def poisoned(q):
        out = real(q)
        out.fill_(float("nan"))
        return out
    monkeypatch.setattr(AP, "empty_output", poisoned)


def make_mask(B, T, G, kind, gen):
    if kind == "off":
        return torch.zeros(B, T, G, dtype=torch.bool)
    if kind == "on":
        return torch.ones(B, T, G, dtype=torch.bool)
    if kind == "group0":  # a single group, on for every token
        m = torch.zeros(B, T, G, dtype=torch.bool)
        m[..., 0] = True
        return m
    if kind == "one":  # one random group per token
        m = torch.zeros(B, T, G, dtype=torch.bool)
        m.scatter_(2, torch.randint(0, G, (B, T, 1), generator=gen), True)
        return m
    if kind == "ragged":  # each batch row its own density
        dens = torch.linspace(0.1, 0.9, B)[:, None, None] if B > 1 else torch.full((1, 1, 1), 0.4)
        return torch.rand(B, T, G, generator=gen) < dens
    return torch.rand(B, T, G, generator=gen) < kind


def make_qkv(B, Hq, Hkv, T, d, dtype, gen):
    # q as HF Llama hands it over: a [B, T, Hq, d] projection transposed to [B, Hq, T, d] (not contiguous)
    q = torch.randn(B, T, Hq, d, generator=gen).to(dtype).transpose(1, 2)
    k = torch.randn(B, Hkv, T, d, generator=gen).to(dtype)
    v = torch.randn(B, Hkv, T, d, generator=gen).to(dtype)
    return q, k, v


def rel(out, ref):
    num = (out.double() - ref.double()).norm()
    den = ref.double().norm()
    return (num / den).item() if den > 0 else num.item()


def run_and_check(q, k, v, mask, gs, window=None, scale=None, config=None):
    """Kernel vs the float64 reference on the device under test; returns the kernel's output (on the CPU)."""
    dq, dk, dv, dm = (t.to(DEV) for t in (q, k, v, mask))
    out = AP.attn_prefill_triton(dq, dk, dv, dm, gs, window, scale, config=config).cpu()
    assert out.shape == q.shape and out.dtype == q.dtype
    assert out.transpose(1, 2).is_contiguous()  # SDPA's flash layout
    ref = AP.attn_prefill_ref(q.double(), k.double(), v.double(), mask, gs, window, scale)
    inactive = ~AP.row_mask(mask, gs).expand_as(out)
    assert (out[inactive] == 0).all(), "an inactive row is not exactly 0"
    assert torch.isfinite(out).all(), "unwritten (poisoned) or non-finite output"
    assert rel(out, ref) <= TOL[q.dtype], (rel(out, ref), mask.float().mean().item())
    return out


# (B, Hq, Hkv, T, d, group_size): KV-aligned groups, 1-head groups, groups of 3 with 3 heads per KV head,
# MHA, a group spanning two KV heads, T = 1
SHAPES = [
    (2, 4, 2, 17, 16, 2),
    (1, 4, 2, 33, 32, 1),
    (2, 6, 2, 17, 16, 3),
    (1, 4, 4, 33, 16, 1),
    (2, 8, 4, 5, 16, 4),
    (2, 4, 2, 1, 16, 2),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}_H{}x{}_T{}_d{}_gs{}".format(*s))
def test_kernel_vs_float64_reference_masks(shape):
    B, Hq, Hkv, T, d, gs = shape
    gen = torch.Generator().manual_seed(sum(shape))
    q, k, v = make_qkv(B, Hq, Hkv, T, d, torch.float32, gen)
    for kind in MASK_KINDS:
        run_and_check(q, k, v, make_mask(B, T, Hq // gs, kind, gen), gs)


@pytest.mark.parametrize("window", [1, 4, 16])
@pytest.mark.parametrize("gs", [1, 2])
def test_sliding_window(window, gs):
    B, Hq, Hkv, T, d = 2, 4, 2, 33, 16
    gen = torch.Generator().manual_seed(window)
    q, k, v = make_qkv(B, Hq, Hkv, T, d, torch.float32, gen)
    for kind in ("on", 0.5, "ragged"):
        run_and_check(q, k, v, make_mask(B, T, Hq // gs, kind, gen), gs, window=window)


@pytest.mark.parametrize("config", [dict(BLOCK_M=32, BLOCK_N=16), dict(BLOCK_M=16, BLOCK_N=32)])
def test_other_tiles(config):
    """Other tile shapes: more tokens per tile than per key block, and key blocks wider than the tile."""
    B, Hq, Hkv, T, d, gs = 2, 4, 2, 33, 16, 2
    gen = torch.Generator().manual_seed(3)
    q, k, v = make_qkv(B, Hq, Hkv, T, d, torch.float32, gen)
    for kind in (0.5, "on"):
        run_and_check(q, k, v, make_mask(B, T, Hq // gs, kind, gen), gs, config=config)
    run_and_check(q, k, v, make_mask(B, T, Hq // gs, 0.5, gen), gs, window=5, config=config)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_against_float64(dtype):
    B, Hq, Hkv, T, d, gs = 2, 4, 2, 33, 32, 2
    gen = torch.Generator().manual_seed(5)
    q, k, v = make_qkv(B, Hq, Hkv, T, d, dtype, gen)
    for kind in (0.5, "on"):
        run_and_check(q, k, v, make_mask(B, T, Hq // gs, kind, gen), gs)
    run_and_check(q, k, v, make_mask(B, T, Hq // gs, 0.5, gen), gs, window=7)


@pytest.mark.parametrize("gs", [1, 2, 4])
def test_all_on_equals_sdpa_causal(gs):
    B, Hq, Hkv, T, d = 2, 4, 2, 17, 16
    gen = torch.Generator().manual_seed(gs)
    q, k, v = make_qkv(B, Hq, Hkv, T, d, torch.float32, gen)
    scale = 0.3
    out = run_and_check(q, k, v, make_mask(B, T, Hq // gs, "on", gen), gs, scale=scale)
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=scale)
    torch.testing.assert_close(out, sdpa, rtol=1e-5, atol=1e-5)


def test_reference_matches_sdpa_with_window_mask():
    """The reference itself: all rows on, causal and sliding window, against SDPA with an explicit mask."""
    B, Hq, Hkv, T, d = 1, 4, 2, 9, 16
    gen = torch.Generator().manual_seed(1)
    q, k, v = (t.double() for t in make_qkv(B, Hq, Hkv, T, d, torch.float32, gen))
    on = torch.ones(B, T, 2, dtype=torch.bool)
    for window in (None, 3):
        ref = AP.attn_prefill_ref(q, k, v, on, 2, window)
        sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=AP.visible_keys(T, window), enable_gqa=True)
        torch.testing.assert_close(ref, sdpa)


def test_inactive_rows_zero_with_nan_inf_queries():
    B, Hq, Hkv, T, d, gs = 2, 4, 2, 17, 16, 2
    gen = torch.Generator().manual_seed(7)
    q, k, v = make_qkv(B, Hq, Hkv, T, d, torch.float32, gen)
    mask = make_mask(B, T, Hq // gs, 0.5, gen)
    clean = run_and_check(q, k, v, mask, gs)
    bad = q.clone()
    inactive = ~AP.row_mask(mask, gs).expand_as(q)
    poison = torch.tensor([float("nan"), float("inf"), -float("inf")]).repeat(inactive.sum().item() // 3 + 1)
    bad[inactive] = poison[: inactive.sum().item()]
    for fn in (lambda: AP.attn_prefill_triton(*(t.to(DEV) for t in (bad, k, v, mask)), gs).cpu(),
               lambda: AP.attn_prefill_ref(bad, k, v, mask, gs)):
        out = fn()
        assert (out[inactive] == 0).all() and torch.isfinite(out).all()
    torch.testing.assert_close(AP.attn_prefill_triton(*(t.to(DEV) for t in (bad, k, v, mask)), gs).cpu(), clean,
                               rtol=0, atol=0)


@pytest.mark.parametrize("T", [1, 7, 40, 1100])
def test_active_order_matches_reference(T):
    gen = torch.Generator().manual_seed(T)
    for kind in ("off", "on", 0.5, "ragged"):
        mask = make_mask(2, T, 3, kind, gen)
        order, counts = AP.active_order_triton(mask.to(DEV))
        ref_order, ref_counts = AP.active_order_ref(mask)
        assert torch.equal(order.cpu(), ref_order) and torch.equal(counts.cpu(), ref_counts)


def test_bad_input_errors():
    q, k, v = make_qkv(1, 6, 2, 5, 16, torch.float32, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="span part of two KV heads"):
        AP.attn_prefill_ref(q, k, v, torch.ones(1, 5, 3, dtype=torch.bool), 2)
    with pytest.raises(ValueError, match="mask must be"):
        AP.attn_prefill_triton(q, k, v, torch.ones(1, 5, 3, dtype=torch.bool), 3)
    with pytest.raises(ValueError, match="window"):
        AP.attn_prefill_ref(q, k, v, torch.ones(1, 5, 2, dtype=torch.bool), 3, window=0)
    with pytest.raises(ValueError, match="multiple of the KV heads"):
        AP.attn_prefill_ref(q, k[:, :1].expand(1, 4, 5, 16), v[:, :1].expand(1, 4, 5, 16),
                            torch.ones(1, 5, 2, dtype=torch.bool), 3)
    q24 = torch.zeros(1, 6, 5, 24)
    kv24 = torch.zeros(1, 2, 5, 24)
    with pytest.raises(ValueError, match="power of two"):
        AP.attn_prefill_triton(q24, kv24, kv24, torch.ones(1, 5, 2, dtype=torch.bool), 3)
    with pytest.raises(ValueError, match="one device"):
        AP.attn_prefill_ref(q, k, v, torch.ones(1, 5, 2, dtype=torch.bool, device="meta"), 3)
    with pytest.raises(ValueError, match="unknown keys"):
        AP.config_for(16, {"BLOCK_K": 16})


def test_op_on_cpu_is_the_reference_and_opchecks():
    gen = torch.Generator().manual_seed(11)
    q, k, v = make_qkv(2, 4, 2, 9, 16, torch.float32, gen)
    mask = make_mask(2, 9, 2, 0.5, gen)
    torch.testing.assert_close(wide_attn_prefill(q, k, v, mask, 2, window=3),
                               AP.attn_prefill_ref(q, k, v, mask, 2, 3), rtol=0, atol=0)
    op = torch.ops.wide.attn_prefill.default
    for args in [(q, k, v, mask, 2, None, None, ""), (q, k, v, mask, 2, 4, 0.25, ""),
                 (q.bfloat16(), k.bfloat16(), v.bfloat16(), make_mask(2, 9, 4, 0.5, gen), 1, None, None, "")]:
        torch.library.opcheck(op, args)


# ----------------------------------------------------------------------------- the CUDA body, traced with fake tensors

def test_cuda_body_traces_without_host_sync():
    """The op's CUDA body traced with fake CUDA tensors (as Inductor traces a triton_op): two kernel launches,
    static shapes, no data-dependent op. A subprocess with TRITON_INTERPRET=0, so the kernels are compiled-mode
    Triton functions."""
    _run_compiled_mode("check_cuda_body")


def _run_compiled_mode(check: str, **env):
    """Runs this module's function `check` in a subprocess with TRITON_INTERPRET=0."""
    env = dict(os.environ, TRITON_INTERPRET="0", **env)
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
            f"import {__name__.rsplit('.', 1)[-1]} as t; t.{check}()")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]


def check_cuda_body():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(1, 2048, 32, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        k = torch.empty(1, 8, 2048, 128, device="cuda", dtype=torch.bfloat16)
        mask = torch.empty(1, 2048, 8, device="cuda", dtype=torch.bool)
    body = lambda q, k, v, m: AP.attn_prefill_triton(q, k, v, m, 4, wrap=True)  # noqa: E731
    gm = make_fx(body, tracing_mode="fake")(q, k, k, mask)
    launches = [n for n in gm.graph.nodes if "triton_kernel_wrapper" in str(n.target)]
    assert len(launches) == 2, gm.graph
    outs = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
    assert tuple(outs.meta["val"].shape) == (1, 32, 2048, 128)


# ----------------------------------------------------------------------------- ahead-of-time compile for the H100/H200

SM90_SHARED = 232448  # bytes of shared memory per block on the H100 / H200
CUOBJDUMP = None
try:
    import triton as _triton

    CUOBJDUMP = os.path.join(os.path.dirname(_triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
except ImportError:  # pragma: no cover
    pass


@pytest.mark.skipif(CUOBJDUMP is None or not os.path.isfile(CUOBJDUMP), reason="this triton wheel has no cuobjdump")
def test_cuda_configs_compile_for_sm90_without_spills():
    """The shipped CUDA tiles (CONFIGS["cuda"]) compiled for sm_90 with this machine's Triton: no register spills
    and shared memory within the H100/H200 limit with a 5 % margin (the GPU machine's Triton differs)."""
    _run_compiled_mode("check_sm90_configs", TRITON_DEFAULT_FP_FUSION="1")


def _compile_sm90(consts: dict, cfg: dict, float_type: str = "fp32"):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    fn = JITFunction(getattr(AP._attn_prefill_kernel, "fn", AP._attn_prefill_kernel))
    ptrs = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "o_ptr": "*bf16", "order_ptr": "*i32",
            "cnt_ptr": "*i32"}
    strides = [f"s{t}{a}" for t in "qkvo" for a in "bhtd"]
    sig = dict(ptrs) | {s: "i32" for s in strides} | dict(T="i32", n_tiles="i32", qk_scale=float_type, window="i32")
    unit = {s: 1 for s in strides if s.endswith("d")}  # head-dim strides are 1, as the launcher specialises them
    sig |= {k: "constexpr" for k in list(consts) + list(unit)}
    aligned = [i for i, name in enumerate(sig) if name in ptrs or (name in strides and name not in unit)]
    src = ASTSource(fn=fn, signature=sig, constexprs=consts | unit,
                    attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})


def check_sm90_configs():
    import tempfile

    bad = []
    for d, gs, window in [(128, 4, None), (128, 1, None), (128, 4, 256), (64, 1, None)]:
        cfg = AP.config_for(d)
        kernel = _compile_sm90(AP.kernel_constants(32, 8, d, gs, window, torch.bfloat16, cfg), cfg)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(kernel.asm["cubin"])
            f.flush()
            usage = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True).stdout
        stack = int(usage.split("STACK:")[1].split()[0])
        shared = kernel.metadata.shared
        print(d, gs, window, cfg, "stack", stack, "shared", shared)
        if stack or shared > SM90_SHARED / 1.05:
            bad.append((d, gs, window, cfg, f"spilled {stack} B" if stack else f"shared {shared} B"))
    assert not bad, bad


@pytest.mark.skipif(CUOBJDUMP is None or not os.path.isfile(CUOBJDUMP), reason="this triton wheel has no cuobjdump")
def test_compiles_with_inductors_fp64_float_arguments():
    """Inductor types a Python float argument of a user-defined kernel as fp64 (torch._inductor.config.
    _use_fp64_for_unbacked_floats); the kernel compiles under that signature as well as under Triton's fp32."""
    _run_compiled_mode("check_fp64_scale", TRITON_DEFAULT_FP_FUSION="1")


def check_fp64_scale():
    cfg = AP.config_for(128)
    for window in (None, 256):
        _compile_sm90(AP.kernel_constants(32, 8, 128, 4, window, torch.bfloat16, cfg), cfg, float_type="fp64")


@pytest.mark.skipif(INTERPRET, reason="Inductor compiles the Triton kernels only on a CUDA GPU")
@pytest.mark.parametrize("window", [None, 100])
def test_op_under_torch_compile_matches_reference(window):
    """torch.compile (Inductor) compiles the op's Triton kernels itself (its own signature and launcher): the
    compiled op equals the eager kernel and stays within the float64 reference's tolerance."""
    from wide_compile.kernels.attn_ops import wide_attn_prefill

    gen = torch.Generator().manual_seed(21)
    q, k, v = (t.to(DEV) for t in make_qkv(2, 32, 8, 333, 128, torch.bfloat16, gen))
    mask = make_mask(2, 333, 8, 0.5, gen).to(DEV)
    compiled = torch.compile(lambda *a: wide_attn_prefill(*a, 4, window) * 1.0, fullgraph=True)
    out = compiled(q, k, v, mask)
    assert torch.equal(out, wide_attn_prefill(q, k, v, mask, 4, window))
    ref = AP.attn_prefill_ref(q.double(), k.double(), v.double(), mask, 4, window)
    assert rel(out, ref) <= TOL[torch.bfloat16]
