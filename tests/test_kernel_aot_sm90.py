"""The CUDA kernels compiled ahead of time for the H200 (sm_90) on this CPU machine: Triton's own
compiler and ptxas (shipped in the triton wheel) report the shared memory each configuration really
uses, so a tile that does not fit is caught here instead of on the GPU, where it fails with "out of
resource: shared memory" (bf16-tuned decode tiles used as they are in fp32 need 245760 B of the H200's
232448); compact_mlp.fit_shared_memory fits the tiles per element size.

Compiled with this machine's Triton (the GPU machine's is older), with a 5 % margin for differences."""
import json
import os
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from wide_compile.kernels import compact_mlp as cm  # noqa: E402

H200_SMEM = 232448
SM90 = GPUTarget("cuda", 90, 32)
TY = {torch.bfloat16: "bf16", torch.float32: "fp32"}
SHAPES = {"8b-mlp": (4096, 14336, 64), "smol-mlp": (576, 1536, 64), "smol-q": (576, 576, 64)}

pytestmark = pytest.mark.skipif(
    not os.path.isfile(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")),
    reason="this triton wheel has no ptxas")


def _compile(kernel, args: dict, consts: dict, warps: int, stages: int):
    # a compiled-mode JITFunction of the kernel's Python function: the test session may run the kernels
    # under TRITON_INTERPRET, where @triton.jit produced interpreter objects
    fn = JITFunction(getattr(kernel, "fn", kernel))
    sig = dict(args) | {k: "constexpr" for k in consts}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts)
    return triton.compile(src, target=SM90, options={"num_warps": warps, "num_stages": stages})


def compile_gather(cfg, D_, F_, GS, dt):
    """The gate/up gather GEMM exactly as compact_mlp.ngather launches it (gated, no bias)."""
    t = "*" + TY[dt]
    args = {"x_ptr": t, "w1_ptr": t, "w2_ptr": t, "b_ptr": t, "out_ptr": t, "mask_ptr": "*u8", "idx_ptr": "*i32",
            "cnt_ptr": "*i32", "sorted_ptr": "*i32", "ntpp_ptr": "*i32", "T": "i32", "D": "i32", "stride_x": "i32",
            "stride_w": "i32", "stride_o": "i32"}
    consts = dict(G=F_ // GS, GS=GS, BM=cfg["up_bm"], BN=cfg["up_bn"], BK=cfg["up_bk"], SORTED=cfg["path"] == "sorted",
                  GATED=True, HAS_BIAS=False, ZERO_INACTIVE=False, PREC=cm._prec(dt), UPCAST=False,
                  GROUP_G=cfg["group_g"], LISTS=cfg.get("lists", "kernel") != "none", ACT=cm.ACT_IDS["silu"],
                  FUSE_GU=bool(cfg.get("up_fuse", False)))
    return _compile(cm._ngather_kernel, args, consts, cfg["up_warps"], cfg["up_stages"])


def compile_kskip(cfg, F_, GS, dt):
    """The decode K-skip reduction as compact_mlp.kskip launches it (split-K, fp32 atomics)."""
    t = "*" + TY[dt]
    atomic = cfg["dn_split"] > 1
    args = {"a_ptr": t, "w_ptr": t, "b_ptr": t, "out_ptr": "*fp32" if atomic else t, "mask_ptr": "*u8",
            "tg_ptr": "*i32", "tc_ptr": "*i32", "T": "i32", "N": "i32", "stride_a": "i32", "stride_w": "i32",
            "stride_o": "i32"}
    consts = dict(G=F_ // GS, GS=GS, BM=cfg["dn_bm"], BN=cfg["dn_bn"], BK=cfg["dn_bk"], SPLIT=cfg["dn_split"],
                  HAS_BIAS=False, ATOMIC=atomic, PREC=cm._prec(dt), UPCAST=False, GROUP_M=cfg["group_m"],
                  LISTS=cfg.get("lists", "kernel") != "none")
    return _compile(cm._kskip_kernel, args, consts, cfg["dn_warps"], cfg["dn_stages"])


CASES = [(shape, T, dt) for shape in SHAPES for T in (1, 2048) for dt in ("bf16", "fp32")]


def measure(cases):
    """{case: (gather shared B, K-skip shared B or None, config)} for the fitted configs, plus the unfitted
    fp32 decode config; run in a process without TRITON_INTERPRET (see _measured)."""
    out = {}
    for shape, T, dts in cases:
        dt = getattr(torch, {"bf16": "bfloat16", "fp32": "float32"}[dts])
        D_, F_, GS = SHAPES[shape]
        cfg = cm.kernel_config(T, D_, F_, GS, D_, elem_size=dt.itemsize, device="cpu")
        up = compile_gather(cfg, D_, F_, GS, dt).metadata.shared
        dn = None if cfg.get("down") == "dense" else compile_kskip(cfg, F_, GS, dt).metadata.shared
        out[f"{shape}/{T}/{dts}"] = (up, dn, cfg)
    for dts in ("bf16", "fp32"):  # the decode kernels without reorder lists (tile path, mask read in-kernel)
        dt = getattr(torch, {"bf16": "bfloat16", "fp32": "float32"}[dts])
        cfg = cm.kernel_config(1, 4096, 14336, 64, 4096, {"lists": "none"}, elem_size=dt.itemsize, device="cpu")
        out[f"no-lists/{dts}"] = (compile_gather(cfg, 4096, 14336, 64, dt).metadata.shared,
                                  compile_kskip(cfg, 14336, 64, dt).metadata.shared, cfg)
    for dts in ("bf16", "fp32"):  # the prefill gather with gate and up in one dot (config up_fuse), 8 warps too
        dt = getattr(torch, {"bf16": "bfloat16", "fp32": "float32"}[dts])
        for warps in (4, 8):
            cfg = cm.kernel_config(2048, 4096, 14336, 64, 4096, {"up_fuse": True, "up_warps": warps},
                                   elem_size=dt.itemsize, device="cpu")
            out[f"up-fuse-{warps}w/{dts}"] = (compile_gather(cfg, 4096, 14336, 64, dt).metadata.shared, None, cfg)
    raw = cm.default_config(1, 576, 1536, 64, 576)
    out["unfitted-fp32-decode"] = (compile_gather(raw, 576, 1536, 64, torch.float32).metadata.shared, None, raw)
    return out


@pytest.fixture(scope="module")
def measured():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (f"import sys, json; sys.path.insert(0, {os.path.dirname(__file__)!r}); import {__name__.rsplit('.', 1)[-1]} "
            f"as t; print('AOT' + json.dumps(t.measure(t.CASES)))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("AOT"))
    return json.loads(line[3:])


@pytest.mark.parametrize("case", [f"{a}/{b}/{c}" for a, b, c in CASES] + ["no-lists/bf16", "no-lists/fp32"]
                         + [f"up-fuse-{w}w/{d}" for w in (4, 8) for d in ("bf16", "fp32")])
def test_fitted_configs_fit_the_h200(measured, case):
    up, dn, cfg = measured[case]
    assert up <= 0.95 * H200_SMEM, (case, cfg, up)
    assert dn is None or dn <= 0.95 * H200_SMEM, (case, cfg, dn)


def test_unfitted_fp32_decode_config_exceeds_the_h200_shared_memory(measured):
    # bf16-tuned tiles used as they are in fp32 need more than the H200 has; fitted, they fit
    assert measured["unfitted-fp32-decode"][0] > H200_SMEM
    assert measured["smol-mlp/1/fp32"][0] <= 0.95 * H200_SMEM
