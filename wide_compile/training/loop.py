"""The resumable training loop shared by stage 1 and stage 2.

A phase (one stage of one run) lives in a folder. Its checkpoint (<dir>/ckpt/) holds everything the next
invocation needs to continue exactly where this one stopped: the trainable tensors, the AdamW state, the
torch RNG states (Gumbel noise), the best-so-far trainables, and state.json (step, the held-out
evaluations, early-stopping counter, the curve). The data position is a function of the step
(data.TokenBlocks.batches is seeded per epoch), so the step restores it. A run therefore splits across
invocations: a wall-clock deadline (or `stop_after`) checkpoints and returns "paused"; re-running the
same phase continues; a finished phase returns "done" at once.

Under torchrun (training/distributed.py) every rank runs the loop; checkpoint tensors are gathered to full
tensors on every rank, rank 0 writes the files (the single-process format, RNG states of every rank
added), and the others wait for it.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from . import distributed
from .curves import write_curve

STATE_VERSION = 1


@dataclass
class Phase:
    """What a stage hands the loop.

    trainables(): name -> tensor of everything being trained (saved / restored / kept as the best);
    load_trainables(d): put such a dict back. step_fn(step, ids) runs forward + backward + optimizer step
    and returns detached scalar tensors (no host sync); schedule(step) -> dict of floats logged with it
    (tau, targets, lr factor). evaluate() -> dict with at least "ppl" (held-out, routed, deterministic).
    eligible(step): whether an evaluation at this step may become the best / count for patience (e.g.
    only once the capacity ramp has reached the target)."""

    name: str
    out_dir: Path | None
    total_steps: int
    tokens_per_step: int
    batches: Callable[[int], "object"]  # start step -> iterator of id batches
    step_fn: Callable
    schedule: Callable[[int], dict]
    evaluate: Callable[[bool], dict]
    trainables: Callable[[], dict]
    load_trainables: Callable[[dict], None]
    optimizer: torch.optim.Optimizer
    eligible: Callable[[int], bool] = lambda step: True
    eval_every: int = 0          # 0: only at the end
    patience: int = 0            # evaluations without improvement before stopping early; 0: never
    log_every: int = 10
    ckpt_every: int = 100
    config: dict = field(default_factory=dict)


@dataclass
class LoopState:
    step: int = 0
    curve: dict = field(default_factory=lambda: {"train": [], "eval": []})
    best_ppl: float | None = None
    best_step: int | None = None
    bad_evals: int = 0
    trained: bool = False        # the training steps are over (finished or stopped early)
    stopped_early: bool = False
    acc: dict = field(default_factory=dict)  # sums of the open logging interval (a pause may split one)
    n_acc: int = 0

    def to_json(self) -> str:
        return json.dumps({"version": STATE_VERSION, **self.__dict__})

    @classmethod
    def from_json(cls, s: str) -> "LoopState":
        d = json.loads(s)
        d.pop("version", None)
        return cls(**d)


# -- checkpoint files --------------------------------------------------------------------------------
def _save_tensors(d: dict, path: Path, meta: dict | None = None) -> None:
    from safetensors.torch import save_file

    tmp = path.with_suffix(".tmp")
    save_file({k: v.detach().cpu().contiguous() for k, v in d.items()}, str(tmp), metadata=meta)
    tmp.replace(path)  # a checkpoint is whole or absent, never half-written


def _load_tensors(path: Path) -> tuple[dict, dict]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, (f.metadata() or {})


def optimizer_tensors(opt: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(tensors, metadata) of the optimizer state: "<param index>.<name>" -> full tensor (a sharded state is
    gathered: call on every rank), param_groups as JSON."""
    sd = opt.state_dict()
    tensors = {}
    for pid, st in sd["state"].items():
        for k, v in st.items():
            tensors[f"{pid}.{k}"] = v if torch.is_tensor(v) else torch.tensor(v)
    return distributed.full_tensors(tensors), {"param_groups": json.dumps(sd["param_groups"])}


def save_optimizer(opt: torch.optim.Optimizer, path: Path) -> None:
    tensors, meta = optimizer_tensors(opt)
    _save_tensors(tensors, path, meta)


def load_optimizer(opt: torch.optim.Optimizer, path: Path) -> None:
    """Load a state saved by save_optimizer; a sharded (DTensor) parameter gets its slice of the full state."""
    tensors, meta = _load_tensors(path)
    params = [p for g in opt.param_groups for p in g["params"]]
    state: dict = {}
    for k, v in tensors.items():
        pid, name = k.split(".", 1)
        p = params[int(pid)]
        state.setdefault(int(pid), {})[name] = distributed.shard_like(v, p) if v.shape == p.shape else v
    opt.load_state_dict({"state": state, "param_groups": json.loads(meta["param_groups"])})


def _rng_state() -> dict:
    d = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            d[f"cuda{i}"] = s
    return d


def _set_rng_state(d: dict) -> None:
    torch.set_rng_state(d["cpu"])
    cuda = [d[k] for k in sorted(k for k in d if k.startswith("cuda"))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)


class Checkpoint:
    """<phase dir>/ckpt/{state.json, train, opt, rng, best}.safetensors."""

    def __init__(self, phase_dir: Path | None):
        self.dir = Path(phase_dir) / "ckpt" if phase_dir is not None else None

    def exists(self) -> bool:
        return self.dir is not None and (self.dir / "state.json").is_file()

    def save(self, phase: Phase, st: LoopState) -> None:
        if self.dir is None:
            return
        env = distributed.current()
        train = distributed.full_tensors(phase.trainables())  # collectives: every rank, before rank 0 writes
        opt, opt_meta = optimizer_tensors(phase.optimizer)
        rng = env.gather_rng(env.rng_state()) if env.active else _rng_state()
        if env.is_main:
            self.dir.mkdir(parents=True, exist_ok=True)
            _save_tensors(train, self.dir / "train.safetensors")
            _save_tensors(opt, self.dir / "opt.safetensors", opt_meta)
            _save_tensors(rng, self.dir / "rng.safetensors")
            tmp = self.dir / "state.json.tmp"
            tmp.write_text(st.to_json())
            tmp.replace(self.dir / "state.json")  # written last: it is what says the checkpoint is complete
        env.barrier()

    def save_best(self, phase: Phase) -> None:
        if self.dir is not None:
            env = distributed.current()
            best = distributed.full_tensors(phase.trainables())
            if env.is_main:
                self.dir.mkdir(parents=True, exist_ok=True)
                _save_tensors(best, self.dir / "best.safetensors")
            env.barrier()

    def load(self, phase: Phase, log=print) -> LoopState:
        st = LoopState.from_json((self.dir / "state.json").read_text())
        phase.load_trainables(_load_tensors(self.dir / "train.safetensors")[0])
        load_optimizer(phase.optimizer, self.dir / "opt.safetensors")
        rng, env = _load_tensors(self.dir / "rng.safetensors")[0], distributed.current()
        if not env.active:
            _set_rng_state(rng)
            return st
        if (mine := env.local_rng(rng)) is not None:
            env.set_rng_state(mine)
        if (have := env.ranks_with_rng(rng)) < env.world_size:
            log(f"{phase.name}: the checkpoint holds the RNG states of {have} process(es): ranks {have} and up "
                "continue their Gumbel noise from their own seeds")
        return st

    def best(self) -> dict | None:
        p = self.dir / "best.safetensors" if self.dir is not None else None
        return _load_tensors(p)[0] if p is not None and p.is_file() else None


# -- the loop ----------------------------------------------------------------------------------------
class Clock:
    """Wall-clock budget of one invocation: `deadline_at` (time.time() seconds, or None) and running
    estimates of what a step, an evaluation and a checkpoint cost, to stop while a checkpoint still fits."""

    def __init__(self, deadline_at: float | None, margin_s: float = 5.0):
        self.deadline_at, self.margin = deadline_at, margin_s
        self.step_s = self.eval_s = self.save_s = 0.0

    def fits(self, step_due_eval: bool) -> bool:
        if self.deadline_at is None:
            return True
        need = self.step_s + (self.eval_s if step_due_eval else 0.0) + self.save_s + self.margin
        # under torchrun rank 0's clock decides for all: a rank that paused alone would wait forever
        return distributed.current().agree(time.time() + need < self.deadline_at)

    @staticmethod
    def ema(old: float, new: float) -> float:
        return new if old == 0.0 else 0.7 * old + 0.3 * new


def run_phase(phase: Phase, clock: Clock | None = None, log=print, stop_after: int | None = None,
              progress: bool = False) -> tuple[str, LoopState]:
    """Train `phase` from its checkpoint (or from the start). Returns ("done" | "paused", state).

    "paused": the deadline (or `stop_after` steps in this invocation) came first; a checkpoint holds the
    exact state. "done": all steps ran or early stopping ended them; the best trainables (if any eligible
    evaluation) are loaded into the phase."""
    clock = clock or Clock(None)
    ck = Checkpoint(phase.out_dir)
    st = ck.load(phase, log) if ck.exists() else LoopState()
    if st.step:
        log(f"{phase.name}: resumed at step {st.step}/{phase.total_steps}")
    if not st.trained:
        status = _train(phase, st, ck, clock, log, stop_after, progress)
        if status == "paused":
            return status, st
    best = ck.best() if st.best_step is not None else None
    if best is not None:
        phase.load_trainables(best)
    return "done", st


def _eval_due(phase: Phase, step: int) -> bool:
    return step == phase.total_steps or (phase.eval_every > 0 and step % phase.eval_every == 0)


def _train(phase: Phase, st: LoopState, ck: Checkpoint, clock: Clock, log, stop_after, progress) -> str:
    from tqdm.auto import tqdm

    it = phase.batches(st.step)
    acc: dict = dict(st.acc)
    n_acc, ran, t_last = st.n_acc, 0, time.time()
    bar = tqdm(total=phase.total_steps, initial=st.step, desc=phase.name, disable=not progress, mininterval=5)
    while st.step < phase.total_steps:
        if (stop_after is not None and ran >= stop_after) or not clock.fits(_eval_due(phase, st.step + 1)):
            st.acc, st.n_acc = {k: float(v) for k, v in acc.items()}, n_acc
            _checkpoint(phase, st, ck, clock)
            log(f"{phase.name}: paused at step {st.step}/{phase.total_steps} (re-run to continue)")
            return "paused"
        t0 = time.time()
        out = phase.step_fn(st.step, next(it))
        for k, v in out.items():
            acc[k] = acc[k] + v if k in acc else v
        n_acc += 1
        st.step += 1
        ran += 1
        bar.update(1)
        if st.step % phase.log_every == 0 or st.step == phase.total_steps:
            rec = {"step": st.step, "tokens": st.step * phase.tokens_per_step,
                   **{k: float(v) / n_acc for k, v in acc.items()}, **phase.schedule(st.step - 1)}
            st.curve["train"].append(rec)
            acc, n_acc = {}, 0
            now = time.time()  # a host sync happened above (float): wall time per step is GPU time per step
            clock.step_s = clock.ema(clock.step_s, (now - t_last) / max(1, phase.log_every))
            t_last = now
        elif clock.step_s == 0.0:  # until the first logged interval: this step's own wall time
            clock.step_s = time.time() - t0
        if _eval_due(phase, st.step) and _evaluate(phase, st, ck, clock, log):
            st.trained = st.stopped_early = True
            log(f"{phase.name}: early stop at step {st.step} (no better held-out ppl in {phase.patience} "
                f"evaluations; best at step {st.best_step})")
            break
        if st.step % phase.ckpt_every == 0:
            _checkpoint(phase, st, ck, clock)
    bar.close()
    st.trained = True
    st.acc, st.n_acc = {}, 0
    _checkpoint(phase, st, ck, clock)
    return "done"


def _evaluate(phase: Phase, st: LoopState, ck: Checkpoint, clock: Clock, log) -> bool:
    """One held-out evaluation; updates best / patience. Returns True when patience is exhausted."""
    t0 = time.time()
    eligible = phase.eligible(st.step - 1)
    ev = phase.evaluate(eligible)
    clock.eval_s = max(clock.eval_s, time.time() - t0)  # the eligible (calibrated) ones cost the most
    rec = {"step": st.step, "tokens": st.step * phase.tokens_per_step, **ev, "best": False, "eligible": eligible}
    ok = eligible and math.isfinite(ev["ppl"])
    if ok and (st.best_ppl is None or ev["ppl"] < st.best_ppl):
        st.best_ppl, st.best_step, st.bad_evals = ev["ppl"], st.step, 0
        rec["best"] = True
        ck.save_best(phase)
    elif ok:
        st.bad_evals += 1
    st.curve["eval"].append(rec)
    log(f"{phase.name}: step {st.step}/{phase.total_steps} held-out ppl {ev['ppl']:.3f}"
        + "".join(f" {k} {ev[k]:.3f}" for k in ("cap", "attn", "ffn", "dense_ppl") if k in ev)
        + (" (best)" if rec["best"] else "")
        + (f" [{clock.step_s:.3f} s/step, {phase.tokens_per_step / clock.step_s:.0f} tokens/s; eval {clock.eval_s:.1f} s]"
           if clock.step_s else ""))
    return bool(phase.patience) and st.bad_evals >= phase.patience


def _checkpoint(phase: Phase, st: LoopState, ck: Checkpoint, clock: Clock) -> None:
    t0 = time.time()
    ck.save(phase, st)
    if phase.out_dir is not None and distributed.current().is_main:
        write_curve(phase.out_dir, phase.name, {"phase": phase.name, "config": phase.config, **st.curve,
                                                "best_step": st.best_step, "best_ppl": st.best_ppl,
                                                "stopped_early": st.stopped_early, "step": st.step,
                                                "total_steps": phase.total_steps})
    clock.save_s = Clock.ema(clock.save_s, time.time() - t0)
