"""One workload (model x phase x tokens x batch) and its rows (capacity x mask kind).

Prefill = one forward over [batch, tokens] with use_cache=False and logits_to_keep=1 (the last position's
logits, as generation's prefill needs). Decode = one token per sequence against a static KV cache filled
to `tokens` positions (e2e/decode_state.py).

The dense variants are built once per workload; the static model once per capacity; WIDE and its eager
reference once per row, with the row's routers attached. A row's variants are timed together in
interleaved rounds (e2e/timing.py), the references in every row, so each ratio comes from one run.
"""
from __future__ import annotations

import os
import time
import traceback

import torch

from . import report as R
from .capabilities import graph_count
from .checks import live_check, measured_capacity, replay_check
from .decode_state import DecodeState
from .records import RowResult, WorkloadExtra, base_record, fill, row_key
from .run_state import log
from .timing import MemTracker, Variant, cuda_graph_step, first_call, free, is_cuda, profile_variants, sync
from .timing import time_interleaved, warmup
from .variants import DENSE_ORDER, VARIANTS, Row, VariantSpec

ROUTERS_ORDER = tuple(n for n, s in VARIANTS.items() if s.scope == "routers")


class Workload:
    def __init__(self, bm, phase: str, tokens: int, batch: int):
        self.bm, self.run, self.options = bm, bm.run, bm.run.options
        self.phase, self.tokens, self.batch = phase, tokens, batch
        self.device, self.dtype, self.cuda = bm.run.device, bm.run.dtype, is_cuda(bm.run.device)
        self.dense, self.wide_model, self.config = bm.dense, bm.wide_model, bm.config
        self.log = log
        self.errors: dict = {}     # the workload's own failures and skips, copied into each of its rows
        self.skipped: dict = {}
        self.dense_vars: dict[str, Variant] = {}
        self.extras: dict[str, WorkloadExtra] = {}
        self.extras_timed = False
        self.state = None
        self._inputs()

    def _inputs(self) -> None:
        o = self.options
        if self.phase == "prefill":
            ids = self.bm.ids(self.tokens, self.batch, torch.Generator().manual_seed(o.seed + self.tokens * 31
                                                                                    + self.batch))  # [B, T]
            self.step_of = lambda m: (lambda: m(input_ids=ids, use_cache=False, logits_to_keep=1))
            self.reset, self.extra_bytes = None, 0
        else:
            self.state = DecodeState(self.dense, self.batch, self.tokens, self.bm.vocab, self.device,
                                     gen_seed=o.seed + self.tokens + self.batch)
            self.step_of, self.reset, self.extra_bytes = self.state.step_fn, self.state.reset, self.state.nbytes()
        self.shared = self.bm.dense_bytes + self.extra_bytes  # weights + KV cache every variant uses

    # -- compile helpers the builders use --------------------------------------------------------
    def inductor(self, model, mode: str | None = None):
        """torch.compile with Inductor; in --smoke (unless --smoke-inductor) backend="eager", since Inductor's
        CPU compile is what a smoke test does not need to wait for."""
        if self.options.smoke and not self.options.smoke_inductor:
            return torch.compile(model, dynamic=False, backend="eager")
        return torch.compile(model, dynamic=False, **({"mode": mode} if mode else {}))

    def cudagraph_tree_reset(self):
        """The reset of a mode="reduce-overhead" variant: the workload's reset, then a new cudagraph step."""
        base = self.reset

        def reset():
            if base:
                base()
            if hasattr(torch, "compiler") and hasattr(torch.compiler, "cudagraph_mark_step_begin"):
                torch.compiler.cudagraph_mark_step_begin()
        return reset

    def graphed(self, step, reset, info: dict):
        """(step, reset, info) with the step captured in a manual CUDA graph (none on CPU / --no-cuda-graphs)."""
        if not self.cuda or self.options.no_cuda_graphs:
            info["cuda_graph"] = False
            return step, reset, info
        replay, g = cuda_graph_step(step, reset)
        info.update(cuda_graph=True, raw_step=step, _keep=g)
        return replay, reset, info

    def free(self) -> None:
        free(self.device)

    # -- building variants -----------------------------------------------------------------------
    def prepare(self, spec: VariantSpec, row: Row | None, shared_bytes: int, errors: dict,
                skipped: dict) -> Variant | None:
        """Build (compile, capture), first call, warm up and measure memory; a failure goes to `errors`."""
        if self.run.over_budget():
            skipped[spec.key] = "time budget exceeded"
            return None
        try:
            tr = MemTracker(self.device, shared_bytes)
            sync(self.device)
            t0 = time.perf_counter()
            step, reset, info = spec.build(self, row)
            c_s = time.perf_counter() - t0 + first_call(step, self.device, reset)
            info = info or {}
            keep = info.pop("_keep", None)
            v = Variant(spec.key, step, reset, compile_s=c_s, info=info)
            v.keep.append(keep)
            warmup(v, self.device, self.options.warmup)
            tr.finish(v)
            log(f"    ready {spec.key:<22} compile+first call {c_s:7.2f}s  ~{v.est_ms:9.3f} ms/step"
                + (f"  mem {v.peak_mem_mb:8.0f} MB" if v.peak_mem_mb else ""))
            return v
        except Exception as e:  # noqa: BLE001  one variant's failure is recorded; the row goes on
            msg = f"{type(e).__name__}: {str(e).strip()[:600]}"
            errors[spec.key] = msg
            log(f"    FAILED {spec.key}: {msg}")
            if self.options.verbose:
                traceback.print_exc()
            self.free()
            return None

    def build_dense(self, names=DENSE_ORDER) -> None:
        for name in names:
            spec = VARIANTS[name]
            if name not in self.options.variants or not spec.applies(self):
                continue
            why = spec.why_not(self)
            if why:
                self.skipped[spec.key] = why
                continue
            v = self.prepare(spec, None, self.shared, self.errors, self.skipped)
            if v:
                self.dense_vars[name] = v

    def build_routed(self, row: Row, res: RowResult) -> dict[str, Variant | None]:
        """The variants that run with this row's routers attached (WIDE, its eager reference)."""
        out = {}
        for name in ROUTERS_ORDER:
            spec = VARIANTS[name]
            if name not in self.options.variants:
                continue
            why = spec.why_not(self)
            if why:
                res.skipped[spec.key] = why
                log(f"    SKIP {spec.key}: {why}")
                continue
            out[name] = self.prepare(spec, row, self.shared, res.errors, res.skipped)
        return out

    # -- rows ------------------------------------------------------------------------------------
    def masks_at(self, cap: float) -> list[str]:
        """The mask kinds timed at this capacity: one all-on row at 1.0; --correlated-capacities limits the
        non-random ones. The resume check uses the same list, or a finished workload would compile again."""
        kinds = self.bm.mask_types()
        cc = self.options.correlated_capacities
        if cap >= 0.9999:
            return ["all-on"]
        if cc is None:
            return kinds
        return [m for m in kinds if m == "random" or any(abs(cap - c) < 1e-6 for c in cc)]

    def emitted(self, masks: str) -> list[str]:
        """The records one timed row stands for: the all-on row is every mask kind's capacity-1.0 row."""
        return self.bm.mask_types() if masks == "all-on" else [masks]

    def record(self, cap: float, masks: str) -> dict:
        bm = self.bm
        return base_record(bm.name, bm.layers, bm.weights, self.phase, self.tokens, self.batch, cap, masks,
                           self.options)

    def row_done(self, cap: float, masks: str) -> bool:
        return all(row_key(self.record(cap, mm)) in self.run.done_keys for mm in self.emitted(masks))

    def routers_for(self, cap: float, masks: str, res: RowResult):
        o = self.options
        try:
            routers = self.bm.routers.get(cap, masks)
            if o.router_dtype == "model":  # tensor-core routers (bf16 weights, fp32 accumulation)
                routers = routers.to(self.dtype)
            elif o.router_dtype == "bf16x2" and self.dtype == torch.bfloat16:
                routers = routers.split_bf16_()
            return routers
        except Exception as e:  # noqa: BLE001  the row is still timed without WIDE, and says why
            res.errors["routers"] = f"{type(e).__name__}: {str(e)[:400]}"
            log(f"    routers cap={cap} masks={masks} FAILED: {res.errors['routers']}")
            if o.verbose:
                traceback.print_exc()
            return None

    def time_row(self, res: RowResult) -> None:
        """Time the row's variants together (+ the once-per-workload ones the first time)."""
        group = [v for v in (res.ref, res.cg, res.static, res.wide, *res.wide_variants.values(), res.wide_eager)
                 if v is not None]
        if not self.extras_timed:
            group += [v for k, v in self.dense_vars.items() if VARIANTS[k].scope == "workload"]
        for v in group:
            v.times_ms = []
        n0 = graph_count()
        try:
            if group:
                time_interleaved(group, self.device, rounds=self.options.rounds, target_s=self.options.target_s)
        except Exception as e:  # noqa: BLE001
            res.errors["timing"] = f"{type(e).__name__}: {str(e)[:400]}"
            log(f"    timing FAILED: {res.errors['timing']}")
            traceback.print_exc()
        res.recompiled = graph_count() != n0 and n0 >= 0
        if not self.extras_timed:
            self.extras = {VARIANTS[k].key: WorkloadExtra(v.compile_s, v.peak_mem_mb, v.summary())
                           for k, v in self.dense_vars.items() if VARIANTS[k].scope == "workload"}
            self.extras_timed = True
        for k in [k for k in self.dense_vars if VARIANTS[k].scope == "workload"]:
            self.dense_vars.pop(k)  # timed once per workload: release their graphs now
        res.extras = self.extras

    def check_row(self, res: RowResult) -> None:
        if res.wide is not None and res.wide_eager is not None:
            try:
                res.check = live_check(self.wide_model, res.wide, res.wide_eager)
            except Exception as e:  # noqa: BLE001
                res.errors["check"] = f"{type(e).__name__}: {str(e)[:300]}"
        if self.options.check_replay and res.wide is not None and res.routers is not None:
            try:
                res.replay_check = replay_check(self.wide_model, self.step_of, self.reset, res.routers, self.options)
                log(f"    replay check: {res.replay_check}")
            except Exception as e:  # noqa: BLE001
                res.errors["replay_check"] = f"{type(e).__name__}: {str(e)[:300]}"
                log(f"    replay check FAILED: {res.errors['replay_check']}")

    def profile_row(self, cap: float, masks: str, res: RowResult) -> None:
        o = self.options
        if not (o.profile and (self.cuda or o.smoke)):
            return
        header = (f"{self.bm.name} layers={self.bm.layers} {self.phase} tokens={self.tokens} batch={self.batch} "
                  f"capacity={cap} masks={masks}")
        res.profile = profile_variants({"dense_inductor": res.ref, "static": res.static, "wide": res.wide,
                                        **res.wide_variants},
                                       self.device, o.profile_steps, header, self.run.profile_path)

    def run_row(self, cap: float, masks: str, static_v: Variant | None, row: Row) -> None:
        import wide_compile as wc

        res = RowResult(errors=dict(self.errors), skipped=dict(self.skipped), ref=self.dense_vars.get("inductor"),
                        cg=self.dense_vars.get("inductor_cg"), static=static_v, static_shape=row.static_shape,
                        shared_measurement=masks == "all-on")
        res.routers = routers = self.routers_for(cap, masks, res)
        if routers is not None:
            self.bm.use_lora(self.bm.routers.lora(cap, masks))
            wc.attach(self.wide_model, routers)
            try:
                res.measured = measured_capacity(self.wide_model, self.step_of(self.wide_model), self.reset, routers)
            except Exception as e:  # noqa: BLE001
                res.errors["measure_capacity"] = f"{type(e).__name__}: {str(e)[:300]}"
            built = self.build_routed(Row(cap, routers), res)
            res.wide, res.wide_eager = built.get("wide"), built.get("wide_eager")
            res.wide_variants = {k: v for k, v in built.items() if k not in ("wide", "wide_eager") and v is not None}
        self.time_row(res)
        self.check_row(res)
        self.profile_row(cap, masks, res)
        for mm in self.emitted(masks):
            rec = fill(self.record(cap, mm), res, self.bm.routers.mask_model)
            # each record names its own run: a resumed file holds rows of several runs
            rec.update(command=self.run.meta.get("command"), date=self.run.meta.get("date"),
                       lora=os.path.basename(self.bm.lora) if routers is not None and self.bm.lora else None)
            self.run.add(rec)
            log(R.one_line(rec))
        self.run.write()
        if routers is not None:
            wc.detach(self.wide_model)

    # -- the workload ----------------------------------------------------------------------------
    def run_capacity(self, cap: float) -> None:
        row, static_v = Row(cap), None
        if "static" in self.options.variants and cap < 0.9999:
            static_v = self.prepare(VARIANTS["static"], row, self.extra_bytes, self.errors, self.skipped)
        for masks in self.masks_at(cap):
            if self.run.over_budget():
                self.run.skip(f"{self.bm.name} {self.phase} {self.tokens}x{self.batch} cap {cap} {masks}: "
                              "time budget exceeded")
                break
            if self.row_done(cap, masks):
                continue
            self.run_row(cap, masks, static_v, row)
            self.free()
        del static_v
        self.free()

    def memory_high(self) -> bool:
        _, total = torch.cuda.mem_get_info()
        return torch.cuda.memory_allocated() > self.options.reset_mem_frac * total

    def reset_memory(self) -> None:
        """Compiled WIDE graphs stay in Dynamo's cache (with any weight copies the backend made) until a
        reset: reset, and re-build the per-row references (Inductor's cache is warm)."""
        log(f"    memory {torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated: "
            "torch._dynamo.reset() and re-preparing the dense references")
        self.dense_vars.clear()
        torch._dynamo.reset()
        self.free()
        self.build_dense(tuple(n for n in DENSE_ORDER if VARIANTS[n].scope == "row"))

    def execute(self) -> None:
        caps = list(self.options.capacities)
        if all(self.row_done(c, m) for c in caps for m in self.masks_at(c)):
            log(f"  {self.phase} tokens={self.tokens} batch={self.batch}: all rows done (resume)")
            return
        log(f"-- {self.bm.name} {self.phase} tokens={self.tokens} batch={self.batch} "
            f"({self.run.elapsed():.0f}s elapsed)")
        with torch.no_grad():
            self.build_dense()
            for cap in caps:
                if self.run.over_budget():
                    self.run.skip(f"{self.bm.name} {self.phase} {self.tokens}x{self.batch} cap {cap}+: time budget "
                                  f"({self.options.time_budget_s}s) exceeded")
                    break
                self.run_capacity(cap)
                if self.cuda and self.memory_high() and cap != caps[-1]:
                    self.reset_memory()
        self.dense_vars.clear()
        self.extras = {}
        self.state = None
        torch._dynamo.reset()
        self.free()
