"""The tensor-core dot the router kernels share: 16-bit inputs, fp32 accumulation, and the same arithmetic under the
Triton CPU interpreter, which mis-computes bf16 dots (there the 16-bit values go upcast, exactly, to an fp32 dot)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def exact_dot(x, w, acc, UPCAST: tl.constexpr):
    # acc [M, N] += x [M, K] @ w [K, N], x and w 16-bit (each product exact in fp32)
    if UPCAST:
        return tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(x, w, acc)
