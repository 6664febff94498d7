"""Routers: per decoder layer, one attention-group router and one FFN-group router.

A router reads a token's hidden state h[..., D] and emits logits[..., G] (execute iff > 0, deterministic).
Which h: the normalized block input (the input of q_proj / gate_proj; cfg.router_input "normed") or the
residual stream before the block's norm ("residual"); `attach` hooks the matching module. Two recipes:
  * "linear" (GroupRouter): logits = W h + b (optionally with a SiLU hidden layer); training relaxes the
    decisions with a straight-through Gumbel-sigmoid;
  * "wide" (PairRouter, the method's recipe): h -> rank r -> one (skip, execute) logit pair per group;
    its logits are the margin exec - skip; training uses a hard Gumbel-softmax over each pair with a
    straight-through estimator.
With cfg.structure "codebook" (CodebookRouter) a token's mask is one of P learned prototype masks, picked
by a scorer that reads the recipe's input; its relaxation is a hard Gumbel-softmax over the P prototypes.
With "nested" (NestedRouter) the scorer picks a width level and the mask is a prefix of a fixed per-layer
group order (an index into the mask; the weights are not permuted).
Each router class owns its maths as functions of (h, *tensors) in router_fns; `graph_form` hands the pass
the mask function and tensors, and `forward` calls the logits twin of that same function.
"""
from __future__ import annotations

import json
import math
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..config import WideConfig
from ..models.spec import ModelSpec, model_spec
from . import router_fns as fns
from .router_fns import split_logits  # noqa: F401  (re-exported: the historical import path)

FORMAT_VERSION = 1
_BIG = 30.0  # logit magnitude of a constant router: sigmoid(30) == 1 in fp32


# Fewest tokens for which a split-bf16 router (Routers.split_bf16_) runs its bf16 pair. A single token reads
# the same bytes either way (fp32 [G, D] or bf16 [2G, D]) and gains nothing from tensor cores, so the fp32
# GEMV serves decode at batch 1; from a few tokens on the tensor-core pair is the faster one.
# benchmarks/results/router-dtype/ has the measurements.
SPLIT_MIN_ROWS = 2


def split_bf16(w: torch.Tensor, pad_to: int = 1) -> torch.Tensor:
    """fp32 weight [G, D] -> bf16 [2Gp, D]: rows :G = bf16(w), rows Gp:Gp + G = bf16(w - bf16(w)), Gp = G rounded
    up to a multiple of pad_to (the rows between are zero); the pair holds w to about 2^-16 relative (16
    mantissa bits instead of bf16's 8)."""
    w = w.detach().float()
    hi = w.to(torch.bfloat16)
    lo = (w - hi.float()).to(torch.bfloat16)
    pad = -w.shape[0] % pad_to
    if pad:
        z = hi.new_zeros(pad, w.shape[1])
        return torch.cat([hi, z, lo, z])
    return torch.cat([hi, lo])


class _RouterBase(nn.Module):
    """What every router offers: forward(h) -> float32 logits [..., G] (execute iff > 0), `relaxed` for
    training, `graph_form` for the form-B pass, `flops_per_token` for capacity accounting."""

    groups: int

    def flops_per_token(self) -> int:
        return 0

    def relaxed(self, h: torch.Tensor, tau: float, noise: bool) -> torch.Tensor:
        """Float 0/1 mask [..., G], hard in the forward, with a straight-through gradient."""
        return gumbel_sigmoid_st(self(h), tau, noise)

    def graph_form(self, dtype: torch.dtype | None = None, rows: int | None = None):
        """(mask_fn, ((name, tensor), ...)): mask_fn(h, *tensors) -> bool [..., G], the decision as the pass
        inserts it into a graph whose router input has `dtype` and `rows` tokens (None: unknown)."""
        raise NotImplementedError


class GroupRouter(_RouterBase):
    """The "linear" recipe: h[..., D] -> logits[..., G] (float32). Linear, or D -> hidden -> G with SiLU."""

    def __init__(self, dim: int, groups: int, hidden: int = 0):
        super().__init__()
        self.dim, self.groups, self.hidden = dim, groups, hidden
        if hidden:
            self.proj_in = nn.Linear(dim, hidden)
            self.proj = nn.Linear(hidden, groups)
        else:
            self.proj = nn.Linear(dim, groups)
        # set by Routers.split_bf16_(): the weight as a bf16 pair for bf16 inputs (inference only; not saved)
        self.register_buffer("w_split", None, persistent=False)

    def flops_per_token(self) -> int:
        if self.hidden:
            return 2 * (self.dim * self.hidden + self.hidden * self.groups)
        return 2 * self.dim * self.groups

    def margin_bias(self) -> torch.Tensor:
        """The bias whose increase by d raises every group's logit by d (calibration shifts it)."""
        return self.proj.bias

    def split_for(self, dtype: torch.dtype, rows: int | None = None) -> torch.Tensor | None:
        """The bf16 weight pair (Routers.split_bf16_) when it applies to inputs of `dtype` with `rows` tokens
        (None: unknown; in a traced graph a symbolic size, which Dynamo guarantees is >= 2), else None: the
        fp32 router then runs."""
        ok = self.w_split is not None and dtype == torch.bfloat16 == self.w_split.dtype
        if rows is not None and rows < SPLIT_MIN_ROWS:
            ok = False
        return self.w_split if ok else None

    def _form(self, dtype, rows):
        # (logits_fn, mask_fn, tensors): the one place that picks this router's maths
        if self.hidden:
            return fns.mlp_logits, fns.mlp_router_mask, (("w1", self.proj_in.weight), ("b1", self.proj_in.bias),
                                                  ("w2", self.proj.weight), ("b2", self.proj.bias))
        w2 = self.split_for(dtype, rows) if dtype is not None else None
        if w2 is not None:
            return fns.split_logits, fns.split_router_mask, (("w2", w2), ("b", self.proj.bias))
        return fns.linear_logits, fns.linear_router_mask, (("w", self.proj.weight), ("b", self.proj.bias))

    def graph_form(self, dtype=None, rows=None):
        _, mask_fn, tensors = self._form(dtype, rows)
        return mask_fn, tensors

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        logits_fn, _, tensors = self._form(h.dtype, h.numel() // max(h.shape[-1], 1))
        return logits_fn(h, *(t for _, t in tensors))


class PairRouter(_RouterBase):
    """The "wide" recipe: h[..., D] -> down [..., r] -> up [..., G, 2] (skip, execute) logit pairs.
    forward returns the margin exec - skip (float32 [..., G]); `relaxed` is a hard Gumbel-softmax over
    each pair with a straight-through gradient."""

    def __init__(self, dim: int, groups: int, rank: int = 32):
        super().__init__()
        self.dim, self.groups, self.rank = dim, groups, rank
        self.down = nn.Linear(dim, rank)
        self.up = nn.Linear(rank, 2 * groups)

    def flops_per_token(self) -> int:
        return 2 * (self.dim * self.rank + self.rank * 2 * self.groups)

    def margin_bias(self) -> torch.Tensor:
        """The execute logits' biases (a view): raising them by d raises every margin by d."""
        return self.up.bias.view(self.groups, 2)[:, 1]

    def _tensors(self):
        return (("w_down", self.down.weight), ("b_down", self.down.bias), ("w_up", self.up.weight),
                ("b_up", self.up.bias))

    def graph_form(self, dtype=None, rows=None):
        return fns.pair_router_mask, self._tensors()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return fns.pair_margin(h, *(t for _, t in self._tensors()))

    def relaxed(self, h: torch.Tensor, tau: float, noise: bool) -> torch.Tensor:
        z = fns.pair_logits(h, *(t for _, t in self._tensors())).float()  # [..., G, 2]
        if noise:
            u = torch.rand_like(z).clamp_(1e-10, 1 - 1e-7)
            z = z - torch.log(-torch.log(u))  # + Gumbel(0, 1)
        soft = torch.softmax(z / tau, dim=-1)[..., 1]
        return _StraightThrough.apply(soft)


class CodebookRouter(_RouterBase):
    """structure="codebook": a learned table of P prototype masks and a scorer that picks one per token.

    prototypes [P, G] are logits (the hard prototype is logits > 0); the scorer maps h[..., D] to scores
    [..., P] (linear D -> P, or D -> rank -> P when rank > 0). forward returns the chosen prototype's logits
    row (float32 [..., G], execute iff > 0), so the mask is always one of the P prototype masks. The token
    takes the argmax of scores + tilt * width (width [P]: the fraction of groups each hard prototype keeps).
    Capacity calibration moves two margins: first `tilt` (`tilt_margin`, a buffer, 0 until calibrated), which
    moves tokens one at a time between wider and narrower prototypes and leaves the prototypes as they are;
    only when the tilt cannot reach the target, the prototype logits (`margin_bias`, coarse: a shift flips a
    group for every token of a prototype at once, so capacity moves in steps), then the tilt again.
    `relaxed`: hard Gumbel-softmax over the P scores times the hard
    prototype bits in the forward; the backward is that of softmax((scores + g) / tau) @ sigmoid(prototypes
    / tau) (straight through the pick and the bits together), so gradients reach the scorer and the
    prototypes."""

    def __init__(self, dim: int, groups: int, prototypes: int, rank: int = 0):
        super().__init__()
        self.dim, self.groups, self.num_prototypes, self.rank = dim, groups, prototypes, rank
        self.prototypes = nn.Parameter(torch.zeros(prototypes, groups))
        self.register_buffer("tilt", torch.zeros(()))
        if rank:
            self.scorer_in = nn.Linear(dim, rank)
            self.scorer = nn.Linear(rank, prototypes)
        else:
            self.scorer = nn.Linear(dim, prototypes)

    def flops_per_token(self) -> int:
        # the pick is a row lookup; only the scorer multiplies
        if self.rank:
            return 2 * (self.dim * self.rank + self.rank * self.num_prototypes)
        return 2 * self.dim * self.num_prototypes

    def margin_bias(self) -> torch.Tensor:
        """The prototype logits [P, G]: raising them by d (broadcast over P) raises every token's logits by d."""
        return self.prototypes

    def tilt_margin(self) -> torch.Tensor:
        """The width tilt (a 0-dim buffer): raising it never narrows any token's prototype (calibration's fine
        step, after the prototype logits' coarse one)."""
        return self.tilt

    def _scorer_tensors(self):
        if self.rank:
            return (("w_down", self.scorer_in.weight), ("b_down", self.scorer_in.bias), ("w_up", self.scorer.weight),
                    ("b_up", self.scorer.bias))
        return (("w", self.scorer.weight), ("b", self.scorer.bias))

    def _tensors(self):
        return (("protos", self.prototypes), ("tilt", self.tilt), *self._scorer_tensors())

    def graph_form(self, dtype=None, rows=None):
        return fns.codebook_router_mask, self._tensors()

    def bucket_form(self):
        """((bucket_fn, tensors), (table_fn, tensors)): bucket_fn(h, *tensors) -> prototype id [...] (int64),
        table_fn(*tensors) -> the prototype logits [P, G] (None: the one tensor is the table); the mask is
        fns.bucket_mask(bucket, table), the same decision as graph_form's."""
        return (fns.codebook_bucket, self._tensors()), (None, (("protos", self.prototypes),))

    def scores(self, h: torch.Tensor) -> torch.Tensor:
        """Prototype scores [..., P] (float32 for fp32 scorers)."""
        return fns.scorer_scores(h, tuple(t for _, t in self._scorer_tensors()))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return fns.codebook_logits(h, *(t for _, t in self._tensors()))

    def relaxed(self, h: torch.Tensor, tau: float, noise: bool) -> torch.Tensor:
        s = self.scores(h).float()  # [..., P]
        s = s + self.tilt * fns.prototype_widths(self.prototypes.detach())
        if noise:
            u = torch.rand_like(s).clamp_(1e-10, 1 - 1e-7)
            s = s - torch.log(-torch.log(u))  # + Gumbel(0, 1)
        protos = self.prototypes.float()
        soft = torch.softmax(s / tau, dim=-1) @ torch.sigmoid(protos / tau)  # [..., G]
        hard = F.embedding(s.argmax(-1), (protos > 0).to(soft.dtype))
        return _StraightThroughTo.apply(hard, soft)


class NestedRouter(_RouterBase):
    """structure="nested": per token a width level over a fixed order of the groups.

    order [G] (long buffer): the layer's groups, most important first; pos [G] its inverse (a group's rank).
    widths [P]: the number of groups level l keeps. A scorer (as CodebookRouter's) maps h[..., D] to level
    scores [..., P]; the token takes the argmax level of scores + tilt * level, and its mask is the first
    widths[level] groups of the order (pos < width). `tilt` (a buffer) is the margin calibration shifts.
    `relaxed`: hard Gumbel-softmax over the levels with a straight-through gradient to the scorer (the
    level masks are fixed)."""

    def __init__(self, dim: int, groups: int, levels: int, rank: int = 0):
        super().__init__()
        if not 2 <= levels <= groups:
            raise ValueError(f"NestedRouter: nested_levels={levels} must be in [2, {groups}] (the number of groups "
                             "of this router); lower nested_levels or use smaller groups")
        self.dim, self.groups, self.levels, self.rank = dim, groups, levels, rank
        self.register_buffer("pos", torch.arange(groups))
        self.register_buffer("widths", torch.tensor([-(-groups * (lv + 1) // levels) for lv in range(levels)]))
        self.register_buffer("tilt", torch.zeros(()))
        if rank:
            self.scorer_in = nn.Linear(dim, rank)
            self.scorer = nn.Linear(rank, levels)
        else:
            self.scorer = nn.Linear(dim, levels)

    @property
    def order(self) -> torch.Tensor:
        """The groups, most important first [G]."""
        return torch.argsort(self.pos)

    def set_order_(self, order: torch.Tensor) -> "NestedRouter":
        order = torch.as_tensor(order, dtype=torch.long).flatten()
        if not torch.equal(order.sort().values, torch.arange(self.groups)):
            raise ValueError(f"NestedRouter.set_order_: order must be a permutation of range({self.groups})")
        with torch.no_grad():
            self.pos[order.to(self.pos.device)] = torch.arange(self.groups, device=self.pos.device)
        return self

    def level_masks(self) -> torch.Tensor:
        """bool [P, G]: the mask of each level."""
        return self.pos[None, :] < self.widths[:, None]

    def flops_per_token(self) -> int:
        if self.rank:
            return 2 * (self.dim * self.rank + self.rank * self.levels)
        return 2 * self.dim * self.levels

    def margin_bias(self) -> torch.Tensor:
        """The level tilt (a 0-dim buffer): raising it never lowers any token's level."""
        return self.tilt

    def _tensors(self):
        sc = ((self.scorer_in.weight, self.scorer_in.bias) if self.rank else ()) + (self.scorer.weight,
                                                                                  self.scorer.bias)
        names = ("w_down", "b_down", "w_up", "b_up") if self.rank else ("w", "b")
        return (("pos", self.pos), ("widths", self.widths), ("tilt", self.tilt), *zip(names, sc))

    def graph_form(self, dtype=None, rows=None):
        return fns.nested_router_mask, self._tensors()

    def bucket_form(self):
        """As CodebookRouter.bucket_form: the level id and the levels' +-30 logits table [P, G]."""
        t = self._tensors()
        return (fns.nested_level, t[2:]), (fns.nested_table, t[:2])

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return fns.nested_logits(h, *(t for _, t in self._tensors()))

    def relaxed(self, h: torch.Tensor, tau: float, noise: bool) -> torch.Tensor:
        sc = tuple(t for _, t in self._tensors()[3:])
        s = fns.scorer_scores(h, sc).float()  # [..., P]
        s = s + self.tilt * torch.arange(self.levels, device=s.device, dtype=s.dtype)
        if noise:
            u = torch.rand_like(s).clamp_(1e-10, 1 - 1e-7)
            s = s - torch.log(-torch.log(u))  # + Gumbel(0, 1)
        bits = self.level_masks().to(s.dtype)  # [P, G]
        soft = torch.softmax(s / tau, dim=-1) @ bits
        hard = F.embedding(s.argmax(-1), bits)
        return _StraightThroughTo.apply(hard, soft)


class ConstantRouter(_RouterBase):
    """Token-independent mask: logits = +-_BIG per group; costs no FLOPs."""

    def __init__(self, mask: torch.Tensor):
        super().__init__()
        mask = torch.as_tensor(mask, dtype=torch.bool).flatten()
        self.groups = mask.numel()
        self.register_buffer("mask", mask.clone())

    def graph_form(self, dtype=None, rows=None):
        return fns.constant_router_mask, (("mask", self.mask),)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        logits = torch.where(self.mask, _BIG, -_BIG).to(device=h.device, dtype=torch.float32)
        return logits.expand(*h.shape[:-1], self.groups)


class ReplayRouter(_RouterBase):
    """Replays masks recorded on one input: logits = +-_BIG from mask[..., G], for exactly that token shape.

    For checks that must not depend on router decisions that sit within rounding of 0: a compiled model
    and its eager reference compute router logits with different rounding (bf16, fusion order), so a
    live router can flip a group for some token, and in a deep random-weight model one flip changes
    everything downstream. Replaying the same recorded masks in both isolates kernel / pass error."""

    def __init__(self, mask: torch.Tensor):
        super().__init__()
        mask = torch.as_tensor(mask, dtype=torch.bool)
        if mask.dim() < 2:
            raise ValueError(f"ReplayRouter needs a mask [..., tokens, G], got shape {tuple(mask.shape)}")
        self.groups = mask.shape[-1]
        self.register_buffer("mask", mask.clone())

    def graph_form(self, dtype=None, rows=None):
        return fns.replay_router_mask, (("mask", self.mask),)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if tuple(h.shape[:-1]) != tuple(self.mask.shape[:-1]):
            raise ValueError(f"ReplayRouter: recorded masks are for tokens {tuple(self.mask.shape[:-1])}, "
                             f"got input {tuple(h.shape[:-1])}; replay only on the input they were recorded on")
        return torch.where(self.mask.to(h.device), _BIG, -_BIG).to(dtype=torch.float32)


LEARNED = (GroupRouter, PairRouter, CodebookRouter, NestedRouter)


def _init_group_router(spec: ModelSpec, cfg: WideConfig, groups: int, gen) -> GroupRouter:
    r = GroupRouter(spec.hidden_size, groups, cfg.router_hidden)
    with torch.no_grad():
        for lin in ([r.proj_in] if cfg.router_hidden else []):
            lin.weight.normal_(0.0, 1.0 / math.sqrt(lin.in_features), generator=gen)
            lin.bias.zero_()
        if cfg.router_init == "dense":
            r.proj.weight.normal_(0.0, 0.01, generator=gen)
            r.proj.bias.fill_(cfg.router_init_bias)
        else:
            r.proj.weight.normal_(0.0, 1.0 / math.sqrt(r.proj.in_features), generator=gen)
            r.proj.bias.zero_()
    return r


def _init_pair_router(spec: ModelSpec, cfg: WideConfig, groups: int, gen) -> PairRouter:
    r = PairRouter(spec.hidden_size, groups, cfg.router_rank)
    with torch.no_grad():
        r.down.weight.normal_(0.0, 1.0 / math.sqrt(spec.hidden_size), generator=gen)
        r.down.bias.zero_()
        r.up.bias.zero_()
        if cfg.router_init == "dense":
            # zero up-projection: every margin is exactly +router_init_bias, whatever the residual's scale
            r.up.weight.zero_()
            r.margin_bias().fill_(cfg.router_init_bias)
        else:
            r.up.weight.normal_(0.0, 1.0 / math.sqrt(cfg.router_rank), generator=gen)
    return r


def _init_codebook_router(spec: ModelSpec, cfg: WideConfig, groups: int, gen) -> CodebookRouter:
    rank = cfg.router_rank if cfg.router_recipe == "wide" else 0
    r = CodebookRouter(spec.hidden_size, groups, cfg.codebook_size, rank)
    with torch.no_grad():
        for lin in ([r.scorer_in] if rank else []) + [r.scorer]:
            lin.weight.normal_(0.0, 1.0 / math.sqrt(lin.in_features), generator=gen)
            lin.bias.zero_()
        if cfg.router_init == "dense":
            # every prototype all on (logits near +router_init_bias), slightly different so that the
            # relaxation's gradient already tells prototypes, and so the scorer's choices, apart
            b = cfg.router_init_bias
            r.prototypes.normal_(0.0, 0.1 * abs(b), generator=gen).add_(b)
        else:
            r.prototypes.normal_(0.0, 1.0, generator=gen)
    return r


def _init_nested_router(spec: ModelSpec, cfg: WideConfig, groups: int, gen) -> NestedRouter:
    rank = cfg.router_rank if cfg.router_recipe == "wide" else 0
    r = NestedRouter(spec.hidden_size, groups, cfg.nested_levels, rank)
    with torch.no_grad():
        for lin in ([r.scorer_in] if rank else []) + [r.scorer]:
            lin.weight.normal_(0.0, 1.0 / math.sqrt(lin.in_features), generator=gen)
            lin.bias.zero_()
        if cfg.router_init == "dense":  # the widest level wins by router_init_bias over every other
            r.scorer.weight.mul_(0.01)
            r.scorer.bias[-1] = cfg.router_init_bias
    return r


def group_importance(model, spec: ModelSpec, cfg: WideConfig) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer, a weight-based importance of each attention / FFN group of the dense `model`: for a group
    of q columns, ||q_proj rows||_F * ||o_proj columns||_F; for a group of FFN channels, the sum over its
    channels of ||up_proj row|| * ||down_proj column|| (how much a channel can move the output)."""
    from ..models.spec import decoder_layers

    geo = cfg.geometry(spec)
    attn, ffn = [], []
    with torch.no_grad():
        for layer in decoder_layers(model):
            q, o = layer.self_attn.q_proj.weight.float(), layer.self_attn.o_proj.weight.float()
            g, c = geo.groups("attn")
            attn.append(q.reshape(g, c, -1).pow(2).sum((1, 2)).sqrt() * o.reshape(-1, g, c).pow(2).sum((0, 2)).sqrt())
            up, down = layer.mlp.up_proj.weight.float(), layer.mlp.down_proj.weight.float()
            g, c = geo.groups("ffn")
            ffn.append((up.norm(dim=1) * down.norm(dim=0)).reshape(g, c).sum(1))
    return attn, ffn


def attention_order(importance: torch.Tensor, geo) -> torch.Tensor:
    """Head groups most important first, keeping the groups of one KV head together when groups are finer than
    KV heads (KV heads by their groups' total importance, then the groups within each), so a nested width
    level ends on whole KV heads as often as the levels allow."""
    per_kv = (geo.num_heads // geo.num_kv_heads) // geo.head_group_size if geo.num_kv_heads else 0
    if per_kv <= 1 or (geo.num_heads // geo.num_kv_heads) % geo.head_group_size:
        return torch.argsort(importance, descending=True, stable=True)
    blocks = importance.reshape(-1, per_kv)                                   # [Hkv, groups per KV head]
    kv_first = torch.argsort(blocks.sum(1), descending=True, stable=True)
    within = torch.argsort(blocks, dim=1, descending=True, stable=True)       # [Hkv, per_kv]
    return (kv_first[:, None] * per_kv + within[kv_first]).reshape(-1)


class Routers(nn.Module):
    """All routers of one model: `attn[i]` and `ffn[i]` for decoder layer i."""

    def __init__(self, spec: ModelSpec, cfg: WideConfig, attn: Sequence[nn.Module], ffn: Sequence[nn.Module],
                 kind: str = "learned"):
        super().__init__()
        cfg.validate(spec)
        if len(attn) != spec.num_layers or len(ffn) != spec.num_layers:
            raise ValueError(f"need one attn and one ffn router per layer ({spec.num_layers}), "
                             f"got {len(attn)} / {len(ffn)}")
        self.spec, self.cfg, self.kind = spec, cfg, kind
        self.attn = nn.ModuleList(attn)
        self.ffn = nn.ModuleList(ffn)
        self.tau: float | None = None  # None: hard decisions; float: Gumbel-sigmoid temperature
        self.noise = True
        self.name: str | None = None  # set for shipped routers

    # -- constructors ------------------------------------------------------------------------------
    @classmethod
    def init(cls, model, cfg: WideConfig, seed: int | None = 0) -> "Routers":
        """Fresh routers for `model` (an HF Llama-family model or a ModelSpec).

        cfg.structure "codebook" makes CodebookRouters (scorer per cfg.router_recipe), "nested" NestedRouters
        (their group order from `group_importance` of `model`'s weights); "free": cfg.router_recipe
        picks the router class (GroupRouter / PairRouter). cfg.router_init == "dense"
        (default): every group starts on (margin +cfg.router_init_bias, output weights ~0), so a fresh router
        reproduces the dense model and training starts from it. "random": random projections, bias 0; use
        `calibrate_` to hit a capacity on real tokens.
        """
        spec = model_spec(model)
        cfg = cfg.for_model(spec)
        cfg.validate(spec)
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        ga, gf = cfg.num_head_groups(spec), cfg.num_ffn_groups(spec)

        if cfg.router_recipe == "wide" and cfg.router_hidden:
            raise ValueError("router_hidden applies to the linear recipe; the wide recipe's bottleneck is "
                             "router_rank (set router_hidden=0)")
        if cfg.structure == "codebook":
            make_one = _init_codebook_router
        elif cfg.structure == "nested":
            make_one = _init_nested_router
        else:
            make_one = _init_pair_router if cfg.router_recipe == "wide" else _init_group_router

        def make(groups: int):
            return make_one(spec, cfg, groups, gen)

        routers = cls(spec, cfg, [make(ga) for _ in range(spec.num_layers)],
                      [make(gf) for _ in range(spec.num_layers)])
        if cfg.structure == "nested" and isinstance(model, nn.Module):
            # the order, once, from the dense weights (a ModelSpec alone keeps the identity order)
            geo = cfg.geometry(spec)
            for kind, imp in zip(("attn", "ffn"), group_importance(model, spec, cfg)):
                for r, x in zip(getattr(routers, kind), imp):
                    order = attention_order(x.cpu(), geo) if kind == "attn" else \
                        torch.argsort(x.cpu(), descending=True, stable=True)
                    r.set_order_(order)
        return routers

    @classmethod
    def constant(cls, model, cfg: WideConfig, attn: Sequence, ffn: Sequence) -> "Routers":
        """Token-independent masks: attn[i] bool[G_a], ffn[i] bool[G_f] for every layer i."""
        spec = model_spec(model)
        cfg = cfg.for_model(spec)
        cfg.validate(spec)
        ga, gf = cfg.num_head_groups(spec), cfg.num_ffn_groups(spec)
        for name, masks, g in (("attn", attn, ga), ("ffn", ffn, gf)):
            if len(masks) != spec.num_layers:
                raise ValueError(f"Routers.constant: {name} needs {spec.num_layers} masks (one per layer), "
                                 f"got {len(masks)}")
            for i, m in enumerate(masks):
                if torch.as_tensor(m).numel() != g:
                    raise ValueError(f"Routers.constant: {name}[{i}] has {torch.as_tensor(m).numel()} entries, "
                                     f"expected {g} groups")
        return cls(spec, cfg, [ConstantRouter(m) for m in attn], [ConstantRouter(m) for m in ffn],
                   kind="constant")

    @classmethod
    def replay(cls, model, cfg: WideConfig, recorded: dict) -> "Routers":
        """Routers that replay masks recorded with `record_masks` over ONE forward call:
        recorded["attn"][i] / ["ffn"][i] = [mask [..., T, G]] (a list of one tensor, or the tensor)."""
        spec = model_spec(model)
        cfg = cfg.for_model(spec)
        cfg.validate(spec)

        def one(kind, i, groups):
            m = recorded[kind][i]
            if isinstance(m, (list, tuple)):
                if len(m) != 1:
                    raise ValueError(f"Routers.replay: {kind}[{i}] holds {len(m)} forward calls; record exactly one")
                m = m[0]
            if m.shape[-1] != groups:
                raise ValueError(f"Routers.replay: {kind}[{i}] has {m.shape[-1]} groups, expected {groups}")
            return ReplayRouter(m.detach() > 0.5 if m.dtype != torch.bool else m.detach())

        L = spec.num_layers
        return cls(spec, cfg, [one("attn", i, cfg.num_head_groups(spec)) for i in range(L)],
                   [one("ffn", i, cfg.num_ffn_groups(spec)) for i in range(L)], kind="replay")

    def split_bf16_(self) -> "Routers":
        """Run every linear router on bf16 inputs as one bf16 tensor-core GEMM over its fp32 weight split in
        a bf16 pair (split_logits): fp32 decisions up to rounding, at bf16 speed. The fp32 weights stay the
        source of truth (saved, trained); call again after changing them. Routers with a hidden layer keep
        fp32 (their second input is not bf16-exact). Returns self."""
        for r in list(self.attn) + list(self.ffn):
            if isinstance(r, GroupRouter):
                if r.proj.weight.dtype != torch.float32:
                    raise ValueError("split_bf16_ needs fp32 router weights (the split keeps their precision); "
                                     f"these are {r.proj.weight.dtype}")
                r.w_split = None if r.hidden else split_bf16(r.proj.weight)
        return self

    # -- decisions ---------------------------------------------------------------------------------
    def decide(self, router: nn.Module, h: torch.Tensor) -> torch.Tensor:
        """Mask for h: bool [..., G] when hard, float 0/1 with straight-through gradient when relaxed."""
        if self.tau is None:
            return router(h) > 0
        return router.relaxed(h, self.tau, self.noise and self.training)

    @contextmanager
    def relax(self, tau: float, noise: bool = True) -> Iterator["Routers"]:
        """Within this context, decisions are relaxed (each router's `relaxed`: Gumbel with temperature tau,
        hard forward, straight-through gradient)."""
        old = (self.tau, self.noise)
        self.tau, self.noise = float(tau), noise
        try:
            yield self
        finally:
            self.tau, self.noise = old

    def flops_per_token(self) -> tuple[list[int], list[int]]:
        return [r.flops_per_token() for r in self.attn], [r.flops_per_token() for r in self.ffn]

    # -- persistence -------------------------------------------------------------------------------
    def _metadata(self) -> dict[str, str]:
        types = [type(r).__name__ for r in list(self.attn) + list(self.ffn)]
        return {"format": str(FORMAT_VERSION), "config": self.cfg.to_json(), "spec": self.spec.to_json(),
                "fingerprint": self.spec.fingerprint(), "kind": self.kind, "router_types": json.dumps(types),
                "structure": self.cfg.structure,
                "name": self.name or ""}

    def save(self, path) -> None:
        from safetensors.torch import save_file

        if self.kind == "replay":
            raise ValueError("replay routers hold masks for one recorded input (a check tool); they are not saved")
        tensors = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path), metadata=self._metadata())

    @classmethod
    def load(cls, path, model, structure: str | None = None) -> "Routers":
        """Load routers saved by `save` onto `model`; ValueError if they were made for another shape, or, when
        `structure` is given ("free" / "codebook"), if the checkpoint holds routers of another structure."""
        from safetensors import safe_open

        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"router checkpoint {path} does not exist")
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        if "spec" not in meta or "config" not in meta:
            raise ValueError(f"{path} is not a wide_compile router checkpoint (no config/spec metadata)")
        saved_spec = ModelSpec.from_json(meta["spec"])
        cfg = _checkpoint_config(path, meta, structure)
        spec = model_spec(model)
        if saved_spec != spec:
            diff = {k: (getattr(saved_spec, k), getattr(spec, k)) for k in saved_spec.__dataclass_fields__
                    if getattr(saved_spec, k) != getattr(spec, k)}
            raise ValueError(f"router checkpoint {path} was made for another model shape "
                             f"(fingerprint {meta.get('fingerprint')} vs {spec.fingerprint()}); "
                             f"differences (checkpoint, model): {diff}")
        if meta.get("kind") == "constant":
            L = spec.num_layers
            routers = cls.constant(spec, cfg, [tensors[f"attn.{i}.mask"] for i in range(L)],
                                   [tensors[f"ffn.{i}.mask"] for i in range(L)])
        else:
            routers = cls.init(spec, cfg, seed=None)
        if cfg.structure == "codebook":  # codebooks saved before the width tilt existed: tilt 0, the same picks
            tensors.update({k: torch.zeros_like(v) for k, v in routers.state_dict().items()
                            if k.endswith(".tilt") and k not in tensors})
        routers.load_state_dict(tensors, strict=True)
        routers.name = meta.get("name") or None
        return routers

    # -- shipped routers ---------------------------------------------------------------------------
    @staticmethod
    def available() -> list[str]:
        """Names of the routers shipped inside the package (see wide_compile/pretrained/)."""
        from .. import pretrained

        return pretrained.available()

    @classmethod
    def pretrained(cls, name: str, model) -> "Routers":
        from .. import pretrained

        r = cls.load(pretrained.path(name), model)
        r.name = name
        return r

    # -- calibration -------------------------------------------------------------------------------
    def calibrate_(self, model, input_ids: torch.Tensor, capacity: float | None = None,
                   attention_mask: torch.Tensor | None = None) -> "Routers":
        """Per-group bias calibration to a capacity (see routing.calibrate.calibrate_groups_)."""
        from .calibrate import calibrate_groups_

        return calibrate_groups_(self, model, input_ids, capacity, attention_mask)


def _checkpoint_config(path, meta: dict, structure: str | None) -> WideConfig:
    """The WideConfig a checkpoint was saved with, checked against the structure the caller asks for."""
    from ..config import STRUCTURES

    if structure is not None and structure not in STRUCTURES:
        raise ValueError(f"Routers.load: structure must be one of {STRUCTURES} (or None: any), got {structure!r}")
    saved = json.loads(meta["config"]).get("structure", "free")  # checkpoints before structures were free
    if meta.get("structure", saved) != saved:
        raise ValueError(f"router checkpoint {path} is inconsistent: its metadata says structure "
                         f"{meta['structure']!r}, its config {saved!r}")
    if saved not in STRUCTURES:
        raise ValueError(f"router checkpoint {path} holds routers of structure {saved!r}, which this version of "
                         f"wide_compile cannot load (it knows {STRUCTURES}); use the version that saved it")
    if structure is not None and saved != structure:
        raise ValueError(f"router checkpoint {path} holds structure={saved!r} routers, but structure={structure!r} "
                         f"was asked for; load routers trained with structure={structure!r} (or pass "
                         f"structure={saved!r})")
    return WideConfig.from_json(meta["config"])


def gumbel_sigmoid_st(logits: torch.Tensor, tau: float, noise: bool = True) -> torch.Tensor:
    """Straight-through Gumbel-sigmoid: forward hard (0/1), backward d sigmoid((logits+g)/tau)."""
    if noise:
        u = torch.rand_like(logits).clamp_(1e-6, 1 - 1e-6)
        logits = logits + (torch.log(u) - torch.log1p(-u))
    soft = torch.sigmoid(logits / tau)
    return _StraightThrough.apply(soft)


class _StraightThroughTo(torch.autograd.Function):
    """Forward: `hard` exactly; backward: the gradient goes to `soft` unchanged (a straight-through
    estimator whose hard value is not a threshold of soft)."""

    @staticmethod
    def forward(ctx, hard, soft):
        return hard.clone()

    @staticmethod
    def backward(ctx, grad):
        return None, grad


class _StraightThrough(torch.autograd.Function):
    """Forward: exact 0/1 (soft > 0.5); backward: identity onto `soft` (`hard + soft - soft.detach()`
    would leave values like 0.99999994 in the forward)."""

    @staticmethod
    def forward(ctx, soft):
        return (soft > 0.5).to(soft.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad
