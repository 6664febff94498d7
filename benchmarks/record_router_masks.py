#!/usr/bin/env python
"""Record the masks the shipped SmolLM2 routers emit on real text, for the kernel benchmark's "trained" masks.

    python benchmarks/record_router_masks.py [--routers smollm2-135m-c50] [--lora FILE | none] [--tokens 8192]
        [--window 2048] [--data ../shared/data] [--out benchmarks/data/smollm2-c50-router-masks.safetensors]
    python benchmarks/record_router_masks.py --report    # tile union densities of the recorded masks

SmolLM2-135M-Instruct (fp32, CPU is fine) with the routers' stage-2 LoRA merged (a shipped name's own LoRA
unless --lora says otherwise: the routers were trained to read that model) and the routers attached reads the first `--tokens` tokens of
the WikiText-2 test text in windows of `--window`; for every layer the attention mask [T, 9 head groups]
and the FFN mask [T, 24 channel groups] are stored bit-packed along the token axis (np.packbits), with the
per-layer on-rates, the command and the date in the metadata. `bench_kernels.py --masks trained` times the
SmolLM2-shape kernels on these masks: for a density d it takes the layer whose on-rate is closest to d.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEFAULT_OUT = Path(__file__).resolve().parent / "data" / "smollm2-c50-router-masks.safetensors"


def pack(mask: torch.Tensor) -> torch.Tensor:
    """bool [T, G] -> uint8 [ceil(T / 8), G], bits packed along the token axis."""
    return torch.from_numpy(np.packbits(mask.cpu().numpy().astype(np.uint8), axis=0))


def unpack(packed: torch.Tensor, T: int) -> torch.Tensor:
    return torch.from_numpy(np.unpackbits(packed.numpy(), axis=0, count=T).astype(bool))


def read_meta(path=DEFAULT_OUT) -> dict:
    """The metadata of a file this script wrote (routers, structure, tokens, on-rates, command), masks unread."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return json.loads(f.metadata()["wide"])


def load_masks(path=DEFAULT_OUT) -> dict:
    """{"attn": [bool [T, G_attn] per layer], "ffn": [...], "meta": {...}} from a file this script wrote."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = json.loads(f.metadata()["wide"])
        T = meta["tokens"]
        return {k: [unpack(f.get_tensor(f"{k}.{i}"), T) for i in range(meta["layers"])] for k in ("attn", "ffn")} | {
            "meta": meta}


def closest_layer(rec: dict, kind: str, density: float) -> int:
    """The layer whose recorded `kind` ("attn" / "ffn") on-rate is closest to `density`."""
    rates = rec["meta"]["on_rate"][kind]
    return min(range(len(rates)), key=lambda i: abs(rates[i] - density))


def lex_order(m: torch.Tensor) -> torch.Tensor:
    """Token order that sorts masks lexicographically, the most balanced groups (rate nearest 0.5) first:
    a sort a GPU can do per layer (pack the bits into a key, argsort)."""
    p = m.float().mean(0)
    cols = torch.argsort((p - 0.5).abs())
    key = torch.zeros(m.shape[0], dtype=torch.float64)
    for c in cols[:52].tolist():  # float64 holds 52 bits exactly
        key = key * 2 + m[:, c].double()
    return torch.argsort(key, stable=True)


def greedy_order(m: torch.Tensor, bm: int) -> torch.Tensor:
    """Tiles grown greedily (seed: the token with fewest groups; then the token that adds fewest new groups):
    an offline bound on what reordering tokens can reach, not a GPU algorithm."""
    rem = torch.ones(m.shape[0], dtype=torch.bool)
    out = []
    big = m.shape[1] + 1
    while rem.any():
        seed = torch.where(rem, m.sum(1), torch.full((m.shape[0],), big)).argmin().item()
        tile, u = [seed], m[seed].clone()
        rem[seed] = False
        while len(tile) < bm and rem.any():
            j = torch.where(rem, (m & ~u).sum(1), torch.full((m.shape[0],), big)).argmin().item()
            tile.append(j)
            rem[j] = False
            u |= m[j]
        out += tile
    return torch.tensor(out)


def tile_union(m: torch.Tensor, bm: int) -> float:
    T = m.shape[0] // bm * bm
    return m[:T].view(-1, bm, m.shape[1]).any(1).float().mean().item()


def union_report(rec: dict, densities=(0.25, 0.5, 0.75), tiles=(4, 16, 128), reorder_tokens=2048) -> list[dict]:
    """For the layer closest to each density: the share of groups a tile of consecutive tokens must compute
    (union of their masks), next to what tokens drawn independently with the same per-group rates would
    need — how much real router output lets a token tile skip beyond its per-group rates."""
    rows = []
    for kind in ("ffn", "attn"):
        rates = rec["meta"]["on_rate"][kind]
        for d in densities:
            i = closest_layer(rec, kind, d)
            m = rec[kind][i]
            p = m.float().mean(0)
            head = m[:reorder_tokens]
            lex = head[lex_order(head)]
            for bm in tiles:
                indep = (1 - (1 - p) ** bm).mean().item()
                rows.append(dict(kind=kind, layer=i, on_rate=rates[i], tile=bm, union=round(tile_union(m, bm), 3),
                                 independent=round(indep, 3),
                                 # the first reorder_tokens tokens (one prefill), reordered by mask
                                 union_lex_sorted=round(tile_union(lex, bm), 3),
                                 union_greedy=round(tile_union(head[greedy_order(head, bm)], bm), 3)))
    return rows


def pick_layer(ffn: list, layer: str) -> int:
    """The model layer `--layer` names: an index, or 'auto' (the FFN on-rate closest to the mean over layers)."""
    rates = [m.float().mean().item() for m in ffn]
    if layer == "auto":
        mean = sum(rates) / len(rates)
        return min(range(len(rates)), key=lambda i: abs(rates[i] - mean))
    if not layer.lstrip("-").isdigit() or not 0 <= int(layer) < len(rates):
        raise SystemExit(f"record_router_masks --layer {layer}: expected 'auto' or a layer index 0..{len(rates) - 1}")
    return int(layer)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--routers", default="smollm2-135m-c50", help="shipped routers' name, or a router file")
    ap.add_argument("--lora", default=None,
                    help="stage-2 LoRA merged before recording; default: a shipped name's own; 'none': no LoRA")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--data", default=None, help="../shared/data (its wikitext-2/wiki.test.raw)")
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--layer", default=None,
                    help="keep one layer only (a file of ~35 KB instead of ~1 MB): its index, or 'auto', the layer "
                         "whose FFN on-rate is closest to the mean over layers; the metadata names it")
    ap.add_argument("--report", action="store_true", help="print the tile union densities of --out and exit")
    a = ap.parse_args(argv)
    if a.report:
        for r in union_report(load_masks(a.out)):
            print(f"{r['kind']:4s} layer {r['layer']:2d} on-rate {r['on_rate']:.3f} tile {r['tile']:3d}: union "
                  f"{r['union']:.2f} (independent tokens, same rates: {r['independent']:.2f}); 2048 tokens "
                  f"reordered: lexicographic {r['union_lex_sorted']:.2f}, greedy bound {r['union_greedy']:.2f}")
        return 0

    import wide_compile as wc
    from safetensors.torch import save_file
    from wide_compile.models import load_smollm2
    from wide_compile.routing import record_masks, routed
    from wide_compile.training.data import default_data_root

    data = Path(a.data) if a.data else default_data_root()
    if data is None or not (data / "wikitext-2" / "wiki.test.raw").is_file():
        raise SystemExit("record_router_masks: needs --data with wikitext-2/wiki.test.raw (../shared/data)")
    from wide_compile.training.convert import resolve_lora

    lora = resolve_lora(a.routers, a.lora)
    model, tok = load_smollm2(dtype=torch.float32, device="cpu", gguf_path=a.gguf)
    if lora is not None:
        from wide_compile.training.stage2 import load_lora_merged

        model = load_lora_merged(model, lora)
    routers = (wc.Routers.load(a.routers, model) if Path(a.routers).is_file()  # a router file, any structure
               else wc.Routers.pretrained(a.routers, model))
    ids = tok((data / "wikitext-2" / "wiki.test.raw").read_text(), return_tensors="pt").input_ids[0]
    if ids.numel() < a.tokens:
        raise SystemExit(f"record_router_masks: the text has {ids.numel()} tokens, fewer than --tokens {a.tokens}")
    ids = ids[: a.tokens]
    t0 = time.time()
    with routed(model, routers), record_masks(model) as rec, torch.no_grad():
        for s in range(0, a.tokens, a.window):
            model(ids[s: s + a.window][None])
    masks = {k: [torch.cat([m.reshape(-1, m.shape[-1]) for m in rec[k][i]]).bool() for i in range(len(rec[k]))]
             for k in ("attn", "ffn")}
    layers = list(range(len(masks["ffn"])))
    if a.layer is not None:
        layers = [pick_layer(masks["ffn"], a.layer)]
        masks = {k: [v[layers[0]]] for k, v in masks.items()}
    L = len(masks["ffn"])
    meta = {"routers": a.routers, "structure": routers.cfg.structure, "lora": str(lora) if lora is not None else "none",
            "tokens": a.tokens, "window": a.window, "layers": L,
            "text": "wikitext-2/wiki.test.raw, first tokens", "groups": {k: masks[k][0].shape[1] for k in masks},
            "on_rate": {k: [round(m.float().mean().item(), 4) for m in masks[k]] for k in masks},
            "model_layers": layers,
            "command": "python benchmarks/record_router_masks.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "seconds": round(time.time() - t0, 1)}
    tensors = {f"{k}.{i}": pack(masks[k][i]) for k in masks for i in range(L)}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, a.out, metadata={"wide": json.dumps(meta)})
    print(json.dumps({k: v for k, v in meta.items() if k != "on_rate"}))
    print("on-rates (ffn):", meta["on_rate"]["ffn"])
    print("on-rates (attn):", meta["on_rate"]["attn"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
