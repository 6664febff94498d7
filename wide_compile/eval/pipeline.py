"""The whole SmolLM2 accuracy study in one process (the GPU run): train, build baselines, evaluate, report.

Order (most important first, so a deadline or timeout still leaves the key records): dense; then for each
capacity (0.5 first): WIDE stage 1, static pruning, SkipGPT stage 1, WIDE stage 2 (LoRA), static + LoRA,
SkipGPT + LoRA; then WIDE stage 2 with jointly trained routers. After every record the results JSON is
rewritten, and router / LoRA files are re-bundled into artifacts.tar, so a partial run returns what it did.
Each item is skipped if the time it is expected to take exceeds what is left before --deadline.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import platform
import shutil
import tarfile
import time
from pathlib import Path

import torch

from ..routing import attach, detach
from .capacity import capacity_meter


def versions() -> dict:
    import transformers

    v = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    for m in ("peft", "lm_eval", "accelerate"):
        try:
            v[m] = __import__(m).__version__
        except Exception:  # noqa: BLE001
            try:
                from importlib.metadata import version

                v[m] = version(m.replace("_", "-"))
            except Exception:  # noqa: BLE001
                v[m] = None
    return v


def build_parser() -> argparse.ArgumentParser:
    from ..helpfmt import HelpFormatter

    ap = argparse.ArgumentParser(prog="wide eval pipeline", description=__doc__,
                                 formatter_class=HelpFormatter)
    ap.add_argument("--data", default=None, help="data root with wikitext-2/, train-text/ and the task folders; "
                                                 "unset: $WIDE_DATA_DIR, else ../shared/data next to the checkout")
    ap.add_argument("--tasks-dir", default=None, help="prepared lm-eval tasks (made from --data if absent)")
    ap.add_argument("--tokens", default=None, help="training token cache (.npy/.npz); else tokenize train-text")
    ap.add_argument("--train-data", default=None, help="train-text folder (default <data>/train-text)")
    ap.add_argument("--out", required=True, help="folder for accuracy-smollm2.json, table.md, artifacts.tar "
                                                 "and pipeline.log")
    ap.add_argument("--work", default=None, help="scratch folder for checkpoints (default <out>/work)")
    ap.add_argument("--gguf", default=None, help="SmolLM2 GGUF; unset: $WIDE_SMOLLM2_GGUF, else the cache")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="bf16 on CUDA, fp32 on the CPU")
    ap.add_argument("--capacities", default="0.5,0.7", help="comma-separated capacity targets, in this order")
    ap.add_argument("--methods", default="wide,static,skipgpt", help="comma-separated subset of wide,static,skipgpt")
    ap.add_argument("--limit", type=int, default=None, help="items per task (seeded random subset)")
    ap.add_argument("--s1-steps", type=int, default=400, help="stage-1 (router) training steps")
    ap.add_argument("--s2-steps", type=int, default=200, help="stage-2 (LoRA) training steps")
    ap.add_argument("--batch-size", type=int, default=8, help="training sequences per step")
    ap.add_argument("--seq-len", type=int, default=512, help="training sequence length (tokens)")
    ap.add_argument("--s1-lr", type=float, default=3e-3, help="stage-1 learning rate")
    ap.add_argument("--cap-weight", type=float, default=30.0, help="weight of the capacity loss")
    ap.add_argument("--lm-weight", type=float, default=0.1, help="weight of the LM loss beside distillation")
    ap.add_argument("--s2-lr", type=float, default=1e-3, help="stage-2 (LoRA) learning rate")
    ap.add_argument("--joint", action="store_true", help="also run WIDE stage 2 with jointly trained routers")
    ap.add_argument("--static-at-wide-capacity", action="store_true",
                    help="build the static baseline at the FLOP capacity WIDE stage 1 actually spent on the task "
                         "prompts (so the two are compared at equal measured FLOPs), not at the nominal target")
    ap.add_argument("--baselines-at-wide-capacity", action="store_true",
                    help="like --static-at-wide-capacity, and also train SkipGPT's routers to that capacity")
    ap.add_argument("--wide-routers", default=None,
                    help="WIDE stage-1 routers to evaluate instead of training them: a shipped name "
                         "(Routers.available()) or a .safetensors file; used at the first capacity only")
    ap.add_argument("--stage2-methods", default=None,
                    help="methods that get a stage 2 (default: all of --methods), e.g. static,skipgpt")
    ap.add_argument("--no-stage2", action="store_true", help="stage 1 and the baselines only")
    ap.add_argument("--s2-recalibrate", action="store_true",
                    help="after stage 2, re-fit the routers' global offset on the LoRA-merged model so the "
                         "capacity on held-out text is the target again (the LoRA shifts the hidden states)")
    ap.add_argument("--eval-batch", type=int, default=64, help="lm-eval batch size")
    ap.add_argument("--ppl-ctx", type=int, default=1024, help="WikiText-2 perplexity window")
    ap.add_argument("--ppl-stride", type=int, default=512, help="WikiText-2 perplexity stride")
    ap.add_argument("--ppl-max-tokens", type=int, default=None, help="score only the first N test tokens")
    ap.add_argument("--deadline", type=float, default=None, help="seconds from start; later items are skipped")
    ap.add_argument("--smoke", action="store_true", help="CPU check: tiny steps, tiny limits")
    ap.add_argument("--seed", type=int, default=0, help="training seed")
    return ap



def _apply_smoke(a) -> None:
    """--smoke: tiny steps, windows and limits, so the whole study runs on a CPU."""
    a.s1_steps, a.s2_steps, a.batch_size, a.seq_len = 4, 2, 2, 64
    a.limit = a.limit or 4
    a.ppl_max_tokens = a.ppl_max_tokens or 1024
    a.ppl_ctx, a.ppl_stride = 256, 128
    a.eval_batch = 4


def _tag(cap: float) -> str:
    return f"c{int(round(cap * 100))}"


class _Study:
    """One run of the study: its folders and log, the model and data, the results file (rewritten after every
    record) and the time estimates that decide what still fits before --deadline."""

    def __init__(self, a, argv):
        self.a, self.t_start = a, time.time()
        self.out = Path(a.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = Path(a.work) if a.work else self.out / "work"
        self.art = self.work / "artifacts"
        self.art.mkdir(parents=True, exist_ok=True)
        self.logf = open(self.out / "pipeline.log", "a")
        self.est = {"eval": 60.0, "s1_step": 0.25, "s2_step": 0.2}  # seconds; replaced by what the run takes
        self.s1 = {}  # (method, cap) -> stage-1 routers
        self.s1_variant = {}  # (method, cap) -> (capacity stage 1 trained/pruned for, variant fields of its records)
        self._load_inputs()
        self.results = self._results_header(argv)

    def _load_inputs(self) -> None:
        from ..models import load_smollm2
        from ..training.data import TokenBlocks, load_tokens
        from . import records, tasks
        from .perplexity import WIKITEXT2_TEST

        a = self.a
        prepared = bool(a.tasks_dir) and (Path(a.tasks_dir) / "counts.json").is_file()
        task_files = [] if prepared else tasks.data_files()
        self.data_root = records.require_data(records.data_root(a.data), WIKITEXT2_TEST, *task_files)
        if prepared:
            self.tasks_dir = Path(a.tasks_dir)
            tasks.write_yamls(self.tasks_dir)
        else:
            self.tasks_dir = Path(a.tasks_dir) if a.tasks_dir else self.work / "tasks"
            tasks.prepare_tasks(self.data_root, self.tasks_dir, limit=a.limit)
        self.task_counts = json.loads((self.tasks_dir / "counts.json").read_text())
        self.dev = torch.device(a.device)
        self.dtype = torch.bfloat16 if self.dev.type == "cuda" else torch.float32
        self.model, self.tok = load_smollm2(dtype=self.dtype, device=self.dev, gguf_path=a.gguf)
        self.model.requires_grad_(False)
        self.log(f"model loaded ({self.dtype}, {self.dev}); tasks {self.task_counts}")
        self.toks = load_tokens(self.tok, a.train_data or self.data_root / "train-text", a.tokens)
        self.blocks = TokenBlocks(self.toks, a.seq_len)
        self.calib = self.blocks.heldout[:32] if not a.smoke else self.blocks.heldout[:2]
        self.log(f"training tokens {len(self.toks)}: {len(self.blocks.train)} train blocks, "
                 f"{len(self.blocks.heldout)} held-out blocks")

    def _results_header(self, argv) -> dict:
        a = self.a
        return {"records": [], "router_stats": {}, "timings": {}, "date": _dt.date.today().isoformat(),
                "gpu": torch.cuda.get_device_name(0) if self.dev.type == "cuda" else "cpu", "versions": versions(),
                "command": "python -m wide_compile.eval pipeline " + " ".join(argv if argv is not None else []),
                "protocol": {
                    "tasks": self.task_counts, "lm_eval": "zero-shot, local task configs (wide_compile.eval.tasks), "
                    "HFLM on the in-memory model, batch %d" % a.eval_batch,
                    "wikitext2": {"file": "wikitext-2/wiki.test.raw", "ctx": a.ppl_ctx, "stride": a.ppl_stride,
                                  "max_tokens": a.ppl_max_tokens},
                    "capacity_measured": "FLOP capacity on the tokens lm-eval scored (all 5 tasks, padding "
                                         "excluded); capacity_wikitext2 on the WikiText-2 scored tokens",
                    "train": {"tokens_available": int(len(self.toks)), "seq_len": a.seq_len, "batch": a.batch_size,
                              "s1_steps": a.s1_steps, "s2_steps": a.s2_steps, "s1_lr": a.s1_lr,
                              "cap_weight": a.cap_weight, "lm_weight": a.lm_weight, "s2_lr": a.s2_lr},
                    "dtype": str(self.dtype)}}

    # -- bookkeeping --------------------------------------------------------------------------------
    def log(self, msg) -> None:
        line = f"[{time.time() - self.t_start:6.1f}s] {msg}"
        print(line, flush=True)
        self.logf.write(line + "\n")
        self.logf.flush()

    def save(self) -> None:
        from . import report

        self.results["timings"]["total_s"] = time.time() - self.t_start
        report.add_retention(self.results["records"])
        (self.out / "accuracy-smollm2.json").write_text(json.dumps(self.results, indent=1))
        (self.out / "table.md").write_text(report.markdown_table(self.results["records"]))
        with tarfile.open(self.out / "artifacts.tar", "w") as tf:
            for p in sorted(self.art.glob("*")):  # routers, and the WIDE LoRAs (baseline LoRAs stay in --work)
                if not p.name.endswith(".lora.safetensors") or p.name.startswith("wide-"):
                    tf.add(p, arcname=p.name)

    def left(self) -> float:
        a = self.a
        return float("inf") if a.deadline is None else a.deadline - (time.time() - self.t_start)

    def fits(self, name: str, seconds: float) -> bool:
        if seconds > self.left():
            self.log(f"SKIP {name}: needs ~{seconds:.0f}s, {self.left():.0f}s left")
            self.results.setdefault("skipped", []).append(name)
            self.save()
            return False
        return True

    def evaluate(self, m, method, stage, cap, routers=None, **extra) -> dict:
        """WikiText-2 ppl and the zero-shot tasks of `m` (routed by `routers` if given): one record."""
        from . import tasks
        from .perplexity import wikitext2_ppl

        a, t0 = self.a, time.time()
        if routers is not None:
            attach(m, routers)
        try:
            ppl = wikitext2_ppl(m, self.tok, self.data_root, ctx=a.ppl_ctx, stride=a.ppl_stride, batch_size=8,
                                max_tokens=a.ppl_max_tokens)
            dense = contextlib.nullcontext({"overall": 1.0, "attn": 1.0, "ffn": 1.0})
            with capacity_meter(m) if routers is not None else dense as capm:
                tk = tasks.evaluate_tasks(m, self.tok, self.tasks_dir, batch_size=a.eval_batch)
        finally:
            if routers is not None:
                detach(m)
        rec = {"method": method, "stage": stage, "capacity_target": cap, "capacity_measured": capm.get("overall"),
               "capacity_attn": capm.get("attn"), "capacity_ffn": capm.get("ffn"),
               "capacity_wikitext2": (ppl.get("capacity") or {}).get("overall", 1.0 if routers is None else None),
               "tasks": tk, "wikitext2_ppl": ppl["ppl"], "eval_s": round(time.time() - t0, 1), **extra}
        self.results["records"].append(rec)
        self.save()
        avg = sum(v["acc"] for v in tk.values()) / len(tk)
        self.log(f"RECORD {method} s{stage} c={cap}: cap {rec['capacity_measured']:.3f} (wt2 "
                 f"{rec['capacity_wikitext2']:.3f}) avg acc {avg:.4f} ppl {ppl['ppl']:.2f} [{rec['eval_s']}s]")
        return rec

    # -- the items ----------------------------------------------------------------------------------
    def baseline_capacity(self, method: str, cap: float) -> tuple[float, dict]:
        """A method's capacity at target `cap`: the target, or (--*-at-wide-capacity) what WIDE stage 1 spent
        on the task prompts; and the variant fields its records then carry."""
        a = self.a
        wide_rec = next((x for x in self.results["records"] if x["method"] == "wide" and x["stage"] == 1
                         and x["capacity_target"] == cap), None)
        at_wide = a.baselines_at_wide_capacity or (a.static_at_wide_capacity and method == "static")
        b_cap = cap
        if method != "wide" and at_wide and wide_rec and wide_rec.get("capacity_measured"):
            b_cap = round(float(wide_rec["capacity_measured"]), 4)
        if b_cap == cap:
            return b_cap, {}
        return b_cap, {f"{method}_capacity": b_cap, "variant": f"{method} at WIDE stage 1's measured task-prompt capacity"}

    def _build_stage1(self, method, b_cap, name, loaded, variant, t0):
        """(routers, record fields) of `method` at capacity `b_cap`: pruned, loaded or trained."""
        from ..training.stage1 import Stage1Config, train_stage1
        from . import baselines

        a = self.a
        if method == "static":
            r = baselines.static_pruning(self.model, self.calib, b_cap, allocation="best",
                                         eval_blocks=self.calib[:8], log=self.log)
            return r, {"allocation": r.allocation, **variant}
        if loaded:
            from ..routing import Routers

            src = Path(a.wide_routers)
            r = Routers.load(src, self.model) if src.is_file() else Routers.pretrained(a.wide_routers, self.model)
            r.to(self.dev)
            return r, {"routers_from": a.wide_routers}
        cfg = Stage1Config(capacity=b_cap, steps=a.s1_steps, batch_size=a.batch_size, seq_len=a.seq_len,
                           lr=a.s1_lr, cap_weight=a.cap_weight, lm_weight=a.lm_weight, seed=a.seed,
                           ckpt_every=max(50, a.s1_steps // 4), calib_blocks=len(self.calib))
        if method == "skipgpt":
            s = baselines.skipgpt_config(self.model, b_cap)
            cfg.head_group_size, cfg.ffn_group_size = s.head_group_size, s.ffn_group_size
        r = train_stage1(self.model, self.blocks, cfg, out_dir=self.work / name, log=self.log, progress=False)
        self.est["s1_step"] = max(0.01, (time.time() - t0 - 5) / a.s1_steps)
        # a run resumed from its final checkpoint trains no step, so it has no history of its own
        h = r.train_history[-1] if r.train_history else None
        extra = {"train_final": {k: h[k] for k in ("kd", "lm", "cap")}} if h else {"resumed": True}
        return r, {**extra, **variant}

    def stage1(self, method: str, cap: float, first_cap: bool) -> None:
        """Stage 1 of `method` at target `cap` (routers trained or loaded, or static pruning), then its record."""
        from ..training.stage1 import deterministic_capacity
        from . import report

        a, tag = self.a, _tag(cap)
        b_cap, variant = self.baseline_capacity(method, cap)
        name = f"{method}-{tag}-s1" + ("-atwide" if variant else "")  # its own work folder (resume)
        loaded = method == "wide" and a.wide_routers and first_cap
        need = self.est["eval"] + (a.s1_steps * self.est["s1_step"] + 10 if method != "static" and not loaded else 10)
        if not self.fits(name, need):
            return
        t0 = time.time()
        r, extra = self._build_stage1(method, b_cap, name, loaded, variant, t0)
        held = deterministic_capacity(self.model, r, self.calib)
        extra["capacity_heldout"] = held["overall"]
        extra["train_s"] = round(time.time() - t0, 1)
        r.name = f"smollm2-135m-{tag}" if method == "wide" else f"{method}-smollm2-135m-{tag}"
        r.save(self.art / f"{method}-{tag}-s1.safetensors")
        self.s1[(method, cap)] = r
        self.s1_variant[(method, cap)] = (b_cap, variant)  # stage 2 on these routers/groups carries the same
        self.log(f"{name}: trained/built in {extra['train_s']}s, held-out capacity {held['overall']:.4f}")
        self.evaluate(self.model, method, 1, cap, r, **extra)
        if method != "static":
            stats = self.results["router_stats"]
            stats[f"{method} {tag} stage 1"] = report.router_stats(self.model, self.tok, r, self.calib[:16])
            self.save()
            with contextlib.suppress(Exception):
                report.plot_stats(stats, self.out / "router-skip-smollm2.png")

    def _train_stage2(self, routers, name, **cfg):
        from ..training.stage2 import Stage2Config, train_stage2

        a = self.a
        c2 = Stage2Config(steps=a.s2_steps, batch_size=a.batch_size, seq_len=a.seq_len, lr=a.s2_lr,
                          lm_weight=a.lm_weight, seed=a.seed, ckpt_every=max(50, a.s2_steps // 2), **cfg)
        merged, r2, _ = train_stage2(self.model, routers, self.blocks, c2, out_dir=self.work / name, log=self.log,
                                     progress=False)
        return merged, r2

    def stage2(self, method: str, cap: float) -> None:
        """Stage 2 (LoRA) on `method`'s stage-1 routers at target `cap`, then its record."""
        from ..training.stage1 import calibrate_offset_, deterministic_capacity

        a, tag = self.a, _tag(cap)
        b_cap, variant = self.s1_variant.get((method, cap), (cap, {}))
        name = f"{method}-{tag}-s2" + ("-atwide" if variant else "")
        if (method, cap) not in self.s1 or not self.fits(name, self.est["eval"] + a.s2_steps * self.est["s2_step"] + 10):
            return
        t0 = time.time()
        merged, r2 = self._train_stage2(self.s1[(method, cap)], name)
        self.est["s2_step"] = max(0.01, (time.time() - t0 - 5) / a.s2_steps)
        shutil.copy(self.work / name / "lora.safetensors", self.art / f"{method}-{tag}-s2.lora.safetensors")
        if a.s2_recalibrate and method != "static":
            # back to the capacity stage 1 was trained for (a baseline at WIDE's capacity keeps that one)
            calibrate_offset_(merged, r2, self.calib, b_cap, log=self.log)
            r2.save(self.art / f"{method}-{tag}-s2.safetensors")
        held = deterministic_capacity(merged, r2, self.calib)
        final = {"train_final": {"kd": merged.train_history[-1]["kd"]}} if merged.train_history else {"resumed": True}
        self.evaluate(merged, method, 2, cap, r2, train_s=round(time.time() - t0, 1),
                      capacity_heldout=held["overall"], **final, **variant)
        del merged
        if self.dev.type == "cuda":
            torch.cuda.empty_cache()

    def joint_stage2(self, cap: float) -> None:
        """WIDE stage 2 with the routers trained jointly with the LoRA, re-calibrated to `cap`."""
        from ..training.stage1 import calibrate_offset_, deterministic_capacity

        a, tag = self.a, _tag(cap)
        name = f"wide-{tag}-s2joint"
        if not self.fits(name, self.est["eval"] + a.s2_steps * self.est["s2_step"] * 1.3 + 15):
            return
        t0 = time.time()
        merged, r2 = self._train_stage2(self.s1[("wide", cap)], name, joint=True, cap_weight=a.cap_weight)
        calibrate_offset_(merged, r2, self.calib, cap, log=self.log)
        r2.save(self.art / f"wide-{tag}-s2joint.safetensors")
        shutil.copy(self.work / name / "lora.safetensors", self.art / f"wide-{tag}-s2joint.lora.safetensors")
        held = deterministic_capacity(merged, r2, self.calib)
        self.evaluate(merged, "wide", 2, cap, r2, variant="joint routers", train_s=round(time.time() - t0, 1),
                      capacity_heldout=held["overall"])

    def run(self) -> None:
        """Dense first; then per capacity every method's stage 1, then their stage 2; then the joint stage 2."""
        a = self.a
        t0 = time.time()
        self.evaluate(self.model, "dense", 0, 1.0)
        self.est["eval"] = time.time() - t0
        caps = [float(c) for c in a.capacities.split(",") if c]
        methods = [m for m in a.methods.split(",") if m]
        s2_methods = [m for m in (a.stage2_methods.split(",") if a.stage2_methods else methods) if m]
        for cap in caps:
            for method in methods:
                self.stage1(method, cap, first_cap=cap == caps[0])
            if not a.no_stage2:
                for method in [m for m in methods if m in s2_methods]:
                    self.stage2(method, cap)
        if a.joint and not a.no_stage2 and ("wide", caps[0]) in self.s1:
            self.joint_stage2(caps[0])
        self.log(f"done in {time.time() - self.t_start:.0f}s")
        self.save()


def main(argv=None):
    a = build_parser().parse_args(argv)
    if a.smoke:
        _apply_smoke(a)
    study = _Study(a, argv)
    try:
        study.run()
    finally:
        study.logf.close()
    return 0
