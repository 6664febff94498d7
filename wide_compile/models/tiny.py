"""Tiny random-weight models of each supported architecture (tests, CI, CPU demos)."""
from __future__ import annotations

import torch

ARCHS = ("llama", "mistral", "qwen2", "smollm2")


def tiny_config(arch: str = "llama", **overrides):
    """A small config of `arch` with GQA (hidden 64, FFN 192, 4 q / 2 kv heads, 2 layers by default).
    "smollm2" mirrors SmolLM2's ratios (3 q heads per kv head, tied embeddings, odd head count)."""
    import transformers as tf

    common = dict(vocab_size=128, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-5, tie_word_embeddings=False)
    if arch == "llama":
        cfg = tf.LlamaConfig(**{**common, **overrides})
    elif arch == "mistral":
        cfg = tf.MistralConfig(**{**common, "sliding_window": None, **overrides})
    elif arch == "qwen2":
        cfg = tf.Qwen2Config(**{**common, **overrides})  # q/k/v carry biases
    elif arch == "smollm2":
        cfg = tf.LlamaConfig(**{**common, "hidden_size": 72, "intermediate_size": 192, "num_attention_heads": 6,
                                "num_key_value_heads": 2, "tie_word_embeddings": True, **overrides})
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {ARCHS}")
    cfg._attn_implementation = overrides.get("attn_implementation", "sdpa")
    return cfg


def tiny_model(arch: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A randomly initialised causal LM of `arch` in eval mode. Biases (qwen2) are made non-zero so
    tests see them."""
    import transformers as tf

    cfg = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.05)
    return model.to(dtype).eval()
