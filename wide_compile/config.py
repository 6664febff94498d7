"""WideConfig: the knobs of WIDE routing, validated on construction and against a model."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from .models.spec import ModelSpec

ROUTER_INITS = ("dense", "random")
ROUTER_RECIPES = ("linear", "wide")  # linear: D -> G on the normed input; wide: D -> rank -> 2G pairs
ROUTER_INPUTS = ("normed", "residual")
_RECIPE_INPUT = {"linear": "normed", "wide": "residual"}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class WideConfig:
    """Configuration of WIDE width routing.

    ffn_group_size:  consecutive FFN intermediate channels that one FFN router bit switches.
    head_group_size: consecutive query heads that one attention router bit switches. K/V are always
                     computed for every token, so any divisor of the number of query heads is valid,
                     also under GQA (a query-head group may span or split a KV group).
    capacity:        target FLOP-weighted capacity in (0, 1] (DESIGN.md): used by training's capacity
                     regulariser and by `Routers.calibrate_`; inference itself is whatever routers decide.
    router_hidden:   0 = linear router (D -> G); >0 = two-layer router D -> router_hidden -> G (SiLU).
    router_init:     "dense": fresh routers keep every group on (bias +router_init_bias, tiny weights),
                     so an untrained model behaves like the dense one (training starts there);
                     "random": random projections (calibrate them to a capacity with `Routers.calibrate_`).
    router_recipe:   "linear" (the router reads the normed block input, logits > 0 execute) or "wide" (the
                     method's recipe: D -> router_rank -> one (skip, execute) logit pair per group, reading the
                     residual stream before the block's norm; execute iff logit_exec > logit_skip).
    router_rank:     bottleneck width of the "wide" recipe.
    router_input:    "normed" / "residual"; "" = the recipe's own (linear: normed, wide: residual).
    """

    ffn_group_size: int = 64
    head_group_size: int = 1
    capacity: float = 0.5
    router_hidden: int = 0
    router_init: str = "dense"
    router_init_bias: float = 3.0
    router_recipe: str = "linear"
    router_rank: int = 32
    router_input: str = ""

    def __post_init__(self) -> None:
        if self.router_recipe not in ROUTER_RECIPES:
            raise ValueError(f"WideConfig.router_recipe must be one of {ROUTER_RECIPES}, got {self.router_recipe!r}")
        if not isinstance(self.router_rank, int) or isinstance(self.router_rank, bool) or self.router_rank < 1:
            raise ValueError(f"WideConfig.router_rank must be a positive integer, got {self.router_rank!r}")
        if self.router_input == "":
            object.__setattr__(self, "router_input", _RECIPE_INPUT[self.router_recipe])
        if self.router_input not in ROUTER_INPUTS:
            raise ValueError(f"WideConfig.router_input must be one of {ROUTER_INPUTS} (or \"\" for the recipe's "
                             f"own), got {self.router_input!r}")
        for name in ("ffn_group_size", "head_group_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"WideConfig.{name} must be a positive integer, got {v!r}")
        if not isinstance(self.capacity, (int, float)) or not (0.0 < float(self.capacity) <= 1.0):
            raise ValueError(
                f"WideConfig.capacity must be in (0, 1] (a FLOP fraction of the dense model), got {self.capacity!r}"
            )
        if not isinstance(self.router_hidden, int) or self.router_hidden < 0:
            raise ValueError(f"WideConfig.router_hidden must be an integer >= 0, got {self.router_hidden!r}")
        if self.router_init not in ROUTER_INITS:
            raise ValueError(f"WideConfig.router_init must be one of {ROUTER_INITS}, got {self.router_init!r}")

    # -- validation against a model -------------------------------------------------------------
    def validate(self, spec: "ModelSpec") -> None:
        """Raise ValueError when this config cannot route `spec` (a ModelSpec or a model)."""
        from .models.spec import model_spec

        spec = model_spec(spec)
        if spec.intermediate_size % self.ffn_group_size:
            valid = [d for d in _divisors(spec.intermediate_size) if d >= 8] or _divisors(spec.intermediate_size)
            raise ValueError(
                f"ffn_group_size={self.ffn_group_size} does not divide the FFN width {spec.intermediate_size}; "
                f"valid group sizes are divisors of {spec.intermediate_size}, e.g. {valid[:12]}"
            )
        if spec.num_heads % self.head_group_size:
            raise ValueError(
                f"head_group_size={self.head_group_size} does not divide the number of query heads "
                f"{spec.num_heads}; valid values: {_divisors(spec.num_heads)}"
            )

    def num_ffn_groups(self, spec: "ModelSpec") -> int:
        return spec.intermediate_size // self.ffn_group_size

    def num_head_groups(self, spec: "ModelSpec") -> int:
        return spec.num_heads // self.head_group_size

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, s: str) -> "WideConfig":
        return cls(**json.loads(s))
