"""Router modules, masks, capacity accounting, attach/detach (the eager WIDE reference)."""
from .attach import attach, attached_routers, detach, is_attached, record_logits, record_masks, routed
from .capacity import FlopCost
from .measure import measure_capacity, per_token_capacity
from .routers import CodebookRouter, ConstantRouter, GroupRouter, NestedRouter, PairRouter, ReplayRouter, Routers, gumbel_sigmoid_st

__all__ = ["attach", "detach", "is_attached", "attached_routers", "record_masks", "record_logits", "routed", "FlopCost",
           "measure_capacity", "per_token_capacity", "Routers", "CodebookRouter", "NestedRouter", "GroupRouter", "PairRouter", "ConstantRouter", "ReplayRouter",
           "gumbel_sigmoid_st"]
