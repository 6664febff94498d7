"""Decode attention over the active KV heads (kernels/attn_decode.py) against its float64 reference and SDPA.

Under TRITON_INTERPRET=1 on the CPU (the default here), compiled on a CUDA GPU with TRITON_INTERPRET=0.
Tolerances (relative L2 error against a float64 reference on the same rounded inputs): fp32 <= 1e-4 (ieee
dots), bf16 <= 2e-2 (the probabilities are rounded to bf16 before the P @ V dot, as in flash attention).
An inactive group's rows must be exactly 0 even when its queries are NaN.
"""
import os
import subprocess
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from wide_compile.kernels import attn_decode as AD  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERPRET else "cuda"
if not INTERPRET and not torch.cuda.is_available():  # pragma: no cover
    pytestmark = pytest.mark.skip("compiled Triton kernels need a CUDA GPU: on a CPU run with TRITON_INTERPRET=1")
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def head_mask(B, G, density, gen):
    if density == "one":                                    # one group on per sequence, a different one each
        m = torch.zeros(B, G, dtype=torch.bool)
        m[torch.arange(B), torch.randint(0, G, (B,), generator=gen)] = True
        return m
    return torch.rand(B, G, generator=gen) < density


def case(B, Hq, Hkv, L, D, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, 1, D, generator=gen).to(dtype)
    k = torch.randn(B, Hkv, L, D, generator=gen).to(dtype)
    v = torch.randn(B, Hkv, L, D, generator=gen).to(dtype)
    return q, k, v, gen


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def check(q, k, v, hm, gs, km=None, scale=None):
    out = AD.attn_decode_triton(*(t.to(DEV) for t in (q, k, v, hm)), gs,
                                None if km is None else km.to(DEV), scale).cpu()
    ref = AD.attn_decode_ref(q.double(), k.double(), v.double(), hm, gs, km, scale)
    inactive = ~hm.repeat_interleave(gs, dim=1)
    assert (out[inactive] == 0).all(), "an inactive group's rows must be exactly 0"
    assert torch.isfinite(out).all()
    if ref.norm() > 0:
        assert rel_err(out, ref) <= TOL[q.dtype], rel_err(out, ref)
    return out


SHAPES = [  # B, Hq, Hkv, group sizes to try, L, D
    (1, 4, 2, (1, 2, 4), 70, 32),
    (2, 6, 2, (1, 3, 6), 130, 16),
    (2, 4, 4, (1, 2), 1, 32),
    (1, 8, 2, (4, 2), 257, 24),       # D not a power of two, L past two splits of 128
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}_Hq{}_Hkv{}_L{}_D{}".format(*s[:3], *s[4:]))
@pytest.mark.parametrize("density", [0.0, "one", 0.5, 1.0])
def test_decode_matches_reference(shape, dtype, density):
    B, Hq, Hkv, sizes, L, D = shape
    for gs in sizes:
        q, k, v, gen = case(B, Hq, Hkv, L, D, dtype, seed=L + gs)
        check(q, k, v, head_mask(B, Hq // gs, density, gen), gs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_key_mask_ragged_lengths(dtype):
    """A static cache: per sequence a different number of written keys (one sequence with none: its rows
    are 0), the tail holding garbage that must not leak."""
    B, Hq, Hkv, L, D, gs = 4, 8, 2, 200, 32, 4
    q, k, v, gen = case(B, Hq, Hkv, L, D, dtype)
    lengths = torch.tensor([200, 1, 77, 0])
    km = torch.arange(L)[None, :] < lengths[:, None]
    k[~km[:, None, :, None].expand_as(k)] = float("nan")
    v[~km[:, None, :, None].expand_as(v)] = float("inf")
    hm = head_mask(B, Hq // gs, 0.6, gen)
    hm[:, 0] = True
    out = check(q, k, v, hm, gs, km)
    assert (out[3] == 0).all()


def test_all_on_equals_sdpa_with_gqa():
    B, Hq, Hkv, L, D = 2, 8, 2, 150, 32
    q, k, v, _ = case(B, Hq, Hkv, L, D, torch.float32, seed=3)
    out = AD.attn_decode_triton(*(t.to(DEV) for t in (q, k, v)), torch.ones(B, 2, dtype=torch.bool, device=DEV),
                                4).cpu()
    ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert rel_err(out, ref) <= 1e-4


def test_inactive_queries_never_leak():
    """NaN queries in inactive groups, NaN keys / values in KV heads no active group reads."""
    B, Hq, Hkv, L, D, gs = 2, 8, 4, 90, 16, 2                # KV-aligned: group g reads KV head g
    q, k, v, _ = case(B, Hq, Hkv, L, D, torch.float32, seed=5)
    hm = torch.tensor([[True, False, False, True], [False, True, False, False]])
    for b in range(B):
        for g in range(4):
            if not hm[b, g]:
                q[b, g * gs:(g + 1) * gs] = float("nan")
                k[b, g], v[b, g] = float("nan"), float("inf")
    check(q, k, v, hm, gs)


def test_custom_scale():
    q, k, v, gen = case(1, 4, 2, 40, 16, torch.float32, seed=7)
    check(q, k, v, head_mask(1, 4, 1.0, gen), 1, scale=0.37)


def test_group_straddling_kv_heads_is_an_error():
    with pytest.raises(ValueError, match="straddle KV heads"):
        AD.check_groups(12, 2, 4)                            # 6 query heads per KV head, groups of 4
    with pytest.raises(ValueError, match="does not divide"):
        AD.check_groups(8, 2, 3)


def test_splits_cover_the_context():
    for B, Hkv, L in [(1, 8, 16384), (8, 8, 1024), (1, 2, 1), (3, 1, 65)]:
        S, split_len = AD.num_splits(B, Hkv, L, torch.device("cpu"))
        assert split_len % AD.BLOCK_N == 0 and (S - 1) * split_len < L <= S * split_len


TUNED_ROWS = [{"B": 1, "Hkv": 8, "ctx": 4096, "config": {"programs_per_sm": 8}},
              {"B": 1, "Hkv": 8, "ctx": 16384, "config": {"programs_per_sm": 2}},
              {"B": 8, "Hkv": 8, "ctx": 4096, "config": {"num_stages": 2}},
              {"B": 8, "Hkv": 8, "ctx": 16384, "config": {"num_stages": 3}}]


@pytest.mark.parametrize("B, Hkv, L, want", [
    (1, 8, 16384, {"programs_per_sm": 2}), (8, 8, 16384, {"num_stages": 3}),
    (1, 8, 1024, {"programs_per_sm": 8}),        # nearest in log context: 4096
    (8, 8, 65536, {"num_stages": 3}), (4, 8, 4096, {"num_stages": 2}),
    (8, 8, 8192, {"num_stages": 3}), (1, 8, 8192, {"programs_per_sm": 2}),   # ties in context: the longer
    (2, 32, 16384, {"num_stages": 3}),           # 64 (sequence, KV head) pairs, as B 8 x 8
])
def test_tuned_config_takes_the_nearest_swept_shape(B, Hkv, L, want):
    assert AD.nearest_config(TUNED_ROWS, B, Hkv, L) == want
    assert AD.nearest_config([], B, Hkv, L) == {}


def test_tuned_file_is_checked_and_used(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="non-empty 'rows'"):
        AD.check_tuned({"rows": []}, "x.json")
    with pytest.raises(ValueError, match="positive integers"):
        AD.check_tuned({"rows": [{"B": 0, "Hkv": 8, "ctx": 4096, "config": {}}]}, "x.json")
    with pytest.raises(ValueError, match="config keys"):
        AD.check_tuned({"rows": [{"B": 1, "Hkv": 8, "ctx": 4096, "config": {"BLOCK_M": 64}}]}, "x.json")
    # every shipped tuned file passes the check
    for path in AD.TUNED_DIR.glob("*.json"):
        AD._tuned_rows.cache_clear()
        assert AD._tuned_rows(path.stem)
    # the kernel runs the shape's tuned config: a file asking for 16-key blocks gives 16-key splits
    monkeypatch.setattr(AD, "tuned_config", lambda B, Hkv, L, device: {"block_n": 16, "programs_per_sm": 64})
    seen = {}
    real = AD.num_splits

    def spy(B, Hkv, L, device, block_n, programs_per_sm):
        seen.update(block_n=block_n, programs_per_sm=programs_per_sm)
        return real(B, Hkv, L, device, block_n, programs_per_sm)

    monkeypatch.setattr(AD, "num_splits", spy)
    q, k, v, gen = case(2, 8, 2, 70, 16, torch.float32, seed=4)
    check(q, k, v, head_mask(2, 2, 0.5, gen), 4)
    assert seen == {"block_n": 16, "programs_per_sm": 64}


def test_inactive_kv_heads_are_not_computed(monkeypatch):
    """The split kernel never touches a (sequence, KV head) whose query heads are all inactive: its partials
    keep the sentinel they were allocated with (the bytes of that KV head are never read)."""
    made = {}

    def sentinel_partials(B, Hq, S, D, device):
        made["po"] = torch.full((B, Hq, S, D), 12345.0, device=device)
        made["lse"] = torch.full((B, Hq, S), 12345.0, device=device)
        return made["po"], made["lse"]

    monkeypatch.setattr(AD, "_partials", sentinel_partials)
    B, Hq, Hkv, L, D = 2, 8, 4, 150, 16
    q, k, v, _ = case(B, Hq, Hkv, L, D, torch.float32, seed=9)
    hm = torch.tensor([[True, False, False, True, False, False, False, False],     # 1-head groups
                       [False, False, False, False, False, False, True, True]])
    check(q, k, v, hm, 1)
    kv_on = hm.view(B, Hkv, 2).any(-1).repeat_interleave(2, dim=1).cpu()             # [B, Hq]
    lse = made["lse"].cpu()
    assert (lse[~kv_on] == 12345.0).all() and (lse[kv_on] != 12345.0).all()


def test_op_on_cpu_runs_the_reference_and_passes_opcheck():
    from wide_compile.kernels import wide_attn_decode

    q, k, v, gen = case(2, 8, 2, 33, 16, torch.float32, seed=11)
    hm, km = head_mask(2, 2, 0.5, gen), torch.arange(33)[None, :] < torch.tensor([[33], [20]])
    out = wide_attn_decode(q, k, v, hm, 4, km)
    assert torch.equal(out, AD.attn_decode_ref(q, k, v, hm, 4, km))
    torch.library.opcheck(torch.ops.wide.attn_decode.default, (q, k, v, hm, 4, km, None, ""))


def check_sm90_compile(float_type: str) -> None:
    """Compiles the split kernel for sm_90 (no GPU needed) with its float argument typed `float_type`."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    fn = JITFunction(getattr(AD._decode_split_kernel, "fn", AD._decode_split_kernel))
    ptrs = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", hm_ptr="*u8", km_ptr="*u8", po_ptr="*fp32",
                plse_ptr="*fp32")
    ints = ["L", "split_len", "qk_scale", "sq_b", "sq_h", "sk_b", "sk_h", "sk_l", "sv_b", "sv_h", "sv_l",
            "shm_b", "skm_b"]
    consts = dict(Hkv=8, n_rep=4, group_size=4, D=128, S=16, HAS_KEY_MASK=True, DOT_PRECISION="tf32",
                  UPCAST=False, BLOCK_H=16, BLOCK_N=AD.DEFAULT_CONFIG["block_n"], BLOCK_D=128)
    sig = ptrs | {n: (float_type if n == "qk_scale" else "i32") for n in ints} | {k: "constexpr" for k in consts}
    triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": AD.DEFAULT_CONFIG["num_warps"], "num_stages": AD.DEFAULT_CONFIG["num_stages"]})


@pytest.mark.skipif(not INTERPRET, reason="the ahead-of-time compile runs on the CPU machine")
@pytest.mark.parametrize("float_type", ["fp32", "fp64"])
def test_split_kernel_compiles_with_inductors_float_signature(float_type):
    """Inductor types a Python float argument of a user-defined kernel as fp64 (torch._inductor.config.
    _use_fp64_for_unbacked_floats), Triton's own launcher as fp32: the kernel compiles for sm_90 under both."""
    pytest.importorskip("triton.backends.nvidia")
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
            f"import {__name__.rsplit('.', 1)[-1]} as t; t.check_sm90_compile({float_type!r})")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]


@pytest.mark.skipif(INTERPRET, reason="Inductor compiles the Triton kernels only on a CUDA GPU")
def test_op_under_torch_compile_matches_reference():
    """torch.compile (Inductor) compiles the op's Triton kernels itself (its own signature and launcher): the
    compiled op equals the eager kernel and stays within the float64 reference's tolerance."""
    from wide_compile.kernels import wide_attn_decode

    q, k, v, gen = case(2, 32, 8, 1000, 128, torch.bfloat16, seed=12)
    hm, km = head_mask(2, 8, 0.5, gen), torch.arange(1000)[None, :] < torch.tensor([[1000], [613]])
    q, k, v, hm, km = (t.to(DEV) for t in (q, k, v, hm, km))
    compiled = torch.compile(lambda *a: wide_attn_decode(*a, 4, km) * 1.0, fullgraph=True)
    out = compiled(q, k, v, hm)
    assert torch.equal(out, wide_attn_decode(q, k, v, hm, 4, km))
    ref = AD.attn_decode_ref(q.double(), k.double(), v.double(), hm, 4, km)
    assert rel_err(out, ref) <= TOL[torch.bfloat16]
