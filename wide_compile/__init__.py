"""wide_compile: WIDE dynamic-width inference for Llama-family models as a torch.compile backend."""
from .config import WideConfig
from .routing import Routers, attach, detach, is_attached, measure_capacity

__version__ = "0.1.0"

__all__ = ["WideConfig", "Routers", "attach", "detach", "is_attached", "measure_capacity", "optimize",
           "explain", "static_cache", "__version__"]


def __getattr__(name):  # the compiler side imports torch._dynamo / inductor: load it on first use
    if name in ("optimize", "explain", "static_cache"):
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'wide_compile' has no attribute {name!r}")
