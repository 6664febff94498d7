"""ModelSpec: the shapes WIDE needs from a Llama-family model, and where its layers live."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

import torch
from torch import nn

# a decoder layer's projections: separate q/k/v (Llama, ...) or one fused qkv_proj (Phi-3); separate gate/up or
# one fused gate_up_proj (Phi-3)
_ATTN, _ATTN_FUSED = ("q_proj", "k_proj", "v_proj", "o_proj"), ("qkv_proj", "o_proj")
_MLP, _MLP_FUSED = ("gate_proj", "up_proj", "down_proj"), ("gate_up_proj", "down_proj")

SUPPORTED = ("wide_compile supports dense Llama-family causal LMs: decoder layers at model.model.layers, each with "
             "self_attn.{q,k,v,o}_proj (or a fused qkv_proj + o_proj) and a gated MLP mlp.{gate,up,down}_proj (or "
             "a fused gate_up_proj + down_proj), e.g. Llama, Mistral, Qwen2, Qwen3, OLMo, OLMo2, Granite, StableLM, "
             "Cohere, Gemma, Gemma2, Phi-3, SmolLM2; a model with another layout but that structure (e.g. "
             "gpt-fast style) compiles with wide_compile.optimize(model, routers) and routers built from a "
             "ModelSpec")


class UnsupportedModelError(ValueError):
    """The model is not a dense Llama-family causal LM (mixture-of-experts MLPs, GPT-2-style blocks, ...)."""

@dataclass(frozen=True)
class ModelSpec:
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def q_size(self) -> int:  # rows of q_proj = columns of o_proj
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def fingerprint(self) -> str:
        blob = json.dumps(dataclasses.asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, s: str) -> "ModelSpec":
        return cls(**json.loads(s))


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a Llama-family causal LM, each with .self_attn.{q,k,v,o}_proj (or qkv_proj, o_proj)
    and .mlp.{gate,up,down}_proj (or gate_up_proj, down_proj). Raises UnsupportedModelError (a ValueError)
    saying what is supported otherwise."""
    base = model
    for attr in ("base_model", "model"):  # peft wrapper -> CausalLM -> backbone
        while hasattr(base, attr) and isinstance(getattr(base, attr), nn.Module) and not hasattr(base, "layers"):
            nxt = getattr(base, attr)
            if nxt is base:
                break
            base = nxt
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise UnsupportedModelError(f"{type(model).__name__}: decoder layers not recognised (no non-empty "
                                    f"model.model.layers). {SUPPORTED}")
    for i, layer in enumerate(layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if mlp is not None and hasattr(mlp, "experts"):
            raise UnsupportedModelError(
                f"{type(model).__name__}: decoder layer {i} has a mixture-of-experts MLP ({type(mlp).__name__}); "
                f"WIDE routes the channel groups of one dense MLP, and experts are not supported. {SUPPORTED}")
        missing = _missing(attn, "self_attn", _ATTN, _ATTN_FUSED) + _missing(mlp, "mlp", _MLP, _MLP_FUSED)
        if missing:
            raise UnsupportedModelError(
                f"{type(model).__name__}: decoder layer {i} ({type(layer).__name__}) is not a Llama-style layer; "
                f"missing {missing}. {SUPPORTED}")
    return list(layers)


def _missing(mod, prefix: str, split: tuple, fused: tuple) -> list[str]:
    """What `mod` lacks of the split projections, or [] when it has them or the fused ones."""
    if mod is not None and all(hasattr(mod, n) for n in fused):
        return []
    return [f"{prefix}.{n}" for n in split if mod is None or not hasattr(mod, n)]


def attn_input_module(layer: nn.Module) -> nn.Module:
    """The module whose input is the attention block's normalized input: q_proj, or the fused qkv_proj."""
    a = layer.self_attn
    return a.q_proj if hasattr(a, "q_proj") else a.qkv_proj


def mlp_input_module(layer: nn.Module) -> nn.Module:
    """The module whose input is the MLP's normalized input: gate_proj, or the fused gate_up_proj."""
    m = layer.mlp
    return m.gate_proj if hasattr(m, "gate_proj") else m.gate_up_proj


def _weight(mod: nn.Module) -> torch.Tensor:
    w = getattr(mod, "weight", None)
    if w is None and hasattr(mod, "base_layer"):  # peft LoRA wrapper
        w = mod.base_layer.weight
    return w


def model_spec(model) -> ModelSpec:
    """ModelSpec of an HF Llama-family model (read from the layer shapes), or `model` if it is one."""
    if isinstance(model, ModelSpec):
        return model
    layers = decoder_layers(model)
    attn, mlp = layers[0].self_attn, layers[0].mlp
    cfg = getattr(model, "config", None)
    x_w = _weight(attn_input_module(layers[0]))  # q rows, or q/k/v rows of the fused projection
    n_heads = getattr(cfg, "num_attention_heads", None) or getattr(attn, "num_heads", None)
    head_dim = getattr(attn, "head_dim", None) or getattr(cfg, "head_dim", None)
    if head_dim is None and n_heads:
        head_dim = (x_w.shape[0] if hasattr(attn, "q_proj") else getattr(cfg, "hidden_size", 0)) // n_heads
    if hasattr(attn, "q_proj"):
        q_rows, kv_rows = x_w.shape[0], _weight(attn.k_proj).shape[0]
    else:  # fused [q; k; v] rows
        q_rows = (n_heads or 0) * (head_dim or 0)
        kv_rows = (x_w.shape[0] - q_rows) // 2
    if not n_heads or not head_dim or q_rows % head_dim or kv_rows % head_dim or kv_rows <= 0:
        raise ValueError(f"{type(model).__name__}: cannot read the number of attention heads")
    return ModelSpec(
        num_layers=len(layers),
        hidden_size=x_w.shape[1],
        intermediate_size=_weight(mlp.down_proj).shape[1],
        num_heads=q_rows // head_dim,
        num_kv_heads=kv_rows // head_dim,
        head_dim=head_dim,
    )
