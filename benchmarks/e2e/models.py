"""Benchmark models: Llama-3.1-8B / Llama-3.2-3B / SmolLM2-135M shapes with cheap random weights,
static width-pruned models of a given FLOP capacity, and weight-sharing clones.

Random weights are drawn directly on the target device (N(0, 0.02) for matrices, 1 for norm weights;
never zeros: zeros can run faster than real data). The models are built under `torch.device(meta)` and
materialised on the device, so an 8B-shape model never runs 8B CPU `normal_` calls.
"""
from __future__ import annotations

import dataclasses
import inspect
import math

import torch
from torch import nn

# `_attn_implementation` of every model built here (bench_e2e.py --attention, e2e/attention.py)
ATTENTION = "sdpa"


def set_attention(name: str) -> None:
    global ATTENTION
    from .attention import use

    ATTENTION = use(name)


# name -> LlamaConfig fields. rope scaling (llama3) is left out: it does not change any timing.
SHAPES: dict[str, dict] = {
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=128, num_hidden_layers=32, vocab_size=128256, rope_theta=500000.0,
                         tie_word_embeddings=False, rms_norm_eps=1e-5),
    "llama-3.2-3b": dict(hidden_size=3072, intermediate_size=8192, num_attention_heads=24, num_key_value_heads=8,
                         head_dim=128, num_hidden_layers=28, vocab_size=128256, rope_theta=500000.0,
                         tie_word_embeddings=True, rms_norm_eps=1e-5),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                         head_dim=64, num_hidden_layers=30, vocab_size=49152, rope_theta=100000.0,
                         tie_word_embeddings=True, rms_norm_eps=1e-5),
    # CPU smoke test only
    "tiny": dict(hidden_size=64, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 num_hidden_layers=2, vocab_size=256, rope_theta=10000.0, tie_word_embeddings=False,
                 rms_norm_eps=1e-5),
}


def make_config(shape: str | dict, layers: int | None = None, max_positions: int = 16384, **overrides):
    import transformers as tf

    fields = dict(SHAPES[shape]) if isinstance(shape, str) else dict(shape)
    if layers:
        fields["num_hidden_layers"] = int(layers)
    fields.update(overrides)
    cfg = tf.LlamaConfig(max_position_embeddings=max_positions, attention_bias=False, mlp_bias=False, **fields)
    cfg._attn_implementation = ATTENTION
    return cfg


@torch.no_grad()
def random_init_(model: nn.Module, seed: int = 0, std: float = 0.02) -> nn.Module:
    """Cheap deterministic random init on the model's device (no zeros)."""
    dev = next(model.parameters()).device
    gen = torch.Generator(device=dev).manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            p.normal_(0.0, std, generator=gen)
        elif "norm" in name:
            p.fill_(1.0)
        else:
            p.normal_(0.0, std, generator=gen)
    return model


def _materialize_rotary(model: nn.Module, device) -> None:
    """Recompute non-persistent buffers that were created on meta (rotary inv_freq)."""
    for mod in model.modules():
        if isinstance(getattr(mod, "inv_freq", None), torch.Tensor):
            params = inspect.signature(type(mod).__init__).parameters
            with torch.device(device):  # the default device places inv_freq (no deprecated device= kwarg)
                fresh = type(mod)(config=mod.config) if "config" in params else type(mod)()
            for k, b in fresh._buffers.items():
                mod._buffers[k] = b
            for k, v in vars(fresh).items():
                if isinstance(v, torch.Tensor) and k not in mod._buffers:
                    setattr(mod, k, v)


def build_model(config, device, dtype, seed: int = 0) -> nn.Module:
    """LlamaForCausalLM of `config`, random weights drawn on `device`, eval mode."""
    import transformers as tf

    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # so to_empty allocates the final dtype directly (no fp32 copy)
    try:
        with torch.device("meta"):
            model = tf.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(old)
    model = model.to_empty(device=device).to(dtype)
    _materialize_rotary(model, device)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    random_init_(model, seed)
    model.config._attn_implementation = ATTENTION
    return model.eval().requires_grad_(False)


def shared_clone(model: nn.Module, attn_implementation: str | None = None) -> nn.Module:
    """A second module tree that shares every parameter/buffer tensor with `model` (no weight memory).
    Used so WIDE hooks / compiled graphs live on their own instance and never touch the dense one. The clone
    has its own copy of the config, so its attention implementation can differ (`attn_implementation`)."""
    import copy

    config = copy.deepcopy(model.config)
    with torch.device("meta"):
        clone = type(model)(config)
    src, dst = dict(model.named_modules()), dict(clone.named_modules())
    if src.keys() != dst.keys():
        raise RuntimeError("shared_clone: module trees differ")
    for name, m1 in src.items():
        m2 = dst[name]
        for k, p in m1._parameters.items():
            m2._parameters[k] = p
        for k, b in m1._buffers.items():
            m2._buffers[k] = b
        for k, v in vars(m1).items():
            if isinstance(v, torch.Tensor) and k not in m1._parameters and k not in m1._buffers:
                setattr(m2, k, v)
    clone.config._attn_implementation = attn_implementation or model.config._attn_implementation
    return clone.eval().requires_grad_(False)


def param_bytes(model: nn.Module) -> int:
    seen, n = set(), 0
    for p in list(model.parameters()) + list(model.buffers()):
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        n += p.numel() * p.element_size()
    return n


# -- static width-pruned model -------------------------------------------------------------------
@dataclasses.dataclass
class StaticShape:
    num_heads: int
    intermediate_size: int
    capacity: float          # exact FLOP capacity of the pruned model (DESIGN.md accounting, no routers)
    attn_rate: float
    ffn_rate: float


def static_shape(hidden: int, inter: int, n_q: int, n_kv: int, head_dim: int, capacity: float,
                 ffn_multiple: int = 64) -> StaticShape:
    """Widths of a static model with FLOP capacity ~= `capacity`.

    HF Llama needs num_heads % num_kv_heads == 0 (K/V stay full), so the query heads are the multiple of
    n_kv closest to capacity*n_q (at least n_kv); the FFN width then absorbs the difference so the
    FLOP-weighted capacity matches (rounded to `ffn_multiple` channels)."""
    qo = 4 * hidden * n_q * head_dim
    kv = 4 * hidden * n_kv * head_dim
    ffn = 6 * hidden * inter
    dense = qo + kv + ffn
    if capacity >= 0.9999:
        return StaticShape(n_q, inter, 1.0, 1.0, 1.0)
    r = (capacity * dense - kv) / (qo + ffn)
    cands = [m for m in range(n_kv, n_q + 1, n_kv)]
    heads = min(cands, key=lambda m: abs(m / n_q - r))
    a = heads / n_q
    f = (capacity * dense - kv - a * qo) / ffn
    f = min(max(f, ffn_multiple / inter), 1.0)
    F = max(ffn_multiple, int(round(f * inter / ffn_multiple)) * ffn_multiple)
    F = min(F, inter)
    cap = (a * qo + kv + (F / inter) * ffn) / dense
    return StaticShape(heads, F, cap, a, F / inter)


def build_static(config, capacity: float, device, dtype, seed: int = 1):
    """(model, StaticShape): a physically smaller model (fewer q heads / narrower FFN) of that capacity."""
    hd = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    ffn_multiple = 64 if config.intermediate_size % 64 == 0 and config.intermediate_size >= 512 else 8
    st = static_shape(config.hidden_size, config.intermediate_size, config.num_attention_heads,
                      config.num_key_value_heads, hd, capacity, ffn_multiple)
    cfg = config.__class__.from_dict(config.to_dict())
    cfg.num_attention_heads = st.num_heads
    cfg.intermediate_size = st.intermediate_size
    cfg.head_dim = hd
    cfg._attn_implementation = ATTENTION
    return build_model(cfg, device, dtype, seed), st


# -- SmolLM2 ---------------------------------------------------------------------------------------
def load_smollm2_real(device, dtype, gguf: str | None = None):
    """(model, tokenizer) of the real SmolLM2-135M, or raise with the reason (no download on the GPU box)."""
    from wide_compile.models import load_smollm2

    model, tok = load_smollm2(dtype=dtype, device=device, gguf_path=gguf, download=False)
    model.config._attn_implementation = ATTENTION
    return model.eval().requires_grad_(False), tok


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def fmt_gb(b: int) -> str:
    return f"{b / 2**30:.1f} GiB"


__all__ = ["SHAPES", "make_config", "build_model", "build_static", "static_shape", "StaticShape", "shared_clone",
           "param_bytes", "load_smollm2_real", "random_init_", "math"]
