"""The run loop: for every model and phase, each workload in turn, with the time budget shared between
the (model, phase) pairs; results are written after every row, a plot and the table at the end."""
from __future__ import annotations

import json
import traceback

import torch

from . import models as MD
from . import report as R
from .bench_model import BenchModel
from .capabilities import set_dynamo_limits, trt_status, wide_backend_status
from .run_state import RunState, log
from .text import default_text_file
from .timing import free, is_cuda
from .workload import Workload


def setup(o) -> RunState:
    """Process-wide settings of the run (every variant sees the same), then the run state."""
    if o.smoke and torch.device(o.device).type == "cpu":
        torch.set_num_threads(min(2, torch.get_num_threads()))  # tiny shapes: OpenMP spinning only hurts
    set_dynamo_limits()
    MD.set_attention(o.attention)  # before any model is built: every variant runs the same attention
    torch.manual_seed(o.seed)
    run = RunState(o)
    run.text_file = o.text_file or default_text_file()
    run.meta["text_file"] = run.text_file  # the real model's prompt text (None: the built-in paragraph)
    log(f"bench_e2e: {run.meta['gpu'] or o.device} torch {run.meta['torch']} triton {run.meta['triton']} "
        f"transformers {run.meta['transformers']}; models {o.models}; phases {o.phases}; caps {o.capacities}; "
        f"masks {o.masks}; variants {o.variants}; layers {o.layers or 'full'}; budget {o.time_budget_s}")
    if not is_cuda(o.device):
        log("  NOTE: not on CUDA: timings are meaningless (smoke/plumbing only)")
    for why, what in ((wide_backend_status(o.wide_backend), "wide"), (trt_status(), "trt")):
        if why and what in o.variants:
            run.skip(f"{what}: {why}")
    return run


def workloads(o, phase: str) -> list[tuple[int, int]]:
    if phase == "prefill":
        return [(t, b) for t in o.prefill_tokens for b in o.prefill_batch]
    return [(t, b) for t in o.decode_ctx for b in o.decode_batch]


def run_workload(run: RunState, bm: BenchModel, phase: str, tokens: int, batch: int) -> None:
    if run.over_budget():
        run.skip(f"{bm.name} {phase} tokens={tokens} batch={batch}: time budget exceeded")
        return
    try:
        Workload(bm, phase, tokens, batch).execute()
    except Exception as e:  # noqa: BLE001  one workload's failure is recorded; the others still run
        run.skip(f"{bm.name} {phase} tokens={tokens} batch={batch}: FAILED {type(e).__name__}: {str(e)[:500]}")
        traceback.print_exc()
        torch._dynamo.reset()
        free(run.device)
    run.write()


def run_model(run: RunState, name: str, units: list) -> None:
    o = run.options
    bm = None
    try:
        bm = BenchModel(run, name)
        for phase in o.phases:
            if o.time_budget_s is not None and not o.no_budget_split:
                # each (model, phase) may use the budget up to its share's end, so a slow first phase cannot
                # starve the others; time a fast one leaves over goes to the next
                run.deadline = o.time_budget_s * (units.index((name, phase)) + 1) / len(units)
            for tokens, batch in workloads(o, phase):
                run_workload(run, bm, phase, tokens, batch)
    except Exception as e:  # noqa: BLE001
        run.skip(f"{name}: FAILED {type(e).__name__}: {str(e)[:500]}")
        traceback.print_exc()
    finally:
        del bm
        torch._dynamo.reset()
        free(run.device)


def finish(run: RunState) -> dict:
    o = run.options
    if not o.no_plot:
        try:
            png = R.plot(json.loads(run.json_path.read_text()), run.out / f"{o.name}.png")
            log(f"plot: {png}")
        except Exception as e:  # noqa: BLE001  e.g. no matplotlib on the GPU machine: plot_e2e.py draws it later
            log(f"plot failed: {type(e).__name__}: {e}")
    data = json.loads(run.json_path.read_text())
    log("\n" + R.markdown(data))
    log(f"wrote {run.json_path} ({len(data['records'])} records) in {run.elapsed():.0f}s")
    return data


def run_all(o) -> dict:
    """Run the benchmark `o` (e2e/options.BenchOptions) describes; returns the results file's content."""
    run = setup(o)
    run.write()
    units = [(m, ph) for m in o.models for ph in o.phases]
    for name in o.models:
        run.deadline = None
        if run.over_budget():
            run.skip(f"{name}: time budget exceeded before start")
            continue
        run_model(run, name, units)
    run.write()
    return finish(run)
