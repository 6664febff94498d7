"""--kernel-config: the WIDE kernel config of a run, handed to every WIDE model the run compiles (the
backend keeps it in the graph it compiles; nothing process-wide changes)."""
from __future__ import annotations


def kernel_config(options) -> dict | None:
    """options.kernel_overrides() as the backend's kernel_config ({"decode"|"prefill": {field: value}}),
    or None when --kernel-config is unset (the device's shipped table)."""
    return options.kernel_overrides() or None
