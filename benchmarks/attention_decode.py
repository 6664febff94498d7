"""Decode attention kernel table: wide.attn_decode (reads only the KV heads of active head groups) against
SDPA with GQA at the same shapes, on a CUDA GPU.

    python benchmarks/attention_decode.py --out decode.json                # the table (GPU)
    python benchmarks/attention_decode.py --dry-run --out /tmp/d.json      # tiny shapes, CPU interpreter
    python benchmarks/attention_decode.py --sweep --write-config wide_compile/kernels/configs/attn_decode/X.json \
        --out sweep.json                                                   # the GPU's tuned file from a sweep
    python benchmarks/attention_decode.py --config-from sweep.json --write-config X.json   # from a recorded sweep

Every row: correctness against the float64 reference first (relative L2 error on the active rows), then
each variant captured in a CUDA graph of `--inner` calls and replayed `--rounds` times, variants interleaved
round by round; medians with the interquartile range. Masks: per sequence exactly round(c * G) groups on
(random which), so the bytes a KV-aligned kernel must read are exactly c of the cache.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
from pathlib import Path

import torch


def _masks(B: int, G: int, capacity: float, gen: torch.Generator) -> torch.Tensor:
    on = max(1, round(capacity * G))
    m = torch.zeros(B, G, dtype=torch.bool)
    for b in range(B):
        m[b, torch.randperm(G, generator=gen)[:on]] = True
    return m


def _time_graphs(fns: dict, inner: int, rounds: int, device) -> dict:
    """{name: fn} -> {name: [ms per call, one per round]}: each fn captured `inner` times in one CUDA graph
    (eager loops on the CPU), rounds interleaved across the variants."""
    if device.type != "cuda":
        out = {n: [] for n in fns}
        for _ in range(rounds):
            for n, f in fns.items():
                f()
                out[n].append(float("nan"))
        return out
    from e2e.timing import cuda_graph_step

    def calls(f):
        def run():
            for _ in range(inner):
                f()
        return run

    # one graph of `inner` calls per variant, captured after one warm-up round of those calls
    graphs = {n: cuda_graph_step(calls(f), None, warm=1)[1] for n, f in fns.items()}
    for g in graphs.values():
        g.replay()
    torch.cuda.synchronize()
    out = {n: [] for n in fns}
    for _ in range(rounds):
        for n, g in graphs.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            out[n].append(a.elapsed_time(b) / inner)
    return out


def _stats(xs: list) -> dict:
    xs = sorted(xs)
    q = statistics.quantiles(xs, n=4) if len(xs) >= 2 else [xs[0]] * 3
    return {"median_ms": statistics.median(xs), "q1_ms": q[0], "q3_ms": q[2], "min_ms": xs[0], "max_ms": xs[-1]}


def decode_row(B, Hq, Hkv, D, ctx, group_size, capacity, dtype, device, inner, rounds, seed=0) -> dict:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from wide_compile.kernels.attn_decode import DEFAULT_CONFIG, attn_decode_ref, attn_decode_triton, tuned_config

    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, 1, D, generator=gen).to(dtype).to(device)
    k = torch.randn(B, Hkv, ctx, D, generator=gen).to(dtype).to(device)
    v = torch.randn(B, Hkv, ctx, D, generator=gen).to(dtype).to(device)
    hm = _masks(B, Hq // group_size, capacity, gen).to(device)
    full = torch.ones_like(hm)
    out = attn_decode_triton(q, k, v, hm, group_size)
    ref = attn_decode_ref(q.double(), k.double(), v.double(), hm, group_size)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    n_rep = Hq // Hkv
    kv_read = hm.repeat_interleave(group_size, 1).view(B, Hkv, n_rep).any(-1).float().mean().item()
    fns = {
        "wide": lambda: attn_decode_triton(q, k, v, hm, group_size),
        "wide_all_on": lambda: attn_decode_triton(q, k, v, full, group_size),
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
    }
    if device.type == "cuda":
        def flash():
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        fns["sdpa_flash"] = flash
    times = {n: _stats(t) for n, t in _time_graphs(fns, inner, rounds, device).items()}
    kv_bytes = 2 * B * Hkv * ctx * D * q.element_size()
    row = {"B": B, "Hq": Hq, "Hkv": Hkv, "D": D, "ctx": ctx, "group_size": group_size, "capacity": capacity,
           "dtype": str(dtype).replace("torch.", ""), "kv_heads_read": kv_read, "rel_err": err, "times": times,
           "config": {**DEFAULT_CONFIG, **tuned_config(B, Hkv, ctx, device)}}
    if device.type == "cuda":
        med = {n: t["median_ms"] for n, t in times.items()}
        row["speedup_vs_sdpa"] = med["sdpa"] / med["wide"]
        row["speedup_vs_sdpa_flash"] = med["sdpa_flash"] / med["wide"]
        row["wide_GBps"] = kv_bytes * kv_read / (med["wide"] * 1e6)
        row["wide_all_on_GBps"] = kv_bytes / (med["wide_all_on"] * 1e6)
        row["sdpa_GBps"] = kv_bytes / (med["sdpa"] * 1e6)
    return row


SWEEP = {"block_n": (32, 64, 128), "programs_per_sm": (2, 4, 8, 16), "num_warps": (4, 8), "num_stages": (2, 3, 4)}


def sweep_rows(Hq, Hkv, D, shapes, group_size, capacity, dtype, device, inner, rounds, grid=SWEEP) -> list:
    """Every config of `grid` (default SWEEP) on each (B, ctx), timed in one interleaved set per shape (configs
    whose shared memory does not fit are recorded with their error)."""
    import itertools

    from wide_compile.kernels.attn_decode import attn_decode_triton

    rows = []
    for B, ctx in shapes:
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(B, Hq, 1, D, generator=gen).to(dtype).to(device)
        k = torch.randn(B, Hkv, ctx, D, generator=gen).to(dtype).to(device)
        v = torch.randn(B, Hkv, ctx, D, generator=gen).to(dtype).to(device)
        hm = _masks(B, Hq // group_size, capacity, gen).to(device)
        want = attn_decode_triton(q, k, v, hm, group_size)
        fns, errors = {}, {}
        for vals in itertools.product(*grid.values()):
            cfg = dict(zip(grid, vals))
            name = json.dumps(cfg, sort_keys=True)
            try:
                got = attn_decode_triton(q, k, v, hm, group_size, config=cfg)
                if not torch.allclose(got, want, atol=2e-2, rtol=2e-2):
                    errors[name] = "differs from the default config"
                    continue
            except Exception as e:  # an out-of-resources config is a result of the sweep, not a failure
                errors[name] = f"{type(e).__name__}: {str(e)[:120]}"
                continue
            fns[name] = (lambda c: (lambda: attn_decode_triton(q, k, v, hm, group_size, config=c)))(cfg)
        times = {n: _stats(t) for n, t in _time_graphs(fns, inner, rounds, device).items()}
        best = min(times, key=lambda n: times[n]["median_ms"]) if device.type == "cuda" else None
        rows.append({"B": B, "Hkv": Hkv, "ctx": ctx, "group_size": group_size, "capacity": capacity, "times": times,
                     "errors": errors, "best": best})
        print(f"sweep B {B} ctx {ctx}: best {best} "
              f"{times[best]['median_ms'] * 1e3 if best else float('nan'):.1f}us", flush=True)
    return rows


def tuned_file(sweep: dict, source: str, default_hkv: int) -> dict:
    """A sweep record -> the tuned file attn_decode reads (configs/attn_decode/<GPU>.json): each swept shape's
    fastest config with its time, the device and the record it comes from. Rows without a best (CPU) are refused."""
    from wide_compile.kernels.attn_decode import check_tuned

    rows = []
    for r in sweep["rows"]:
        if not r.get("best"):
            raise SystemExit(f"{source}: sweep row B {r['B']} ctx {r['ctx']} has no best config (a CPU dry run?)")
        rows.append({"B": r["B"], "Hkv": r.get("Hkv", default_hkv), "ctx": r["ctx"], "config": json.loads(r["best"]),
                     "median_us": round(r["times"][r["best"]]["median_ms"] * 1e3, 2)})
    out = {"device": sweep["machine"]["device"], "source": source, "command": sweep.get("command", ""),
           "date": sweep.get("date", ""), "rows": rows}
    check_tuned(out, source)
    return out


def machine(device) -> dict:
    import triton

    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", help="JSON file to write (the table or the sweep; not needed with --config-from)")
    ap.add_argument("--ctx", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--group-sizes", type=int, nargs="+", default=[4, 1],
                    help="query heads per group (4 = one KV head's queries on the 8B shape)")
    ap.add_argument("--capacity", type=float, default=0.5, help="share of head groups on per sequence")
    ap.add_argument("--heads", type=int, nargs=3, default=[32, 8, 128], metavar=("HQ", "HKV", "D"),
                    help="query heads, KV heads, head dim (default: Llama-3.1-8B)")
    ap.add_argument("--inner", type=int, default=20, help="calls per CUDA graph")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--sweep", action="store_true",
                    help="time every config of SWEEP at ctx 4096 / 16384, batch 1 / 8, instead of the table")
    ap.add_argument("--grid", type=json.loads, default=None,
                    help='JSON {key: [values]} replacing SWEEP\'s grid, e.g. \'{"block_n": [64, 128]}\'')
    ap.add_argument("--write-config", default=None, metavar="PATH",
                    help="write the sweep's fastest config per shape as a tuned file (attn_decode reads "
                         "wide_compile/kernels/configs/attn_decode/<GPU name>.json)")
    ap.add_argument("--config-from", default=None, metavar="SWEEP_JSON",
                    help="no timing: write --write-config from this recorded sweep")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (Triton interpreter)")
    a = ap.parse_args(argv)
    if a.config_from or a.write_config:
        if not (a.write_config and (a.sweep or a.config_from)):
            raise SystemExit("--write-config takes its configs from --sweep or from --config-from SWEEP_JSON")
    if a.config_from:
        rec = json.loads(Path(a.config_from).read_text())
        return _write_tuned(a.write_config, tuned_file(rec, a.config_from, a.heads[1]))
    if not a.out:
        raise SystemExit("--out is needed: the JSON file the table or the sweep is written to")
    if a.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        a.ctx, a.batch, a.heads, a.inner, a.rounds = [70], [2], [8, 2, 16], 1, 2
        device, dtype = torch.device("cpu"), torch.float32
    else:
        if not torch.cuda.is_available():
            raise SystemExit("the decode attention table needs a CUDA GPU (or --dry-run on the CPU)")
        device, dtype = torch.device("cuda"), torch.bfloat16
    Hq, Hkv, D = a.heads
    if a.sweep:
        shapes = [(B, c) for B in a.batch for c in a.ctx if c >= 4096] or [(a.batch[0], a.ctx[-1])]
        grid = {**SWEEP, **(a.grid or {})}
        bad = sorted(set(grid) - set(SWEEP))
        if bad:
            raise SystemExit(f"--grid keys {bad} are not config keys; they are {sorted(SWEEP)}")
        rec = {"what": "decode attention config sweep", "machine": machine(device), "sweep": grid,
               "rows": sweep_rows(Hq, Hkv, D, shapes, a.group_sizes[0], a.capacity, dtype, device, a.inner,
                                  a.rounds, grid)}
        rec = _write(a, argv, rec)
        if a.write_config:
            _write_tuned(a.write_config, tuned_file(rec, a.out, Hkv))
        return None
    rows = []
    for gs in a.group_sizes:
        for B in a.batch:
            for ctx in a.ctx:
                r = decode_row(B, Hq, Hkv, D, ctx, gs, a.capacity, dtype, device, a.inner, a.rounds)
                rows.append(r)
                print(f"gs {gs} B {B} ctx {ctx}: err {r['rel_err']:.2e} kv read {r['kv_heads_read']:.2f} "
                      + " ".join(f"{n} {t['median_ms'] * 1e3:.1f}us" for n, t in r["times"].items())
                      + (f" | x{r['speedup_vs_sdpa']:.2f} vs sdpa, x{r['speedup_vs_sdpa_flash']:.2f} vs flash, "
                         f"{r['wide_GBps']:.0f} GB/s" if "speedup_vs_sdpa" in r else ""), flush=True)
    _write(a, argv, {"what": "decode attention kernel table", "machine": machine(device), "rows": rows})


def _write(a, argv, rec: dict) -> dict:
    rec = {**rec, "command": " ".join(["benchmarks/attention_decode.py", *(argv or sys.argv[1:])]),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rec, indent=1))
    print(f"wrote {a.out}")
    return rec


def _write_tuned(path: str, tuned: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(tuned, indent=1) + "\n")
    print(f"wrote {path}: " + "; ".join(f"B {r['B']} ctx {r['ctx']} {r['config']}" for r in tuned["rows"]))


if __name__ == "__main__":
    main()
