"""One row's record: the fields that name the row (`base_record`, `row_key`), each variant's timing
(<key>_ms, _p10, _p90, _n, _compile_s, _peak_mem_mb, _mode, ...), the ratios and the row's checks.
benchmarks/e2e/README.md lists the fields; report.py and plot_e2e.py read them."""
from __future__ import annotations

import dataclasses

from . import report as R
from .timing import Variant

INFO_FIELDS = ("mode", "cuda_graph", "entry", "cuda_graph_error", "paths")  # Variant.info keys copied into the record
# dense variants a record always names (None when not timed)
ALWAYS = ("eager_dense", "dense_max_autotune", "dense_inductor_cg", "trt")


def row_key(r: dict) -> tuple:
    """What makes two records the same row (--resume skips a row whose key is done)."""
    return (r.get("model"), r.get("layers"), r.get("phase"), r.get("tokens"), r.get("batch"),
            round(float(r.get("capacity", 0)), 3), r.get("masks"))


def base_record(model: str, layers: int, weights: str, phase: str, tokens: int, batch: int, cap: float,
                masks: str, options) -> dict:
    from wide_compile.passes.options import PassOptions

    return {"model": model, "layers": layers, "weights": weights, "phase": phase,
            "tokens": tokens, "batch": batch, "capacity": cap, "masks": masks,
            "router_dtype": options.router_dtype, "kernel_config": options.kernel_config,
            "attention": options.attention, "kernel_path": options.kernel_path,
            **{name: getattr(options, name) for name in PassOptions.names()},
            "router_recipe": options.router_recipe(model) if masks != "trained" else "trained"}


@dataclasses.dataclass
class WorkloadExtra:
    """A variant timed once per workload (first row), copied into every record of the workload."""
    compile_s: float | None
    peak_mem_mb: float | None
    summary: dict


@dataclasses.dataclass
class RowResult:
    """Everything one timed row produced (one measurement; emitted once per mask type it stands for)."""
    ref: Variant | None = None
    cg: Variant | None = None
    static: Variant | None = None
    wide: Variant | None = None
    wide_eager: Variant | None = None
    static_shape: object | None = None
    measured: dict | None = None
    routers: object | None = None
    errors: dict = dataclasses.field(default_factory=dict)
    skipped: dict = dataclasses.field(default_factory=dict)
    check: dict | None = None
    replay_check: dict | None = None
    recompiled: bool = False
    profile: dict | None = None
    extras: dict = dataclasses.field(default_factory=dict)  # record key -> WorkloadExtra
    wide_variants: dict = dataclasses.field(default_factory=dict)  # wide_table / wide_fused -> Variant
    shared_measurement: bool = False                       # capacity 1.0: one measurement, every mask kind


def _r(x, nd):
    return round(x, nd) if x is not None else None


def put_variant(rec: dict, prefix: str, v: Variant | None) -> float | None:
    if v is None:
        rec[f"{prefix}_ms"] = None
        return None
    s = v.summary()
    rec[f"{prefix}_ms"] = round(s["median"], 4) if s else None
    if s:
        rec[f"{prefix}_p10"], rec[f"{prefix}_p90"], rec[f"{prefix}_n"] = round(s["p10"], 4), round(s["p90"], 4), s["n"]
    rec[f"{prefix}_compile_s"] = _r(v.compile_s, 2)
    rec[f"{prefix}_peak_mem_mb"] = _r(v.peak_mem_mb, 1)
    for k in INFO_FIELDS:
        if k in v.info:
            rec[f"{prefix}_{k}"] = v.info[k]
    return rec[f"{prefix}_ms"]


def put_extra(rec: dict, key: str, x: WorkloadExtra) -> None:
    s = x.summary
    rec[f"{key}_ms"] = round(s["median"], 4) if s else None
    if s:
        rec[f"{key}_p10"], rec[f"{key}_p90"] = round(s["p10"], 4), round(s["p90"], 4)
    rec[f"{key}_compile_s"] = _r(x.compile_s, 2)
    rec[f"{key}_peak_mem_mb"] = _r(x.peak_mem_mb, 1)


def put_static(rec: dict, res: RowResult) -> None:
    if rec["capacity"] >= 0.9999:
        rec["static_ms"] = rec["dense_inductor_ms"]
        rec["static_note"] = "capacity 1.0: the static model is the dense model (same measurement)"
        rec["static_capacity"] = 1.0
        return
    put_variant(rec, "static", res.static)
    st = res.static_shape
    if st is not None:
        rec.update(static_capacity=round(st.capacity, 4), static_heads=st.num_heads,
                   static_intermediate=st.intermediate_size)


def put_ratios(rec: dict) -> None:
    def ratio(a, b):
        return round(a / b, 4) if a and b else None

    d, w, s = rec.get("dense_inductor_ms"), rec.get("wide_ms"), rec.get("static_ms")
    rec["speedup"] = ratio(d, w)
    rec["static_speedup"] = ratio(d, s)
    rec["speedup_vs_graphed_default"] = ratio(rec.get("dense_inductor_cg_ms"), w)
    rec["speedup_vs_max_autotune"] = ratio(rec.get("dense_max_autotune_ms"), w)
    R.add_best_dense(rec)
    rec["wide_over_static"] = ratio(w, s)
    rec["peak_mem_mb"] = rec.get("wide_peak_mem_mb")
    rec["compile_s"] = rec.get("wide_compile_s")


def put_row_facts(rec: dict, res: RowResult, mask_model: dict | None) -> None:
    """Measured capacity, router geometry, mask model, the checks, errors and skips."""
    if res.measured:
        rec["measured_capacity"] = res.measured["overall"]
        rec["measured_capacity_attn"] = res.measured["attn"]
        rec["measured_capacity_ffn"] = res.measured["ffn"]
    if res.routers is not None:
        rec["calibrated_capacity"] = getattr(res.routers, "calib_capacity", None)
        rec["ffn_group_size"] = res.routers.cfg.ffn_group_size
        rec["head_group_size"] = res.routers.cfg.head_group_size
    if rec["masks"] == "correlated" and mask_model and rec["capacity"] < 0.9999:
        rec["mask_model"] = {k: v for k, v in mask_model.items() if k != "fit"}
    if res.shared_measurement:
        rec["masks_note"] = "capacity 1.0: every group on (all-on routers); one measurement for all mask types"
    rec["recompiled_during_timing"] = bool(res.recompiled)
    if res.check:
        rec["wide_check"] = res.check
    if res.replay_check:
        rec["wide_replay_check"] = res.replay_check
    rec["errors"] = res.errors
    rec["skipped"] = res.skipped
    if res.profile:
        rec["profile"] = res.profile


def fill(rec: dict, res: RowResult, mask_model: dict | None = None) -> dict:
    """Complete `rec` (a base_record) with one row's results; the field order is the results files' order."""
    put_variant(rec, "dense_inductor", res.ref)
    if res.cg is not None:
        put_variant(rec, "dense_inductor_cg", res.cg)
    for key, x in res.extras.items():
        put_extra(rec, key, x)
    for k in ALWAYS:
        rec.setdefault(f"{k}_ms", None)
    put_static(rec, res)
    put_variant(rec, "wide", res.wide)
    put_variant(rec, "wide_eager", res.wide_eager)
    for key, v in res.wide_variants.items():  # the other WIDE configurations, as ratios to dense Inductor
        ms = put_variant(rec, key, v)
        ref = rec.get("dense_inductor_ms")
        rec[f"{key}_speedup"] = round(ref / ms, 4) if ms and ref else None
    put_ratios(rec)
    put_row_facts(rec, res, mask_model)
    return rec
