"""How much of trained free routers' decisions each mask structure keeps, per router kind, with no training.

    python benchmarks/structure_oracle.py --out DIR [--routers smollm2-135m-c50] [--structures cb16 cb64 pq2x16]

The free routers' margins m [N, G] are recorded on train text with the routers attached (and their LoRA
merged), as `wide train convert` does: fit tokens first, then held-out test tokens. For each structure the
table is fitted to the fit tokens (routing/convert.fit_prototypes) and every test token takes the row of
best margin-weighted agreement with its free decision (convert.agreement: the pick of a converted router,
before capacity calibration). Structures:
  cbP    one codebook of P prototypes over all G groups (WideConfig(structure="codebook"))
  pqKxP  a product codebook: the G groups cut into K equal consecutive parts, one codebook of P prototypes per
         part, a token's mask the concatenation of its K picks (P^K masks from K tables of P rows)
  winP   windows: the groups put in one order per layer (co-active groups side by side: the spectral order of
         their decisions' correlation, fitted to the fit tokens), every mask one contiguous range of that order,
         the table the P ranges the fit tokens pick most (win: every range). A bucket's weights would be one
         slice of weights permuted once, so its GEMMs need no gather
  winP-id  the same ranges over the groups' own order (what the spectral order buys)
Per structure and kind it reports the margin-weighted disagreement
    wloss = sum |m| [mask != (m > 0)] / sum |m|
(0: every decision kept; the share of the free routers' margin mass that the structure overrides), its
worst layer, and the structure's capacity beside the free one (group share, uncalibrated). Writes
DIR/structure-oracle.json and DIR/structure-oracle.md (command, machine, date).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DEFAULT_STRUCTURES = ("cb16", "cb64", "cb128", "cb256", "pq2x16", "pq2x32", "pq3x16", "pq4x8")
WINDOWS = re.compile(r"win(\d*)(-id)?")


def parse_structure(text: str) -> tuple[int, int]:
    """'cb64' -> (1, 64); 'pq2x16' -> (2, 16): (parts, prototypes per part). Window structures: (1, P), P = 0
    for every range (their -id suffix, read through WINDOWS, says which order)."""
    w = WINDOWS.fullmatch(text)
    if w:
        return 1, int(w.group(1) or 0)
    m = re.fullmatch(r"cb(\d+)|pq(\d+)x(\d+)", text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r}: expected cbP (e.g. cb64), pqKxP (e.g. pq2x16) or winP / "
                                         "winP-id (e.g. win64, win)")
    parts, protos = (1, int(m.group(1))) if m.group(1) else (int(m.group(2)), int(m.group(3)))
    if parts < 1 or protos < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: parts and prototypes must be >= 1")
    return parts, protos


def structured_masks(fit: torch.Tensor, test: torch.Tensor, parts: int, protos: int, seed: int = 0) -> torch.Tensor:
    """bool [N_test, G]: each test token's mask under a product codebook of `parts` equal consecutive parts with
    `protos` prototypes each (parts=1: one codebook), its tables fitted to the margins `fit` [N_fit, G]."""
    from wide_compile.routing.convert import agreement, fit_prototypes

    g = fit.shape[1]
    if g % parts:
        raise ValueError(f"{parts} parts do not divide {g} groups")
    w = g // parts
    out = []
    for k in range(parts):
        a, b = fit[:, k * w:(k + 1) * w].double(), test[:, k * w:(k + 1) * w].double()
        table = fit_prototypes(a, protos, seed=seed).double()
        out.append(table[agreement(b, table).argmax(1)] > 0)
    return torch.cat(out, 1)


def spectral_order(decisions: torch.Tensor) -> torch.Tensor:
    """int64 [G]: an order of the groups that puts groups whose decisions go together side by side: the
    Fiedler vector of the graph whose edge weights are the decisions' correlations (negatives as 0)."""
    d = decisions.double()
    d = d - d.mean(0)
    sd = d.pow(2).mean(0).sqrt().clamp_min(1e-12)
    corr = (d.t() @ d / d.shape[0]) / (sd[:, None] * sd[None, :])
    a = corr.clamp_min(0.0)
    a.fill_diagonal_(0.0)
    lap = torch.diag(a.sum(1)) - a
    _, vecs = torch.linalg.eigh(lap)
    return vecs[:, 1].argsort()


def _ranges(g: int) -> torch.Tensor:
    """int64 [R, 2]: every range [a, b) of g positions, 0 <= a < b <= g."""
    return torch.tensor([(a, b) for a in range(g) for b in range(a + 1, g + 1)], dtype=torch.long)


def _range_scores(margins: torch.Tensor, ranges: torch.Tensor) -> torch.Tensor:
    """[N, R]: each token's margin sum inside each range (the range's agreement with its free decision, up to a
    per-token constant)."""
    c = torch.nn.functional.pad(margins.double().cumsum(1), (1, 0))
    return c[:, ranges[:, 1]] - c[:, ranges[:, 0]]


def window_masks(fit: torch.Tensor, test: torch.Tensor, protos: int, spectral: bool = True) -> torch.Tensor:
    """bool [N_test, G]: each test token's mask under the window structure (module docstring, winP), fitted to
    the margins `fit` [N_fit, G]; protos = 0: every range."""
    g = fit.shape[1]
    order = spectral_order(fit > 0) if spectral else torch.arange(g)
    ranges = _ranges(g)
    if protos:
        picks = _range_scores(fit[:, order], ranges).argmax(1)
        ranges = ranges[torch.bincount(picks, minlength=len(ranges)).argsort(descending=True)[:protos]]
    best = ranges[_range_scores(test[:, order], ranges).argmax(1)]  # [N_test, 2]
    pos = torch.arange(g)
    inside = (pos >= best[:, :1]) & (pos < best[:, 1:])           # in the permuted order
    mask = torch.empty_like(inside)
    mask[:, order] = inside
    return mask


def weighted_disagreement(margins: torch.Tensor, mask: torch.Tensor) -> float:
    """sum |m| [mask != (m > 0)] / sum |m| over every (token, group)."""
    m = margins.double()
    total = float(m.abs().sum())
    return float((m.abs() * (mask != (m > 0))).sum()) / total if total else 0.0


def oracle(fit: dict, test: dict, structures, seed: int = 0, log=print) -> list[dict]:
    """Rows {kind, structure, groups, wloss, wloss_max_layer, capacity, free_capacity} for every kind of the
    recorded margins {"attn": [L x [N, G]], "ffn": [...]} and every structure whose parts divide G."""
    rows = []
    for kind in ("attn", "ffn"):
        g = fit[kind][0].shape[1]
        free_cap = sum(float((t > 0).double().mean()) for t in test[kind]) / len(test[kind])
        for name in structures:
            parts, protos = parse_structure(name)
            if g % parts:
                log(f"{kind}: {name} skipped ({parts} parts do not divide {g} groups)")
                continue
            wl, cap = [], []
            win = WINDOWS.fullmatch(name)
            for a, b in zip(fit[kind], test[kind]):
                mask = window_masks(a, b, protos, spectral=not win.group(2)) if win else \
                    structured_masks(a, b, parts, protos, seed=seed)
                wl.append(weighted_disagreement(b, mask))
                cap.append(float(mask.double().mean()))
            row = {"kind": kind, "structure": name, "groups": g, "wloss": sum(wl) / len(wl),
                   "wloss_max_layer": max(wl), "capacity": sum(cap) / len(cap), "free_capacity": free_cap}
            rows.append(row)
            log(f"{kind} G={g} {name:8s} wloss {row['wloss']:.4f} (worst layer {row['wloss_max_layer']:.4f}) "
                f"capacity {row['capacity']:.3f} (free {free_cap:.3f})")
    return rows


def main(argv=None) -> int:
    from wide_compile.eval.records import command_line, machine
    from wide_compile.routing.convert import record_margins
    from wide_compile.training.convert import free_routers_on_text

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for structure-oracle.json / .md")
    ap.add_argument("--routers", default="smollm2-135m-c50", help="free routers: a shipped name or a file")
    ap.add_argument("--lora", default=None, help="their stage-2 LoRA (default: the shipped one; 'none': none)")
    ap.add_argument("--structures", nargs="+", type=str, default=list(DEFAULT_STRUCTURES), help="cbP / pqKxP / winP / winP-id")
    ap.add_argument("--fit-tokens", type=int, default=24576)
    ap.add_argument("--test-tokens", type=int, default=4096, help="held-out tokens after the fit tokens")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--data", default=None, help="train-text folder (default: $WIDE_DATA_DIR/train-text, else "
                                                 "../shared/data/train-text)")
    ap.add_argument("--tokens", default=None, help="token cache .npy (read if present)")
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    for s in a.structures:
        try:
            parse_structure(s)
        except argparse.ArgumentTypeError as e:
            ap.error(f"--structures: {e}")
    t0 = time.time()
    n_fit, n_test = a.fit_tokens // a.seq_len, a.test_tokens // a.seq_len
    model, free, blocks, _, lora = free_routers_on_text(a.routers, a.lora, n_fit + n_test, a.seq_len, a.device,
                                                        a.gguf, a.data, a.tokens, what="--fit-tokens + --test-tokens")
    fit, test = record_margins(model, free, blocks[:n_fit]), record_margins(model, free, blocks[n_fit:])
    rows = oracle(fit, test, a.structures, seed=a.seed)

    os.makedirs(a.out, exist_ok=True)
    rec = {"command": command_line(argv, prog="python benchmarks/structure_oracle.py"),
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine(a.device),
           "routers": a.routers, "lora": None if lora is None else str(lora), "fit_tokens": n_fit * a.seq_len,
           "test_tokens": n_test * a.seq_len, "rows": rows, "seconds": round(time.time() - t0, 1)}
    with open(os.path.join(a.out, "structure-oracle.json"), "w") as f:
        json.dump(rec, f, indent=1)
    lines = ["# Mask structures against trained free routers (no training)", "",
             f"`{rec['command']}`", "", f"{rec['date']}, {rec['machine'].get('device_name')}, routers "
             f"{a.routers}, {rec['fit_tokens']} fit / {rec['test_tokens']} held-out train-text tokens", "",
             "| kind | groups | structure | wloss | worst layer | capacity | free capacity |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['kind']} | {r['groups']} | {r['structure']} | {r['wloss']:.4f} | {r['wloss_max_layer']:.4f} | "
              f"{r['capacity']:.3f} | {r['free_capacity']:.3f} |" for r in rows]
    with open(os.path.join(a.out, "structure-oracle.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {a.out}/structure-oracle.json and .md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
