"""The CUDA bodies of the wide ops, traced on the CPU with fake CUDA tensors (as Inductor traces a
triton_op on the GPU). Guards against constructs Inductor cannot lower on the GPU (torch 2.11), which CPU
runs never execute because the CPU dispatches to the references, e.g. `aten.view.dtype` to or from bool
("torch.bool is not supported by torch.iinfo").

The kernels must be compiled-mode Triton functions (not the interpreter's), so the checks run in a
subprocess without TRITON_INTERPRET (the test session sets it for the other kernel tests): one subprocess for the
module (its start, importing torch and the kernels, is most of a check's time), each test reading its own check's
result."""
import json
import os
import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from wide_compile.kernels.compact_attn import o_proj_triton, q_proj_triton
from wide_compile.kernels.compact_mlp import default_config, mlp_triton
from wide_compile.kernels.reorder import mask_reorder_triton


CHECKS = [("check_mlp_body", (T,)) for T in (3, 8, 130)] + [("check_one_token_gemv_bodies", ())] + [
    ("check_attention_projection_bodies", (T,)) for T in (3, 8, 130)] + [("check_mask_reorder_body", ())] + [
    ("check_routed_select_bodies", ())]


@pytest.fixture(scope="module")
def isolated():
    """{(check, params): None, or the traceback of its failure}: every check of CHECKS run in one subprocess."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (f"import json, sys, traceback; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
            f"import {__name__.rsplit('.', 1)[-1]} as t\n"
            f"res = []\n"
            f"for name, params in {CHECKS!r}:\n"
            f"    try:\n"
            f"        getattr(t, name)(*params); res.append(None)\n"
            f"    except BaseException:\n"
            f"        res.append(traceback.format_exc()[-3000:])\n"
            f"print('RESULTS ' + json.dumps(res))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    return dict(zip(CHECKS, json.loads(lines[-1][len("RESULTS "):])))


def _run_isolated(results, test_name: str, *params):
    err = results[(test_name, params)]
    assert err is None, err


def _trace(fn, *shapes_dtypes):
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        args = [torch.empty(s, device="cuda", dtype=d) for s, d in shapes_dtypes]
    return make_fx(fn, tracing_mode="fake")(*args)


def _bool_dtype_views(gm):
    bad = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is torch.ops.aten.view.dtype:
            src = n.args[0].meta["val"].dtype
            if torch.bool in (src, n.args[1]):
                bad.append(f"{n.name}: view {src} as {n.args[1]}")
    return bad


def _mask_conversions(gm):
    """Casts of a bool input in the traced body: each would be a launch of its own where the mask comes from an
    opaque kernel (the fused norm + router), which Inductor cannot fuse a cast into."""
    bools = {n for n in gm.graph.nodes if n.op == "placeholder" and n.meta["val"].dtype == torch.bool}
    return [n.name for n in gm.graph.nodes if n.op == "call_function" and n.target in (
        torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default) and n.args[0] in bools]


def _kernel_launches(gm):
    return sum(1 for n in gm.graph.nodes if "triton_kernel_wrapper" in str(n.target))


BF16, BOOL = torch.bfloat16, torch.bool


def _dense_small_batch(T):
    return default_config(T, 64, 128, 32, 64)["path"] == "dense"  # the device's table decides


def _mms(gm):
    return sum(1 for n in gm.graph.nodes if n.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default))


# gather-GEMV decode path, dense small-batch path, prefill path (rows of the tuning table)
@pytest.mark.parametrize("T", [3, 8, 130])
def test_mlp_body(T, isolated):
    _run_isolated(isolated, "check_mlp_body", T)


def check_mlp_body(T):
    gm = _trace(lambda x, wg, wu, wd, m: mlp_triton(x, wg, wu, wd, m, 32, wrap=True),
                ((T, 64), BF16), ((128, 64), BF16), ((128, 64), BF16), ((128, 64), BF16), ((T, 4), BOOL))
    assert _bool_dtype_views(gm) == []
    if _dense_small_batch(T):  # three cuBLAS GEMMs and elementwise ops Inductor fuses; no Triton launch
        assert _kernel_launches(gm) == 0 and _mms(gm) == 3
    else:
        assert _kernel_launches(gm) >= 2


def test_one_token_gemv_bodies(isolated):
    _run_isolated(isolated, "check_one_token_gemv_bodies")


def check_one_token_gemv_bodies():
    """The one-token GEMVs (gemv): the free op's on the transposed copy (w_down_t read column-wise, split
    partials: 3 launches) and on the transposed view of down_proj's own weight that a one-token graph hands it
    (rows read whole, no split: 2 launches), and the bucketed op's (a prototype row picked on the device)."""
    from wide_compile.kernels.bucket_mlp import mlp_bucket_triton

    gm = _trace(lambda x, wg, wu, wd, m: mlp_triton(x, wg, wu, wd, m, 32, config={"one_token": "gemv"}, wrap=True),
                ((1, 64), BF16), ((128, 64), BF16), ((128, 64), BF16), ((128, 64), BF16), ((1, 4), BOOL))
    assert _bool_dtype_views(gm) == [] and _kernel_launches(gm) == 3 and _mask_conversions(gm) == []
    gv = _trace(lambda x, wg, wu, wd, m: mlp_triton(x, wg, wu, wd.t(), m, 32, config={"one_token": "gemv"},
                                                    wrap=True),
                ((1, 64), BF16), ((128, 64), BF16), ((128, 64), BF16), ((64, 128), BF16), ((1, 4), BOOL))
    assert _bool_dtype_views(gv) == [] and _kernel_launches(gv) == 2 and _mask_conversions(gv) == []
    gb = _trace(lambda x, wg, wu, wd, b, p: mlp_bucket_triton(x, wg, wu, wd, b, p, 32, wrap=True),
                ((1, 64), BF16), ((128, 64), BF16), ((128, 64), BF16), ((64, 128), BF16), ((1,), torch.int32),
                ((5, 4), BOOL))
    assert _bool_dtype_views(gb) == [] and _kernel_launches(gb) == 2


@pytest.mark.parametrize("T", [3, 8, 130])
def test_attention_projection_bodies(T, isolated):
    _run_isolated(isolated, "check_attention_projection_bodies", T)


def check_attention_projection_bodies(T):
    gq = _trace(lambda x, w, b, m: q_proj_triton(x, w, b, m, 32, wrap=True),
                ((T, 64), BF16), ((128, 64), BF16), ((128,), BF16), ((T, 4), BOOL))
    go = _trace(lambda a, w, m: o_proj_triton(a, w, None, m, 32, wrap=True),
                ((T, 128), BF16), ((128, 64), BF16), ((T, 4), BOOL))
    assert _bool_dtype_views(gq) == [] and _bool_dtype_views(go) == []
    assert _mask_conversions(gq) == [] and _mask_conversions(go) == []  # the kernels read the bool mask as it is
    if _dense_small_batch(T):
        assert _kernel_launches(gq) == 0 and _kernel_launches(go) == 0 and _mms(gq) == 1 and _mms(go) == 1
        return
    assert _kernel_launches(gq) >= 1
    if T <= 16:  # prefill o_proj is masked input + cuBLAS (KERNELS_NOTES.md): no Triton launch there
        assert _kernel_launches(go) >= 1


def test_mask_reorder_body(isolated):
    _run_isolated(isolated, "check_mask_reorder_body")


def check_mask_reorder_body():
    gm = _trace(lambda m: mask_reorder_triton(m, 16, wrap=True), ((37, 5), BOOL))
    assert _bool_dtype_views(gm) == []
    assert _kernel_launches(gm) >= 3


def test_routed_select_bodies(isolated):
    _run_isolated(isolated, "check_routed_select_bodies")


def check_routed_select_bodies():
    """The router-in-the-select ops' CUDA bodies (routed_select_ops): one Triton launch each, the select of o_proj's
    input and the MLP's act(g) * u, with and without the router's bias (then the pair's rows say G)."""
    from wide_compile.kernels.routed_select_ops import _routed_gated_select_impl, _routed_select_impl

    F32 = torch.float32
    go = _trace(lambda a, h, w2, b: _routed_select_impl(a, h, w2, b, 16),
                ((130, 96), BF16), ((130, 64), BF16), ((16, 64), BF16), ((6,), F32))
    gg = _trace(lambda g, u, h, w2: _routed_gated_select_impl(g, u, h, w2, None, 16, "silu"),
                ((130, 128), BF16), ((130, 128), BF16), ((130, 64), BF16), ((16, 64), BF16))
    for gm in (go, gg):
        assert _bool_dtype_views(gm) == [] and _kernel_launches(gm) == 1
