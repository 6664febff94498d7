"""Routers: per decoder layer, one attention-group router and one FFN-group router.

A router reads the normalized block input h[..., D] (the input of q_proj / gate_proj) and emits
logits[..., G]. Inference: mask = logits > 0 (deterministic). Training: `Routers.relax(tau)` switches
to a Gumbel-sigmoid relaxation with a straight-through estimator (hard 0/1 forward, sigmoid gradient).
"""
from __future__ import annotations

import json
import math
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

import torch
from torch import nn

from ..config import WideConfig
from ..models.spec import ModelSpec, model_spec

FORMAT_VERSION = 1
_BIG = 30.0  # logit magnitude of a constant router: sigmoid(30) == 1 in fp32


# Fewest tokens for which a split-bf16 router (Routers.split_bf16_) runs its bf16 pair. A single token
# reads the same bytes either way (fp32 [G, D] or bf16 [2G, D]) and gains nothing from tensor cores, and on
# the H200 the fp32 GEMV was faster: Llama-3.1-8B-shape decode at batch 1 (32 layers, capacity 0.5) took
# 4.96 ms with fp32 routers and 5.26 ms with the pair (dense Inductor 5.93 / 5.88 ms in the same runs).
# From 8 tokens on the pair wins (batch-8 decode 1.37 -> 1.31 ms in one call; 2048-token prefill 52.3 -> 47.4 ms
# in two runs whose dense times are within 3 %);
# 2-7 tokens are not timed.
# benchmarks/results/router-dtype/ has the runs.
SPLIT_MIN_ROWS = 2


def split_bf16(w: torch.Tensor) -> torch.Tensor:
    """fp32 weight [G, D] -> bf16 [2G, D]: rows :G = bf16(w), rows G: = bf16(w - bf16(w)); the pair holds w
    to about 2^-16 relative (16 mantissa bits instead of bf16's 8)."""
    w = w.detach().float()
    hi = w.to(torch.bfloat16)
    return torch.cat([hi, (w - hi.float()).to(torch.bfloat16)])


def split_logits(h: torch.Tensor, w2: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """Logits of a linear router held as a bf16 pair (split_bf16), for bf16 inputs: one tensor-core GEMM
    h @ [hi; lo]^T with fp32 accumulation and fp32 output (aten::mm.dtype on CUDA), then hi + lo in fp32.
    A product of two bf16 values is exact in fp32, so this is the fp32 router up to summation order and the
    2^-16 weight split, at bf16 GEMM speed (fp32 routers run without tensor cores: 4.6 ms of a 52 ms
    Llama-3.1-8B-shape prefill on the H200)."""
    G = w2.shape[0] // 2
    x = h.reshape(-1, h.shape[-1])
    if x.is_cuda:
        y = torch.mm(x, w2.t(), out_dtype=torch.float32)
    else:  # the same arithmetic where mm.dtype has no kernel (CPU)
        y = x.float() @ w2.float().t()
    out = y.narrow(1, 0, G) + y.narrow(1, G, G)
    if b is not None:
        out = out + b.float()
    return out.reshape(*h.shape[:-1], G)


class GroupRouter(nn.Module):
    """h[..., D] -> logits[..., G] (float32). Linear, or D -> hidden -> G with SiLU."""

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

    def split_for(self, dtype: torch.dtype, rows: int | None = None) -> torch.Tensor | None:
        """The bf16 weight pair (Routers.split_bf16_) when it applies to inputs of `dtype` with `rows` tokens
        (None: unknown; in a traced graph a symbolic size, which Dynamo guarantees is >= 2), else None: the
        fp32 router then runs."""
        ok = self.w_split is not None and dtype == torch.bfloat16 == self.w_split.dtype
        if rows is not None and rows < SPLIT_MIN_ROWS:
            ok = False
        return self.w_split if ok else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        w2 = self.split_for(h.dtype, h.numel() // max(h.shape[-1], 1))
        if w2 is not None:
            return split_logits(h, w2, self.proj.bias)
        x = h.to(self.proj.weight.dtype)
        if self.hidden:
            x = nn.functional.silu(self.proj_in(x))
        return self.proj(x)


class ConstantRouter(nn.Module):
    """Token-independent mask: logits = +-_BIG per group; costs no FLOPs."""

    def __init__(self, mask: torch.Tensor):
        super().__init__()
        mask = torch.as_tensor(mask, dtype=torch.bool).flatten()
        self.groups = mask.numel()
        self.register_buffer("mask", mask.clone())

    def flops_per_token(self) -> int:
        return 0

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        logits = torch.where(self.mask, _BIG, -_BIG).to(device=h.device, dtype=torch.float32)
        return logits.expand(*h.shape[:-1], self.groups)


class ReplayRouter(nn.Module):
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

    def flops_per_token(self) -> int:
        return 0

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if tuple(h.shape[:-1]) != tuple(self.mask.shape[:-1]):
            raise ValueError(f"ReplayRouter: recorded masks are for tokens {tuple(self.mask.shape[:-1])}, "
                             f"got input {tuple(h.shape[:-1])}; replay only on the input they were recorded on")
        return torch.where(self.mask.to(h.device), _BIG, -_BIG).to(dtype=torch.float32)


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

        cfg.router_init == "dense" (default): every group starts on (bias +cfg.router_init_bias, weights
        ~N(0, 0.01^2)), so a fresh router reproduces the dense model and training starts from it.
        "random": weights ~N(0, 1/D), bias 0; use `calibrate_` to hit a capacity on real tokens.
        """
        spec = model_spec(model)
        cfg.validate(spec)
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        ga, gf = cfg.num_head_groups(spec), cfg.num_ffn_groups(spec)

        def make(groups: int) -> GroupRouter:
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

        return cls(spec, cfg, [make(ga) for _ in range(spec.num_layers)],
                   [make(gf) for _ in range(spec.num_layers)])

    @classmethod
    def constant(cls, model, cfg: WideConfig, attn: Sequence, ffn: Sequence) -> "Routers":
        """Token-independent masks: attn[i] bool[G_a], ffn[i] bool[G_f] for every layer i."""
        spec = model_spec(model)
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
        logits = router(h)
        if self.tau is None:
            return logits > 0
        return gumbel_sigmoid_st(logits, self.tau, self.noise and self.training)

    @contextmanager
    def relax(self, tau: float, noise: bool = True) -> Iterator["Routers"]:
        """Within this context, decisions are Gumbel-sigmoid (temperature tau) with straight-through."""
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
                "name": self.name or ""}

    def save(self, path) -> None:
        from safetensors.torch import save_file

        if self.kind == "replay":
            raise ValueError("replay routers hold masks for one recorded input (a check tool); they are not saved")
        tensors = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path), metadata=self._metadata())

    @classmethod
    def load(cls, path, model) -> "Routers":
        """Load routers saved by `save` onto `model`; ValueError if they were made for another shape."""
        from safetensors import safe_open

        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"router checkpoint {path} does not exist")
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        if "spec" not in meta or "config" not in meta:
            raise ValueError(f"{path} is not a wide_compile router checkpoint (no config/spec metadata)")
        saved_spec, cfg = ModelSpec.from_json(meta["spec"]), WideConfig.from_json(meta["config"])
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
    @torch.no_grad()
    def calibrate_(self, model, input_ids: torch.Tensor, capacity: float | None = None,
                   attention_mask: torch.Tensor | None = None) -> "Routers":
        """Set router biases so every group's on-rate on these tokens is the uniform rate that gives
        `capacity` (default cfg.capacity). Used for random-weight benchmark models; trained routers
        should not need it."""
        from .attach import record_logits, routed
        from .capacity import FlopCost

        cap = self.cfg.capacity if capacity is None else capacity
        rate = FlopCost.from_routers(self).uniform_rate(cap)
        with routed(model, self), record_logits(model) as rec:  # these routers, whatever was attached
            model(input_ids=input_ids, attention_mask=attention_mask)
        valid = None if attention_mask is None else attention_mask.bool().reshape(-1)
        for kind, routers in (("attn", self.attn), ("ffn", self.ffn)):
            for i, r in enumerate(routers):
                if not isinstance(r, GroupRouter):
                    raise ValueError("calibrate_ needs learned (GroupRouter) routers")
                lg = rec[kind][i].reshape(-1, r.groups).float()
                if valid is not None:
                    lg = lg[valid]
                # per group: shift so that a fraction `rate` of tokens has logit > 0
                q = torch.quantile(lg, 1.0 - rate, dim=0) if rate < 1 else lg.min(0).values - 1.0
                r.proj.bias -= q.to(r.proj.bias.dtype)
        return self


def gumbel_sigmoid_st(logits: torch.Tensor, tau: float, noise: bool = True) -> torch.Tensor:
    """Straight-through Gumbel-sigmoid: forward hard (0/1), backward d sigmoid((logits+g)/tau)."""
    if noise:
        u = torch.rand_like(logits).clamp_(1e-6, 1 - 1e-6)
        logits = logits + (torch.log(u) - torch.log1p(-u))
    soft = torch.sigmoid(logits / tau)
    return _StraightThrough.apply(soft)


class _StraightThrough(torch.autograd.Function):
    """Forward: exact 0/1 (soft > 0.5); backward: identity onto `soft` (`hard + soft - soft.detach()`
    would leave values like 0.99999994 in the forward)."""

    @staticmethod
    def forward(ctx, soft):
        return (soft > 0.5).to(soft.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad
