"""`python -m wide_compile.training lora-rank`: a saved LoRA cut to a lower rank by the SVD of each update, or
grown to a higher one with its update unchanged.

A LoRA of rank r adds (alpha / r) * B @ A to each target weight. Its best rank-k approximation (in the Frobenius
and spectral norms, Eckart-Young) keeps the k largest singular values of that product; the factors written here
are U_k sqrt(S_k) and sqrt(S_k) V_k^T with alpha' = alpha * k / r, so the scale alpha' / k stays alpha / r and the
merged model changes only by the dropped singular directions. The file keeps save_lora's format (bf16 tensors,
rank / alpha / targets metadata), so every loader reads it unchanged; its metadata also records the source rank
and, per file, the share of the updates' squared Frobenius norm that is kept.

A higher rank k > r keeps the r factor pairs and appends k - r: rows of A drawn as peft draws a fresh adapter's A
(uniform in +-1/sqrt(in), Kaiming with a = sqrt(5)) and zero columns of B, again with alpha' = alpha * k / r, so the
update is exactly the old one and training moves the new directions from there.

Why: a rank-64 adapter is four times the bytes of a rank-16 one, and the shipped sets live in the repository; a
shipped rank-16 set trained further gets the rank the recipe trains at by growing.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch

_A = re.compile(r"^(?P<mod>.+)\.lora_A\.weight$")


def lower_rank(state: dict, rank: int, alpha: int, new_rank: int) -> tuple[dict, int, float]:
    """(factors of rank new_rank, alpha', kept share of sum ||dW||_F^2) for adapter tensors `state`
    (lora_state's keys: <module>.lora_A.weight [r, in], <module>.lora_B.weight [out, r])."""
    if not 1 <= new_rank <= rank:
        raise ValueError(f"the new rank must be in [1, {rank}] (the adapter's rank), got {new_rank}")
    _check_alpha(rank, alpha, new_rank)
    scale = alpha / rank
    out, kept, total = {}, 0.0, 0.0
    for mod in _modules(state):
        a = state[f"{mod}.lora_A.weight"].double()                      # [r, in]
        b = state[f"{mod}.lora_B.weight"].double()                      # [out, r]
        # dW = scale * b @ a has rank <= r: its SVD from the QR factors of b and a^T, an r x r problem
        qb, rb = torch.linalg.qr(b)                                      # [out, r], [r, r]
        qa, ra = torch.linalg.qr(a.T)                                    # [in, r], [r, r]
        u, s, vh = torch.linalg.svd(scale * rb @ ra.T)
        s_k = s[:new_rank].sqrt()
        out[f"{mod}.lora_B.weight"] = (qb @ u[:, :new_rank]) * s_k / scale   # the loader multiplies by scale
        out[f"{mod}.lora_A.weight"] = s_k[:, None] * (vh[:new_rank] @ qa.T)
        kept += float((s[:new_rank] ** 2).sum())
        total += float((s ** 2).sum())
    return out, alpha * new_rank // rank, kept / total if total > 0 else 1.0


def _check_alpha(rank: int, alpha: int, new_rank: int) -> None:
    if alpha * new_rank % rank:
        raise ValueError(f"alpha * new_rank / rank = {alpha * new_rank / rank} is not an integer: pick a rank that "
                         "keeps it one")


def raise_rank(state: dict, rank: int, alpha: int, new_rank: int, seed: int = 0) -> tuple[dict, int]:
    """(factors of rank new_rank > rank whose update equals `state`'s, alpha') for adapter tensors `state`."""
    if new_rank <= rank:
        raise ValueError(f"the new rank must be above {rank} (the adapter's rank) to grow it, got {new_rank}")
    _check_alpha(rank, alpha, new_rank)
    mods = _modules(state)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for mod in mods:
        a, b = state[f"{mod}.lora_A.weight"], state[f"{mod}.lora_B.weight"]   # a: [r, in], b: [out, r]
        bound = a.shape[1] ** -0.5
        a_new = (torch.rand(new_rank - rank, a.shape[1], generator=gen, dtype=torch.float64) * 2 - 1) * bound
        out[f"{mod}.lora_A.weight"] = torch.cat([a.double(), a_new])              # [new_rank, in]
        out[f"{mod}.lora_B.weight"] = torch.cat([b.double(), b.new_zeros(b.shape[0], new_rank - rank,
                                                                           dtype=torch.float64)], dim=1)
    return out, alpha * new_rank // rank


def _modules(state: dict) -> list[str]:
    mods = sorted(m.group("mod") for k in state if (m := _A.match(k)))
    if not mods or len(state) != 2 * len(mods):
        raise ValueError("not a LoRA state: expected pairs of <module>.lora_A.weight / <module>.lora_B.weight")
    return mods


def main(argv=None) -> int:
    from safetensors.torch import save_file

    from .stage2 import read_lora

    ap = argparse.ArgumentParser(prog="python -m wide_compile.training lora-rank", description=__doc__.split("\n\n")[0])
    ap.add_argument("lora", help="a LoRA written by save_lora (stage 2's lora.safetensors)")
    ap.add_argument("--rank", type=int, required=True, help="the new rank: below the adapter's cuts it, above grows it")
    ap.add_argument("--out", required=True, help="the new LoRA .safetensors")
    ap.add_argument("--seed", type=int, default=0, help="the seed of a grown adapter's new rows of A")
    a = ap.parse_args(argv)
    sd, rank, alpha, targets = read_lora(a.lora)
    if a.rank > rank:
        (state, new_alpha), kept = raise_rank(sd, rank, alpha, a.rank, a.seed), 1.0
    else:
        state, new_alpha, kept = lower_rank(sd, rank, alpha, a.rank)
    meta = {"rank": str(a.rank), "alpha": str(new_alpha), "targets": json.dumps(sorted(targets)),
            "source_rank": str(rank), "kept_update_energy": f"{kept:.6f}"}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in state.items()}, a.out, metadata=meta)
    print(json.dumps({"out": a.out, "rank": a.rank, "alpha": new_alpha, "source_rank": rank,
                      "kept_update_energy": round(kept, 6)}))
    return 0
