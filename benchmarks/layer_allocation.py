"""A trained router set's capacity moved between its routers at one overall capacity (no training): what each
router's groups are worth per FLOP, and whether an allocation by that measure keeps more quality than the set's
own (SmolLM2-135M-Instruct, fp32, CPU or GPU).

    python benchmarks/layer_allocation.py --routers smollm2-135m-c70 --capacity 0.7 --out DIR/alloc.json

The routers' LoRA is merged. Text: WikiText-2 *validation* (the test text stays for the final score), three disjoint
parts in blocks of --seq-len: calibration (the first --calib-tokens), evaluation (the next --eval-tokens), then
sensitivity (--sens-tokens).

1. Gain per FLOP: each router in turn runs all-on (every group executed), the others as shipped; its gain is the drop
   of the mean NLL of the sensitivity text per unit of overall capacity (FLOP fraction) it adds, both from one
   forward.
2. Allocation: per router an on-rate target c_i + lam * --step * z_i, z the standardized log gain (0 where a router
   adds no capacity), clipped to [0.02, 1], set by shifting that router's margins by the quantile of its recorded
   logits on the calibration text; then one global offset brings the overall capacity on the calibration text back
   to --capacity (calibrate_offset_, as the set was shipped) and the evaluation text is scored. lam = 0 is the set
   as shipped; a negative lam moves capacity against the measure (a control: it must lose if the measure means
   anything).
Writes the JSON (every router's gain, every row's offsets, capacities and NLL, the dense NLL) and a .md beside it.
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from capacity_split import CAPACITY_HEADER, add_set_args, capacity_cells, set_record, write_record  # noqa: E402

KINDS = ("attn", "ffn")


def nll_and_capacity(model, routers, blocks, batch_size: int = 8) -> tuple[float, dict | None]:
    """Mean next-token NLL over `blocks` [N, S] (each block on its own) and the routers' measured capacity on them
    (None when routers is None: dense), from the same forward passes."""
    import torch
    import torch.nn.functional as F

    from wide_compile.routing.attach import record_masks, routed
    from wide_compile.routing.measure import capacity_from_record

    total, count = 0.0, 0
    with torch.no_grad(), routed(model, routers):
        rec_ctx = record_masks(model) if routers is not None else None
        rec = rec_ctx.__enter__() if rec_ctx is not None else None
        try:
            for i in range(0, len(blocks), batch_size):
                ids = blocks[i:i + batch_size]
                logits = model(input_ids=ids).logits[:, :-1].float()
                total += F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum").item()
                count += ids[:, 1:].numel()
        finally:
            if rec_ctx is not None:
                rec_ctx.__exit__(None, None, None)
    return total / count, (capacity_from_record(routers, rec) if rec is not None else None)


def router_at(routers, kind: str, layer: int):
    r = getattr(routers, kind)[layer]
    if not hasattr(r, "margin_bias"):
        raise SystemExit(f"layer_allocation needs learned routers with a margin bias; {kind} router {layer} is "
                         f"{type(r).__name__}")
    return r


def gains(model, routers, blocks, batch_size: int, log=print) -> tuple[list[dict], float, dict]:
    """Each router's NLL drop per unit of overall capacity when it alone runs all-on."""
    import torch

    nll0, cap0 = nll_and_capacity(model, routers, blocks, batch_size)
    log(f"as shipped: NLL {nll0:.4f}, capacity {cap0['overall']:.4f}")
    out = []
    for kind in KINDS:
        for layer in range(len(getattr(routers, kind))):
            bias = router_at(routers, kind, layer).margin_bias()
            saved = bias.detach().clone()
            with torch.no_grad():
                bias += 1e4  # every logit above 0: every group executed
            try:
                nll, cap = nll_and_capacity(model, routers, blocks, batch_size)
            finally:
                with torch.no_grad():
                    bias.copy_(saved)
            added = cap["overall"] - cap0["overall"]
            gain = (nll0 - nll) / added if added > 1e-6 else None
            rate = cap0[f"{kind}_per_layer"][layer]
            out.append({"kind": kind, "layer": layer, "kind_capacity": rate, "capacity_added": added,
                        "nll_all_on": nll, "gain_per_capacity": gain})
            log(f"{kind} {layer:2d}: capacity {rate:.3f}, +{added:.4f} capacity, NLL {nll:.4f}, gain "
                f"{'-' if gain is None else f'{gain:.3f}'}")
    return out, nll0, cap0


def z_scores(rows: list[dict]) -> list[float]:
    """Standardized log gain per router; 0 where a router adds nothing or gains nothing measurable."""
    logs = [math.log(r["gain_per_capacity"]) if r["gain_per_capacity"] and r["gain_per_capacity"] > 0 else None
            for r in rows]
    vals = [v for v in logs if v is not None]
    if len(vals) < 2:
        return [0.0] * len(rows)
    mu = sum(vals) / len(vals)
    sd = (sum((v - mu) ** 2 for v in vals) / len(vals)) ** 0.5 or 1.0
    return [0.0 if v is None else (v - mu) / sd for v in logs]


def allocate(model, routers, calib, gain_rows: list[dict], lam: float, step: float, capacity: float,
             batch_size: int, log=print) -> tuple[object, list[float], float]:
    """A copy of `routers` with per-router rate targets moved by lam * step * z, then one global offset to
    `capacity` on `calib`. Returns (routers, per-router margin shifts, global offset)."""
    import torch

    from wide_compile.routing.attach import record_logits, routed
    from wide_compile.routing.calibrate import calibrate_offset_

    r = copy.deepcopy(routers)
    z = z_scores(gain_rows)
    shifts = []
    if lam != 0:
        with torch.no_grad(), routed(model, r), record_logits(model) as rec:
            model(input_ids=calib)
        for row, zi in zip(gain_rows, z):
            router = router_at(r, row["kind"], row["layer"])
            lg = rec[row["kind"]][row["layer"]].reshape(-1).float()
            rate = float((lg > 0).float().mean())
            target = min(1.0, max(0.02, rate + lam * step * zi))
            q = torch.quantile(lg, 1.0 - target) if target < 1.0 else lg.min() - 1.0
            shift = -float(q)
            with torch.no_grad():
                router.margin_bias().add_(shift)
            shifts.append(shift)
    offset = calibrate_offset_(model, r, calib, capacity, batch_size=batch_size, log=log)
    return r, shifts, offset


def table(rec: dict) -> str:
    lines = [f"Routers `{rec['routers']}` with LoRA `{rec['lora']}`, overall capacity {rec['capacity']}; calibration "
             f"{rec['calib_tokens']}, evaluation {rec['eval_tokens']}, sensitivity {rec['sens_tokens']} tokens of "
             f"`{rec['text_file']}`; dense NLL on the evaluation text {rec['dense_nll']:.4f}.", "",
             "| lam | " + CAPACITY_HEADER, "|---|---|---|---|---|"]
    for r in rec["rows"]:
        lines.append(f"| {r['lam']:+g} | " + capacity_cells(r, rec["dense_nll"]))
    lines += ["", "Gain per unit of overall capacity when a router alone runs all-on (sensitivity text):", "",
              "| layer | attn capacity | attn gain | ffn capacity | ffn gain |", "|---|---|---|---|---|"]
    by = {(g["kind"], g["layer"]): g for g in rec["gains"]}
    fmt = (lambda v: "-" if v is None else f"{v:.3f}")
    for layer in range(max(g["layer"] for g in rec["gains"]) + 1):
        a, f = by[("attn", layer)], by[("ffn", layer)]
        lines.append(f"| {layer} | {a['kind_capacity']:.3f} | {fmt(a['gain_per_capacity'])} | "
                     f"{f['kind_capacity']:.3f} | {fmt(f['gain_per_capacity'])} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    import torch

    from wide_compile.paths import data_file
    from wide_compile.routing.calibrate import deterministic_capacity
    from wide_compile.training.convert import free_routers_on_text

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_set_args(ap, torch)
    ap.add_argument("--lams", type=float, nargs="+", default=[0.0, 1.0, 2.0, -1.0],
                    help="allocation strengths to try (0: as shipped; negative: against the measure, a control)")
    ap.add_argument("--step", type=float, default=0.1, help="on-rate moved per standard deviation of log gain")
    ap.add_argument("--sens-tokens", type=int, default=4096)
    a = ap.parse_args(argv)
    if not 0.0 < a.capacity <= 1.0:
        ap.error("--capacity must be in (0, 1]")
    if any(n % a.seq_len for n in (a.calib_tokens, a.eval_tokens, a.sens_tokens)):
        ap.error("--calib-tokens, --eval-tokens and --sens-tokens must be multiples of --seq-len")
    text = a.text_file or str(data_file("wikitext-2", "wiki.valid.raw"))
    t0 = time.time()
    n_c, n_e, n_s = (n // a.seq_len for n in (a.calib_tokens, a.eval_tokens, a.sens_tokens))
    model, routers, blocks, src, lora = free_routers_on_text(a.routers, a.lora, n_c + n_e + n_s, a.seq_len, a.device,
                                                             a.gguf, None, None, what="the three parts",
                                                             text_file=text)
    calib, evalb, sens = blocks[:n_c], blocks[n_c:n_c + n_e], blocks[n_c + n_e:]
    dense, _ = nll_and_capacity(model, None, evalb, a.batch_size)
    gain_rows, sens_nll, sens_cap = gains(model, routers, sens, a.batch_size)
    rows = []
    for lam in a.lams:
        r, shifts, offset = allocate(model, routers, calib, gain_rows, lam, a.step, a.capacity, a.batch_size)
        cap_c = deterministic_capacity(model, r, calib, batch_size=a.batch_size)
        nll, cap_e = nll_and_capacity(model, r, evalb, a.batch_size)
        rows.append({"lam": lam, "router_shifts": shifts, "global_offset": offset,
                     "capacity_calib": {k: cap_c[k] for k in ("overall", "attn", "ffn")},
                     "capacity_eval": {k: cap_e[k] for k in ("overall", "attn", "ffn")},
                     "capacity_eval_per_layer": {k: cap_e[f"{k}_per_layer"] for k in KINDS}, "nll": nll})
        print(f"lam {lam:+g}: calib capacity {cap_c['overall']:.4f}, eval capacity {cap_e['overall']:.4f}, "
              f"NLL {nll:.4f} (ratio {math.exp(nll - dense):.3f})", flush=True)
    rec = set_record(a, argv, "python benchmarks/layer_allocation.py", src, lora, text, t0, step=a.step,
                     calib_tokens=calib.numel(), eval_tokens=evalb.numel(), sens_tokens=sens.numel(),
                     seq_len=a.seq_len, dense_nll=dense, sens_nll_as_shipped=sens_nll,
                     sens_capacity_as_shipped=sens_cap["overall"], gains=gain_rows, rows=rows)
    return write_record(rec, a.out, table)


if __name__ == "__main__":
    main()
