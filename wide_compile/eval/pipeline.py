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

from ..routing import FlopCost, attach, detach
from ..routing.attach import _require


# -- capacity on the tokens lm-eval evaluates -------------------------------------------------------
class _Acc(list):
    def __init__(self, meter):
        super().__init__()
        self.meter, self.s, self.n = meter, 0.0, 0.0

    def append(self, m):  # called by the attach hooks with one mask [B, S, G]
        w = self.meter.weight
        frac = m.float().mean(-1).reshape(-1)
        if w is None or w.numel() != frac.numel():
            w = torch.ones_like(frac)
        self.s += float((frac * w).sum())
        self.n += float(w.sum())


@contextlib.contextmanager
def capacity_meter(model, pad_id: int = 0):
    """Accumulate the FLOP capacity over every forward in the context; tokens equal to `pad_id` (lm-eval's
    right padding) are excluded. Yields a dict filled with {"overall", "attn", "ffn", "tokens"} on exit."""
    att = _require(model)
    L = att.routers.spec.num_layers
    meter = type("M", (), {"weight": None})()
    rec = {"attn": [_Acc(meter) for _ in range(L)], "ffn": [_Acc(meter) for _ in range(L)]}

    def pre(mod, args, kwargs):
        ids = args[0] if args else kwargs.get("input")
        meter.weight = (ids != pad_id).reshape(-1).float() if ids is not None else None

    h = model.get_input_embeddings().register_forward_pre_hook(pre, with_kwargs=True)
    att.recorders.append(rec)
    out: dict = {}
    try:
        yield out
    finally:
        att.recorders.remove(rec)
        h.remove()
        if rec["attn"][0].n > 0:
            cost = FlopCost.from_routers(att.routers)
            c = cost.capacity([torch.tensor([a.s / a.n]) for a in rec["attn"]],
                              [torch.tensor([f.s / f.n]) for f in rec["ffn"]])
            out.update({k: float(c[k]) for k in ("overall", "attn", "ffn")})
            out["tokens"] = int(rec["attn"][0].n)


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
    from .helpfmt import DefaultsFormatter

    ap = argparse.ArgumentParser(prog="wide eval pipeline", description=__doc__,
                                 formatter_class=DefaultsFormatter)
    ap.add_argument("--data", default=None, help="data root with wikitext-2/ and the task folders "
                                                 "(default ../shared/data)")
    ap.add_argument("--tasks-dir", default=None, help="prepared lm-eval tasks (made from --data if absent)")
    ap.add_argument("--tokens", default=None, help="training token cache (.npy/.npz); else tokenize train-text")
    ap.add_argument("--train-data", default=None, help="train-text folder (default <data>/train-text)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default=None, help="scratch folder for checkpoints (default <out>/work)")
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--capacities", default="0.5,0.7")
    ap.add_argument("--methods", default="wide,static,skipgpt")
    ap.add_argument("--limit", type=int, default=None, help="items per task (seeded random subset)")
    ap.add_argument("--s1-steps", type=int, default=400)
    ap.add_argument("--s2-steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--s1-lr", type=float, default=3e-3)
    ap.add_argument("--cap-weight", type=float, default=30.0)
    ap.add_argument("--lm-weight", type=float, default=0.1)
    ap.add_argument("--s2-lr", type=float, default=1e-3)
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
    ap.add_argument("--no-stage2", action="store_true")
    ap.add_argument("--s2-recalibrate", action="store_true",
                    help="after stage 2, re-fit the routers' global offset on the LoRA-merged model so the "
                         "capacity on held-out text is the target again (the LoRA shifts the hidden states)")
    ap.add_argument("--eval-batch", type=int, default=64)
    ap.add_argument("--ppl-ctx", type=int, default=1024)
    ap.add_argument("--ppl-stride", type=int, default=512)
    ap.add_argument("--ppl-max-tokens", type=int, default=None)
    ap.add_argument("--deadline", type=float, default=None, help="seconds from start; later items are skipped")
    ap.add_argument("--smoke", action="store_true", help="CPU check: tiny steps, tiny limits")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def main(argv=None):
    ap = build_parser()
    a = ap.parse_args(argv)

    t_start = time.time()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(a.work) if a.work else out / "work"
    art = work / "artifacts"
    art.mkdir(parents=True, exist_ok=True)
    logf = open(out / "pipeline.log", "a")

    def log(msg):
        line = f"[{time.time() - t_start:6.1f}s] {msg}"
        print(line, flush=True)
        logf.write(line + "\n")
        logf.flush()

    from ..models import load_smollm2
    from ..training.data import TokenBlocks, default_data_root, load_tokens
    from ..training.stage1 import Stage1Config, deterministic_capacity, train_stage1
    from ..training.stage2 import Stage2Config, train_stage2
    from . import baselines, report, tasks
    from .perplexity import wikitext2_ppl

    if a.smoke:
        a.s1_steps, a.s2_steps, a.batch_size, a.seq_len = 4, 2, 2, 64
        a.limit = a.limit or 4
        a.ppl_max_tokens = a.ppl_max_tokens or 1024
        a.ppl_ctx, a.ppl_stride = 256, 128
        a.eval_batch = 4
    data_root = Path(a.data) if a.data else default_data_root()
    if a.tasks_dir and (Path(a.tasks_dir) / "counts.json").is_file():
        tasks_dir = Path(a.tasks_dir)
        tasks.write_yamls(tasks_dir)
    else:
        tasks_dir = Path(a.tasks_dir) if a.tasks_dir else work / "tasks"
        tasks.prepare_tasks(data_root, tasks_dir, limit=a.limit)
    task_counts = json.loads((tasks_dir / "counts.json").read_text())
    dev = torch.device(a.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model, tok = load_smollm2(dtype=dtype, device=dev, gguf_path=a.gguf)
    model.requires_grad_(False)
    log(f"model loaded ({dtype}, {dev}); tasks {task_counts}")
    toks = load_tokens(tok, a.train_data or (data_root / "train-text" if data_root else None), a.tokens)
    blocks = TokenBlocks(toks, a.seq_len)
    calib = blocks.heldout[:32] if not a.smoke else blocks.heldout[:2]
    log(f"training tokens {len(toks)}: {len(blocks.train)} train blocks, {len(blocks.heldout)} held-out blocks")

    results = {"records": [], "router_stats": {}, "timings": {}, "date": _dt.date.today().isoformat(),
               "gpu": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu", "versions": versions(),
               "command": "python -m wide_compile.eval pipeline " + " ".join(argv if argv is not None else []),
               "protocol": {
                   "tasks": task_counts, "lm_eval": "zero-shot, local task configs (wide_compile.eval.tasks), "
                   "HFLM on the in-memory model, batch %d" % a.eval_batch,
                   "wikitext2": {"file": "wikitext-2/wiki.test.raw", "ctx": a.ppl_ctx, "stride": a.ppl_stride,
                                 "max_tokens": a.ppl_max_tokens},
                   "capacity_measured": "FLOP capacity on the tokens lm-eval scored (all 5 tasks, padding "
                                        "excluded); capacity_wikitext2 on the WikiText-2 scored tokens",
                   "train": {"tokens_available": int(len(toks)), "seq_len": a.seq_len, "batch": a.batch_size,
                             "s1_steps": a.s1_steps, "s2_steps": a.s2_steps, "s1_lr": a.s1_lr,
                             "cap_weight": a.cap_weight, "lm_weight": a.lm_weight, "s2_lr": a.s2_lr},
                   "dtype": str(dtype)}}
    res_path = out / "accuracy-smollm2.json"

    def save():
        results["timings"]["total_s"] = time.time() - t_start
        report.add_retention(results["records"])
        res_path.write_text(json.dumps(results, indent=1))
        (out / "table.md").write_text(report.markdown_table(results["records"]))
        with tarfile.open(out / "artifacts.tar", "w") as tf:
            for p in sorted(art.glob("*")):  # routers, and the WIDE LoRAs (baseline LoRAs stay in --work)
                if not p.name.endswith(".lora.safetensors") or p.name.startswith("wide-"):
                    tf.add(p, arcname=p.name)


    def evaluate(m, method, stage, cap, routers=None, **extra):
        t0 = time.time()
        if routers is not None:
            attach(m, routers)
        try:
            ppl = wikitext2_ppl(m, tok, data_root, ctx=a.ppl_ctx, stride=a.ppl_stride, batch_size=8,
                                max_tokens=a.ppl_max_tokens)
            if routers is not None:
                with capacity_meter(m) as capm:
                    tk = tasks.evaluate_tasks(m, tok, tasks_dir, batch_size=a.eval_batch)
            else:
                capm = {"overall": 1.0, "attn": 1.0, "ffn": 1.0}
                tk = tasks.evaluate_tasks(m, tok, tasks_dir, batch_size=a.eval_batch)
        finally:
            if routers is not None:
                detach(m)
        rec = {"method": method, "stage": stage, "capacity_target": cap, "capacity_measured": capm.get("overall"),
               "capacity_attn": capm.get("attn"), "capacity_ffn": capm.get("ffn"),
               "capacity_wikitext2": (ppl.get("capacity") or {}).get("overall", 1.0 if routers is None else None),
               "tasks": tk, "wikitext2_ppl": ppl["ppl"], "eval_s": round(time.time() - t0, 1), **extra}
        results["records"].append(rec)
        save()
        avg = sum(v["acc"] for v in tk.values()) / len(tk)
        log(f"RECORD {method} s{stage} c={cap}: cap {rec['capacity_measured']:.3f} (wt2 "
            f"{rec['capacity_wikitext2']:.3f}) avg acc {avg:.4f} ppl {ppl['ppl']:.2f} [{rec['eval_s']}s]")
        return rec

    est = {"eval": 60.0, "s1_step": 0.25, "s2_step": 0.2}

    def left():
        return float("inf") if a.deadline is None else a.deadline - (time.time() - t_start)

    def fits(name, seconds):
        if seconds > left():
            log(f"SKIP {name}: needs ~{seconds:.0f}s, {left():.0f}s left")
            results.setdefault("skipped", []).append(name)
            save()
            return False
        return True

    # 1) dense
    t0 = time.time()
    evaluate(model, "dense", 0, 1.0)
    est["eval"] = time.time() - t0
    caps = [float(c) for c in a.capacities.split(",") if c]
    methods = [m for m in a.methods.split(",") if m]
    s1 = {}
    s1_variant = {}  # (method, cap) -> (capacity stage 1 trained/pruned for, variant fields of its records)
    for cap in caps:
        tag = f"c{int(round(cap * 100))}"
        # stage 1 / baselines at this capacity
        for method in methods:
            # a baseline's capacity: the nominal target, or what WIDE stage 1 spent on the task prompts
            wide_rec = next((x for x in results["records"] if x["method"] == "wide" and x["stage"] == 1
                             and x["capacity_target"] == cap), None)
            at_wide = (a.baselines_at_wide_capacity or (a.static_at_wide_capacity and method == "static"))
            b_cap = cap
            if method != "wide" and at_wide and wide_rec and wide_rec.get("capacity_measured"):
                b_cap = round(float(wide_rec["capacity_measured"]), 4)
            variant = {}
            if b_cap != cap:
                variant = {f"{method}_capacity": b_cap,
                           "variant": f"{method} at WIDE stage 1's measured task-prompt capacity"}
            name = f"{method}-{tag}-s1" + ("-atwide" if variant else "")  # its own work folder (resume)
            loaded = method == "wide" and a.wide_routers and cap == caps[0]
            need = est["eval"] + (a.s1_steps * est["s1_step"] + 10 if method != "static" and not loaded else 10)
            if not fits(name, need):
                continue
            t0 = time.time()
            if method == "static":
                r = baselines.static_pruning(model, calib, b_cap, allocation="best", eval_blocks=calib[:8], log=log)
                extra = {"allocation": r.allocation, **variant}
            elif loaded:
                from ..routing import Routers

                src = Path(a.wide_routers)
                r = Routers.load(src, model) if src.is_file() else Routers.pretrained(a.wide_routers, model)
                r.to(dev)
                extra = {"routers_from": a.wide_routers}
            else:
                cfg = Stage1Config(capacity=b_cap, steps=a.s1_steps, batch_size=a.batch_size, seq_len=a.seq_len,
                                   lr=a.s1_lr, cap_weight=a.cap_weight, lm_weight=a.lm_weight, seed=a.seed,
                                   ckpt_every=max(50, a.s1_steps // 4), calib_blocks=len(calib))
                if method == "skipgpt":
                    s = baselines.skipgpt_config(model, b_cap)
                    cfg.head_group_size, cfg.ffn_group_size = s.head_group_size, s.ffn_group_size
                r = train_stage1(model, blocks, cfg, out_dir=work / name, log=log, progress=False)
                est["s1_step"] = max(0.01, (time.time() - t0 - 5) / a.s1_steps)
                # a run resumed from its final checkpoint trains no step, so it has no history of its own
                h = r.train_history[-1] if r.train_history else None
                extra = {"train_final": {k: h[k] for k in ("kd", "lm", "cap")}} if h else {"resumed": True}
                extra.update(variant)
            held = deterministic_capacity(model, r, calib)
            extra["capacity_heldout"] = held["overall"]
            extra["train_s"] = round(time.time() - t0, 1)
            r.name = f"smollm2-135m-{tag}" if method == "wide" else f"{method}-smollm2-135m-{tag}"
            r.save(art / f"{method}-{tag}-s1.safetensors")
            s1[(method, cap)] = r
            s1_variant[(method, cap)] = (b_cap, variant)  # stage 2 on these routers/groups carries the same
            log(f"{name}: trained/built in {extra['train_s']}s, held-out capacity {held['overall']:.4f}")
            evaluate(model, method, 1, cap, r, **extra)
            if method != "static":
                results["router_stats"][f"{method} {tag} stage 1"] = report.router_stats(model, tok, r, calib[:16])
                save()
                with contextlib.suppress(Exception):
                    report.plot_stats(results["router_stats"], out / "router-skip-smollm2.png")
        if a.no_stage2:
            continue
        s2_methods = [m for m in (a.stage2_methods.split(",") if a.stage2_methods else methods) if m]
        for method in [m for m in methods if m in s2_methods]:
            b_cap, variant = s1_variant.get((method, cap), (cap, {}))
            name = f"{method}-{tag}-s2" + ("-atwide" if variant else "")
            if (method, cap) not in s1 or not fits(name, est["eval"] + a.s2_steps * est["s2_step"] + 10):
                continue
            t0 = time.time()
            c2 = Stage2Config(steps=a.s2_steps, batch_size=a.batch_size, seq_len=a.seq_len, lr=a.s2_lr,
                              lm_weight=a.lm_weight, seed=a.seed, ckpt_every=max(50, a.s2_steps // 2))
            merged, r2, _ = train_stage2(model, s1[(method, cap)], blocks, c2, out_dir=work / name, log=log,
                                         progress=False)
            est["s2_step"] = max(0.01, (time.time() - t0 - 5) / a.s2_steps)
            shutil.copy(work / name / "lora.safetensors", art / f"{method}-{tag}-s2.lora.safetensors")
            if a.s2_recalibrate and method != "static":
                from ..training.stage1 import calibrate_offset_

                # back to the capacity stage 1 was trained for (a baseline at WIDE's capacity keeps that one)
                calibrate_offset_(merged, r2, calib, b_cap, log=log)
                r2.save(art / f"{method}-{tag}-s2.safetensors")
            held = deterministic_capacity(merged, r2, calib)
            final = {"train_final": {"kd": merged.train_history[-1]["kd"]}} if merged.train_history else {"resumed": True}
            evaluate(merged, method, 2, cap, r2, train_s=round(time.time() - t0, 1),
                     capacity_heldout=held["overall"], **final, **variant)
            del merged
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    # joint stage 2 (routers trained with the LoRA), WIDE at the first capacity
    if a.joint and not a.no_stage2 and ("wide", caps[0]) in s1:
        cap = caps[0]
        tag = f"c{int(round(cap * 100))}"
        name = f"wide-{tag}-s2joint"
        if fits(name, est["eval"] + a.s2_steps * est["s2_step"] * 1.3 + 15):
            t0 = time.time()
            c2 = Stage2Config(steps=a.s2_steps, batch_size=a.batch_size, seq_len=a.seq_len, lr=a.s2_lr,
                              lm_weight=a.lm_weight, seed=a.seed, joint=True, cap_weight=a.cap_weight,
                              ckpt_every=max(50, a.s2_steps // 2))
            merged, r2, _ = train_stage2(model, s1[("wide", cap)], blocks, c2, out_dir=work / name, log=log,
                                         progress=False)
            from ..training.stage1 import calibrate_offset_

            calibrate_offset_(merged, r2, calib, cap, log=log)
            r2.save(art / f"wide-{tag}-s2joint.safetensors")
            shutil.copy(work / name / "lora.safetensors", art / f"wide-{tag}-s2joint.lora.safetensors")
            held = deterministic_capacity(merged, r2, calib)
            evaluate(merged, "wide", 2, cap, r2, variant="joint routers", train_s=round(time.time() - t0, 1),
                     capacity_heldout=held["overall"])
    log(f"done in {time.time() - t_start:.0f}s")
    save()
    return 0
