"""What this machine can run (the WIDE backend, torch-tensorrt) and the Dynamo settings a benchmark needs."""
from __future__ import annotations


def wide_backend_status(name: str) -> str | None:
    """None if `name` is a usable dynamo backend, else the reason."""
    try:
        import wide_compile.backend  # noqa: F401  registers "wide"
    except Exception as e:  # noqa: BLE001
        if name == "wide":
            return f"import wide_compile.backend failed: {type(e).__name__}: {e}"
    try:
        from torch._dynamo.backends.registry import lookup_backend

        lookup_backend(name)
        return None
    except Exception as e:  # noqa: BLE001
        return f"dynamo backend {name!r} not registered: {type(e).__name__}: {str(e)[:200]}"


def trt_status() -> str | None:
    """None if torch-tensorrt imports, else the reason."""
    try:
        import torch_tensorrt  # noqa: F401

        return None
    except Exception as e:  # noqa: BLE001
        return f"torch_tensorrt not importable ({type(e).__name__}: {str(e)[:120]})"


def set_dynamo_limits() -> None:
    """Every (routers, workload) pair is its own graph: lift Dynamo's recompile limits out of the way."""
    import torch._dynamo.config as dc

    for n, v in (("recompile_limit", 4096), ("cache_size_limit", 4096), ("accumulated_recompile_limit", 65536),
                 ("accumulated_cache_size_limit", 65536)):
        if hasattr(dc, n):
            try:
                setattr(dc, n, v)
            except Exception:  # noqa: BLE001  a read-only or renamed setting in this torch version
                pass


def graph_count() -> int:
    """Dynamo's count of compiled graphs (-1 when this torch does not keep it): a change during timing
    means a row compiled while it was timed."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001
        return -1
