"""Kernel tuning as data: a table of tile configs per device (configs/<device>.json, the layout of vLLM's
fused_moe configs), looked up by token count, handed to the kernels explicitly.

A `KernelTuning` is a table (rows keyed by the smallest token count T they apply to) plus per-phase
overrides ("decode": T <= DECODE_T, "prefill": larger T) that a sweep or a benchmark applies to one
compiled model. It travels as JSON through the `torch.ops.wide.*` ops (their `tuning` argument; "" = the
device's own table), so a compiled graph holds the tuning it was compiled with and no process-wide state
decides it. `benchmarks/bench_kernels.py --write-config` writes a table for the GPU it runs on.
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional

CONFIG_DIR = Path(__file__).with_name("configs")
INTERPRETER = "triton-interpreter"
DEFAULT = "default"
# Tokens up to DECODE_T run one token tile (a decode step): the "decode" phase of the overrides.
DECODE_T = 16
PHASES = ("decode", "prefill")
# Tile fields bounded by the group: a tile never spans more than one group's columns (up_bn) / rows (dn_bk).
GROUP_CAPPED = ("up_bn", "dn_bk")
# ... but a K tile stays at least tl.dot's minimum K on the GPU (16): the kernels mask the rows past the group
DOT_MIN = {"dn_bk": 16}
FIELDS = ("path", "down", "up_bm", "up_bn", "up_bk", "up_warps", "up_stages", "dn_bm", "dn_bn", "dn_bk",
          "dn_split", "dn_warps", "dn_stages", "group_g", "group_m")
# Fields a row may add (absent: off): up_fuse, the gate and up rows in one dot (compact_mlp.gather_gemm's FUSE_GU)
OPTIONAL_FIELDS = ("up_fuse",)


def with_phase_overrides(cfg: dict, over: Optional[Mapping]) -> dict:
    """A row with a phase's overrides applied. An override that names the path replaces the row's whole choice of
    path, its one-token switch ("one_token": "gemv", which the kernels check first at T = 1) included, unless the
    override names that switch too."""
    out = dict(cfg)
    if over and "path" in over and "one_token" not in over:
        out.pop("one_token", None)
    out.update(over or {})
    return out


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def device_key(name: str) -> str:
    """File name (without .json) of a device's table: its name with spaces as underscores."""
    return name.strip().replace(" ", "_")


@dataclass(frozen=True)
class KernelTuning:
    device: str
    rows: tuple = ()                                    # ((min_T, {field: value}), ...) ascending in min_T
    overrides: Mapping = field(default_factory=dict)   # {"decode": {...}, "prefill": {...}}

    def __post_init__(self) -> None:
        if not self.rows or self.rows[0][0] != 1:
            raise ValueError(f"kernel tuning {self.device!r}: needs a row for T = 1 (keys are the smallest T of "
                             "each row)")
        for t, cfg in self.rows:
            missing = [f for f in FIELDS if f not in cfg]
            if missing:
                raise ValueError(f"kernel tuning {self.device!r}, row T >= {t}: missing fields {missing}")
        bad = [p for p in self.overrides if p not in PHASES]
        if bad:
            raise ValueError(f"kernel tuning overrides: phases must be {PHASES}, got {bad}")

    def row(self, T: int, group_size: int) -> dict:
        """The config of the row for T tokens with its group-bounded tiles capped (the phase overrides are
        applied by compact_mlp.kernel_config, after the shared-memory fit)."""
        cfg = dict(next(c for t, c in reversed(self.rows) if t <= max(T, 1)))
        gs2 = 1 << max(group_size - 1, 0).bit_length()  # group size rounded up to a power of two
        for k in GROUP_CAPPED:
            cfg[k] = min(cfg[k], max(gs2, DOT_MIN.get(k, 1)))
        return cfg

    def with_overrides(self, decode: Optional[dict] = None, prefill: Optional[dict] = None) -> "KernelTuning":
        over = {p: dict(v) for p, v in (("decode", decode), ("prefill", prefill)) if v}
        return KernelTuning(self.device, self.rows, over)

    # -- as data ------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = {"device": self.device, "configs": {str(t): dict(c) for t, c in self.rows}}
        if self.overrides:
            d["overrides"] = {p: dict(v) for p, v in self.overrides.items()}
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: Mapping) -> "KernelTuning":
        try:
            rows = tuple(sorted((int(t), dict(c)) for t, c in d["configs"].items()))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError("a kernel tuning table is {\"device\": ..., \"configs\": {\"<min T>\": {...}}}, "
                             f"got {str(d)[:200]}") from e
        return cls(str(d.get("device", "?")), rows, dict(d.get("overrides") or {}))

    @classmethod
    def from_json(cls, s: str) -> "KernelTuning":
        return _parse(s)

    @classmethod
    def load(cls, path) -> "KernelTuning":
        with open(path) as f:
            return cls.from_dict(json.load(f))


@functools.lru_cache(maxsize=64)
def _parse(s: str) -> KernelTuning:  # the ops hand the same string in on every trace
    return KernelTuning.from_dict(json.loads(s))


@functools.lru_cache(maxsize=None)
def _table(key: str) -> KernelTuning:
    return KernelTuning.load(CONFIG_DIR / f"{key}.json")


def cuda_device_key(device=None) -> Optional[str]:
    """device_key of the CUDA GPU that `device` names (None: the current one); None without CUDA or for another
    device type. The file name under which per-GPU tuning data is looked up."""
    import torch

    dev = torch.device(device) if device is not None else None
    if not torch.cuda.is_available() or (dev is not None and dev.type != "cuda"):
        return None
    idx = dev.index if dev is not None and dev.index is not None else torch.cuda.current_device()
    return device_key(torch.cuda.get_device_name(idx))


def table_for(device=None) -> KernelTuning:
    """The shipped table for a device: the interpreter's under TRITON_INTERPRET=1, else configs/<GPU name>.json
    when there is one, else configs/default.json."""
    if interpreting():
        return _table(INTERPRETER)
    key = cuda_device_key(device)
    if key is not None and (CONFIG_DIR / f"{key}.json").exists():
        return _table(key)
    return _table(DEFAULT)


def resolve(tuning, device=None) -> KernelTuning:
    """A KernelTuning from what a caller hands down: None / "" (the device's table), a KernelTuning, its JSON,
    a table dict, or per-phase overrides {"decode": {...}, "prefill": {...}} on the device's table."""
    if tuning is None or tuning == "":
        return table_for(device)
    if isinstance(tuning, KernelTuning):
        return tuning
    if isinstance(tuning, str):
        return _parse(tuning)
    if isinstance(tuning, Mapping):
        if "configs" in tuning:
            return KernelTuning.from_dict(tuning)
        bad = [k for k in tuning if k not in PHASES]
        if bad:
            raise ValueError("kernel config: expected a tuning table {\"device\": ..., \"configs\": {...}} or per-phase "
                             f"overrides with keys {PHASES}, got keys {bad}")
        return table_for(device).with_overrides(**tuning)
    raise TypeError(f"kernel config must be a KernelTuning, its JSON, or a dict, got {type(tuning).__name__}")


def as_arg(tuning) -> str:
    """What the ops take: "" for the device's own table, else the tuning's JSON."""
    if tuning is None or tuning == "":
        return ""
    return resolve(tuning).to_json()
