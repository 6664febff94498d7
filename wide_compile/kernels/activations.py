"""The gated MLP kernels' shared epilogue: act(gate) * up in fp32, one constexpr id per gate activation."""
from __future__ import annotations

import triton
import triton.language as tl

# the ACT constexpr of every gated kernel per gate activation (reference.ACTIVATIONS)
ACT_IDS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}


@triton.jit
def gated_act(acc1, acc2, ACT: tl.constexpr):
    # act(acc1) * acc2 in fp32, act by ACT_IDS: the gated MLP kernels' shared epilogue
    if ACT == 0:  # silu
        y = acc1 * tl.sigmoid(acc1) * acc2
    elif ACT == 1:  # gelu: x * Phi(x)
        y = 0.5 * acc1 * (1.0 + tl.math.erf(acc1 * 0.7071067811865476)) * acc2
    else:  # gelu, tanh approximation: 0.5 x (1 + tanh(z)) = x * sigmoid(2 z)
        z = 0.7978845608028654 * (acc1 + 0.044715 * acc1 * acc1 * acc1)
        y = acc1 * tl.sigmoid(2.0 * z) * acc2
    return y
