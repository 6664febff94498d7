"""Correctness beside the timing: compiled WIDE against its eager reference on a row's own input, with
live routers (`live_check`, and its noise floor) and with replayed masks (`replay_check`, kernel and pass
error alone), and the FLOP capacity the routers gave on the timed input (`measured_capacity`)."""
from __future__ import annotations

import torch

from . import masks as M
from .timing import Variant
from .variants import compile_wide


def step_logits(step, reset=None) -> torch.Tensor:
    """Run one step (after its reset) and return its logits as a float copy."""
    if reset:
        reset()
    o = step()
    lg = getattr(o, "logits", None)
    if lg is None:
        lg = o[0] if isinstance(o, (tuple, list)) else o
    return lg.float().clone()


def compare_logits(x: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(relative L2 error of x against ref, fraction of positions whose argmax agrees)."""
    return (((x - ref).norm() / ref.norm().clamp_min(1e-30)).item(),
            (x.argmax(-1) == ref.argmax(-1)).float().mean().item())


@torch.no_grad()
def live_check(wide_model, wide_v: Variant, eager_v: Variant) -> dict:
    """Compiled WIDE vs the eager reference on the timed inputs: relative error of the logits, and the
    comparison's noise floor: the same eager reference with every router bias moved by N(0, 1e-3), below
    bf16 rounding of a logit of size ~1. Decisions within that of 0 flip, and in a deep random-weight model
    a flip early on changes everything after it; when the floor is as large as logits_rel_err, this check
    cannot tell kernel error from flips (replay_check can)."""
    def logits(v: Variant) -> torch.Tensor:
        return step_logits(v.info.get("raw_step", v.step), v.reset)

    c, e = logits(wide_v), logits(eager_v)
    rel, agree = compare_logits(c, e)
    res = {"logits_rel_err": round(rel, 6), "argmax_agree": round(agree, 4), "finite": bool(torch.isfinite(c).all())}
    try:
        import wide_compile as wc

        with M.jittered_router_biases(wc.routing.attached_routers(wide_model), 1e-3) as moved:
            if moved:
                j_rel, j_agree = compare_logits(logits(eager_v), e)
                res["jitter_floor_rel_err"] = round(j_rel, 6)
                res["jitter_floor_argmax_agree"] = round(j_agree, 4)
    except Exception as ex:  # noqa: BLE001  the floor is extra information; the check stands without it
        res["jitter_floor_error"] = f"{type(ex).__name__}: {str(ex)[:200]}"
    return res


def replay_check(wide_model, step_of, reset, routers, options, tol: float = 0.05) -> dict:
    """Kernel and pass error alone, at this row's shape and input: the masks the live routers give on the
    timed input are recorded in the eager WIDE model and replayed (Routers.replay) both there and in a
    fresh compile with the WIDE backend, so no router decision can flip between the two. Relative L2 error
    of the logits: bf16 rounding stays far below `tol`, a wrong group, index or tile gives errors of order
    1 (results/check-compiled-h200.json); `ok` is rel_err < tol."""
    import wide_compile as wc
    from wide_compile.routing import record_masks

    if reset:
        reset()
    with record_masks(wide_model) as rec:
        step_of(wide_model)()
    replay = wc.Routers.replay(wide_model, routers.cfg, rec)
    wc.attach(wide_model, replay)
    try:
        # the cost model decides as for the timed model (the live routers' target capacity)
        m = compile_wide(wide_model, replay, options, capacity=routers.cfg.capacity)
        c, e = step_logits(step_of(m), reset), step_logits(step_of(wide_model), reset)
    finally:
        wc.attach(wide_model, routers)  # the live routers again, for the rest of the row
    rel, agree = compare_logits(c, e)
    finite = bool(torch.isfinite(c).all())
    return {"logits_rel_err": round(rel, 6), "argmax_agree": round(agree, 4),
            "finite": finite, "tol": tol, "ok": finite and rel < tol}


def measured_capacity(wide_model, step, reset, routers) -> dict:
    """{overall, attn, ffn}: the FLOP capacity `routers` gave on one step (eager WIDE, recorded masks)."""
    from wide_compile.routing import record_masks
    from wide_compile.routing.measure import capacity_from_record

    if reset:
        reset()
    with record_masks(wide_model) as rec:
        step()
    c = capacity_from_record(routers, rec)
    return {k: round(c[k], 4) for k in ("overall", "attn", "ffn")}
