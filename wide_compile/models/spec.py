"""ModelSpec: the shapes WIDE needs from a Llama-family model, and where its layers live."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

import torch
from torch import nn

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


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
    """The decoder layers of a Llama-family causal LM, each with .self_attn.{q,k,v,o}_proj and
    .mlp.{gate,up,down}_proj. Raises ValueError naming what is missing otherwise."""
    base = model
    for attr in ("base_model", "model"):  # peft wrapper -> CausalLM -> backbone
        while hasattr(base, attr) and isinstance(getattr(base, attr), nn.Module) and not hasattr(base, "layers"):
            nxt = getattr(base, attr)
            if nxt is base:
                break
            base = nxt
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError(
            f"{type(model).__name__}: decoder layers not recognised (expected model.model.layers, a non-empty "
            "ModuleList, as in Llama/Mistral/Qwen2/SmolLM causal LMs). For other traced Llama-style graphs use "
            "wide_compile.optimize(model, routers) with routers built from a ModelSpec."
        )
    for i, layer in enumerate(layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        missing = [f"self_attn.{n}" for n in _ATTN if attn is None or not hasattr(attn, n)]
        missing += [f"mlp.{n}" for n in _MLP if mlp is None or not hasattr(mlp, n)]
        if missing:
            raise ValueError(
                f"{type(model).__name__}: decoder layer {i} ({type(layer).__name__}) is not a Llama-style layer; "
                f"missing {missing}"
            )
    return list(layers)


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
    q_w, k_w, g_w = _weight(attn.q_proj), _weight(attn.k_proj), _weight(mlp.gate_proj)
    cfg = getattr(model, "config", None)
    n_heads = getattr(cfg, "num_attention_heads", None) or getattr(attn, "num_heads", None)
    head_dim = getattr(attn, "head_dim", None) or getattr(cfg, "head_dim", None) or q_w.shape[0] // n_heads
    if n_heads is None or q_w.shape[0] % head_dim:
        raise ValueError(f"{type(model).__name__}: cannot read the number of attention heads")
    return ModelSpec(
        num_layers=len(layers),
        hidden_size=q_w.shape[1],
        intermediate_size=g_w.shape[0],
        num_heads=q_w.shape[0] // head_dim,
        num_kv_heads=k_w.shape[0] // head_dim,
        head_dim=head_dim,
    )
