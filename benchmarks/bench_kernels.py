"""Benchmark + correctness check of the WIDE kernels on a CUDA GPU.

    python benchmarks/bench_kernels.py [--quick] [--variants] [--out results.json]

1. Correctness: torch.ops.wide.* (Triton) vs the PyTorch reference, bf16, rel-L2 <= 2e-2, and
   mask_reorder bit-exact vs its reference.
2. Timing: each variant is captured once in a CUDA graph and its replay is timed with
   triton.testing.do_bench (median; do_bench clears the L2 before every repetition, so weights
   are read cold from HBM as in a real multi-layer model).
   dense  = torch F.linear (cuBLAS) on the full matrices (+ silu*mul for the MLP)
   static = the same on density*F (or density*Nq) channels (a statically pruned model)
   wide   = torch.ops.wide.* including its mask reorder launches.
   --compiled: each of those callables goes through torch.compile (Inductor, default mode, static shapes)
   first, so the elementwise work around the GEMMs (the dense MLP's silu * mul, the small-batch path's
   casts and selects) is fused as it is inside a compiled model; without it the ops are called eagerly.
Masks: "random": iid Bernoulli(density) per (token, group).  "corr_pX": all tokens share one
base mask ~ Bernoulli(density); each (token, group) bit is resampled (fresh Bernoulli(density)) with
probability p = X, i.e. it differs from the base with probability 2 p d (1-d)
"fitted": router-like masks whose statistics are fitted to the shipped SmolLM2 routers
(benchmarks/e2e/masks.py: DEFAULT_STATS, measured on smollm2-135m-c50 over real text): per-group
on-rates logit-normal with the measured spread, logits = sqrt(rho) * (rank-2 latent shared across
groups) + sqrt(1 - rho) * noise, rho fitted so the masks reach the measured tile coherence; tokens are
exchangeable (no token-order effects) and thresholds are analytic, so any T has the same statistics.
"trained": the masks the shipped SmolLM2 routers emitted on the first 8192 WikiText-2 test tokens
(benchmarks/record_router_masks.py -> benchmarks/data/), first T tokens of the layer whose on-rate is
closest to the density; only for shapes with the same group counts (SmolLM2's), skipped elsewhere.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

import wide_compile.kernels  # noqa: E402,F401
from wide_compile.kernels import reference as R  # noqa: E402
from wide_compile.kernels.compact_attn import o_proj_triton, q_proj_triton  # noqa: E402
from wide_compile.kernels.compact_mlp import default_config, mlp_triton  # noqa: E402
from wide_compile.helpfmt import HelpFormatter  # noqa: E402
from wide_compile.kernels.tuning import (FIELDS, OPTIONAL_FIELDS, KernelTuning, as_arg, device_key,  # noqa: E402
                                         resolve, CONFIG_DIR)

CORR_PS = (0.1, 0.01)
MASK_KINDS = ("random",) + tuple(f"corr_p{p}" for p in CORR_PS) + ("fitted", "trained")


def mask_label(kind: str) -> str:
    """The results file's `masks` field: "random" or "correlated" (the exact model is in `mask_model`)."""
    return "random" if kind == "random" else "correlated"
MODELS = {
    "llama3.1-8b": dict(D=4096, F=14336, nq=32, nkv=8, hd=128, gs=64, hg=1),
    "smollm2-135m": dict(D=576, F=1536, nq=9, nkv=3, hd=64, gs=64, hg=1),
}
DEV = "cuda"
DT = torch.bfloat16
TS = (1, 4, 16, 128, 2048, 8192)
# the gather-GEMV decode kernels, forced where the tuning table's default is the dense small-batch path: the
# results time both, so the choice of default is measured, not assumed
GATHER = {"path": "decode", "down": "kskip"}
DRY = os.environ.get("WIDE_BENCH_DRYRUN") == "1"  # CPU smoke test of this script (tiny shapes)
if DRY:
    DEV = "cpu"
    MODELS = {"tiny": dict(D=32, F=128, nq=4, nkv=2, hd=16, gs=32, hg=1)}
    TS = (1, 5, 20)  # 5: the dense small-batch path and the gather path timed beside it


_FITTED_RHO: dict = {}


def _fitted_logits(T, G, rho, gen):
    from benchmarks.e2e.masks import LATENT_RANK

    a = torch.randn(LATENT_RANK, G, device=DEV, generator=gen)
    a = a / a.norm(dim=0, keepdim=True)  # each group's latent part has unit variance
    lat = torch.randn(T, LATENT_RANK, device=DEV, generator=gen) @ a
    return math.sqrt(rho) * lat + math.sqrt(1 - rho) * torch.randn(T, G, device=DEV, generator=gen)


def fitted_mask(T, G, density, gen, rho=None):
    """Router-like masks fitted to the trained SmolLM2 routers' statistics (see the module docstring)."""
    from benchmarks.e2e.masks import DEFAULT_STATS, _group_rates

    if rho is None:
        rho = fit_fitted_rho(G, density)
    rates = _group_rates(density, G, DEFAULT_STATS["rate_logit_std"], torch.Generator().manual_seed(G))
    thr = torch.distributions.Normal(0.0, 1.0).icdf((1 - rates).clamp(1e-6, 1 - 1e-6)).to(DEV)  # logits ~ N(0,1)
    return _fitted_logits(T, G, rho, gen) > thr


def fit_fitted_rho(G, density):
    """rho whose masks (1024 tokens) come closest to the trained routers' tile coherence."""
    from benchmarks.e2e.masks import DEFAULT_STATS, RHO_GRID, tile_coherence

    key = (G, round(density, 3))
    if key not in _FITTED_RHO:
        g = torch.Generator(device=DEV).manual_seed(1234)
        err = {}
        for rho in RHO_GRID:
            c = tile_coherence(fitted_mask(1024, G, density, g, rho=rho).cpu())
            err[rho] = abs((c if c is not None else 0.0) - DEFAULT_STATS["tile_coherence"])
        _FITTED_RHO[key] = min(err, key=err.get)
    return _FITTED_RHO[key]


def mask_model_name(kind, G, density):
    """`mask_model` of a record: the kind, with the fitted rho and the tile coherence it reaches."""
    if kind == "trained":
        _, layer, rate = trained_mask(1, G, density)
        return f"trained({_TRAINED['m']['meta']['routers']}, layer {layer}, on-rate {rate} on WikiText-2 test text)"
    if kind != "fitted":
        return kind
    from benchmarks.e2e.masks import DEFAULT_STATS, tile_coherence

    rho = fit_fitted_rho(G, density)
    c = tile_coherence(fitted_mask(1024, G, density, torch.Generator(device=DEV).manual_seed(7), rho=rho).cpu())
    return (f"fitted(rho={rho}, tile_coherence={c:.2f} vs {DEFAULT_STATS['tile_coherence']} measured on "
            "smollm2-135m-c50)")


_TRAINED: dict = {}
CANDIDATE_FAILURES: list = []  # correctness failures of non-default configs (bench_kernels output)


def trained_mask(T, G, density):
    """(mask [T, G], layer, on-rate) from the recorded SmolLM2 router masks, or None when no recorded
    mask kind has G groups or fewer than T tokens were recorded."""
    if "m" not in _TRAINED:
        from benchmarks.record_router_masks import DEFAULT_OUT, load_masks

        _TRAINED["m"] = load_masks(DEFAULT_OUT) if DEFAULT_OUT.is_file() else None
    rec = _TRAINED["m"]
    if rec is None or T > rec["meta"]["tokens"]:
        return None
    kind = next((k for k, g in rec["meta"]["groups"].items() if g == G), None)
    if kind is None:
        return None
    from benchmarks.record_router_masks import closest_layer

    layer = closest_layer(rec, kind, density)
    return rec[kind][layer][:T].to(DEV), layer, rec["meta"]["on_rate"][kind][layer]


def make_mask(T, G, density, kind, gen):
    if kind == "trained":
        got = trained_mask(T, G, density)
        if got is None:
            raise LookupError(f"no recorded router masks with {G} groups and {T} tokens")
        return got[0]
    if kind == "fitted":
        return fitted_mask(T, G, density, gen)
    if kind == "random":
        return torch.rand(T, G, device=DEV, generator=gen) < density
    base = torch.rand(1, G, device=DEV, generator=gen) < density
    p = float(kind.split("corr_p")[1])
    resample = torch.rand(T, G, device=DEV, generator=gen) < p
    fresh = torch.rand(T, G, device=DEV, generator=gen) < density
    return torch.where(resample, fresh, base.expand(T, G))


def graph_time(fn, warm=3):
    if DRY:
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    """median ms of one replay of a CUDA graph holding one call of fn (L2 cleared before each)."""
    from benchmarks.e2e.timing import cuda_graph_step

    replay, g = cuda_graph_step(fn, None, warm)
    ms = do_bench(replay, warmup=20, rep=80, return_mode="median")
    del g
    return ms


def compiled_time(fn):
    """graph_time of fn compiled by Inductor (default mode, static shapes, one graph): what the op costs
    inside a compiled model, where Inductor traces the triton_op bodies and fuses their elementwise ops.
    Dynamo's cache is cleared first: the lambdas of one line share a code object, so without the reset the
    table's shapes would pile up recompiles on it until Dynamo's recompile limit sent the rest to eager."""
    torch._dynamo.reset()
    return graph_time(torch.compile(fn, fullgraph=True, dynamic=False))


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def weights(spec, gen):
    D, Fd, Nq = spec["D"], spec["F"], spec["nq"] * spec["hd"]
    r = lambda *s: (torch.randn(*s, device=DEV, generator=gen) * 0.02).to(DT)  # noqa: E731
    return dict(wg=r(Fd, D), wu=r(Fd, D), wd_t=r(Fd, D).contiguous(), wq=r(Nq, D), wo_t=r(Nq, D).contiguous(),
                wk=r(spec["nkv"] * spec["hd"], D), wv=r(spec["nkv"] * spec["hd"], D))


def correctness(log):
    gen = torch.Generator(device=DEV).manual_seed(0)
    worst = 0.0
    for name, spec in MODELS.items():
        W = weights(spec, gen)
        gs, cols = spec["gs"], spec["hg"] * spec["hd"]
        G, Ga = spec["F"] // gs, spec["nq"] // spec["hg"]
        for T in ((1, 3, 16, 130, 2048) if not DRY else (1, 20)):
            for kind in ("random", "corr_p0.1"):
                for d in (0.0, 0.5, 1.0):
                    x = torch.randn(T, spec["D"], device=DEV, generator=gen).to(DT)
                    m = make_mask(T, G, d, kind, gen)
                    ma = make_mask(T, Ga, d, kind, gen)
                    a = torch.randn(T, spec["nq"] * spec["hd"], device=DEV, generator=gen).to(DT)
                    bq = torch.randn(spec["nq"] * spec["hd"], device=DEV, generator=gen).to(DT)
                    errs = {}

                    def mlp_err(o, m=m, x=x):  # rel-L2 against the reference; all-off masks: output must be 0
                        return rel(o, R.mlp_ref(x, W["wg"], W["wu"], W["wd_t"], m, gs)) if m.any() else o.abs().max().item()

                    errs["mlp"] = mlp_err(torch.ops.wide.mlp(x, W["wg"], W["wu"], W["wd_t"], m, gs))
                    q = torch.ops.wide.q_proj(x, W["wq"], bq, ma, cols)
                    errs["q"] = rel(q, R.q_proj_ref(x, W["wq"], bq, ma, cols)) if ma.any() else q.abs().max().item()
                    assert (q[R.expand_mask(~ma, cols)] == 0).all(), "inactive q columns not zero"
                    oo = torch.ops.wide.o_proj(a, W["wo_t"], None, ma, cols)
                    errs["o"] = rel(oo, R.o_proj_ref(a, W["wo_t"], None, ma, cols)) if ma.any() else oo.abs().max().item()
                    for bm in (1, 16, 64):
                        got = torch.ops.wide.mask_reorder(m, bm)
                        exp = R.mask_reorder_ref(m, bm)
                        assert all(torch.equal(g_, e_) for g_, e_ in zip(got, exp)), ("mask_reorder", T, bm)
                    for cfg in ({"path": "tile"}, {"path": "sorted"}) if T > 16 else (GATHER, {"path": "dense"}):
                        errs["mlp_" + cfg["path"]] = mlp_err(mlp_triton(x, W["wg"], W["wu"], W["wd_t"], m, gs, config=cfg))
                    # candidate configs (not defaults): a failure is recorded, and the default table still runs
                    for cfg in ({"path": "tile", "lists": "none"},) if T > 16 else (dict(GATHER, lists="none"),):
                        try:
                            ce = mlp_err(mlp_triton(x, W["wg"], W["wu"], W["wd_t"], m, gs, config=cfg))
                        except Exception as ex:  # noqa: BLE001
                            ce = f"{type(ex).__name__}: {str(ex)[:200]}"
                        if not (isinstance(ce, float) and ce <= 2e-2):
                            CANDIDATE_FAILURES.append(dict(model=name, T=T, masks=kind, density=d, config=cfg, error=ce))
                            log(f"candidate config {cfg} FAILED at {name} T={T} {kind} d={d}: {ce}")
                    e = max(errs.values())
                    worst = max(worst, e)
                    if not (e <= 2e-2) or not all(math.isfinite(v) for v in errs.values()):
                        raise SystemExit(f"CORRECTNESS FAIL {name} T={T} {kind} d={d}: {errs}")
        log(f"correctness ok: {name}")
    return worst


def _time_dense(timed, W, x, a):
    """dense_ms per op: cuBLAS on the full matrices (+ silu * mul for the MLP)."""
    wd, wo = W["wd_t"].t().contiguous(), W["wo_t"].t().contiguous()
    return {
        "mlp": timed(lambda: F.linear(F.silu(F.linear(x, W["wg"])) * F.linear(x, W["wu"]), wd)),
        "attn_q": timed(lambda: F.linear(x, W["wq"])),
        "attn_o": timed(lambda: F.linear(a, wo)),
    }


def _time_static(timed, W, spec, x, a, d):
    """static_ms per op: cuBLAS on the first density*groups groups (a statically pruned model)."""
    gs, cols = spec["gs"], spec["hg"] * spec["hd"]
    G, Ga = spec["F"] // gs, spec["nq"] // spec["hg"]
    wd, wo = W["wd_t"].t().contiguous(), W["wo_t"].t().contiguous()
    Fs, Ns = max(gs, round(d * G) * gs), max(cols, round(d * Ga) * cols)
    wgs, wus, wds = W["wg"][:Fs].contiguous(), W["wu"][:Fs].contiguous(), wd[:, :Fs].contiguous()
    wqs, wos, as_ = W["wq"][:Ns].contiguous(), wo[:, :Ns].contiguous(), a[:, :Ns].contiguous()
    return {
        "mlp": timed(lambda: F.linear(F.silu(F.linear(x, wgs)) * F.linear(x, wus), wds)),
        "attn_q": timed(lambda: F.linear(x, wqs)),
        "attn_o": timed(lambda: F.linear(as_, wos)),
    }


def _attention_record(name, spec, W, x, a, T, t_dense_mlp, log):
    """Dense causal SDPA next to the four projections: what WIDE leaves dense costs this much."""
    q4 = torch.randn(1, spec["nq"], T, spec["hd"], device=DEV, dtype=DT)
    k4 = torch.randn(1, spec["nkv"], T, spec["hd"], device=DEV, dtype=DT)
    v4 = torch.randn_like(k4)
    wo = W["wo_t"].t().contiguous()
    t_sdpa = graph_time(lambda: F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, enable_gqa=True))
    t_qkvo = graph_time(lambda: (F.linear(x, W["wq"]), F.linear(x, W["wk"]), F.linear(x, W["wv"]), F.linear(a, wo)))
    log(f"{name:13s} T={T:5d} SDPA {t_sdpa:.3f} ms vs q/k/v/o proj {t_qkvo:.3f} ms, mlp {t_dense_mlp:.3f} ms")
    return dict(op="attention", model=name, T=T, density=1.0, masks="-", dense_ms=t_sdpa, static_ms=None,
                wide_ms=t_sdpa, speedup=1.0, qkvo_dense_ms=t_qkvo, mlp_dense_ms=t_dense_mlp,
                note="dense causal SDPA (GQA); WIDE keeps attention dense")


def _time_wide(timed, W, spec, x, a, m, ma, T, tuning):
    """wide_ms per op (the ops with the tuning handed in), and, where the table's default is the dense
    small-batch path, the gather path timed too (gather_ms)."""
    gs, cols = spec["gs"], spec["hg"] * spec["hd"]
    tj = as_arg(tuning)
    t_wide = {
        "mlp": timed(lambda: torch.ops.wide.mlp(x, W["wg"], W["wu"], W["wd_t"], m, gs, tj)),
        "attn_q": timed(lambda: torch.ops.wide.q_proj(x, W["wq"], None, ma, cols, tj)),
        "attn_o": timed(lambda: torch.ops.wide.o_proj(a, W["wo_t"], None, ma, cols, tj)),
    }
    t_gather = {}
    if default_config(T, spec["D"], spec["F"], gs, spec["D"], tuning)["path"] == "dense":
        # eager in both modes: the gather path is Triton launches only, nothing for Inductor to fuse
        kw = dict(config=GATHER, tuning=tuning)
        t_gather = {
            "mlp": graph_time(lambda: mlp_triton(x, W["wg"], W["wu"], W["wd_t"], m, gs, **kw)),
            "attn_q": graph_time(lambda: q_proj_triton(x, W["wq"], None, ma, cols, **kw)),
            "attn_o": graph_time(lambda: o_proj_triton(a, W["wo_t"], None, ma, cols, **kw)),
        }
    return t_wide, t_gather


def _op_records(name, spec, T, d, kind, m, ma, compiled, t_dense, t_static, t_wide, t_gather):
    G, Ga = spec["F"] // spec["gs"], spec["nq"] // spec["hg"]
    recs = []
    for op in ("mlp", "attn_q", "attn_o"):
        mm = m if op == "mlp" else ma
        extra = {}
        if t_gather:
            extra = dict(wide_path="dense", gather_ms=t_gather[op], gather_speedup=t_dense[op] / t_gather[op])
        recs.append(dict(**extra, op=op, model=name, T=T, density=d, masks=mask_label(kind), compiled=compiled,
                         mask_model=mask_model_name(kind, G if op == "mlp" else Ga, d),
                         actual_density=mm.float().mean().item(),
                         # what a few-token step must read: groups active for any token
                         union_density=mm.any(0).float().mean().item(),
                         dense_ms=t_dense[op], static_ms=t_static[op], wide_ms=t_wide[op],
                         speedup=t_dense[op] / t_wide[op], vs_static=t_static[op] / t_wide[op]))
    return recs


def _log_row(log, name, T, d, kind, t_dense, t_static, t_wide, t_gather, t_re):
    r = {op: t_dense[op] / t_wide[op] for op in t_wide}
    line = (f"{name:13s} T={T:5d} d={d} {kind:10s} mlp dense {t_dense['mlp']:.4f} static {t_static['mlp']:.4f} "
            f"wide {t_wide['mlp']:.4f} ({r['mlp']:.2f}x) | q {r['attn_q']:.2f}x o {r['attn_o']:.2f}x | "
            f"reorder {t_re*1e3:.1f}us")
    if t_gather:
        g = {op: t_dense[op] / t_gather[op] for op in t_gather}
        line += f" | gather path: mlp {g['mlp']:.2f}x q {g['attn_q']:.2f}x o {g['attn_o']:.2f}x"
    log(line)


def bench(quick, log, variants, kinds=MASK_KINDS, deadline=float("inf"), save=lambda recs: None, ts=None,
          compiled=False, tuning=None):
    gen = torch.Generator(device=DEV).manual_seed(1)
    recs = []
    timed = compiled_time if compiled else graph_time
    dens = (0.5,) if quick else (0.25, 0.5, 0.75)
    for name, spec in MODELS.items():
        W = weights(spec, gen)
        G, Ga = spec["F"] // spec["gs"], spec["nq"] // spec["hg"]
        for T in tuple(ts) if ts else TS:
            if time.time() > deadline:
                log(f"time budget spent: {name} T={T} and later not measured")
                break
            save(recs)  # a run cut short by the device's limit still returns every finished row
            x = torch.randn(T, spec["D"], device=DEV, generator=gen).to(DT)
            a = torch.randn(T, spec["nq"] * spec["hd"], device=DEV, generator=gen).to(DT)
            t_dense = _time_dense(timed, W, x, a)
            if T in (2048, 8192) or (DRY and T == 20):
                recs.append(_attention_record(name, spec, W, x, a, T, t_dense["mlp"], log))
            for d in dens:
                t_static = _time_static(timed, W, spec, x, a, d)
                for kind in kinds:
                    if kind == "trained" and (trained_mask(T, G, d) is None or trained_mask(T, Ga, d) is None):
                        continue  # recorded router masks exist for SmolLM2's group counts only
                    m, ma = make_mask(T, G, d, kind, gen), make_mask(T, Ga, d, kind, gen)
                    t_wide, t_gather = _time_wide(timed, W, spec, x, a, m, ma, T, tuning)
                    t_re = graph_time(lambda: torch.ops.wide.mask_reorder(m, 64 if T > 16 else 1))
                    recs += _op_records(name, spec, T, d, kind, m, ma, compiled, t_dense, t_static, t_wide, t_gather)
                    recs.append(dict(op="reorder", model=name, T=T, density=d, masks=mask_label(kind),
                                     mask_model=mask_model_name(kind, G, d), dense_ms=None, static_ms=None,
                                     wide_ms=t_re, speedup=None, note="mask_reorder(mask [T,G_ffn], block_m), all 5 outputs"))
                    _log_row(log, name, T, d, kind, t_dense, t_static, t_wide, t_gather, t_re)
    var = sweep_components(log, variants, kinds, gen, tuning) + sweep_variants(log, variants, kinds, gen, tuning)
    return recs, var


def sweep_components(log, variants, kinds, gen, tuning):
    """gate/up (gather kernel) and down (K-skip kernel) of the table's config, each next to cuBLAS."""
    if not variants:
        return []
    from wide_compile.kernels.compact_mlp import kskip, ngather

    var = []
    vkinds = [k for k in kinds if k != "trained"]  # the sweeps run at the 8B shape (no recorded masks)
    spec = next(iter(MODELS.values()))
    W = weights(spec, gen)
    G, gs = spec["F"] // spec["gs"], spec["gs"]
    for T in [t for t in ((1, 8192) if not DRY else (1, 20)) if t in variants or DRY]:
        x = torch.randn(T, spec["D"], device=DEV, generator=gen).to(DT)
        h = torch.randn(T, spec["F"], device=DEV, generator=gen).to(DT)
        wd = W["wd_t"].t().contiguous()
        for kind in vkinds:
            m8 = make_mask(T, G, 0.5, kind, gen).view(torch.uint8)
            cfg = default_config(T, spec["D"], spec["F"], gs, spec["D"], tuning)
            hb = torch.empty_like(h)
            t_up = graph_time(lambda: ngather(x, W["wg"], W["wu"], None, hb, m8, G, gs, cfg, True, False, False))
            t_dn = graph_time(lambda: kskip(h, W["wd_t"], None, m8, G, gs, cfg, DT, False))
            t_cup = graph_time(lambda: (F.linear(x, W["wg"]), F.linear(x, W["wu"])))
            t_cdn = graph_time(lambda: F.linear(h, wd))
            var.append(dict(T=T, masks=kind, component="gate_up", wide_ms=t_up, dense_ms=t_cup))
            var.append(dict(T=T, masks=kind, component="down", wide_ms=t_dn, dense_ms=t_cdn))
            log(f"component T={T} {kind:10s} gate_up wide {t_up:.4f} dense {t_cup:.4f} | down wide {t_dn:.4f} dense {t_cdn:.4f}")
    return var


def sweep_variants(log, variants, kinds, gen, tuning):
    """The Llama MLP at density 0.5 with each candidate override of the table's row (and {} = the row)."""
    var = []
    vkinds = [k for k in kinds if k != "trained"]
    spec = next(iter(MODELS.values()))
    W = weights(spec, gen)
    G = spec["F"] // spec["gs"]
    for T, cfgs in variants.items():
        x = torch.randn(T, spec["D"], device=DEV, generator=gen).to(DT)
        for kind in vkinds:
            m = make_mask(T, G, 0.5, kind, gen)
            for cfg in [{}, *cfgs]:
                try:
                    t = graph_time(lambda: mlp_triton(x, W["wg"], W["wu"], W["wd_t"], m, spec["gs"], config=cfg,
                                                      tuning=tuning))
                except Exception as e:  # noqa: BLE001
                    t = None
                    log(f"variant failed {cfg}: {type(e).__name__}: {str(e)[:200]}")
                var.append(dict(T=T, masks=kind, config=cfg, wide_ms=t))
                log(f"variant T={T} {kind:10s} {t if t is None else round(t, 4)} {cfg}")
    return var


def tuned_table(tuning, var, device: str) -> KernelTuning:
    """The table with, for each swept T, the variant fastest over the mask kinds (summed; a variant that
    failed for any kind is out) applied from T on: a row of its own starting at T unless T starts one."""
    rows = {t: dict(c) for t, c in tuning.rows}
    for T in sorted({v["T"] for v in var if "config" in v}):
        tot: dict = {}
        for v in var:
            if v.get("T") == T and "config" in v:
                key = json.dumps(v["config"], sort_keys=True)
                tot[key] = None if v["wide_ms"] is None or tot.get(key, 0) is None else tot.get(key, 0) + v["wide_ms"]
        ok = {k: t for k, t in tot.items() if t is not None}
        if not ok:
            continue
        best = json.loads(min(ok, key=ok.get))
        rows[T] = {**tuning.row(T, 1 << 30), **{k: v for k, v in best.items() if k in FIELDS + OPTIONAL_FIELDS}}
    return KernelTuning(device, tuple(sorted(rows.items())))


VARIANTS = {
    1: [dict(up_bn=bn, up_bk=bk, up_warps=w, up_stages=st, dn_bn=dbn, dn_split=sp, dn_warps=dw)
        for (bn, bk, w, st, dbn, sp, dw) in [
            (32, 256, 4, 3, 32, 8, 4), (32, 256, 4, 4, 32, 8, 4), (32, 256, 4, 3, 32, 16, 4), (32, 256, 4, 3, 64, 8, 4),
            (16, 512, 4, 3, 32, 8, 4), (64, 256, 8, 3, 32, 8, 4), (32, 128, 4, 5, 32, 8, 4), (32, 256, 4, 3, 32, 8, 2),
            (32, 512, 8, 3, 16, 16, 4), (16, 256, 2, 4, 32, 8, 4)]]
       # wide weight tiles for the decode K-skip: each CTA streams whole 256/512-byte pieces of an active
       # group's rows, with enough split-K CTAs to cover the GPU
       + [dict(dn_bn=dbn, dn_split=sp, dn_bk=bk, dn_warps=dw)
          for (dbn, sp, bk, dw) in [(128, 32, 32, 4), (128, 64, 32, 4), (256, 32, 16, 4), (256, 64, 32, 8),
                                    (256, 128, 16, 8), (128, 128, 64, 4)]]
       # no reorder launch (a decode step pays for the tile-list kernel): the kernels read the mask
       # themselves, alone and with the wide K-skip tiles
       + [dict(lists="none"), dict(lists="none", dn_bn=128, dn_split=32, dn_bk=32, dn_warps=4),
          dict(lists="none", dn_bn=256, dn_split=64, dn_bk=32, dn_warps=8)],
    # the token-sorted gather's tiles (gate / up and q at prefill run it: the largest WIDE kernel of the 8B prefill
    # profile), then the super-block width of its group swizzle
    2048: [dict(path=p, up_bm=bm) for p in ("sorted", "tile") for bm in (64, 128)]
          + [dict(path="sorted", up_bm=bm, up_bk=bk, up_warps=w, up_stages=st)
             for (bm, bk, w, st) in [(128, 64, 8, 3), (128, 64, 8, 4), (128, 32, 4, 5), (128, 128, 8, 3),
                                     (64, 64, 4, 4), (64, 128, 4, 3)]]
          + [dict(path="sorted", group_g=g) for g in (4, 64)]
          # gate and up in one dot of twice the columns per K step
          + [dict(path="sorted", up_fuse=True, up_bm=bm, up_warps=w, up_stages=st)
             for (bm, w, st) in [(128, 4, 3), (128, 8, 3), (128, 8, 4), (64, 4, 4)]],
    8192: [dict(group_g=g) for g in (4, 64)] + [dict(group_m=g) for g in (4, 16)]
          + [dict(up_bk=bk, up_warps=w, up_stages=st) for (bk, w, st) in [(64, 8, 4), (128, 8, 3), (32, 4, 5)]]
          + [dict(dn_bm=bm, dn_bn=bn, dn_warps=w, dn_stages=st)
             for (bm, bn, w, st) in [(128, 256, 8, 3), (128, 128, 8, 3), (128, 128, 4, 3)]]
          + [dict(path="tile")] + [dict(up_fuse=True), dict(up_fuse=True, up_warps=8, up_stages=4)],
}


def main():
    ap = argparse.ArgumentParser(prog="wide bench kernels", description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--quick", action="store_true", help="density 0.5 only (default: 0.25, 0.5 and 0.75)")
    ap.add_argument("--variants", action="store_true", help="also sweep kernel configs (Llama MLP, d=0.5)")
    ap.add_argument("--out", default="benchmarks/results/kernels-h200.json", help="results file (JSON)")
    ap.add_argument("--masks", nargs="+", choices=MASK_KINDS, default=list(MASK_KINDS),
                    help="mask models to time (see above)")
    ap.add_argument("--variant-ts", nargs="+", type=int, default=None,
                    help=f"with --variants: sweep only these T (of {sorted(VARIANTS)}), and their components")
    ap.add_argument("--ts", nargs="+", type=int, default=None, help=f"token counts to time (default {TS})")
    ap.add_argument("--compiled", action="store_true",
                    help="time dense, static and WIDE through torch.compile (elementwise work fused, as in a "
                         "compiled model) instead of eager calls")
    ap.add_argument("--tuning", default=None,
                    help="kernel tuning table (JSON) to time and to start --write-config from (default: the "
                         "shipped table for this GPU, wide_compile/kernels/configs/)")
    ap.add_argument("--write-config", nargs="?", const="auto", default=None, metavar="PATH",
                    help="with --variants: write the table with each swept T's fastest variant (default path: "
                         "wide_compile/kernels/configs/<GPU name>.json, which the kernels then read on this GPU)")
    ap.add_argument("--time-budget-s", type=float, default=float("inf"),
                    help="stop starting new T rows after this many seconds (the file then holds what finished)")
    args = ap.parse_args()
    if args.write_config and not args.variants:
        ap.error("--write-config needs --variants (the sweep it picks the configs from)")
    t0 = time.time()
    log = lambda s: print(f"[{time.time()-t0:6.1f}s] {s}", flush=True)  # noqa: E731
    if DRY:
        torch.cuda.get_device_name = lambda: "cpu-dryrun"  # noqa: E731
    log(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    worst = correctness(log)
    log(f"correctness: worst rel-L2 {worst:.2e}")
    variants = VARIANTS if args.variants else {}
    if variants and args.variant_ts:
        variants = {t: v for t, v in variants.items() if t in args.variant_ts}
    if DRY and variants:
        variants = {1: VARIANTS[1][:2], 20: VARIANTS[8192][:2] + VARIANTS[8192][-1:]}
    def save(recs, var=()):
        out = dict(records=recs, variants=list(var), gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                   triton=triton.__version__, date=time.strftime("%Y-%m-%d"), command=" ".join(sys.argv),
                   correctness_worst_rel_l2_bf16=worst, mask_kinds=list(args.masks),
                   candidate_config_failures=CANDIDATE_FAILURES,
                   compiled=args.compiled,
                   timing="CUDA graph replay of one call" + (" compiled by torch.compile (Inductor)" if args.compiled
                                                             else " (eager)")
                          + ", triton do_bench median (L2 cleared before each rep)")
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)

    tuning = KernelTuning.load(args.tuning) if args.tuning else resolve(None, DEV)
    log(f"kernel tuning: {args.tuning or 'shipped table ' + tuning.device}")
    recs, var = bench(args.quick, log, variants, kinds=tuple(args.masks), deadline=t0 + args.time_budget_s,
                      save=save, ts=args.ts, compiled=args.compiled, tuning=tuning)
    save(recs, var)
    if args.write_config:
        gpu = torch.cuda.get_device_name()
        path = CONFIG_DIR / f"{device_key(gpu)}.json" if args.write_config == "auto" else args.write_config
        about = (f"written by: python {' '.join(sys.argv)} on {time.strftime('%Y-%m-%d')}; its timings are in "
                 f"{args.out}")
        with open(path, "w") as f:
            json.dump({**tuned_table(tuning, var, gpu).to_dict(), "about": about}, f, indent=1)
        log(f"kernel tuning table written: {path}")
    print("\nop      model          T     d     masks       dense_ms  static_ms  wide_ms  speedup vs_static")
    for r in recs:
        if r["op"] in ("mlp", "attn_q", "attn_o") and r["density"] == 0.5:
            print(f"{r['op']:7s} {r['model']:13s} {r['T']:5d} {r['density']:.2f} {r.get('mask_model', r['masks']):10s} {r['dense_ms']:9.4f} "
                  f"{r['static_ms']:9.4f} {r['wide_ms']:9.4f} {r['speedup']:6.2f}x {r['vs_static']:6.2f}x")
    log("done")


if __name__ == "__main__":
    main()
