"""What the Triton kernel tests share: where the kernels run (the CPU interpreter, TRITON_INTERPRET=1, or a CUDA
GPU with TRITON_INTERPRET=0), the buffer poisoning that makes an unwritten element fail, and the error measure.

    from kernel_checks import DEV, INTERPRET, needs_device, poison_buffers, rel  # noqa: F401 (the fixture)
    pytestmark = [needs_device, pytest.mark.usefixtures("poison_buffers")]

The interpreter runs a kernel a thousand times slower than a GPU, so a test over many axes takes `covering`'s cases:
every pair of the two main axes (the shapes and the mask kinds, say), each with one value of the third in turn.
"""
import importlib
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported; TRITON_INTERPRET=0 compiles them

import pytest  # noqa: E402
import torch  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERPRET else "cuda"
needs_device = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                                  reason="compiled Triton kernels need a CUDA GPU: on a CPU run with TRITON_INTERPRET=1")


@pytest.fixture
def poison_buffers():
    """Every buffer the kernels allocate (reorder.alloc) starts as NaN / garbage, so an element a kernel should
    write and does not, or reads before it is written, fails the test."""
    reorder = importlib.import_module("wide_compile.kernels.reorder")
    reorder.POISON = True
    yield
    reorder.POISON = False


def covering(rows, cols, turns):
    """Parameter tuples over rows x cols x turns (each item a value or a tuple of values). Compiled on a GPU: the
    full product. Under the interpreter: every (row, col) pair once, with turns[(i + j) % len(turns)] for row i and
    col j, so every row and every col still meets every turn (each pair of the three axes is covered; only the
    three-way combinations are thinned out)."""
    tup = lambda v: v if isinstance(v, tuple) else (v,)  # noqa: E731
    if not INTERPRET:
        return [tup(r) + tup(c) + tup(t) for r in rows for c in cols for t in turns]
    assert len(rows) >= len(turns) and len(cols) >= len(turns), "too few rows / cols to meet every turn"
    return [tup(r) + tup(c) + tup(turns[(i + j) % len(turns)]) for i, r in enumerate(rows) for j, c in enumerate(cols)]


def case_id(v):
    """pytest ids for covering's cases: float32 / bfloat16 rather than dtype0, dtype1, ..."""
    return str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else None


def rel(out, ref):
    """Relative L2 error of out against ref over the whole tensor (absolute where ref is all zero); a non-finite
    output fails (an unwritten or poisoned element)."""
    assert torch.isfinite(out).all(), "non-finite output (unwritten/poisoned element?)"
    num = (out.double().cpu() - ref.double().cpu()).norm()
    den = ref.double().cpu().norm()
    return (num / den).item() if den > 0 else num.item()
