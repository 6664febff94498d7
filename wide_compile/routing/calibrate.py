"""Capacity calibration: shift learned routers' execute margins so the deterministic (inference) capacity on
real tokens hits a target.

* `calibrate_groups_`: per group, the bias shift that gives every group the uniform on-rate of the target
  (for random-weight benchmark routers).
* `calibrate_offset_`: one offset per router kind (attention, FFN) found by bisection, so each kind's
  deterministic capacity equals its target (for trained routers, after training).
* `calibrate_split_`: the attention capacity set, the FFN routers then bring the overall capacity to its target.
"""
from __future__ import annotations

import contextlib

import torch

from .attach import record_logits, record_masks, routed
from .capacity import FlopCost
from .measure import capacity_from_record


def learned_routers(routers, kind: str | None = None) -> list:
    """The routers that have a margin bias to shift (GroupRouter, PairRouter) of `kind` ("attn" / "ffn" /
    None: both)."""
    kinds = ("attn", "ffn") if kind is None else (kind,)
    return [r for k in kinds for r in getattr(routers, k) if hasattr(r, "margin_bias")]


@torch.no_grad()
def calibrate_groups_(routers, model, input_ids: torch.Tensor, capacity: float | None = None,
                      attention_mask: torch.Tensor | None = None):
    """Set router biases so every group's on-rate on these tokens is the uniform rate that gives `capacity`
    (default cfg.capacity). Used for random-weight benchmark models; trained routers should not need it.
    Returns `routers`."""
    cap = routers.cfg.capacity if capacity is None else capacity
    rate = FlopCost.from_routers(routers).uniform_rate(cap)
    with routed(model, routers), record_logits(model) as rec:  # these routers, whatever was attached
        model(input_ids=input_ids, attention_mask=attention_mask)
    valid = None if attention_mask is None else attention_mask.bool().reshape(-1)
    for kind in ("attn", "ffn"):
        for i, r in enumerate(getattr(routers, kind)):
            if not hasattr(r, "margin_bias"):
                raise ValueError("calibrate_ needs learned (GroupRouter / PairRouter / CodebookRouter) routers")
            if r.margin_bias().shape[-1:] != (r.groups,):
                raise ValueError(f"calibrate_ sets one margin per group; {type(r).__name__} has one margin per "
                                 "router: use calibrate_offset_ (one offset per router kind)")
            lg = rec[kind][i].reshape(-1, r.groups).float()
            if valid is not None:
                lg = lg[valid]
            # per group: shift so that a fraction `rate` of tokens has logit > 0
            q = torch.quantile(lg, 1.0 - rate, dim=0) if rate < 1 else lg.min(0).values - 1.0
            if hasattr(r, "prototypes"):  # a codebook's logits take P values per group: cut between two
                q = _cut_between_values(lg, rate)
            bias = r.margin_bias()
            bias -= q.to(bias.dtype)
    return routers


def _cut_between_values(lg: torch.Tensor, rate: float) -> torch.Tensor:
    """Per column of lg [N, G], the threshold midway between two consecutive distinct values whose count of
    logits above it is nearest rate * N. For logits that take few distinct values (a codebook's P
    prototypes), where a quantile lands on a tie and the whole tie falls off."""
    n = lg.shape[0]
    v = lg.sort(0).values  # ascending
    lo = torch.cat([v[:1] - 1.0, v])  # [N+1, G]: the value just below cut j (j = 0..N)
    hi = torch.cat([v, v[-1:] + 1.0])  # the value just above cut j; cut j keeps n - j tokens
    kept = torch.arange(n, -1, -1, device=lg.device, dtype=lg.dtype)[:, None]
    cost = (kept - rate * n).abs().masked_fill(lo >= hi, float("inf"))  # a cut inside a tie does not exist
    j = cost.argmin(0, keepdim=True)
    return (0.5 * (lo.gather(0, j) + hi.gather(0, j)))[0]


def _autocast(device, enabled: bool):
    if enabled and torch.device(device).type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def deterministic_capacity(model, routers, blocks: torch.Tensor, batch_size: int = 8, amp: bool = False) -> dict:
    """Hard-decision capacity of `routers` on `blocks` [N, S] (all real tokens), as measure_capacity."""
    dev = next(model.parameters()).device
    L = routers.spec.num_layers
    recs = {"attn": [[] for _ in range(L)], "ffn": [[] for _ in range(L)]}
    with routed(model, routers):  # these routers, whatever was attached before
        for i in range(0, len(blocks), batch_size):
            with record_masks(model) as rec, _autocast(dev, amp):
                model(input_ids=blocks[i:i + batch_size].to(dev))
            for k in ("attn", "ffn"):
                for j in range(L):
                    recs[k][j] += [m.float().mean(-1).reshape(-1, 1) for m in rec[k][j]]
    return capacity_from_record(routers, recs)


@torch.no_grad()
def _bisect_offset(rs: list, measure, target: float, tol: float, iters: int,
                   margin=lambda r: r.margin_bias()) -> tuple[float, float, float]:
    """Offset o added to the margins (`margin(r)`) of `rs` so that measure() == target (monotone
    non-decreasing in o). Returns (offset, capacity before, capacity after); the offset left set is the one
    whose capacity came nearest the target (a codebook's capacity moves in steps the target may fall between)."""
    base = [margin(r).detach().clone() for r in rs]
    seen: dict[float, float] = {}

    def set_off(o: float) -> None:
        for r, b in zip(rs, base):
            margin(r).copy_(b + o)

    def at(o: float) -> float:
        set_off(o)
        seen[o] = measure()
        return seen[o]

    cap0 = at(0.0)
    if abs(cap0 - target) <= tol:
        return 0.0, cap0, cap0
    # a margin's scale is its router's (a tilt is in units of score differences): widen the bracket on the
    # target's side until it holds the target
    side = -1.0 if cap0 > target else 1.0
    edge = 12.0 * side
    for _ in range(3):
        if (at(edge) - target) * side >= 0:
            break
        edge *= 4.0
    lo, hi = (edge, 0.0) if side < 0 else (0.0, edge)
    for _ in range(iters):
        off = 0.5 * (lo + hi)
        cap = at(off)
        if abs(cap - target) <= tol:
            break
        if cap > target:
            hi = off
        else:
            lo = off
    best = min(seen, key=lambda o: (abs(seen[o] - target), abs(o)))
    set_off(best)
    return best, cap0, seen[best]


def _calibrate_kind(rs: list, measure, target: float, tol: float, iters: int,
                    coarse: bool = True) -> tuple[float, float, float, str]:
    """The margin offset for free / nested routers. Codebooks: the width tilt (`tilt_margin`) first, which moves
    single tokens between narrower and wider prototypes and leaves the prototypes as they are; only when the tilt
    cannot reach the target (e.g. prototypes of one width) the prototype logits are shifted (a step that flips a
    group for every token of a prototype at once) and the tilt closes what that step left. coarse=False: never
    the shift (the prototypes of converted routers are what their scorer was built for). Returns (offset,
    before, after, a note on the tilt for the log)."""
    tilted = [r for r in rs if hasattr(r, "tilt_margin")]
    if not tilted:
        off, c0, c1 = _bisect_offset(rs, measure, target, tol, iters)
        return off, c0, c1, ""
    if len(tilted) != len(rs):
        raise ValueError("calibrate_offset_: these routers mix codebooks with routers that have no width tilt")

    def by_tilt():
        return _bisect_offset(tilted, measure, target, tol, iters, margin=lambda r: r.tilt_margin())

    tilt, c0, c1 = by_tilt()
    if not coarse or abs(c1 - target) <= tol:
        return 0.0, c0, c1, f" (codebook width tilt {tilt:+.3f}, prototypes kept)"
    off, _, c_off = _bisect_offset(rs, measure, target, tol, iters)
    tilt2, _, c1 = by_tilt()
    return off, c0, c1, f" (codebook width tilt {tilt:+.3f}, then prototype shift -> {c_off:.4f}, tilt {tilt2:+.3f})"


def _calibrate_kinds(model, routers, blocks, steps, tol: float, iters: int, coarse: bool, batch_size: int,
                     amp: bool, log) -> dict:
    """steps: [(router kind, capacity key, target)] in order: each kind's routers get the offset that brings the
    measured capacity `key` on `blocks` to its target. Returns {kind: offset}."""
    out = {}
    for kind, key, tgt in steps:
        def measure(key=key):
            return deterministic_capacity(model, routers, blocks, batch_size=batch_size, amp=amp)[key]

        off, c0, c1, note = _calibrate_kind(learned_routers(routers, kind), measure, tgt, tol, iters, coarse)
        log(f"calibrated {kind} router offset {off:+.3f}: {key} capacity {c0:.4f} -> {c1:.4f} (target {tgt}){note}")
        out[kind] = off
    return out


@torch.no_grad()
def calibrate_split_(model, routers, blocks: torch.Tensor, target: float, attn_target: float, tol: float = 0.003,
                     iters: int = 18, batch_size: int = 8, log=print) -> dict:
    """Move a trained set along its attention / FFN split at a fixed overall capacity: the attention routers'
    offset brings the attention capacity on `blocks` to `attn_target`, then the FFN routers' offset brings the
    overall capacity to `target`. Returns {"attn", "ffn"} offsets (the FFN routers read what the attention
    routers leave, so the FFN offset is found second)."""
    return _calibrate_kinds(model, routers, blocks, [("attn", "attn", attn_target), ("ffn", "overall", target)],
                            tol, iters, True, batch_size, False, log)


@torch.no_grad()
def calibrate_offset_(model, routers, blocks: torch.Tensor, target: float, tol: float = 0.003, iters: int = 18,
                      amp: bool = False, log=print, target_attn: float | None = None,
                      target_ffn: float | None = None, batch_size: int = 8, coarse: bool = True) -> float | dict:
    """Shift the learned routers' margins so the deterministic capacity on `blocks` equals the targets (codebooks:
    their width tilt first, see _calibrate_kind; coarse=False: the tilt only).

    Without per-kind targets: one global offset for every router, overall capacity == `target` (returns the
    offset). With target_attn / target_ffn: the attention routers' offset brings the attention capacity to
    target_attn, then the FFN routers' offset the FFN capacity to target_ffn (returns {"attn", "ffn"})."""
    if target_attn is None and target_ffn is None:
        def measure():
            return deterministic_capacity(model, routers, blocks, batch_size=batch_size, amp=amp)["overall"]

        off, c0, c1, note = _calibrate_kind(learned_routers(routers), measure, target, tol, iters, coarse)
        if c1 != c0:
            log(f"calibrated global router offset {off:+.3f}: capacity {c0:.4f} -> {c1:.4f} (target {target}){note}")
        return off
    steps = [(kind, kind, target if tgt is None else tgt)
             for kind, tgt in (("attn", target_attn), ("ffn", target_ffn))]
    return _calibrate_kinds(model, routers, blocks, steps, tol, iters, coarse, batch_size, amp, log)
