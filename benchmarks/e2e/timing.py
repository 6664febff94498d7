"""Timing: device events around every step, interleaved rounds across variants, medians and p10/p90,
manual CUDA-graph capture, memory accounting, and a per-op profile.

Each variant is a zero-argument `step()` plus an optional `reset()` run before every step *outside* the
timed region (e.g. rewinding a static KV cache). On CUDA one event pair brackets each step, so the
distribution of single steps is kept (p10/p50/p90). Variants of one row are timed in interleaved rounds
(A B C A B C ...) with the order rotated each round, so clock/thermal drift hits them all alike and the
ratios come from one run.
"""
from __future__ import annotations

import gc
import math
import re
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class Variant:
    name: str
    step: Callable[[], object]
    reset: Callable[[], None] | None = None
    compile_s: float | None = None
    peak_mem_mb: float | None = None
    info: dict = field(default_factory=dict)
    times_ms: list = field(default_factory=list)
    est_ms: float | None = None
    keep: list = field(default_factory=list)  # objects kept alive with the variant (graphs, models)

    def summary(self) -> dict:
        t = sorted(self.times_ms)
        if not t:
            return {}
        return {"median": statistics.median(t), "p10": _pct(t, 10), "p90": _pct(t, 90), "n": len(t),
                "min": t[0]}


def _pct(sorted_t: list, q: float) -> float:
    if len(sorted_t) == 1:
        return sorted_t[0]
    k = (len(sorted_t) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return sorted_t[lo] + (sorted_t[hi] - sorted_t[lo]) * (k - lo)


def is_cuda(device) -> bool:
    return torch.device(device).type == "cuda"


def sync(device):
    if is_cuda(device):
        torch.cuda.synchronize()


def first_call(fn: Callable, device, reset=None) -> float:
    """Wall seconds of the first call (compilation included), synchronised."""
    sync(device)
    t0 = time.perf_counter()
    if reset:
        reset()
    fn()
    sync(device)
    return time.perf_counter() - t0


def warmup(v: Variant, device, n: int = 3) -> float:
    """Run n steps; returns the mean ms per step (rough estimate to size the timed rounds)."""
    sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        if v.reset:
            v.reset()
        v.step()
    sync(device)
    v.est_ms = (time.perf_counter() - t0) * 1e3 / max(n, 1)
    return v.est_ms


def time_interleaved(variants: list[Variant], device, rounds: int = 5, target_s: float = 1.0,
                     min_reps: int = 1, max_reps: int = 500) -> None:
    """Append per-step times (ms) to each variant's times_ms; ~target_s of timed steps per variant."""
    cuda = is_cuda(device)
    est_max = max((v.est_ms or 1.0) for v in variants)
    if est_max * rounds > 3e3 * target_s:  # very long steps (e.g. 8k x 4 prefill): fewer rounds, >= 3
        rounds = max(3, int(3e3 * target_s / est_max))
    reps = {}
    for v in variants:
        est = v.est_ms or 1.0
        reps[v.name] = int(min(max_reps, max(min_reps, round(target_s * 1e3 / rounds / max(est, 1e-3)))))
    order = list(variants)
    for rd in range(rounds):
        k = rd % len(order)
        for v in order[k:] + order[:k]:
            n = reps[v.name]
            if cuda:
                evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
                for s, e in evs:
                    if v.reset:
                        v.reset()
                    s.record()
                    v.step()
                    e.record()
                torch.cuda.synchronize()
                v.times_ms += [s.elapsed_time(e) for s, e in evs]
            else:
                for _ in range(n):
                    if v.reset:
                        v.reset()
                    t0 = time.perf_counter()
                    v.step()
                    v.times_ms.append((time.perf_counter() - t0) * 1e3)


def cuda_graph_step(step: Callable, reset: Callable | None, warm: int = 3) -> tuple[Callable, object]:
    """Capture one step in a CUDA graph (after warm-up on a side stream). Returns (replay, graph)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warm):
            if reset:
                reset()
            step()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    if reset:
        reset()
    with torch.cuda.graph(g):
        step()
    torch.cuda.synchronize()
    return g.replay, g


class MemTracker:
    """Memory a variant needs: what its preparation left allocated (weights it built, compiler copies,
    graph pools) + weights/caches it shares with others (`shared_bytes`) + the transient peak of one step."""

    def __init__(self, device, shared_bytes: int = 0):
        self.cuda = is_cuda(device)
        self.shared = shared_bytes
        self.base = torch.cuda.memory_allocated() if self.cuda else 0

    def finish(self, v: Variant) -> None:
        if not self.cuda:
            return
        torch.cuda.synchronize()
        persistent = torch.cuda.memory_allocated() - self.base
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        if v.reset:
            v.reset()
        v.step()
        torch.cuda.synchronize()
        transient = torch.cuda.max_memory_allocated() - before
        v.peak_mem_mb = (self.shared + persistent + transient) / 2**20
        v.info.update(mem_persistent_mb=persistent / 2**20, mem_step_transient_mb=transient / 2**20,
                      mem_shared_mb=self.shared / 2**20)


def free(device) -> None:
    if is_cuda(device):
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# -- per-op profile -----------------------------------------------------------------------------
CATEGORIES = [
    ("wide_ops", re.compile(r"wide|compact|reorder|gather|scatter|moe|align|grouped|sort|index", re.I)),
    ("gemm", re.compile(r"gemm|cutlass|xmma|cublas|nvjet|matmul|mm_|_mm|::mm$|::bmm|sm90|wgmma|addmm|linear", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa|efficient|softmax", re.I)),
    ("triton_fused", re.compile(r"triton", re.I)),
]


def categorize(name: str) -> str:
    for cat, rx in CATEGORIES:
        if rx.search(name):
            return cat
    return "other"


def _dev_time(evt) -> float:
    for a in ("self_device_time_total", "self_cuda_time_total"):
        v = getattr(evt, a, None)
        if v:
            return float(v)
    return 0.0


def profile_step(step: Callable, reset: Callable | None, device, n: int = 5, top: int = 25) -> tuple[str, dict]:
    """torch.profiler over n steps: (table of the top kernels, {category: ms per step})."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if is_cuda(device) else [])
    for _ in range(2):
        if reset:
            reset()
        step()
    sync(device)
    with profile(activities=acts) as prof:
        for _ in range(n):
            if reset:
                reset()
            step()
        sync(device)
    ka = prof.key_averages()
    cats: dict[str, float] = {}
    rows = []
    for evt in ka:
        t = _dev_time(evt) if is_cuda(device) else float(getattr(evt, "self_cpu_time_total", 0.0))
        if t <= 0:
            continue
        if is_cuda(device) and str(getattr(evt, "device_type", "")).endswith("CPU"):
            continue
        c = categorize(evt.key)
        cats[c] = cats.get(c, 0.0) + t / n / 1e3
        rows.append((t / n / 1e3, evt.count // n, c, evt.key))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows) or 1.0
    lines = [f"{'ms/step':>9} {'%':>6} {'calls':>6}  {'category':<13} kernel"]
    for ms, cnt, c, k in rows[:top]:
        lines.append(f"{ms:9.4f} {100 * ms / total:6.1f} {cnt:6d}  {c:<13} {k[:110]}")
    lines.append(f"{total:9.4f}  total device time per step (sum over kernels)")
    lines.append(f"{sum(r[1] for r in rows):9d}  kernel launches per step")
    lines.append("by category: " + ", ".join(f"{k}={v:.3f} ms" for k, v in sorted(cats.items(), key=lambda x: -x[1])))
    return "\n".join(lines), {k: round(v, 4) for k, v in cats.items()}


def profile_variants(variants: dict, device, n: int, header: str, path) -> dict:
    """profile_step of each variant (outside its CUDA graph: the kernels, not one graph launch), printed and
    appended to `path`; returns {variant: {category: ms per step}}."""
    out = {}
    lines = [f"\n===== {header} ====="]
    for name, v in variants.items():
        if v is None:
            continue
        step = v.info.get("raw_step", v.step)
        try:
            table, cats = profile_step(step, v.reset, device, n=n)
            out[name] = cats
            lines += [f"--- {name} ---", table]
        except Exception as e:  # noqa: BLE001  a profile is extra information; the row stands without it
            lines.append(f"--- {name}: profile failed: {type(e).__name__}: {e}")
    text = "\n".join(lines)
    print(text, flush=True)
    with open(path, "a") as f:
        f.write(text + "\n")
    return out
