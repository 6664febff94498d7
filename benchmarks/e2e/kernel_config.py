"""--kernel-config: the WIDE kernel config changes a run makes, applied in this one place (the kernels read
them for the whole process)."""
from __future__ import annotations


def apply_kernel_config(overrides: dict) -> None:
    """overrides: {"decode"|"prefill": {field: value}} (e2e/options.BenchOptions.kernel_overrides)."""
    if not overrides:
        return
    from wide_compile.kernels.compact_mlp import set_default_overrides

    set_default_overrides(**overrides)
