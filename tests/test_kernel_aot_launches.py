"""Every Triton kernel the wide ops launch, compiled ahead of time for Hopper (sm_90) on this CPU machine, with
the arguments its launcher really passes at Llama-3.1-8B shapes in bf16, typed the way Inductor types a
user-defined kernel's arguments (a Python float becomes fp64: torch._inductor.config._use_fp64_for_unbacked_floats).

The launchers run on CPU tensors with `_launcher` replaced by a recorder, so nothing executes; each recorded
launch is then compiled with Triton's own compiler and ptxas (from the triton wheel). A kernel that does not
compile for the GPU, or that needs more shared memory than the H100 / H200 have, fails here instead of in a
device call. The compile runs in a subprocess without TRITON_INTERPRET (the test session sets it)."""
import json
import os
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton")
from wide_compile.kernels.gemv import GEMV_SWEEP  # noqa: E402

SM90_SHARED = 232448  # bytes of shared memory per block on the H100 / H200
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
pytestmark = pytest.mark.skipif(not os.path.isfile(PTXAS), reason="this triton wheel has no ptxas")

# Llama-3.1-8B: hidden 4096, FFN 14336 in groups of 64, 32 query heads of 128 in groups of 4 (one KV head)
D, F, FGS, HQ, HKV, HD, HGS = 4096, 14336, 64, 32, 8, 128, 4
TY = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32", torch.int64: "i64",
      torch.uint8: "u8", torch.int8: "i8", torch.bool: "i1"}


class Recorder:
    """Stands in for `_launcher(kernel, wrap)`: `kernel[grid](*args, **kwargs)` records the launch."""

    def __init__(self):
        self.launches = []

    def __call__(self, kernel, wrap):
        rec = self

        class _Grid:
            def __getitem__(self, grid):
                return lambda *a, **kw: rec.launches.append((kernel, a, kw))

        return _Grid()


def _signature(kernel, args, kwargs):
    """(signature, constexprs, options) for triton.compile from a recorded launch."""
    fn = getattr(kernel, "fn", kernel)
    from triton.runtime.jit import JITFunction

    jf = JITFunction(fn)
    opts = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    values = dict(zip(jf.arg_names, args)) | kwargs
    # specialised as Triton's launcher and Inductor do: an integer 1 becomes a constant, pointers (from the
    # caching allocator) and integers that are multiples of 16 carry tt.divisibility 16, so the pipeliner sees
    # the alignment it sees on the GPU
    sig, consts, aligned = {}, {}, []
    for i, p in enumerate(jf.params):
        v = values[p.name]
        if p.is_constexpr or v is None or (type(v) is int and v == 1):
            sig[p.name], consts[p.name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[p.name] = "*" + TY[v.dtype]
            aligned.append(i)
        elif isinstance(v, bool):
            sig[p.name] = "i1"
        elif isinstance(v, int):
            sig[p.name] = "i32" if -2**31 <= v < 2**31 else "i64"
            if v % 16 == 0:
                aligned.append(i)
        elif isinstance(v, float):
            sig[p.name] = "fp64"  # Inductor's type for a Python float argument
        else:
            raise TypeError(f"{jf.__name__}: argument {p.name} of type {type(v).__name__}")
    return jf, sig, consts, opts, {(i,): [["tt.divisibility", 16]] for i in aligned}


def _cases():
    """name -> a function launching one op's kernels on CPU tensors (nothing runs: the launches are recorded)."""
    from wide_compile.kernels import attn_decode, attn_prefill, bucket_attn, bucket_mlp, compact_attn, compact_mlp
    from wide_compile.kernels import dense_masked, gemv, norm_router, routed_select

    g = torch.Generator().manual_seed(0)
    bf = torch.bfloat16

    def t(*shape, dtype=bf):
        return torch.empty(shape, dtype=dtype)

    def mask(*shape):
        return torch.rand(*shape, generator=g) < 0.5

    def protos(P, G):
        return torch.rand(P, G, generator=g) < 0.5

    def bucket(T, P):
        return torch.randint(0, P, (T,), generator=g, dtype=torch.int32)

    cases = {}
    for T in (1, 16, 2048):
        cases[f"mlp T={T}"] = lambda T=T: compact_mlp.mlp_triton(t(T, D), t(F, D), t(F, D), t(F, D), mask(T, F // FGS),
                                                               FGS)
        cases[f"q_proj T={T}"] = lambda T=T: compact_attn.q_proj_triton(t(T, D), t(HQ * HD, D), None,
                                                                       mask(T, HQ // HGS), HGS * HD)
        cases[f"o_proj T={T}"] = lambda T=T: compact_attn.o_proj_triton(t(T, HQ * HD), t(HQ * HD, D), None,
                                                                       mask(T, HQ // HGS), HGS * HD)
        cases[f"mlp_bucket T={T}"] = lambda T=T: bucket_mlp.mlp_bucket_triton(
            t(T, D), t(F, D), t(F, D), t(D, F), bucket(T, 16), protos(16, F // FGS), FGS)
        cases[f"q_proj_bucket T={T}"] = lambda T=T: bucket_attn.q_proj_bucket_triton(
            t(T, D), t(HQ * HD, D), None, bucket(T, 16), protos(16, HQ // HGS), HGS * HD)
        cases[f"o_proj_bucket T={T}"] = lambda T=T: bucket_attn.o_proj_bucket_triton(
            t(T, HQ * HD), t(D, HQ * HD), None, bucket(T, 16), protos(16, HQ // HGS), HGS * HD)
        cases[f"rmsnorm_router T={T}"] = lambda T=T: norm_router.rmsnorm_router_triton(
            t(T, D), t(D), 1e-5, "normed", "linear", t(2 * F // FGS, D, dtype=torch.float32),
            t(2 * F // FGS, dtype=torch.float32))
        cases[f"add_rmsnorm_router T={T}"] = lambda T=T: norm_router.add_rmsnorm_router_triton(
            t(T, D), t(T, D), t(D), 1e-5, "residual", "linear", t(F // FGS, D, dtype=torch.float32))
        cases[f"add_rmsnorm_router mlp T={T}"] = lambda T=T: norm_router.add_rmsnorm_router_triton(
            t(T, D), t(T, D), t(D), 1e-5, "normed", "mlp", t(32, D, dtype=torch.float32), None,
            t(F // FGS, 32, dtype=torch.float32))
    for kind, sweep in gemv.GEMV_SWEEP.items():  # the one-token MLP at every tile its sweep times
        for i, cfg in enumerate(sweep):
            w_down = t(D, F) if kind == "k_contiguous" else t(F, D).t()
            cases[f"mlp_gemv {kind} {i}"] = lambda w=w_down, c=cfg: gemv.mlp_gemv_triton(
                t(1, D), t(F, D), t(F, D), w, mask(1, F // FGS), None, FGS, config=c)
    cases["mlp_bucket union_blocks T=2048"] = lambda: bucket_mlp.mlp_bucket_triton(
        t(2048, D), t(F, D), t(F, D), t(D, F), bucket(2048, 16), protos(16, F // FGS), FGS,
        config=dict(prefill_lists="union"))
    cases["mlp_bucket global h, gate and up in one dot T=2048"] = lambda: bucket_mlp.mlp_bucket_triton(
        t(2048, D), t(F, D), t(F, D), t(D, F), bucket(2048, 16), protos(16, F // FGS), FGS,
        config=dict(prefill_lists="union", h_layout="global", up_fuse=True))
    cases["q_proj_bucket global T=2048"] = lambda: bucket_attn.q_proj_bucket_triton(
        t(2048, D), t(HQ * HD, D), None, bucket(2048, 16), protos(16, HQ // HGS), HGS * HD,
        config=dict(h_layout="global"))
    cases["mlp gate and up in one dot T=2048"] = lambda: compact_mlp.mlp_triton(
        t(2048, D), t(F, D), t(F, D), t(F, D), mask(2048, F // FGS), FGS, config=dict(up_fuse=True, up_warps=8))
    cases["add_rmsnorm_router tiles 32x128 T=2048"] = lambda: norm_router.add_rmsnorm_router_triton(
        t(2048, D), t(2048, D), t(D), 1e-5, "normed", "linear", t(F // FGS, D, dtype=torch.float32),
        t(F // FGS, dtype=torch.float32), tiles=True, tile=(32, 128))
    for router_input, ng in (("normed", 24), ("residual", 9)):  # SmolLM2's width
        cases[f"add_rmsnorm_router tiles D=576 G={ng} T=2048"] = lambda ri=router_input, ng=ng: \
            norm_router.add_rmsnorm_router_triton(t(2048, 576), t(2048, 576), t(576), 1e-5, ri, "linear",
                                                  t(ng, 576, dtype=torch.float32), t(ng, dtype=torch.float32), tiles=True)
        cases[f"add_rmsnorm_router tiles one pass D=576 G={ng} T=2048"] = lambda ri=router_input, ng=ng: \
            norm_router.add_rmsnorm_router_triton(t(2048, 576), t(2048, 576), t(576), 1e-5, ri, "linear",
                                                  t(ng, 576, dtype=torch.float32), t(ng, dtype=torch.float32), tiles=True,
                                                  tile=(16, 32, 1024, 8))
    # the router in the select: SmolLM2's FFN (24 groups of 64) and attention (9 heads), the 8B o_proj's 8 groups
    for name, (Dh, G, GS, glu) in {"ffn D=576": (576, 24, 64, True), "attn D=576": (576, 9, 64, False),
                                   "o D=4096": (D, HQ // HGS, HGS * HD, False)}.items():
        cases[f"routed_select {name} T=2048"] = lambda Dh=Dh, G=G, GS=GS, glu=glu: routed_select.routed_select_triton(
            t(2048, G * GS), t(2048, Dh), t(2 * (-(-G // 4) * 4), Dh), t(G, dtype=torch.float32), GS,
            t(2048, G * GS) if glu else None)
    cases["gated_select T=16"] = lambda: dense_masked.gated_select_triton(t(16, F), t(16, F), mask(16, F // FGS), FGS)
    cases["q_proj_gemv"] = lambda: gemv.q_proj_gemv_triton(t(1, D), t(HQ * HD, D), t(HQ * HD), mask(1, HQ // HGS),
                                                           None, HGS * HD)
    for kind in ("k_contiguous", "d_contiguous"):
        w_o = t(D, HQ * HD) if kind == "k_contiguous" else t(HQ * HD, D).t()
        cases[f"o_proj_gemv {kind}"] = lambda w=w_o: gemv.o_proj_gemv_triton(t(1, HQ * HD), w, t(D),
                                                                             mask(1, HQ // HGS), None, HGS * HD)
    cases["mlp_gemv bucket"] = lambda: gemv.mlp_gemv_triton(t(1, D), t(F, D), t(F, D), t(D, F),
                                                                protos(16, F // FGS), bucket(1, 16), FGS)
    for B in (1, 8):
        cases[f"attn_decode B={B}"] = lambda B=B: attn_decode.attn_decode_triton(
            t(B, HQ, 1, HD), t(B, HKV, 16384, HD), t(B, HKV, 16384, HD), mask(B, HQ // HGS), HGS,
            torch.ones(B, 16384, dtype=torch.bool))
    for window in (None, 4096):
        cases[f"attn_prefill window={window}"] = lambda w=window: attn_prefill.attn_prefill_triton(
            t(1, 2048, HQ, HD).transpose(1, 2), t(1, HKV, 2048, HD), t(1, HKV, 2048, HD), mask(1, 2048, HQ // HGS),
            HGS, w)
    return cases


def global_loads(ptx: str) -> dict:
    """{PTX global load instruction (e.g. ld.global.v4.b32, ld.global.b16): count} of a compiled kernel."""
    import collections
    import re

    return dict(collections.Counter(re.findall(r"ld\.global[\w.]*", ptx)))


def stack_bytes(cubin: bytes):
    """Bytes of local-memory stack per thread of a compiled kernel (cuobjdump's resource usage), None without
    cuobjdump: registers spilled, or arrays the compiler could not keep in registers."""
    import re
    import tempfile

    tool = os.path.join(os.path.dirname(PTXAS), "cuobjdump")
    if not os.path.isfile(tool):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"STACK:(\d+)", out)
    return int(m.group(1)) if m else None


def record_and_compile(names):
    """In a process without TRITON_INTERPRET: each case's launches compiled for sm_90; {case: [(kernel, shared B,
    error or None), ...]}."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from wide_compile.kernels import (attn_decode, attn_prefill, bucket_mlp, compact_mlp, dense_masked, gemv, norm_router,
                                      reorder, routed_select)

    rec = Recorder()
    for mod in (attn_decode, attn_prefill, bucket_mlp, compact_mlp, dense_masked, gemv, norm_router, reorder,
                routed_select):
        mod._launcher = rec
    cases, out, seen = _cases(), {}, {}
    assert sorted(cases) == sorted(CASE_NAMES), "CASE_NAMES and _cases() list the same cases"
    for name in names:
        rec.launches.clear()
        cases[name]()
        res = []
        for kernel, args, kwargs in list(rec.launches):
            jf, sig, consts, opts, attrs = _signature(kernel, args, dict(kwargs))
            key = json.dumps([jf.__name__, sig, {k: repr(v) for k, v in consts.items()}, opts], sort_keys=True)
            if key not in seen:
                try:
                    ck = triton.compile(ASTSource(fn=jf, signature=sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                                        options=opts)
                    seen[key] = (ck.metadata.shared, None, global_loads(ck.asm["ptx"]), stack_bytes(ck.asm["cubin"]))
                except Exception as e:  # noqa: BLE001  reported per kernel by the test
                    seen[key] = (None, f"{type(e).__name__}: {str(e)[:1500]}", {}, None)
            res.append((jf.__name__, *seen[key]))
        out[name] = res
    return out


CASE_NAMES = ([f"{op} T={T}" for T in (1, 16, 2048) for op in ("mlp", "q_proj", "o_proj", "mlp_bucket", "q_proj_bucket",
                                                                  "o_proj_bucket", "rmsnorm_router",
                                                                  "add_rmsnorm_router", "add_rmsnorm_router mlp")]
              + [f"mlp_gemv {k} {i}" for k, sweep in GEMV_SWEEP.items() for i in range(len(sweep))]
              + ["mlp_bucket global h, gate and up in one dot T=2048", "q_proj_bucket global T=2048",
                 "mlp gate and up in one dot T=2048", "add_rmsnorm_router tiles 32x128 T=2048"]
              + [f"add_rmsnorm_router tiles{p} D=576 G={g} T=2048" for g in (24, 9) for p in ("", " one pass")]
              + [f"routed_select {n} T=2048" for n in ("ffn D=576", "attn D=576", "o D=4096")]
              + ["mlp_gemv bucket", "mlp_bucket union_blocks T=2048", "gated_select T=16", "q_proj_gemv", "o_proj_gemv k_contiguous", "o_proj_gemv d_contiguous"] + [f"attn_decode B={B}" for B in (1, 8)]
              + [f"attn_prefill window={w}" for w in (None, 4096)])


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_DEFAULT_FP_FUSION": "1"}
    code = (f"import sys, json; sys.path.insert(0, {os.path.dirname(__file__)!r}); import {__name__.rsplit('.', 1)[-1]} "
            f"as t; print('AOT' + json.dumps(t.record_and_compile({CASE_NAMES!r})))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(next(x for x in out.stdout.splitlines() if x.startswith("AOT"))[3:])


@pytest.mark.parametrize("case", CASE_NAMES)
def test_launches_compile_for_sm90_within_shared_memory(compiled, case):
    launches = compiled[case]
    if not launches:
        pytest.skip(f"{case}: no Triton launch (the tuning table runs it on the dense-masked path)")
    for kernel, shared, error, *_ in launches:
        assert error is None, f"{case}: {kernel} does not compile for sm_90: {error}"
        assert shared <= SM90_SHARED, f"{case}: {kernel} needs {shared} B of shared memory (the GPU has {SM90_SHARED})"


@pytest.mark.parametrize("case", ["o_proj_gemv k_contiguous", "mlp_gemv k_contiguous 0", "mlp_gemv bucket"])
def test_gemv_reduction_reads_weights_with_vector_loads(compiled, case):
    """The one-token reduction kernel gathers W's columns of the active groups: its weight loads must still be
    16-byte vector loads (the run hint in gemv._k_tile), not one 2-byte load per element, which reads at a
    fraction of the bandwidth."""
    loads = {k: v for kernel, _, _, v, *_ in compiled[case] if kernel == "_gemv_k_kernel" for k, v in v.items()}
    assert loads, f"{case}: no _gemv_k_kernel launch"
    assert not loads.get("ld.global.b16"), f"{case}: scalar bf16 loads in the reduction kernel: {loads}"
    assert loads.get("ld.global.v4.b32"), f"{case}: no 16-byte loads in the reduction kernel: {loads}"


@pytest.mark.parametrize("case", ["add_rmsnorm_router T=2048", "rmsnorm_router T=2048",
                                  *(f"add_rmsnorm_router tiles{p} D=576 G={g} T=2048" for g in (24, 9)
                                    for p in ("", " one pass"))])
def test_norm_router_tiles_need_no_stack(compiled, case):
    """The fused norm + router's default tiles at prefill sizes (8B and SmolLM2 widths), and its one-pass form,
    keep their tiles in registers: dots over a whole-row tile of SmolLM2's width put them on a local-memory
    stack."""
    stacks = [(kernel, stack) for kernel, _, error, _, stack in compiled[case] if kernel == "_rmsnorm_router_tiles_kernel"]
    assert stacks, f"{case}: no tiles-form launch"
    if any(stack is None for _, stack in stacks):
        pytest.skip("this triton wheel has no cuobjdump")
    assert all(stack == 0 for _, stack in stacks), f"{case}: local-memory stack {stacks}"


@pytest.mark.parametrize("case", [f"routed_select {n} T=2048" for n in ("ffn D=576", "attn D=576", "o D=4096")])
def test_routed_select_needs_no_stack(compiled, case):
    """The router-in-the-select kernel keeps its logits tile and each group's tile in registers at SmolLM2's widths
    and with the 8B o_proj's 512-column groups."""
    stacks = [(kernel, stack) for kernel, _, error, _, stack in compiled[case] if kernel == "_routed_select_kernel"]
    assert stacks, f"{case}: no routed-select launch"
    if any(stack is None for _, stack in stacks):
        pytest.skip("this triton wheel has no cuobjdump")
    assert all(stack == 0 for _, stack in stacks), f"{case}: local-memory stack {stacks}"
