"""FX passes of the `wide` backend (one pass per file), their shared types (base.py) and their manager."""
from .base import (AttnMatch, GraphReport, MLPMatch, Pass, PassContext, RoutingDroppedError, WideFallbackWarning,
                   counters, op_counts)
from .insert_routers import NoRoutersError
from .manager import PassManager, default_passes
from .options import PassOptions

__all__ = ["PassManager", "PassOptions", "PassContext", "Pass", "GraphReport", "MLPMatch", "AttnMatch", "WideFallbackWarning",
           "RoutingDroppedError", "NoRoutersError", "counters", "default_passes", "op_counts"]
