"""WideConfig: the knobs of WIDE routing, validated on construction; GroupGeometry: what they mean for one
model (the group counts and sizes), validated once against it."""
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
STRUCTURES = ("free", "codebook", "nested")  # which masks a router may emit per token (see WideConfig.structure)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def kv_head_group_size(spec: "ModelSpec") -> int:
    """head_group_size="kv" on `spec` (a ModelSpec or a model): the query heads that share one KV head."""
    from .models.spec import model_spec

    s = model_spec(spec)
    if s.num_kv_heads < 1 or s.num_heads % s.num_kv_heads:
        raise ValueError(f"head_group_size='kv' needs the query heads ({s.num_heads}) to split evenly into "
                         f"KV groups ({s.num_kv_heads} KV heads)")
    return s.num_heads // s.num_kv_heads


@dataclass(frozen=True)
class WideConfig:
    """Configuration of WIDE width routing.

    ffn_group_size:  consecutive FFN intermediate channels that one FFN router bit switches.
    head_group_size: consecutive query heads that one attention router bit switches. K/V are always
                     computed for every token, so any divisor of the number of query heads is valid,
                     also under GQA (a query-head group may span or split a KV group). "kv": the query
                     heads that share one KV head (resolved per model by `for_model`), the grouping under
                     which attention skips reading whole KV heads (optimize rewrites such blocks by default:
                     sparse_attention="auto").
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
    structure:       which masks a token may get. "free": any subset of groups (one decision per group, the
                     method's routers). "codebook": per layer and kind a learned table of `codebook_size`
                     prototype masks; a scorer (D -> P for the linear recipe, D -> router_rank -> P for the
                     wide recipe, on the recipe's input) picks one prototype per token (argmax), and the
                     token's mask is that prototype's row (CodebookRouter).
                     "nested": per layer and kind a fixed order of the groups (most important first, from
                     the dense model's weights when the routers are made) and `nested_levels` widths; a scorer
                     picks a width level per token, whose mask is the first width groups of the order
                     (NestedRouter; the order is applied as an index into the mask, the weights stay).
    codebook_size:   P, the number of prototypes per codebook router (>= 2).
    nested_levels:   the number of width levels of a nested router (>= 2; at most the number of groups);
                     level l keeps ceil(G * (l + 1) / nested_levels) of the G groups.
    """

    ffn_group_size: int = 64
    head_group_size: int | str = 1
    capacity: float = 0.5
    router_hidden: int = 0
    router_init: str = "dense"
    router_init_bias: float = 3.0
    router_recipe: str = "linear"
    router_rank: int = 32
    router_input: str = ""
    structure: str = "free"
    codebook_size: int = 16
    nested_levels: int = 8

    def __post_init__(self) -> None:
        if self.structure not in STRUCTURES:
            raise ValueError(f"WideConfig.structure must be one of {STRUCTURES}, got {self.structure!r}")
        p = self.codebook_size
        if not isinstance(p, int) or isinstance(p, bool) or p < 2:
            raise ValueError(f"WideConfig.codebook_size must be an integer >= 2 (prototypes per codebook router), "
                             f"got {p!r}")
        n = self.nested_levels
        if not isinstance(n, int) or isinstance(n, bool) or n < 2:
            raise ValueError(f"WideConfig.nested_levels must be an integer >= 2 (width levels per nested router), "
                             f"got {n!r}")
        if self.structure != "free" and self.router_hidden:
            raise ValueError(f"WideConfig: structure={self.structure!r} scores its choices with a linear "
                             "(router_recipe 'linear') or rank-router_rank ('wide') scorer; router_hidden applies "
                             "only to structure='free' (set router_hidden=0)")
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
            if name == "head_group_size" and v == "kv":
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                also = ' or "kv"' if name == "head_group_size" else ""
                raise ValueError(f"WideConfig.{name} must be a positive integer{also}, got {v!r}")
        if not isinstance(self.capacity, (int, float)) or not (0.0 < float(self.capacity) <= 1.0):
            raise ValueError(
                f"WideConfig.capacity must be in (0, 1] (a FLOP fraction of the dense model), got {self.capacity!r}"
            )
        if not isinstance(self.router_hidden, int) or self.router_hidden < 0:
            raise ValueError(f"WideConfig.router_hidden must be an integer >= 0, got {self.router_hidden!r}")
        if self.router_init not in ROUTER_INITS:
            raise ValueError(f"WideConfig.router_init must be one of {ROUTER_INITS}, got {self.router_init!r}")

    # -- validation against a model -------------------------------------------------------------
    def for_model(self, spec: "ModelSpec") -> "WideConfig":
        """This config with head_group_size="kv" resolved to the query heads per KV head of `spec` (a
        ModelSpec or a model); other configs unchanged."""
        if self.head_group_size != "kv":
            return self
        return dataclasses.replace(self, head_group_size=kv_head_group_size(spec))

    def geometry(self, spec: "ModelSpec") -> "GroupGeometry":
        """The group geometry of this config on `spec` (a ModelSpec or a model); ValueError when it does not fit."""
        from .models.spec import model_spec

        return GroupGeometry.of(self.for_model(spec), model_spec(spec))

    def validate(self, spec: "ModelSpec") -> None:
        """Raise ValueError when this config cannot route `spec` (a ModelSpec or a model)."""
        self.geometry(spec)

    def num_ffn_groups(self, spec: "ModelSpec") -> int:
        return self.geometry(spec).num_ffn_groups

    def num_head_groups(self, spec: "ModelSpec") -> int:
        return self.geometry(spec).num_head_groups

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, s: str) -> "WideConfig":
        return cls(**json.loads(s))


@dataclass(frozen=True)
class GroupGeometry:
    """How WIDE cuts one model's layers into router groups: built once from (WideConfig, ModelSpec) and
    checked once, here; the passes, ops and kernels take their group sizes from it.

    Attention: `num_head_groups` groups of `head_group_size` query heads; one group is `head_group_cols`
    consecutive columns of q_proj's output (= rows of o_proj.weight.T). FFN: `num_ffn_groups` groups of
    `ffn_group_size` consecutive intermediate channels (rows of gate/up, columns of down).
    """

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    head_group_size: int
    intermediate_size: int
    ffn_group_size: int

    def __post_init__(self) -> None:
        for name, v in dataclasses.asdict(self).items():
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"GroupGeometry.{name} must be a positive integer, got {v!r}")
        if self.intermediate_size % self.ffn_group_size:
            n = self.intermediate_size
            valid = [d for d in _divisors(n) if d >= 8] or _divisors(n)
            raise ValueError(
                f"ffn_group_size={self.ffn_group_size} does not divide the FFN width {n}; "
                f"valid group sizes are divisors of {n}, e.g. {valid[:12]}"
            )
        if self.num_heads % self.head_group_size:
            raise ValueError(
                f"head_group_size={self.head_group_size} does not divide the number of query heads "
                f"{self.num_heads}; valid values: {_divisors(self.num_heads)}"
            )

    @classmethod
    def of(cls, cfg: WideConfig, spec: "ModelSpec") -> "GroupGeometry":
        return cls(hidden_size=spec.hidden_size, num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
                   head_dim=spec.head_dim, head_group_size=cfg.head_group_size,
                   intermediate_size=spec.intermediate_size, ffn_group_size=cfg.ffn_group_size)

    @classmethod
    def from_routers(cls, routers) -> "GroupGeometry":
        """The geometry of a wide_compile.Routers (its .cfg and .spec)."""
        return cls.of(routers.cfg, routers.spec)

    @property
    def q_size(self) -> int:  # q_proj output width = o_proj input width
        return self.num_heads * self.head_dim

    @property
    def head_group_cols(self) -> int:  # q columns / o_proj input rows per head group
        return self.head_group_size * self.head_dim

    @property
    def num_head_groups(self) -> int:
        return self.num_heads // self.head_group_size

    @property
    def num_ffn_groups(self) -> int:
        return self.intermediate_size // self.ffn_group_size

    def groups(self, kind: str) -> tuple[int, int]:
        """(number of groups, columns per group) of one kind of block: "ffn" or "attn"."""
        if kind == "ffn":
            return self.num_ffn_groups, self.ffn_group_size
        if kind == "attn":
            return self.num_head_groups, self.head_group_cols
        raise ValueError(f"GroupGeometry.groups: kind must be 'ffn' or 'attn', got {kind!r}")
