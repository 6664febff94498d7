"""The MLP block with structured masks (wide.mlp_bucket) against dense, static half width and free masks.

    python benchmarks/bench_bucket_mlp.py --out DIR [--ts 1 16 2048 8192] [--sweep] [--dense-mode default]
        [--masks benchmarks/data/smollm2-cb64-router-masks.safetensors [--masks-layer L]]
    python benchmarks/bench_bucket_mlp.py --out DIR --dry-run     # tiny shapes, CPU, Triton interpreter

Shape: the Llama-3.1-8B MLP (D 4096, F 14336, bf16, FFN groups of 64 channels, G = 224), capacity 0.5.
Variants, per token count T, all from one interleaved run:
  dense            torch.compile'd F.linear triple with silu * mul (--dense-mode: Inductor's mode)
  static           the same on the first F/2 channels (a statically pruned model)
  free             torch.ops.wide.mlp with a random subset of round(capacity * G) groups per token (--mask-draw
                   bernoulli: iid Bernoulli(capacity) per (token, group))
  bucket_codebook  torch.ops.wide.mlp_bucket, P prototypes each such a random subset, each token's
                   prototype uniform at random
  bucket_nested    the same with P prefix prototypes (evenly spaced widths, mean width capacity * G: nested_protos)
  (T = 1 runs on gemv's two GEMVs, 2 <= T <= 16 as one block over the union of the tokens' prototypes; see
  bucket_mlp's docstring.)
  At 2 <= T <= 16 also bucket_codebook_dense (few_tokens="dense": dense GEMMs with the masks applied), above 16
  bucket_codebook_unionblocks (prefill_lists="union": no padding per bucket, blocks over their prototypes' union;
  the GPU default) and bucket_codebook_padded (prefill_lists="padded": each bucket padded to whole token blocks).
  With --masks FILE (benchmarks/record_router_masks.py's recording of trained routers), above 16 also
  bucket_recorded (padded lists) and bucket_recorded_unionblocks (prefill_lists="union") on the buckets of the
  first T recorded tokens of layer --masks-layer (default: the middle one): prototypes = the window's distinct
  FFN masks, group g = recorded group g % G_rec (tiled to G), each token in its mask's bucket; their rows also
  carry the window's padding_factor and union_block_factor (benchmarks/bucket_padding.py) at the op's block_m.
  At T = 1 also: free_gemv (torch.ops.wide.mlp with the tuning's one_token="gemv": the same GEMVs on the free
  op's w_down_t), free_gemv_view (the same on down_proj.weight through a transposed view: what a compiled
  one-token graph passes) and bucket_codebook_union (the union block, one_token="union").
  --sweep adds bucket_codebook at each of bucket_mlp.SWEEP[phase], and at T = 1 free_gemv / bucket_codebook_gemv
  at each of gemv.GEMV_SWEEP (a candidate that fails is a row with its error).
Each WIDE variant is checked against its PyTorch reference before timing (relative L2 <= 2e-2, bf16). Each
callable is captured in a CUDA graph (benchmarks/e2e/timing.cuda_graph_step); the replays are timed with CUDA
events per replay in interleaved rounds (e2e/timing.time_interleaved); a row has the median, p10 and p90 of the
replays and the ratio dense median / variant median. Writes DIR/bucket-mlp.json and DIR/bucket-mlp.md (command,
GPU, software, date). --dry-run times eager calls on the CPU, the WIDE kernels through the Triton interpreter:
a check that the script runs, not a measurement.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SHAPE_8B = dict(D=4096, F=14336, group_size=64)
SHAPE_DRY = dict(D=32, F=128, group_size=16)
TOL = 2e-2
RECORDED_FROM_T = 17  # --masks rows only past the decode phase (tuning.DECODE_T = 16): the prefill's bucket lists


def nested_protos(P: int, G: int, capacity: float = 0.5):
    """[P, G] bool prefixes at P evenly spaced widths centred on capacity * G, spread as far as [0, G] allows:
    width_l = (capacity + ((l + 1/2) / P - 1/2) * 2 min(capacity, 1 - capacity)) G, so the mean width over
    uniform levels is capacity * G (at capacity 0.5: (l + 1/2) G / P)."""
    import torch

    span = 2 * min(capacity, 1 - capacity)
    widths = ((capacity + ((torch.arange(P, dtype=torch.float64) + 0.5) / P - 0.5) * span) * G).round().long()
    return torch.arange(G)[None, :] < widths[:, None]


def draw_masks(rows: int, G: int, capacity: float, how: str, gen):
    """[rows, G] bool: "exact" a random subset of round(capacity * G) groups per row (every row at the asked
    capacity: one decode token's time is its own mask's width, and a single Bernoulli draw of 224 groups lands a
    few percent off), "bernoulli" each (row, group) on with probability capacity."""
    import torch

    if how == "bernoulli":
        return torch.rand(rows, G, generator=gen) < capacity
    k = round(capacity * G)
    return torch.rand(rows, G, generator=gen).argsort(dim=1).argsort(dim=1) < k


def make_inputs(T: int, shape: dict, P: int, capacity: float, dtype, device, gen, mask_draw: str = "exact") -> dict:
    import torch

    D, Fi, gs = shape["D"], shape["F"], shape["group_size"]
    G = Fi // gs
    r = lambda *s: (torch.randn(*s, generator=gen) * 0.02).to(device, dtype)  # noqa: E731
    w = dict(x=torch.randn(T, D, generator=gen).to(device, dtype), wg=r(Fi, D), wu=r(Fi, D), wd=r(D, Fi))
    w["wd_t"] = w["wd"].t().contiguous()                       # wide.mlp's layout (down_proj.weight.T)
    h = Fi // 2
    w.update(wg_half=w["wg"][:h].contiguous(), wu_half=w["wu"][:h].contiguous(), wd_half=w["wd"][:, :h].contiguous())
    w["free_mask"] = draw_masks(T, G, capacity, mask_draw, gen).to(device)
    w["codebook"] = draw_masks(P, G, capacity, mask_draw, gen).to(device)
    w["nested"] = nested_protos(P, G, capacity).to(device)
    w["bucket"] = torch.randint(0, P, (T,), generator=gen, dtype=torch.int32).to(device)
    return w


def recorded_inputs(rec: dict, layer: int, T: int, G: int, device) -> dict:
    """The first T tokens of `layer`'s recorded FFN masks (record_router_masks.load_masks) as bucket inputs at G
    groups: {"recorded": protos [P, G] bool (the window's distinct masks, group g = recorded group g % G_rec),
    "recorded_bucket": [T] int32 (each token's mask among them), "recorded_window": [T, G_rec] bool (CPU)}."""
    import torch
    from benchmarks.bucket_padding import buckets_of

    ffn = rec["ffn"]
    if not 0 <= layer < len(ffn):
        raise ValueError(f"bench_bucket_mlp --masks-layer {layer}: the recording has FFN layers 0..{len(ffn) - 1}")
    if ffn[layer].shape[0] < T:
        raise ValueError(f"bench_bucket_mlp --masks: the recording has {ffn[layer].shape[0]} tokens per layer, "
                         f"fewer than T = {T}; record more tokens or drop T from --ts")
    m = ffn[layer][:T]                                                   # [T, G_rec]
    bucket, widths = buckets_of(m)                                       # [T], [P]
    proto_rec = m.new_zeros(widths.numel(), m.shape[1])
    proto_rec[bucket] = m                                                # [P, G_rec]: every token of p has mask p
    protos = proto_rec[:, torch.arange(G) % m.shape[1]]                  # [P, G]
    return dict(recorded=protos.to(device), recorded_bucket=bucket.to(device, torch.int32), recorded_window=m)


def masks_structure(path):
    """The structure of the routers a --masks recording came from: None without --masks, or for a recording made
    before record_router_masks wrote it down."""
    if not path:
        return None
    from benchmarks.record_router_masks import read_meta

    return read_meta(path).get("structure")


def dense_mlp(x, wg, wu, wd):
    import torch.nn.functional as F

    return F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def variants_for(w: dict, shape: dict, args, dry: bool) -> tuple[dict, dict, list]:
    """({name: callable}, {name: row fields}, failed rows) for one T; WIDE callables checked first."""
    import torch
    from wide_compile.kernels import bucket_mlp as BK
    from wide_compile.kernels import gemv as GV
    from wide_compile.kernels import reference as R
    from wide_compile.kernels.compact_mlp import mlp_triton
    from wide_compile.kernels.tuning import table_for

    gs = shape["group_size"]
    comp = (lambda f: f) if dry else (lambda f: torch.compile(f, mode=args.dense_mode, dynamic=False))
    dense, static = comp(dense_mlp), comp(dense_mlp)
    fns = {"dense": lambda: dense(w["x"], w["wg"], w["wu"], w["wd"]),
           "static": lambda: static(w["x"], w["wg_half"], w["wu_half"], w["wd_half"])}
    meta = {"dense": dict(capacity=1.0), "static": dict(capacity=0.5)}
    if dry:  # the CPU would dispatch the ops to their references: call the Triton launchers (interpreter)
        free = lambda: mlp_triton(w["x"], w["wg"], w["wu"], w["wd_t"], w["free_mask"], gs)  # noqa: E731
    else:
        def free():
            return torch.ops.wide.mlp(w["x"], w["wg"], w["wu"], w["wd_t"], w["free_mask"], gs, "", "silu")
    ref = R.mlp_ref(w["x"], w["wg"], w["wu"], w["wd_t"], w["free_mask"], gs)
    fcap = w["free_mask"].float().mean().item()
    fns["free"], meta["free"] = free, dict(capacity=fcap, rel_l2=rel(free(), ref))
    T = len(w["x"])
    if T == 1:  # the free op on the one-token GEMVs (the tuning's one_token="gemv"), at each swept tile
        # free_gemv reads the op's transposed down copy; free_gemv_view reads down_proj.weight itself through a
        # transposed view, the form a compiled one-token graph passes (passes/base.reduction_weight)
        gemv = [("free_gemv", {}, "wd_t"), ("free_gemv_view", {}, "wd_view")]
        if args.sweep:
            gemv += [(f"free_gemv_{i}", c, "wd_t") for i, c in enumerate(GV.GEMV_SWEEP["d_contiguous"])]
        for name, c, wkey in gemv:
            over = dict(one_token="gemv", **c)
            wdt = w["wd"].t() if wkey == "wd_view" else w["wd_t"]  # [F, D] either way

            def fn(o=over, tj=table_for().with_overrides(decode=over).to_json(), wdt=wdt):
                if dry:
                    return mlp_triton(w["x"], w["wg"], w["wu"], wdt, w["free_mask"], gs, config=o)
                return torch.ops.wide.mlp(w["x"], w["wg"], w["wu"], wdt, w["free_mask"], gs, tj, "silu")
            fns[name], meta[name] = fn, dict(capacity=fcap, rel_l2=rel(fn(), ref), config=over, down_weight=wkey)
    cands = [("bucket_codebook", "codebook", None), ("bucket_nested", "nested", None)]
    if T == 1:  # one token: the GEMVs by default; the union block (one_token="union") and the GEMV tiles
        cands += [("bucket_codebook_union", "codebook", dict(one_token="union"))]
        if args.sweep:
            cands += [(f"bucket_codebook_gemv_{i}", "codebook", c) for i, c in enumerate(GV.GEMV_SWEEP["k_contiguous"])]
    else:
        if BK.uses_union(T, BK.config_for(T, gs, w["x"].dtype, w["x"].device)):  # few tokens: dense GEMMs + masks
            cands += [("bucket_codebook_dense", "codebook", dict(few_tokens="dense"))]
        else:  # unpadded blocks of width-ordered tokens over their prototypes' union
            cands += [("bucket_codebook_unionblocks", "codebook", dict(prefill_lists="union")),
                      ("bucket_codebook_padded", "codebook", dict(prefill_lists="padded"))]
        if args.sweep:
            cands += [(f"bucket_codebook_{i}", "codebook", c) for i, c in enumerate(BK.SWEEP[BK.phase(T)])]
    if "recorded" in w:  # trained routers' buckets (--masks), both ways to cut the sorted tokens
        cands += [("bucket_recorded", "recorded", dict(prefill_lists="padded")),
                  ("bucket_recorded_unionblocks", "recorded", dict(prefill_lists="union"))]
    failed = []
    for name, kind, cfg in cands:
        protos = w[kind]
        bucket = w.get(f"{kind}_bucket", w["bucket"])  # the recorded prototypes come with their own buckets

        def fn(p=protos, b=bucket, c=cfg):
            if dry:
                return BK.mlp_bucket_triton(w["x"], w["wg"], w["wu"], w["wd"], b, p, gs, config=c)
            return torch.ops.wide.mlp_bucket(w["x"], w["wg"], w["wu"], w["wd"], b, p, gs, "silu",
                                             json.dumps(c, sort_keys=True) if c else "")
        cap = protos[bucket.long()].float().mean().item()
        info = dict(capacity=cap, prototypes=protos.shape[0], structure=kind,
                    config=BK.config_for(len(w["x"]), gs, w["x"].dtype, w["x"].device, cfg))
        if kind == "recorded":  # the work factors of this window, at the token block the op's prefill uses
            from benchmarks.bucket_padding import buckets_of, padding_factor, union_block_factor

            m, bm = w["recorded_window"], info["config"]["block_m"]
            info.update(padding_factor=padding_factor(*buckets_of(m), bm), union_block_factor=union_block_factor(m, bm),
                        masks_file=args.masks, masks_layer=args.masks_layer)
        try:
            info["rel_l2"] = rel(fn(), BK.mlp_bucket_ref(w["x"], w["wg"], w["wu"], w["wd"], bucket, protos, gs))
        except Exception as e:  # a swept tile that does not fit this GPU is a row, not the end of the run
            if cfg is None:
                raise
            failed.append(dict(variant=name, error=repr(e)[:300], **info))
            continue
        fns[name], meta[name] = fn, info
    bad = {n: m["rel_l2"] for n, m in meta.items() if m.get("rel_l2", 0) > TOL}
    if bad:
        raise AssertionError(f"bench_bucket_mlp: relative L2 error above {TOL} against the reference: {bad}")
    return fns, meta, failed


def time_variants(fns: dict, args, dry: bool) -> dict:
    """{name: {median, p10, p90, n, min}} (ms), variants interleaved; CUDA-graph replays on the GPU."""
    from benchmarks.e2e.timing import Variant, cuda_graph_step, time_interleaved, warmup

    device = "cpu" if dry else "cuda"
    vs, keep = [], []
    for name, fn in fns.items():
        if dry:
            step = fn
        else:
            step, g = cuda_graph_step(fn, None)
            keep.append(g)
        v = Variant(name, step)
        warmup(v, device, n=1 if dry else 3)
        vs.append(v)
    time_interleaved(vs, device, rounds=args.rounds, target_s=args.target_s)
    return {v.name: v.summary() for v in vs}


def bench(args, dry: bool, save=lambda rows: None) -> list:
    import torch

    dtype, device = (torch.float32, "cpu") if dry else (torch.bfloat16, "cuda")
    shape = SHAPE_DRY if dry else SHAPE_8B
    gen = torch.Generator().manual_seed(args.seed)
    recorded = {}
    if args.masks:  # every window built (and checked) before anything is timed: a bad T fails at once
        from benchmarks.record_router_masks import load_masks

        rec = load_masks(args.masks)
        if args.masks_layer is None:
            args.masks_layer = len(rec["ffn"]) // 2
        G = shape["F"] // shape["group_size"]
        recorded = {T: recorded_inputs(rec, args.masks_layer, T, G, device) for T in args.ts if T >= RECORDED_FROM_T}
    rows = []
    for T in args.ts:
        w = make_inputs(T, shape, args.prototypes, args.capacity, dtype, device, gen, args.mask_draw)
        w.update(recorded.get(T, {}))
        fns, meta, failed = variants_for(w, shape, args, dry)
        times = time_variants(fns, args, dry)
        base = times["dense"]["median"]
        for name, info in meta.items():
            t = times[name]
            rows.append(dict(variant=name, T=T, ms=t, speedup_vs_dense=base / t["median"], **info, **shape))
            print(f"T={T:5d} {name:22s} {t['median']:8.4f} ms  p10 {t['p10']:8.4f}  p90 {t['p90']:8.4f}  "
                  f"{base / t['median']:5.2f}x  capacity {info['capacity']:.3f}", flush=True)
        rows += [dict(T=T, **r, **shape) for r in failed]
        save(rows)  # after every T: a run cut short keeps the rows it has
        del w, fns
    return rows


def markdown(out: dict) -> str:
    lines = [f"# wide.mlp_bucket, MLP block ({out['device']})", "",
             f"command: `{out['command']}`  ", f"date: {out['date']}, torch {out['torch']}, triton {out['triton']}  ",
             f"timing: {out['timing']}", "",
             "| T | variant | capacity | median ms | p10 | p90 | vs dense |", "|---|---|---|---|---|---|---|"]
    for r in out["rows"]:
        if "error" in r:
            lines.append(f"| {r['T']} | {r['variant']} | - | failed: {r['error'][:80]} | | | |")
            continue
        m = r["ms"]
        lines.append(f"| {r['T']} | {r['variant']} | {r['capacity']:.3f} | {m['median']:.4f} | {m['p10']:.4f} | "
                     f"{m['p90']:.4f} | {r['speedup_vs_dense']:.2f}x |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for bucket-mlp.json and bucket-mlp.md")
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny shapes on the CPU under the Triton interpreter (a check that this script runs)")
    ap.add_argument("--ts", nargs="+", type=int, default=None, help="token counts (default 1 16 2048 8192)")
    ap.add_argument("--capacity", type=float, default=0.5, help="share of active (token, group) pairs")
    ap.add_argument("--mask-draw", choices=["exact", "bernoulli"], default="exact",
                    help="free masks and prototypes: exact, round(capacity * G) groups on per row (default), or each "
                         "group on with probability capacity (the record names the draw)")
    ap.add_argument("--prototypes", type=int, default=None, help="P, prototypes per layer (default 16; dry run 4)")
    ap.add_argument("--dense-mode", default="default",
                    help="torch.compile mode of dense and static (e.g. max-autotune-no-cudagraphs)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds (default 5; dry run 1)")
    ap.add_argument("--target-s", type=float, default=None, help="timed seconds per variant (default 1; dry 0.01)")
    ap.add_argument("--sweep", action="store_true", help="also time bucket_mlp.SWEEP's tile configs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--masks", default=None,
                    help="recorded router masks (benchmarks/record_router_masks.py): also time bucket_recorded and "
                         "bucket_recorded_unionblocks at each T > 16 on their buckets")
    ap.add_argument("--masks-layer", type=int, default=None,
                    help="the recorded layer whose FFN masks give the buckets (default: the middle layer)")
    args = ap.parse_args(argv)
    if args.masks_layer is not None and not args.masks:
        ap.error("--masks-layer needs --masks")
    dry = args.dry_run
    args.ts = args.ts or ([1, 17] if dry else [1, 16, 2048, 8192])
    args.prototypes = args.prototypes or (4 if dry else 16)
    args.rounds = args.rounds or (1 if dry else 5)
    args.target_s = args.target_s or (0.01 if dry else 1.0)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.dry_run:  # before anything imports triton: the kernels then run on the CPU interpreter
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import triton

    import wide_compile.kernels  # noqa: F401  (registers torch.ops.wide.*)

    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("bench_bucket_mlp.py times CUDA kernels: run it on a GPU, or pass --dry-run on a CPU")
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 4 * len(args.ts))
    info = dict(device="cpu (dry run, Triton interpreter)" if args.dry_run else torch.cuda.get_device_name(),
                torch=torch.__version__, triton=triton.__version__, date=datetime.date.today().isoformat(),
                mask_draw=args.mask_draw,
                args=dict(capacity=args.capacity, prototypes=args.prototypes, ts=args.ts, masks=args.masks,
                          masks_layer=args.masks_layer),
                masks_structure=masks_structure(args.masks),
                command="python " + " ".join(sys.argv if argv is None else [__file__] + list(argv)),
                timing=("wall time of eager calls (dry run)" if args.dry_run else
                        f"CUDA graph replay of one call, CUDA events per replay, variants interleaved for "
                        f"{args.rounds} rounds of about {args.target_s} s each"))
    os.makedirs(args.out, exist_ok=True)

    def save(rows: list) -> dict:
        out = dict(rows=rows, **info)
        with open(os.path.join(args.out, "bucket-mlp.json"), "w") as f:
            json.dump(out, f, indent=1)
        with open(os.path.join(args.out, "bucket-mlp.md"), "w") as f:
            f.write(markdown(out))
        return out

    rows = bench(args, args.dry_run, save)
    out = save(rows)
    print(f"wrote {len(rows)} rows to {args.out}/bucket-mlp.json and .md")
    return out


if __name__ == "__main__":
    main()
