"""The WIDE cost model: which correct path each routed projection runs, per token count T.

Every path below computes the same routed result (inactive groups contribute exactly 0; they differ only in
summation order), so the model may pick any of them; it picks the one it estimates fastest:

    mlp  dense_masked  three dense GEMMs, the gate's activation and the group select (kernels/dense_masked.py)
         gather+kskip  gather GEMM / GEMV over each token tile's active groups, K-skipping down projection
         gather+dense  the gather, then one dense GEMM over the zero-filled h
         sorted+kskip  group-major gather over the active (token, group) pairs, K-skipping down projection
         sorted+dense  the sorted gather, then one dense GEMM over the zero-filled h
         gemv          one token only (T = 1): kernels/gemv.py's gate/up GEMV with the activation in it, then the
                       K-skipping down GEMV (and its split sum when its tiles split K); the mask is read in the
                       kernels (no reorder launch)
    q    dense_masked | gather | sorted | gemv (T = 1)
    o    dense_masked | kskip | gemv (T = 1)

A path's time is the sum over its launches of a roofline (bytes at the device's copy bandwidth, FLOPs at its
matrix-product rate, each times the share of the ceiling that kernel class reaches) plus a per-launch
overhead and, for tile kernels, the class's ramp (its time beyond the roofline at a small shape); the device's
figures are data (kernels/configs/cost/<device>.json). The weights a tile reads are the union of its tokens'
active groups: 1 - (1 - c)^rows of them for independent masks of density c, or the measured union of `MaskStats`.

The choice travels to the kernels as the tuning table's "path" / "down" fields (kernels/tuning.py): the pass
hands each op a table whose rows carry the cost model's choice per range of T, so a graph with a dynamic
token count picks per call, with no host-side decision at run time.
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from ..kernels.tuning import CONFIG_DIR, DECODE_T, KernelTuning, cuda_device_key, with_phase_overrides

COST_DIR = CONFIG_DIR / "cost"
KINDS = ("gemm", "gather", "kskip", "pointwise", "reorder")
# what the user may force (optimize(..., kernel_path=...)): the cost model, the tuning table as it is, every
# op on its dense-masked path, or every op on its compact kernels
KERNEL_PATHS = ("auto", "table", "dense", "compact")
# the tuning-table fields of each path, per op
PATH_FIELDS = {
    "mlp": {"dense_masked": {"path": "dense"}, "gather+kskip": {"path": "decode", "down": "kskip"},
            "gather+dense": {"path": "decode", "down": "dense"}, "sorted+kskip": {"path": "sorted", "down": "kskip"},
            "sorted+dense": {"path": "sorted", "down": "dense"}},
    "q": {"dense_masked": {"path": "dense"}, "gather": {"path": "decode"}, "sorted": {"path": "sorted"}},
    "o": {"dense_masked": {"path": "dense"}, "kskip": {"path": "decode", "down": "kskip"}},
}
# the one-token GEMVs (T = 1 only): the tile path's fields plus the kernels' switch (compact_mlp / compact_attn)
GEMV_FIELDS = {"path": "decode", "down": "kskip", "one_token": "gemv"}
for _fields in PATH_FIELDS.values():
    _fields["gemv"] = GEMV_FIELDS
# token counts a table with a dynamic T is cut at: every decode size, then powers of two
T_GRID = tuple(range(1, DECODE_T + 2)) + tuple(2 ** k for k in range(5, 17))


@dataclass(frozen=True)
class DeviceCost:
    """A device's ceilings, the share of them each kernel class reaches, and one launch's cost."""
    device: str
    hbm_bytes_per_s: float
    matmul_flop_per_s: float
    launch_s: float
    efficiency: Mapping[str, Mapping[str, float]]
    # a compact path replaces dense_masked only when estimated at least this share faster: each kernel class's
    # efficiency is measured at one shape, so closer estimates do not tell the paths apart
    margin: float = 0.0

    def __post_init__(self) -> None:
        missing = [k for k in KINDS if k not in self.efficiency]
        if missing or min(self.hbm_bytes_per_s, self.matmul_flop_per_s) <= 0 or self.launch_s < 0:
            raise ValueError(f"cost data {self.device!r}: needs positive ceilings, launch_s >= 0 and an efficiency "
                             f"{{bandwidth, flops}} for each of {KINDS} (missing {missing})")

    @classmethod
    def from_dict(cls, d: Mapping) -> "DeviceCost":
        try:
            return cls(str(d.get("device", "?")), float(d["hbm_bytes_per_s"]), float(d["matmul_flop_per_s"]),
                       float(d["launch_s"]), {k: dict(v) for k, v in d["efficiency"].items()},
                       float(d.get("margin", 0.0)))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError("cost data is {\"hbm_bytes_per_s\", \"matmul_flop_per_s\", \"launch_s\", \"efficiency\": "
                             f"{{kind: {{bandwidth, flops}}}}}} (kernels/configs/cost/), got {str(d)[:200]}") from e

    def seconds(self, kind: str, nbytes: float, flops: float, ramp: bool = True) -> float:
        """One launch: the roofline at the kind's shares, the launch, and the kind's ramp ("fixed_s": the time a
        kernel of that class takes beyond its roofline at a small shape, a tile grid's fill and drain; the
        one-token GEMVs, one short pass over the weights, pass ramp=False)."""
        eff = self.efficiency[kind]
        return max(nbytes / (self.hbm_bytes_per_s * eff["bandwidth"]),
                   flops / (self.matmul_flop_per_s * eff["flops"])) + self.launch_s + \
            (eff.get("fixed_s", 0.0) if ramp else 0.0)


@functools.lru_cache(maxsize=None)
def _load(key: str) -> DeviceCost:
    with open(COST_DIR / f"{key}.json") as f:
        return DeviceCost.from_dict(json.load(f))


def device_cost(device=None) -> DeviceCost:
    """The cost data of a CUDA device (configs/cost/<GPU name>.json, else default.json); default.json elsewhere."""
    key = cuda_device_key(device) if device is not None else None  # "cuda" without an index: the current GPU
    if key is not None and (COST_DIR / f"{key}.json").exists():
        return _load(key)
    return _load("default")


@dataclass(frozen=True)
class MaskStats:
    """What the cost model knows of a block's masks: the share of (token, group) pairs active (`density`) and,
    when measured, the share of groups active for any token of a tile of `rows` tokens (`union`)."""
    density: float
    union: Mapping[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 <= self.density <= 1.0 or any(not 0.0 <= v <= 1.0 for v in self.union.values()):
            raise ValueError(f"MaskStats: density and union shares must lie in [0, 1], got {self.density}, "
                             f"{dict(self.union)}")

    def union_share(self, rows: int) -> float:
        """Share of the groups a tile of `rows` tokens needs: measured, else that of independent masks."""
        if rows in self.union:
            return float(self.union[rows])
        return 1.0 - (1.0 - self.density) ** max(rows, 1)

    @classmethod
    def measure(cls, mask, rows=(1, 2, 4, 8, 16, 32, 64, 128)) -> "MaskStats":
        """From recorded masks [..., T, G] (bool): density, and the union over consecutive tiles of each size."""
        m = mask.reshape(-1, mask.shape[-1]).bool()
        union = {}
        for r in rows:
            n = m.shape[0] // r
            if n:
                union[r] = float(m[:n * r].reshape(n, r, -1).any(1).float().mean())
        return cls(float(m.float().mean()), union)

    @classmethod
    def of(cls, spec) -> "MaskStats":
        return spec if isinstance(spec, MaskStats) else cls(float(spec))


@dataclass(frozen=True)
class Shape:
    """One routed projection: T tokens of width `d_in`, `n` grouped columns (F for the MLP, Nq for q / o) in
    groups of `group_size`, `elem` bytes per element."""
    T: int
    d: int
    n: int
    group_size: int
    elem: int = 2

    @property
    def groups(self) -> int:
        return self.n // self.group_size


def _tiles(T: int, bm: int) -> tuple[int, int]:
    # (tiles, tokens per tile) of a token-major kernel with BM-token tiles
    return math.ceil(T / bm), min(T, bm)


def _gather(s: Shape, st: MaskStats, bm: int, mats: int, sorted_: bool) -> tuple:
    """The gather GEMM (mats = 2 gated gate/up, 1 for q): tile mode reads each tile's union of groups and
    computes it for every token of the tile; sorted mode computes the active pairs padded to BM per group."""
    w = s.n * s.d * s.elem
    io = s.T * s.d * s.elem + s.T * s.n * s.elem
    if sorted_:
        pairs = s.groups * math.ceil(st.density * s.T / bm) * bm * s.group_size
        return ("gather", mats * w * st.union_share(s.T) + io, 2 * mats * pairs * s.d)
    nt, rows = _tiles(s.T, bm)
    u = st.union_share(rows)
    return ("gather", nt * u * mats * w + io, 2 * mats * nt * rows * u * s.n * s.d)


def _kskip(s: Shape, st: MaskStats, row: dict) -> list:
    """The K-skipping reduction (down / o) with its tile lists; split-K adds a zero-fill and a cast."""
    nt, rows = _tiles(s.T, row["dn_bm"])
    u = st.union_share(rows)
    out = s.T * s.d * (4 if row["dn_split"] > 1 else s.elem)
    ks = [("kskip", nt * u * s.n * s.d * s.elem + st.density * s.T * s.n * s.elem + out,
           2 * nt * rows * u * s.n * s.d)]
    if row["dn_split"] > 1:
        ks += [("pointwise", out, 0), ("pointwise", out + s.T * s.d * s.elem, 0)]
    return ks


def _gemm(s: Shape) -> tuple:
    return ("gemm", s.n * s.d * s.elem + s.T * (s.d + s.n) * s.elem, 2 * s.T * s.n * s.d)


def _reorder(s: Shape, row: dict) -> list:
    # a tile-list build reads the mask once; the reorder-free tile path (lists="none") has none
    return [] if row.get("lists", "kernel") == "none" else [("reorder", s.T * s.groups + 4 * s.T * s.groups, 0)]


def _gemv_reduce(s: Shape, st: MaskStats, split: int | None) -> list:
    """The one-token K-skipping GEMV (down / o) over the token's active weights; split over K into `split` fp32
    partial rows (None: DEFAULT_GEMV_SPLIT), it needs the launch that adds them (gemv._split_sum_kernel)."""
    split = DEFAULT_GEMV_SPLIT if split is None else split
    u = st.union_share(1)
    if split <= 1:
        return [("kskip", u * s.n * s.d * s.elem + s.n * s.elem + s.d * s.elem, 2 * u * s.n * s.d, False)]
    part = split * s.d * 4
    return [("kskip", u * s.n * s.d * s.elem + s.n * s.elem + part, 2 * u * s.n * s.d, False),
            ("pointwise", part + s.d * s.elem, 0)]


# the split of the one-token reduction GEMV where the caller does not say: gemv.CONFIGS' widest
DEFAULT_GEMV_SPLIT = 16
GEMV_OP = {"mlp": "mlp", "o": "o_proj"}


def gemv_split(op: str, one_token_graph: bool, row: dict, device=None) -> int:
    """How many K slices op's one-token reduction GEMV runs (kernels/gemv.py's tiles on `device`, with the row's
    overrides) for the weight layout the pass hands it (passes/base.reduction_weight): the Linear's own weight in a
    graph of one token; in a graph whose token count is dynamic the transposed copy's tiles, the layout it gets
    where a larger token count runs the K-skipping kernel (else the view's unsplit GEMV runs, never slower); 1 for
    q."""
    if op not in GEMV_OP:
        return 1
    from ..kernels.gemv import config_for

    layout = "k_contiguous" if one_token_graph else "d_contiguous"
    return int(config_for(layout, row, GEMV_OP[op], device)["gd_split"])


def _gemv_n(s: Shape, st: MaskStats, mats: int) -> tuple:
    """The one-token grouped-output GEMV (gate/up: mats = 2, q: 1) over the token's active groups."""
    u = st.union_share(1)
    return ("gather", u * mats * s.n * s.d * s.elem + s.d * s.elem + s.n * s.elem, 2 * mats * u * s.n * s.d, False)


def mlp_kernels(s: Shape, st: MaskStats, row: dict, split: int | None = None) -> dict:
    """The launches of each MLP path: {path name: [(kind, bytes, flops[, ramp]), ...]} (s.n = F, s.d = D)."""
    h = s.T * s.n * s.elem
    zero_h = ("pointwise", h, 0)
    sorted_lists = [("reorder", s.T * s.groups, 0)] * 2  # group counts, then group lists
    tile = _gather(s, st, row["up_bm"], 2, False)
    srt = _gather(s, st, row["up_bm"], 2, True)
    shared = row["up_bm"] == row["dn_bm"]
    paths = {
        # gate, up, the fused activation * up + select (Inductor traces the op body), down
        "dense_masked": [_gemm(s), _gemm(s), ("pointwise", 3 * h + s.T * s.groups, 0), _gemm(s)],
        "gather+kskip": _reorder(s, row) * (1 if shared else 2) + [tile] + _kskip(s, st, row),
        "gather+dense": [zero_h] + _reorder(s, row) + [tile, _gemm(s)],
        "sorted+kskip": sorted_lists + [srt] + _reorder(s, row) + _kskip(s, st, row),
        "sorted+dense": [zero_h] + sorted_lists + [srt, _gemm(s)],
    }
    if s.T == 1:
        paths["gemv"] = [_gemv_n(s, st, 2)] + _gemv_reduce(s, st, split)
    return paths


def q_kernels(s: Shape, st: MaskStats, row: dict, split: int | None = None) -> dict:
    """q_proj's paths (s.d = D, s.n = Nq): the output is zero-filled before a gather writes the active pairs
    (`split`: the other ops' signature; q has no reduction GEMV)."""
    out = ("pointwise", s.T * s.n * s.elem, 0)
    paths = {"dense_masked": [_gemm(s), ("pointwise", 2 * s.T * s.n * s.elem, 0)],
             "gather": [out] + _reorder(s, row) + [_gather(s, st, row["up_bm"], 1, False)],
             "sorted": [out, ("reorder", s.T * s.groups, 0), ("reorder", s.T * s.groups, 0),
                        _gather(s, st, row["up_bm"], 1, True)]}
    if s.T == 1:  # one launch: the GEMV writes the inactive columns' zeros itself
        paths["gemv"] = [_gemv_n(s, st, 1)]
    return paths


def o_kernels(s: Shape, st: MaskStats, row: dict, split: int | None = None) -> dict:
    """o_proj's paths (s.n = Nq its input width, s.d = D its output): select + dense GEMM, or K-skip."""
    paths = {"dense_masked": [("pointwise", 2 * s.T * s.n * s.elem, 0), _gemm(s)],
             "kskip": _reorder(s, row) + _kskip(s, st, row)}
    if s.T == 1:
        paths["gemv"] = _gemv_reduce(s, st, split)
    return paths


KERNELS = {"mlp": mlp_kernels, "q": q_kernels, "o": o_kernels}


def path_seconds(op: str, s: Shape, st: MaskStats, row: dict, dev: DeviceCost, split: int | None = None) -> dict:
    """{path: estimated seconds} for one op at one token count, with the tile sizes of the table's row; `split`:
    the one-token reduction GEMV's K slices (gemv_split; None: DEFAULT_GEMV_SPLIT)."""
    return {name: sum(dev.seconds(*k) for k in ks) for name, ks in KERNELS[op](s, st, row, split).items()}


def table_path(op: str, row: dict, T: int = 1) -> str:
    """The path the tuning table's row itself names for this op at T tokens (the one-token GEMVs run at T = 1
    only: compact_mlp / compact_attn)."""
    if T == 1 and row.get("one_token") == "gemv":
        return "gemv"
    if row["path"] == "dense" or (op == "o" and row.get("down") == "dense"):
        return "dense_masked"
    if op == "o":
        return "kskip"
    kind = "sorted" if row["path"] == "sorted" else "gather"
    return kind if op == "q" else f"{kind}+{'dense' if row.get('down') == 'dense' else 'kskip'}"


def choose(op: str, s: Shape, st: MaskStats, row: dict, dev: DeviceCost, kernel_path: str = "auto",
           split: int | None = None) -> str:
    """The path `kernel_path` asks for: "auto" the estimated fastest compact path when it beats dense_masked
    by the device's margin, else dense_masked; "table" the table's own; "dense" dense_masked; "compact" the
    estimated fastest compact path (ties keep the table's)."""
    if kernel_path not in KERNEL_PATHS:
        raise ValueError(f"kernel_path must be one of {KERNEL_PATHS}, got {kernel_path!r}")
    own = table_path(op, row, s.T)
    if kernel_path == "table":
        return own
    if kernel_path == "dense":
        return "dense_masked"
    secs = path_seconds(op, s, st, row, dev, split)
    dense = secs.pop("dense_masked")
    best = min(secs, key=secs.get)
    if secs.get(own) == secs[best]:  # ties keep the table's own
        best = own
    if kernel_path == "compact" or secs[best] < (1.0 - dev.margin) * dense:
        return best
    return "dense_masked"


@dataclass
class Decision:
    """What the pass records on a rewritten op's node (meta["wide_path"]) and in the report."""
    op: str
    T: int | None                      # the graph's token count, None when dynamic
    path: str                          # the path at T (at decode, T = 1, when dynamic)
    rows: list                         # [(min T, path), ...]: the table the op runs with
    seconds: dict                      # {path: estimated seconds} at T (or T = 1)
    source: str                        # "cost model" | "table" | "forced: dense" | ...

    def __str__(self) -> str:
        at = f"T={self.T}" if self.T is not None else "T dynamic: " + ", ".join(f"{t}+ {p}" for t, p in self.rows)
        return f"{self.op} {self.path} ({self.source}, {at})"


def _phase_overrides(base: KernelTuning, T: int) -> dict:
    return dict(base.overrides.get("decode" if T <= DECODE_T else "prefill", {}))


def plan(op: str, shape: Shape, base: KernelTuning, dev: DeviceCost, stats: MaskStats | None,
         kernel_path: str = "auto", device=None) -> tuple[KernelTuning, Decision]:
    """The tuning table `op` runs with (base's rows, cut where the chosen path changes, each row carrying the
    chosen path's fields; base itself for "table") and the Decision to record. Without mask stats "auto" keeps
    the table's paths. `device`: the torch device the kernels run on (their one-token GEMV tiles, gemv_split)."""
    source = {"auto": "cost model", "table": "tuning table"}.get(kernel_path, f"forced: {kernel_path}")
    if stats is None and kernel_path in ("auto", "compact"):
        kernel_path = "table" if kernel_path == "auto" else kernel_path
        source = "tuning table (no mask density known)" if kernel_path == "table" else source
    st = stats or MaskStats(1.0)

    def split_at(t: int, eff: dict) -> int | None:  # the one-token GEMV's K slices, at T = 1 only
        return gemv_split(op, shape.T == 1, eff, device) if t == 1 else None

    grid = sorted(set(T_GRID) | {t for t, _ in base.rows} | ({shape.T} if shape.T else set()))
    rows, named = [], []
    for t in grid:
        row = base.row(t, shape.group_size)
        over = _phase_overrides(base, t)  # applied by the kernels after the row: they decide as the kernels run
        s = Shape(t, shape.d, shape.n, shape.group_size, shape.elem)
        eff = with_phase_overrides(row, over)
        cfg = {**row, **PATH_FIELDS[op][choose(op, s, st, eff, dev, kernel_path, split_at(t, eff))]}
        if not rows or rows[-1][1] != cfg:
            rows.append((t, cfg))
            named.append((t, table_path(op, with_phase_overrides(cfg, over), t)))
    T = shape.T or 1
    at = Shape(T, shape.d, shape.n, shape.group_size, shape.elem)
    eff = with_phase_overrides(base.row(T, shape.group_size), _phase_overrides(base, T))
    secs = path_seconds(op, at, st, eff, dev, split_at(T, eff))
    path = next(p for t, p in reversed(named) if t <= T)
    merged = [named[0]] + [b for a, b in zip(named, named[1:]) if a[1] != b[1]]
    table = base if kernel_path == "table" else KernelTuning(base.device, tuple(rows), base.overrides)
    return (table,
            Decision(op, shape.T or None, path, merged, secs, source))
