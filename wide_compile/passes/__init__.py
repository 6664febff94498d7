"""FX passes of the `wide` backend (one pass per file) and their manager."""
from .manager import (AttnMatch, GraphReport, MLPMatch, Pass, PassContext, PassManager, WideFallbackWarning,
                      counters, default_passes, op_counts)
from .insert_routers import NoRoutersError

__all__ = ["PassManager", "PassContext", "Pass", "GraphReport", "MLPMatch", "AttnMatch", "WideFallbackWarning",
           "NoRoutersError", "counters", "default_passes", "op_counts", "run_passes"]


def run_passes(gm, example_inputs, routers=None, strict: bool = False, options=None) -> PassContext:
    return PassManager().run(gm, example_inputs, routers=routers, strict=strict, options=options)
