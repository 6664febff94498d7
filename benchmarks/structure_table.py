"""Issue 24's side-by-side table: free, codebook and nested masks at each capacity, quality beside speed.

    python benchmarks/structure_table.py --quality benchmarks/results/quality-smollm2/structures \\
        [--mlp DIR ...] [--e2e FILE ...] [--out DIR]

Quality (`--quality`): one folder per capacity, `c50/`, `c70/`, ..., each with one folder per router set: `free/`
(the shipped set) and `codebook<P>/` / `nested<L>/` (converted from it by `wide train convert`), each holding the
`wide eval quality` records `ppl.json` and `generation.json` (and `convert.json` for a converted set), or a
`records.json` naming committed records of the same measurement elsewhere in the repository. Quality is
SmolLM2-135M's: WikiText-2 test ppl ratio to dense, the measured FLOP capacity, generation agreement with dense.

Speed, on the Llama-3.1-8B shape, read from the records given (rows without one say "not timed"):
  --mlp DIR   `benchmarks/bench_bucket_mlp.py` folders (`bucket-mlp.json`), one per (capacity, structure). Each
              row is matched to the record with its capacity (the record's `--capacity`) and, for a structured
              set, its prototypes / levels (`--prototypes`); the MLP block's speedup over dense at each T:
              free masks: variant `free`; codebook: `bucket_codebook` (random prototypes) at T <= 16 and the
              trained routers' recorded buckets (`bucket_recorded_unionblocks`, the op's default above 16 tokens)
              where the record has them, else `bucket_codebook`; nested: `bucket_nested` at T <= 16, the
              recorded buckets above (a nested set's recorded masks are its width prefixes). Recorded rows count
              only when the record names the recording's structure; a record from before bench_bucket_mlp wrote
              its arguments is read through its command line.
  --e2e FILE  `benchmarks/bench_e2e.py` records: a row's end-to-end speedup over dense Inductor per workload from
              the records with its capacity and masks (`random` for free masks, `codebook<P>`, `nested<L>`).
Writes `<out>/structure-table.md` and `.json` (default out: the quality folder) and prints the table.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # bench_bucket_mlp, when run as a script

MLP_TS = (1, 16, 2048, 8192)
E2E_WORKLOADS = (("prefill", 2048, 1), ("prefill", 8192, 1), ("decode", 1024, 1), ("decode", 1024, 8))
SET_NAME = re.compile(r"(free)|(codebook|nested)(\d+)")
CAP_NAME = re.compile(r"c(\d+)")


def _load(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def _shown(p: Path) -> str:
    """A path as the records name it: from the repository root when it lies inside it."""
    p = p.resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)


def record_files(d: Path) -> dict:
    """{"ppl": path, "generation": path} of a set's folder: its own records, or the committed records its
    `records.json` names ({"ppl": ..., "generation": ...}, paths from the repository root), so a set already
    scored elsewhere is not scored twice."""
    files = {k: d / f"{k}.json" for k in ("ppl", "generation")}
    links = _load(d / "records.json")
    for k, rel in (links or {}).items():
        if k not in files:
            raise SystemExit(f"structure_table: {d / 'records.json'} names {k!r}; expected ppl and generation")
        p = ROOT / rel
        if not p.is_file():
            raise SystemExit(f"structure_table: {d / 'records.json'}: {rel} is not a file")
        files[k] = p
    return files


def quality_rows(root: Path) -> list[dict]:
    """One row per `<root>/c<NN>/<set>/` with a `ppl.json`, free first within each capacity."""
    rows = []
    for cap_dir in sorted(p for p in root.iterdir() if p.is_dir() and CAP_NAME.fullmatch(p.name)):
        for d in sorted(p for p in cap_dir.iterdir() if p.is_dir()):
            m = SET_NAME.fullmatch(d.name)
            if not m:
                continue
            files = record_files(d)
            ppl = _load(files["ppl"])
            if ppl is None:
                continue
            rows.append(dict(capacity=int(CAP_NAME.fullmatch(cap_dir.name)[1]) / 100, set=d.name,
                             structure="free" if m[1] else m[2], size=None if m[1] else int(m[3]),
                             folder=str(d), ppl=ppl, generation=_load(files["generation"]),
                             convert=_load(d / "convert.json"),
                             sources={k: _shown(v) for k, v in files.items() if v.is_file()}))
    if not rows:
        raise SystemExit(f"structure_table: no <c NN>/<set>/ppl.json under {root}")
    return sorted(rows, key=lambda r: (r["capacity"], r["structure"] != "free", r["structure"], r["size"] or 0))


def mlp_speed(records: list[dict], row: dict) -> dict:
    """{T: (speedup over dense, variant, device, the variant's measured capacity or None)} for `row` from the
    bench_bucket_mlp records (missing T: absent)."""
    out = {}
    for rec in records:
        if abs(rec["args"]["capacity"] - row["capacity"]) > 1e-9:
            continue
        if row["structure"] != "free" and rec["args"]["prototypes"] != row["size"]:
            continue
        if row["structure"] != "free" and rec.get("masks_structure") not in (None, row["structure"]):
            continue
        by = {(r["variant"], r["T"]): (r["speedup_vs_dense"], r.get("capacity")) for r in rec["rows"]
              if "speedup_vs_dense" in r}
        for T in MLP_TS:
            if row["structure"] == "free":
                names = ["free"]
            elif T <= 16:
                names = [f"bucket_{row['structure']}"]
            else:
                names = (["bucket_recorded_unionblocks"] if rec.get("masks_structure") == row["structure"] else []) + \
                        ([f"bucket_{row['structure']}"] if row["structure"] == "codebook" else [])
            for n in names:
                if (n, T) in by:
                    x, cap = by[(n, T)]
                    out.setdefault(T, (x, n, rec["device"], cap))
                    break
    return out


def e2e_masks(row: dict) -> str:
    return "random" if row["structure"] == "free" else f"{row['structure']}{row['size']}"


def e2e_speed(records: list[dict], row: dict) -> dict:
    """{(phase, tokens, batch): (speedup, static speedup, device)} from bench_e2e records at row's capacity and
    masks (the last record of a workload wins: later runs come later on the command line)."""
    out = {}
    for rec in records:
        if rec.get("masks") != e2e_masks(row) or abs(rec.get("capacity", -1) - row["capacity"]) > 1e-9:
            continue
        if rec.get("speedup") is None:
            continue
        out[(rec["phase"], rec["tokens"], rec["batch"])] = (rec["speedup"], rec.get("static_speedup"), rec["device"])
    return out


def command_args(rec: dict, where) -> dict:
    """capacity and prototypes of a bench_bucket_mlp record from its command line, with the script's defaults."""
    import shlex

    import bench_bucket_mlp

    argv = shlex.split(rec.get("command", ""))
    if len(argv) < 2 or not argv[1].endswith("bench_bucket_mlp.py"):
        raise SystemExit(f"structure_table --mlp {where}: the record names no bench_bucket_mlp.py command; re-run it")
    a = bench_bucket_mlp.parse_args(argv[2:])
    return dict(capacity=a.capacity, prototypes=a.prototypes, ts=a.ts, masks=a.masks, masks_layer=a.masks_layer)


def load_mlp(folders: list[Path]) -> list[dict]:
    recs = []
    for f in folders:
        rec = _load(f / "bucket-mlp.json")
        if rec is None:
            raise SystemExit(f"structure_table --mlp {f}: no bucket-mlp.json there")
        if "args" not in rec:  # records before bench_bucket_mlp wrote its args: its own parser reads the command
            rec["args"] = command_args(rec, f)
        recs.append(rec)
    return recs


def load_e2e(files: list[Path]) -> list[dict]:
    recs = []
    for f in files:
        data = _load(f)
        if data is None or "records" not in data:
            raise SystemExit(f"structure_table --e2e {f}: not a bench_e2e JSON (no `records`)")
        for r in data["records"]:
            recs.append(dict(r, device=data.get("gpu") or data.get("device")))
    return recs


def build(quality: Path, mlp: list[Path], e2e: list[Path]) -> list[dict]:
    rows = quality_rows(quality)
    mrecs, erecs = load_mlp(mlp), load_e2e(e2e)
    free_ratio = {r["capacity"]: r["ppl"]["result"]["ppl_ratio"] for r in rows if r["structure"] == "free"}
    for r in rows:
        res = r["ppl"]["result"]
        r["ppl_ratio"] = res["ppl_ratio"]
        r["relative_to_free"] = res["ppl_ratio"] / free_ratio[r["capacity"]] if r["capacity"] in free_ratio else None
        r["measured_capacity"] = res["wide"]["capacity"]
        r["test_tokens"] = res["wide"]["tokens"]
        g = (r["generation"] or {}).get("result")
        r["agreement"] = None if g is None else dict(mean=g["mean_agreement"], at=g["agree_at"],
                                                     frac_at=g["frac_agree_at"], dense_nll=g["dense_nll_of_wide"],
                                                     dense_nll_of_dense=g["dense_nll_of_dense"])
        r["mlp"] = mlp_speed(mrecs, r)
        r["e2e"] = e2e_speed(erecs, r)
    return rows


def _x(v) -> str:
    return "-" if v is None else f"{v:.2f}x"


CAP_SLACK = 0.05  # a timing whose masks' capacity is further than this from the row's says its own capacity


def _mlp_cell(timing, capacity: float) -> str:
    """One MLP-block timing; with its masks' capacity where that is not the row's: a nested draw of one or a few
    tokens runs at those tokens' levels, not at the row's capacity, so its speedup is not the row's."""
    if timing is None:
        return "-"
    x, _, _, cap = timing
    if cap is not None and abs(cap - capacity) > CAP_SLACK:
        return f"{_x(x)} (at {cap:.2f})"
    return _x(x)


def markdown(rows: list[dict]) -> str:
    head = ("| capacity | routers | WikiText-2 ppl ratio | relative to free | measured capacity (attn / ffn) | "
            "generation: mean agreement / >= 16 tokens / dense NLL of the answers | MLP block T = "
            + " / ".join(str(t) for t in MLP_TS) + " | end to end: prefill 2048 / 8192, decode ctx 1024 x 1 / x 8 |")
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        c = r["measured_capacity"]
        a = r["agreement"]
        gen = "-" if a is None else f"{a['mean']:.1f} / {100 * a['frac_at']:.0f} % / {a['dense_nll']:.3f}"
        mlp = " / ".join(_mlp_cell(r["mlp"].get(T), r["capacity"]) for T in MLP_TS)
        e2e = " / ".join(_x(r["e2e"][w][0]) if w in r["e2e"] else "-" for w in E2E_WORKLOADS)
        name = "free (shipped)" if r["structure"] == "free" else f"{r['structure']} {r['size']}"
        rel = "1.000" if r["structure"] == "free" else ("-" if r["relative_to_free"] is None
                                                       else f"{r['relative_to_free']:.3f}")
        lines.append(f"| {r['capacity']:.2f} | {name} | {r['ppl_ratio']:.3f} | {rel} | {c['overall']:.3f} "
                     f"({c['attn']:.3f} / {c['ffn']:.3f}) | {gen} | {mlp} | {e2e} |")
    devices = sorted({v[2] for r in rows for v in list(r["mlp"].values()) + list(r["e2e"].values()) if v[2]})
    tokens = " / ".join(str(t) for t in sorted({r["test_tokens"] for r in rows}))
    lines += ["", f"Quality: SmolLM2-135M-Instruct, WikiText-2 test ({tokens} tokens scored, ctx 1024 "
              "stride 512), generation on the committed 110 prompts; each row's folder holds its records (command, "
              "machine, date). Speed: the Llama-3.1-8B shape, over dense Inductor"
              + (f", on {', '.join(devices)}" if devices else ": not timed yet") + "; `-`: no record; "
              f"`(at C)`: the timed masks' capacity, where it is more than {CAP_SLACK} from the row's."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quality", required=True, type=Path, help="folder of c<NN>/<set>/ quality records")
    ap.add_argument("--mlp", nargs="*", type=Path, default=[], help="bench_bucket_mlp.py output folders")
    ap.add_argument("--e2e", nargs="*", type=Path, default=[], help="bench_e2e.py JSON records")
    ap.add_argument("--out", type=Path, default=None, help="where structure-table.md / .json go (default: --quality)")
    a = ap.parse_args(argv)
    rows = build(a.quality, a.mlp, a.e2e)
    out = a.out or a.quality
    out.mkdir(parents=True, exist_ok=True)
    md = markdown(rows)
    (out / "structure-table.md").write_text(md)
    keep = ("capacity", "set", "structure", "size", "folder", "sources", "ppl_ratio", "relative_to_free",
            "measured_capacity", "test_tokens", "agreement")
    (out / "structure-table.json").write_text(json.dumps(
        dict(command="python benchmarks/structure_table.py " + " ".join(sys.argv[1:] if argv is None else argv),
             rows=[{k: r[k] for k in keep} | {"mlp": {str(t): v for t, v in r["mlp"].items()},
                                              "e2e": {"/".join(map(str, w)): v for w, v in r["e2e"].items()}}
                   for r in rows]), indent=1))
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
