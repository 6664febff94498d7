"""How much work the bucketed kernels' padding adds: tokens sorted by prototype, each bucket padded to whole
token blocks (bucket_mlp.bucket_lists_ref), counted on the CPU, no GPU needed.

    python benchmarks/bucket_padding.py --out DIR [--masks FILE] [--ts 2048 8192] [--block-m 64 128]
        [--prototypes 16 64] [--draws 20]

For a prefill of T tokens in blocks of BM rows, the bucketed GEMMs compute sum_p ceil(n_p / BM) * BM * w_p
(n_p tokens in bucket p, w_p its prototype's width), where the work the masks ask for is sum_p n_p * w_p. A row
is that ratio ("padding factor": 1.0 = no waste; the kernels' speedup over dense is at most 1 / (capacity *
factor)), beside the same ratio for the other way to cut the sorted tokens, with no padding: consecutive blocks
of BM tokens each computed over the union of its tokens' groups ("union blocks"). Two sources of buckets:
  uniform  each token's prototype uniform over P random prototypes of density 0.5 (the benchmarks' random
           codebooks), `--draws` draws per (T, P, BM): median and range;
  recorded (with --masks, a file of benchmarks/record_router_masks.py from a structured router set) the FFN masks
           of each layer, bucket = the token's mask (a prototype), in windows of T consecutive tokens: median and
           range over layers and windows.
Writes DIR/bucket-padding.json and DIR/bucket-padding.md (command, date).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def padding_factor(bucket: torch.Tensor, widths: torch.Tensor, block_m: int) -> float:
    """bucket [T] prototype ids, widths [P] (groups of each prototype) -> padded work / asked work."""
    n = torch.bincount(bucket.long(), minlength=widths.numel()).double()   # [P]
    padded = torch.ceil(n / block_m) * block_m
    w = widths.double()
    asked = (n * w).sum()
    return float((padded * w).sum() / asked) if asked > 0 else 1.0


def union_block_factor(masks: torch.Tensor, block_m: int) -> float:
    """The other way to cut sorted tokens: no padding per bucket, consecutive blocks of BM tokens sorted as
    bucket_mlp.width_order sorts them (by their prototype's width, then the prototype: here its mask bits), each
    block computed over the union of its tokens' groups (bucket_mlp's prefill_lists="union").
    masks [T, G] bool -> (blocks x BM x union width) / asked."""
    T, G = masks.shape
    key = torch.zeros(T, dtype=torch.float64)
    for g in range(min(G, 52)):  # float64 holds 52 bits exactly; later groups only break ties
        key = key * 2 + masks[:, g].double()
    order = torch.argsort(key, stable=True)
    order = order[torch.argsort(masks[order].sum(1), stable=True)]       # width first, the bits within a width
    m = masks[order]
    nb = -(-T // block_m)
    pad = torch.zeros(nb * block_m - T, G, dtype=torch.bool)
    union = torch.cat([m, pad]).view(nb, block_m, G).any(1).sum()
    asked = masks.sum()
    return float(union * block_m / asked) if asked > 0 else 1.0


def buckets_of(masks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """masks [T, G] bool -> (bucket [T]: index of the token's row among the distinct rows, widths [P])."""
    rows, inv = torch.unique(masks, dim=0, return_inverse=True)
    return inv, rows.sum(1)


def summary(xs: list) -> dict:
    t = torch.tensor(xs, dtype=torch.float64)
    return dict(median=round(t.median().item(), 4), min=round(t.min().item(), 4), max=round(t.max().item(), 4),
                n=len(xs))


def uniform_rows(ts, block_ms, prototypes, draws, G=224, seed=0) -> list:
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for T in ts:
        for P in prototypes:
            for bm in block_ms:
                xs, us = [], []
                for _ in range(draws):
                    protos = torch.rand(P, G, generator=gen) < 0.5
                    bucket = torch.randint(0, P, (T,), generator=gen)
                    xs.append(padding_factor(bucket, protos.sum(1), bm))
                    us.append(union_block_factor(protos[bucket], bm))
                rows.append(dict(source="uniform", T=T, prototypes=P, block_m=bm, **summary(xs),
                                 union_blocks=summary(us)))
    return rows


def recorded_rows(path, ts, block_ms) -> list:
    from record_router_masks import load_masks

    rec = load_masks(path)
    rows = []
    for T in ts:
        for bm in block_ms:
            xs, us, ps = [], [], []
            for m in rec["ffn"]:
                for s in range(0, m.shape[0] - T + 1, T):
                    bucket, widths = buckets_of(m[s: s + T])
                    xs.append(padding_factor(bucket, widths, bm))
                    us.append(union_block_factor(m[s: s + T], bm))
                    ps.append(widths.numel())
            if xs:
                rows.append(dict(source="recorded", T=T, block_m=bm, prototypes_used=summary(ps), **summary(xs),
                                 union_blocks=summary(us)))
    return rows, rec["meta"]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--masks", default=None, help="recorded masks of a structured router set (record_router_masks)")
    ap.add_argument("--ts", nargs="+", type=int, default=[2048, 8192])
    ap.add_argument("--block-m", nargs="+", type=int, default=[64, 128])
    ap.add_argument("--prototypes", nargs="+", type=int, default=[16, 64])
    ap.add_argument("--draws", type=int, default=20)
    a = ap.parse_args(argv)
    rows = uniform_rows(a.ts, a.block_m, a.prototypes, a.draws)
    meta = None
    if a.masks:
        more, meta = recorded_rows(a.masks, a.ts, a.block_m)
        rows += more
    out = dict(rows=rows, recorded=meta, date=datetime.date.today().isoformat(),
               command="python benchmarks/bucket_padding.py " + " ".join(sys.argv[1:] if argv is None else argv))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "bucket-padding.json"), "w") as f:
        json.dump(out, f, indent=1)
    lines = ["# Padding of the bucketed kernels' token blocks", "", f"command: `{out['command']}`  ",
             f"date: {out['date']}" + (f"; recorded masks: {meta['routers']}, {meta['tokens']} WikiText-2 test "
                                       f"tokens, {meta['layers']} layers" if meta else ""), "",
             "| source | T | prototypes | block rows | padding factor (median) | range | union blocks (median) "
             "| range |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p = r.get("prototypes", f"{r['prototypes_used']['median']:.0f} used (median)" if "prototypes_used" in r
                  else "-")
        u = r["union_blocks"]
        lines.append(f"| {r['source']} | {r['T']} | {p} | {r['block_m']} | {r['median']:.3f} | "
                     f"{r['min']:.3f}-{r['max']:.3f} | {u['median']:.3f} | {u['min']:.3f}-{u['max']:.3f} |")
    with open(os.path.join(a.out, "bucket-padding.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return out


if __name__ == "__main__":
    main()
