"""The one-token GEMV kernels (wide_compile/kernels/gemv.py) one at a time, over a grid of tiles.

    python benchmarks/bench_gemv.py --out DIR [--capacity 0.5] [--kernels gate_up down_k ...]
    python benchmarks/bench_gemv.py --out DIR --write-config    # also the best tiles as this GPU's tuned file
    python benchmarks/bench_gemv.py --out DIR --dry-run    # tiny shapes, CPU, Triton interpreter, 2 tiles each

Llama-3.1-8B shapes in bf16 at T = 1, one random mask of the given capacity (FFN groups of 64, head groups of 512
columns): the gate/up kernel (gated, compact output), the down kernel on both layouts of the down weight
(down_proj.weight: "k_contiguous"; the free op's transposed copy: "d_contiguous", plus its split sum), q_proj
and o_proj. Each kernel alone, for each tile of the grid, captured 20 times in one CUDA graph; a row is the median
per call over the graph's replays (CUDA events) with the bytes of weights it must read and the rate that gives.
Beside them, cuBLAS reading the same bytes: F.linear of x on the active rows' weights, contiguous (a statically
pruned layer). Writes DIR/gemv.json and DIR/gemv.md (command, GPU, date). --write-config also writes the fastest tile of each swept
kernel (and layout) as the GPU's tuned file, wide_compile/kernels/configs/gemv/<GPU name>.json (kernels not swept
keep the entries the file had), and a copy as DIR/gemv-config.json: the ops then run on those tiles. --dry-run calls each kernel once on
the CPU through the Triton interpreter, checked against its reference: a check that the script runs, not a
measurement.
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SHAPE = dict(D=4096, F=14336, FGS=64, NQ=4096, HGS=512)    # Llama-3.1-8B
SHAPE_DRY = dict(D=48, F=96, FGS=16, NQ=64, HGS=16)
KERNELS = ("gate_up", "down_k", "down_d", "q_proj", "o_proj_k", "o_proj_d")
# Tiles per kernel: rows x K tile, warps, and whether each tile's loads go out one iteration ahead (prefetch)
GU = [dict(gu_bn=bn, gu_bk=bk, gu_warps=w, gu_prefetch=p) for p, bn, bk, w in
      itertools.product((1, 0), (2, 4, 8, 16), (128, 256, 512), (1, 2, 4)) if bn * bk <= 4096]
GD = {"k_contiguous": [dict(gd_bn=bn, gd_bk=bk, gd_split=s, gd_warps=w, gd_prefetch=p) for p, bn, bk, s, w in
                       itertools.product((1, 0), (4, 8, 16), (256, 512), (1, 4, 8, 16), (2, 4))],
      "d_contiguous": [dict(gd_bn=bn, gd_bk=bk, gd_split=s, gd_warps=w) for bn, bk, s, w in
                       itertools.product((64, 128, 256), (16, 32, 64), (8, 16, 32), (4, 8)) if bn * bk <= 8192]}


def timed(fn, dry: bool, reps: int = 20, replays: int = 30) -> float:
    """Median ms per call: `reps` calls captured in one CUDA graph, each replay timed with events (dry run: the
    wall time of one call)."""
    import time

    import torch

    if dry:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    ts = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / reps)
    ts.sort()
    return ts[len(ts) // 2]


def write_us_table(out: str, stem: str, script: str, title: str, rows: list, dry: bool, extra=()) -> None:
    """out/<stem>.json (command, GPU, date, torch, rows) and out/<stem>.md: "# title (GPU)", the command line and a
    table of shape, T, variant (its default marked), us and the `extra` columns [(header, row key)] ("-" for None):
    the record of a bench that times variants per call in CUDA graphs (`timed`)."""
    import torch

    os.makedirs(out, exist_ok=True)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() and not dry else "cpu (dry run)"
    info = dict(command=f"python benchmarks/{script} " + " ".join(sys.argv[1:]), gpu=gpu,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                torch=torch.__version__)
    with open(os.path.join(out, f"{stem}.json"), "w") as f:
        json.dump(dict(info, rows=rows), f, indent=1)
    heads = ["shape", "T", "variant", "us", *(h for h, _ in extra)]
    lines = [f"# {title} ({gpu})", "",
             f"`{info['command']}`, {info['date']}, torch {info['torch']}. Median us per call, 20 calls per CUDA "
             "graph.", "", "| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for r in rows:
        cells = [r["shape"], r["T"], r["variant"] + (" (default)" if r["default"] else ""), r["us"],
                 *("-" if r[k] is None else r[k] for _, k in extra)]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    with open(os.path.join(out, f"{stem}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--capacity", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS,
                    help="which kernels to sweep (default all); cuBLAS's rows always run")
    ap.add_argument("--write-config", action="store_true",
                    help="write the fastest tile per swept kernel as this GPU's tuned file (configs/gemv/)")
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny shapes on the CPU under the Triton interpreter, two tiles per kernel (a check)")
    args = ap.parse_args(argv)
    dry = args.dry_run
    if dry:  # before anything imports triton: the kernels then run on the CPU interpreter
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import torch.nn.functional as Fn
    import triton

    from wide_compile.kernels import gemv as GV
    from wide_compile.kernels import reference as R
    from wide_compile.kernels.tuning import device_key

    if not dry and not torch.cuda.is_available():
        raise SystemExit("bench_gemv.py times CUDA kernels: run it on a GPU, or pass --dry-run on a CPU")
    sh = SHAPE_DRY if dry else SHAPE
    D, F, FGS, NQ, HGS = sh["D"], sh["F"], sh["FGS"], sh["NQ"], sh["HGS"]
    grid = (lambda g: g[:2]) if dry else (lambda g: g)
    gen = torch.Generator().manual_seed(args.seed)
    dev, dt = ("cpu", torch.float32) if dry else ("cuda", torch.bfloat16)
    r = lambda *s: (torch.randn(*s, generator=gen) * 0.02).to(dev, dt)  # noqa: E731
    x, wg, wu, wd = r(1, D) * 50, r(F, D), r(F, D), r(D, F)
    wd_t = wd.t().contiguous()
    wq, wo = r(NQ, D), r(D, NQ)
    wo_t = wo.t().contiguous()
    G, GQ = F // FGS, NQ // HGS
    m = (torch.rand(1, G, generator=gen) < args.capacity).to(dev).to(torch.uint8)
    mq = (torch.rand(1, GQ, generator=gen) < args.capacity).to(dev).to(torch.uint8)
    m[0, 0] = mq[0, 0] = 1
    esz = torch.empty((), dtype=dt).element_size()
    act_f = int(m.sum()) * FGS * esz  # bytes per weight row's worth of active columns
    act_q = int(mq.sum()) * HGS * esz
    rows = []
    info = dict(device="cpu (dry run, Triton interpreter)" if dry else torch.cuda.get_device_name(),
                torch=torch.__version__, triton=triton.__version__,
                date=datetime.datetime.now().isoformat(timespec="seconds"), capacity=args.capacity,
                active_ffn_groups=int(m.sum()), active_head_groups=int(mq.sum()), shape=sh,
                command="python " + " ".join(sys.argv if argv is None else [__file__] + list(argv)),
                out_json=os.path.join(args.out, "gemv.json"))
    os.makedirs(args.out, exist_ok=True)
    tol = 1e-4 if dry else 2e-2

    def check(name, out, ref):
        err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
        if not err <= tol:
            raise AssertionError(f"bench_gemv: {name}: relative L2 error {err:.2e} above {tol} against the reference")

    def add(kernel, layout, cfg, ms, nbytes):
        rows.append(dict(kernel=kernel, layout=layout, config=cfg, ms=ms, bytes=nbytes, tb_s=nbytes / ms / 1e9))
        save()

    tuned_path = GV.TUNED_DIR / f"{device_key(info['device'])}.json"

    def save():  # after every row: a run cut short keeps its rows (and the tiles it has found)
        write(args, info, rows, G, GQ)
        if args.write_config:
            write_config(rows, info["device"], tuned_path, info)

    h = torch.empty(F, dtype=dt, device=dev)
    glist = torch.empty(G, dtype=torch.int32, device=dev)

    def gate_up(cfg):  # the gated kernel alone, as mlp_gemv_triton launches it
        GV._gate_up(x, wg, wu, h, glist, m, m, 1, False, G, FGS, "silu", dict(GV.config_for("k_contiguous"), **cfg),
                    False)

    # cuBLAS on the same bytes, contiguous: the statically pruned layer's GEMVs
    keep = torch.nonzero(m[0].bool().repeat_interleave(FGS)).flatten()
    wg_s, wu_s, wd_s = wg[keep].contiguous(), wu[keep].contiguous(), wd[:, keep].contiguous()
    hs = torch.randn(1, len(keep), generator=gen).to(dev, dt)
    add("cublas gate+up", "-", {}, timed(lambda: (Fn.linear(x, wg_s), Fn.linear(x, wu_s)), dry), 2 * act_f * D)
    add("cublas down", "k_contiguous", {}, timed(lambda: Fn.linear(hs, wd_s), dry), act_f * D)
    mlp_ref = R.mlp_ref(x, wg, wu, wd_t, m.bool(), FGS)
    for cfg in grid(GU) if "gate_up" in args.kernels else ():
        add("gate_up", "-", cfg, timed(lambda c=cfg: gate_up(c), dry), 2 * act_f * D)
    for lay, w_nk in (("k_contiguous", wd), ("d_contiguous", wd_t.t())):
        for i, cfg in enumerate(grid(GD[lay]) if "down_" + lay[0] in args.kernels else ()):
            c = dict(GV.config_for(lay), **cfg)
            if i == 0:  # the whole MLP on this layout, against its reference
                check(f"MLP ({lay})", GV.mlp_gemv_triton(x, wg, wu, w_nk, m, None, FGS, config=c), mlp_ref)
            gate_up(GU[0])  # h and the group list for the down kernel

            def down(c=c, w=w_nk):
                return GV._reduce(h, w, None, glist, m, m, 1, False, G, FGS, c, True, False)
            add("down", lay, cfg, timed(down, dry), act_f * D)
    q_ref = R.q_proj_ref(x, wq, None, mq.bool(), HGS)
    for i, cfg in enumerate(grid(GU) if "q_proj" in args.kernels else ()):
        c = dict(GV.config_for("k_contiguous"), **cfg)
        if i == 0:
            check("q_proj", GV.q_proj_gemv_triton(x, wq, None, mq, None, HGS, c), q_ref)
        add("q_proj", "-", cfg, timed(lambda c=c: GV.q_proj_gemv_triton(x, wq, None, mq, None, HGS, c), dry),
            act_q * D)
    a = r(1, NQ) * 50
    o_ref = R.o_proj_ref(a, wo_t, None, mq.bool(), HGS)
    for lay, w_nk in (("k_contiguous", wo), ("d_contiguous", wo_t.t())):
        for i, cfg in enumerate(grid(GD[lay]) if "o_proj_" + lay[0] in args.kernels else ()):
            c = dict(GV.config_for(lay), **cfg)
            if i == 0:
                check(f"o_proj ({lay})", GV.o_proj_gemv_triton(a, w_nk, None, mq, None, HGS, c), o_ref)
            add("o_proj", lay, cfg,
                timed(lambda c=c, w=w_nk: GV.o_proj_gemv_triton(a, w, None, mq, None, HGS, c), dry), act_q * D)
    if args.write_config:
        print(f"tuned tiles written to {tuned_path}")
    print(open(os.path.join(args.out, "gemv.md")).read())
    return dict(rows=rows, **info)


def best_tiles(rows: list) -> dict:
    """The tuned file's entries from the sweep's rows: the fastest tile per kernel (gate_up, q_proj) and per kernel
    and layout (down, o_proj); cuBLAS's rows are not tiles."""
    out = {}
    for r in sorted((r for r in rows if not r["kernel"].startswith("cublas")), key=lambda r: r["ms"], reverse=True):
        if r["layout"] == "-":
            out[r["kernel"]] = dict(r["config"])       # the fastest comes last
        else:
            out.setdefault(r["kernel"], {})[r["layout"]] = dict(r["config"])
    return out


def write_config(rows: list, device: str, path, info: dict):
    """Merge best_tiles(rows) into the tuned file at `path` (entries of kernels not in rows stay) and copy the
    result to the output folder."""
    old = {}
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
    new = dict(old, device=device, written_by=info["command"], date=info["date"])
    for k, v in best_tiles(rows).items():
        new[k] = dict(old.get(k, {}), **v) if k in ("down", "o_proj") else v
    os.makedirs(os.path.dirname(path), exist_ok=True)
    for p in (path, os.path.join(os.path.dirname(info["out_json"]), "gemv-config.json")):
        with open(p, "w") as f:
            json.dump(new, f, indent=1, sort_keys=True)
            f.write("\n")
    return path


def write(args, info, rows, G, GQ):
    with open(os.path.join(args.out, "gemv.json"), "w") as f:
        json.dump(dict(rows=rows, **info), f, indent=1)
    lines = [f"# One-token GEMV kernels ({info['device']})", "", f"command: `{info['command']}`  ",
             f"date: {info['date']}, torch {info['torch']}, triton {info['triton']}; shape {info['shape']}, capacity "
             f"{args.capacity} ({info['active_ffn_groups']}/{G} FFN groups, {info['active_head_groups']}/{GQ} head "
             "groups); median ms per call, 20 calls per CUDA graph", "",
             "Best five per kernel and layout:", "", "| kernel | layout | config | ms | TB/s |",
             "|---|---|---|---|---|"]
    for key in sorted({(r["kernel"], r["layout"]) for r in rows}):
        best = sorted((r for r in rows if (r["kernel"], r["layout"]) == key), key=lambda r: r["ms"])[:5]
        lines += [f"| {r['kernel']} | {r['layout']} | {json.dumps(r['config'])} | {r['ms'] * 1e3:.1f} us | "
                  f"{r['tb_s']:.2f} |" for r in best]
    with open(os.path.join(args.out, "gemv.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
