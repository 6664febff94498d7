"""What Inductor needs from a user-defined Triton kernel that the interpreter does not check.

With torch 2.11 / triton 3.6, a ``tl.constexpr`` parameter with a default value that a launch leaves out
makes Inductor's generated launcher take one argument more than its call site passes, and the compiled
model fails with ``launcher() missing 1 required positional argument: '_grid_2'``. The kernels therefore
declare no defaults, so a launch that leaves a constexpr out fails at once, on the CPU too, in the
interpreter tests."""
import importlib
import inspect

import pytest

triton = pytest.importorskip("triton")

MODULES = ["wide_compile.kernels.compact_mlp", "wide_compile.kernels.compact_attn", "wide_compile.kernels.reorder",
           "wide_compile.kernels.attn_decode", "wide_compile.kernels.attn_prefill",
           "wide_compile.kernels.bucket_mlp", "wide_compile.kernels.norm_router"]


def _jit_kernels():
    out = []
    for name in MODULES:
        mod = importlib.import_module(name)
        for attr, obj in vars(mod).items():
            fn = getattr(obj, "fn", None)  # JITFunction (and the interpreter's wrapper) keep the Python function
            if inspect.isfunction(fn):
                out.append((f"{name}.{attr}", fn))
    return out


def test_kernels_found():
    names = [n for n, _ in KERNELS]
    assert any(n.endswith("_ngather_kernel") for n in names) and any(n.endswith("_kskip_kernel") for n in names)
    assert any(n.endswith("_tile_lists_kernel") for n in names)


KERNELS = _jit_kernels()


@pytest.mark.parametrize("name,fn", KERNELS, ids=[n for n, _ in KERNELS])
def test_no_defaulted_parameters(name, fn):
    defaulted = [p.name for p in inspect.signature(fn).parameters.values() if p.default is not inspect.Parameter.empty]
    assert not defaulted, f"{name}: parameters with defaults {defaulted}; pass them at every launch instead"
