"""attach / detach: make an HF Llama-family model's own eager forward execute WIDE exactly.

The eager reference (the oracle for kernels and compiled graphs), per decoder layer:
  * the attention router reads q_proj's input (the normalized attention input h; router_input "normed") or
    input_layernorm's input (the residual stream; "residual") -> mask_a[..., G_a];
    o_proj's input columns of inactive head groups are zeroed, so those heads contribute exactly 0.
    q/k/v are computed densely: K and V must be (KV cache stays complete); the inactive q rows only
    feed outputs that are zeroed before o_proj, so computing them changes nothing.
  * the FFN router reads gate_proj's input (or post_attention_layernorm's input) -> mask_f[..., G_f];
    down_proj's input channels of inactive
    groups are zeroed, so those channels contribute exactly 0.
Implemented with forward pre-hooks, so it works whatever the attention implementation, cache class or
transformers version. `detach` removes every hook and the routers: the dense model is back bit for bit.
LoRA (peft) should be applied before `attach` so the hooks sit on the outer (LoRA) modules.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from ..models.spec import attn_input_module, decoder_layers, mlp_input_module, model_spec

_ATTR = "_wide_state"


class _LayerState:
    __slots__ = ("attn", "ffn")

    def __init__(self):
        self.attn = None
        self.ffn = None


class _Attached:
    def __init__(self, routers, handles: list, states: list[_LayerState]):
        self.routers, self.handles, self.states = routers, handles, states
        self.recorders: list[dict] = []


def _expand(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # x: [..., G*gs], mask: [..., G] -> x with the columns of inactive groups zeroed
    g = mask.shape[-1]
    xs = x.unflatten(-1, (g, x.shape[-1] // g))
    return (xs * mask.to(x.dtype).unsqueeze(-1)).flatten(-2)


def _is_routers(obj) -> bool:
    # duck-typed so that this module does not import routers.py (which imports calibration, which imports
    # this module)
    return isinstance(obj, nn.Module) and all(hasattr(obj, a) for a in ("decide", "spec", "cfg", "attn", "ffn"))


def _route_points(layer: nn.Module, i: int, router_input: str) -> tuple[nn.Module, nn.Module]:
    """The modules whose input the attention / FFN routers of decoder layer i read."""
    if router_input == "normed":
        return attn_input_module(layer), mlp_input_module(layer)
    na = getattr(layer, "input_layernorm", None)
    # Gemma2-style layers norm the attention output with post_attention_layernorm and the MLP's input with
    # pre_feedforward_layernorm
    nf = getattr(layer, "pre_feedforward_layernorm", None) or getattr(layer, "post_attention_layernorm", None)
    if na is None or nf is None:
        raise ValueError(f"decoder layer {i} ({type(layer).__name__}) has no input_layernorm / "
                         "post_attention_layernorm, so the residual stream before the norms cannot be routed; "
                         "use routers with router_input='normed'")
    return na, nf


def attach(model: nn.Module, routers) -> nn.Module:
    """Route `model` with `routers` (in place; returns the model). Re-attaching replaces the routers."""
    if not _is_routers(routers):
        raise TypeError(f"attach expects wide_compile.Routers, got {type(routers).__name__}")
    spec = model_spec(model)
    if spec != routers.spec:
        raise ValueError(f"routers were made for another model shape: routers {routers.spec}, model {spec}")
    if is_attached(model):
        detach(model)
    p = next(model.parameters())
    routers.to(device=p.device)
    model.wide_routers = routers  # a submodule: moves with model.to(), visible to torch.compile
    handles, states = [], []
    att = _Attached(routers, handles, states)

    for i, layer in enumerate(decoder_layers(model)):
        st = _LayerState()
        states.append(st)

        route_a, mask_a = _route_hook(att, "attn", i, st), _mask_hook("attn", st)
        route_f, mask_f = _route_hook(att, "ffn", i, st), _mask_hook("ffn", st)
        at_a, at_f = _route_points(layer, i, routers.cfg.router_input)
        handles += [at_a.register_forward_pre_hook(route_a, with_kwargs=True),
                    layer.self_attn.o_proj.register_forward_pre_hook(mask_a, with_kwargs=True),
                    at_f.register_forward_pre_hook(route_f, with_kwargs=True),
                    layer.mlp.down_proj.register_forward_pre_hook(mask_f, with_kwargs=True)]
    object.__setattr__(model, _ATTR, att)
    return model


def _route_hook(att: _Attached, kind: str, i: int, st: _LayerState):
    """Pre-hook on the router's input module: decide layer i's `kind` mask from that module's input h."""
    router = getattr(att.routers, kind)[i]

    def hook(mod, args, kwargs):
        h = args[0] if args else next(iter(kwargs.values()))
        mask = att.routers.decide(router, h)
        setattr(st, kind, mask)
        for rec in att.recorders:
            rec[kind][i].append(router(h) if rec.get("_logits") else mask)
        return None

    return hook


def _mask_hook(kind: str, st: _LayerState):
    """Pre-hook for o_proj / down_proj: zero the input columns of the groups that mask switched off."""

    def hook(mod, args, kwargs):
        mask = getattr(st, kind)
        # read once per forward: cleared, so a compiled graph does not keep every layer's mask alive as an output
        # (Dynamo replays attribute writes after the graph), which also keeps Inductor from fusing the threshold
        # into the kernel that applies the mask
        setattr(st, kind, None)
        if args:
            return (_expand(args[0], mask), *args[1:]), kwargs
        return args, {**kwargs, "input": _expand(kwargs["input"], mask)}

    return hook


def detach(model: nn.Module) -> nn.Module:
    """Remove WIDE routing from `model` (no-op if none is attached)."""
    att = getattr(model, _ATTR, None)
    if att is None:
        return model
    for h in att.handles:
        h.remove()
    object.__delattr__(model, _ATTR)
    if "wide_routers" in model._modules:
        del model._modules["wide_routers"]
    return model


def is_attached(model: nn.Module) -> bool:
    return getattr(model, _ATTR, None) is not None


def attached_routers(model: nn.Module):
    att = getattr(model, _ATTR, None)
    return None if att is None else att.routers


@contextmanager
def routed(model: nn.Module, routers) -> Iterator[nn.Module]:
    """Run `model` with `routers` attached (None: dense) inside the block, then put back whatever was
    attached before (other routers, or none)."""
    prev = attached_routers(model)
    if routers is None:
        detach(model)
    elif routers is not prev:
        attach(model, routers)
    try:
        yield model
    finally:
        if prev is None:
            detach(model)
        elif attached_routers(model) is not prev:
            attach(model, prev)


def _require(model) -> _Attached:
    att = getattr(model, _ATTR, None)
    if att is None:
        raise ValueError("no WIDE routers are attached to this model: call wide_compile.attach(model, routers) "
                         "first (or pass routers=... to optimize)")
    return att


@contextmanager
def record_masks(model: nn.Module) -> Iterator[dict]:
    """Collect the masks each router emits: rec["attn"][layer] / rec["ffn"][layer] are lists with one
    tensor [..., G] per forward call (bool when hard, float 0/1 with gradient when relaxed)."""
    att = _require(model)
    L = len(att.states)
    rec = {"attn": [[] for _ in range(L)], "ffn": [[] for _ in range(L)]}
    att.recorders.append(rec)
    try:
        yield rec
    finally:
        att.recorders.remove(rec)


@contextmanager
def record_logits(model: nn.Module) -> Iterator[dict]:
    """Like record_masks, but collects router logits (one tensor per layer: calls concatenated on exit
    along the token axis is left to the caller; for a single forward rec[kind][i] is that tensor)."""
    att = _require(model)
    L = len(att.states)
    raw = {"attn": [[] for _ in range(L)], "ffn": [[] for _ in range(L)], "_logits": True}
    att.recorders.append(raw)
    out = {"attn": [None] * L, "ffn": [None] * L}
    try:
        yield out
    finally:
        att.recorders.remove(raw)
        for k in ("attn", "ffn"):
            for i in range(L):
                out[k][i] = torch.cat([t.reshape(-1, t.shape[-1]) for t in raw[k][i]]) if raw[k][i] else None
