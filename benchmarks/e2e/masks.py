"""Routers for the benchmark: random masks, correlated (router-like) masks, all-on, trained.

random      `Routers.init(..., router_init="random")` (linear routers, N(0, 1/D) weights) calibrated with
            `Routers.calibrate_` so every group's on-rate is the uniform rate of the target capacity. On a
            random-weight model the hidden states of different tokens are nearly independent, so these
            masks are close to i.i.d. per token and group: the worst case for the kernels.

correlated  a synthetic router-like model. Each router is still linear (so it runs through exactly the
            same WIDE code path), with weight
                W = sqrt(rho) * A @ P + sqrt(1 - rho) * R,   P ~ N(0, 1/D) [k, D],  A ~ N(0, 1/k) [G, k],
                                                              R ~ N(0, 1/D) [G, D]
            i.e. a fraction rho of each logit's variance comes from a k-dimensional latent shared by all
            groups, so masks of different tokens agree far more than independent masks would (tokens
            whose latents are close get nearly the same mask, as real routers do for similar tokens).
            Per-group on-rates are heterogeneous, as in trained routers: r_g = sigmoid(logit(r) + s*z_g),
            z_g ~ N(0,1), shifted so mean_g r_g = r (capacity unchanged); biases set by per-group quantiles.
            Two statistics are matched: `s` = std over groups of logit(on-rate), and `tile_coherence`:
            order the tokens by the first principal component of their masks, cut them into tiles of
            TILE tokens, and measure the fraction of groups active in each tile's union, u;
            coherence = (u_indep - u) / (u_indep - r), where u_indep is that fraction for independent
            masks with the same per-group rates: 0 = tokens' masks independent, 1 = every tile shares one
            mask (what token-major kernels need). (Chance-corrected agreement of random token *pairs* is
            ~0 for any model with exchangeable tokens, synthetic or trained, so it is reported as
            `kappa` but not fitted; `kappa_adjacent`, neighbouring tokens, is reported for real text.)
            When trained SmolLM2 routers ship (`Routers.available()`), the statistics are *measured* on
            them (real text through the real model) and rho is fitted by a small grid search so the
            synthetic masks reach the measured coherence; otherwise DEFAULT_STATS, the same statistics
            measured offline on those routers (results/mask-stats), are used; the JSON says which
            (record["mask_model"]). Not reproduced: real text's token-order effects (kappa_adjacent,
            well above the random-pair kappa there); the synthetic tokens are exchangeable (both ~0).

all-on      capacity 1.0: random routers with +1e4 biases (every group on) - the cost of routing itself.

trained     SmolLM2's shipped routers, on the real SmolLM2 model only.

codebookP / nestedL  random routers of a mask structure (`structured_routers`), calibrated like random: every
            token's mask is one of P random prototypes (codebook), or a prefix of the dense weights' group
            order at one of L widths (nested); the compiled model runs them on the bucketed ops.
"""
from __future__ import annotations

import dataclasses
import json
import math
from contextlib import contextmanager
from pathlib import Path

import torch

from wide_compile import Routers, WideConfig
from wide_compile.routing import record_logits, record_masks, routed
from wide_compile.routing.calibrate import calibrate_offset_
from wide_compile.routing.capacity import FlopCost

# Used when the trained routers cannot be measured in this run (e.g. the real SmolLM2 is not on the GPU
# machine): the same statistics measured offline on the shipped routers `smollm2-135m-c50` (the file says
# how, where and when).
STATS_FILE = Path(__file__).resolve().parents[1] / "results" / "mask-stats" / "smollm2-135m-c50.json"
DEFAULT_STATS = json.loads(STATS_FILE.read_text())["stats"]


def default_stats() -> dict:
    """A copy of DEFAULT_STATS (callers may add to it)."""
    return dict(DEFAULT_STATS)


LATENT_RANK = 2
TILE = 16
RHO_GRID = (0.0, 0.5, 0.8, 0.9, 0.95, 0.98, 0.99, 1.0)


def make_cfg(capacity: float, ffn_group_size: int, head_group_size: int, router_recipe: str = "linear") -> WideConfig:
    return WideConfig(ffn_group_size=ffn_group_size, head_group_size=head_group_size,
                      capacity=min(max(capacity, 1e-3), 1.0), router_init="random", router_recipe=router_recipe)


def _routers_to(r: Routers, model) -> Routers:
    p = next(model.parameters())
    return r.to(device=p.device)


def random_routers(model, cfg: WideConfig, calib_ids, capacity: float, seed: int = 0, iters: int = 2) -> Routers:
    r = _routers_to(Routers.init(model, cfg, seed=seed), model)
    for _ in range(iters):  # masks change the hidden states of later layers: iterate to converge
        r.calibrate_(model, calib_ids, capacity)
    return r


def structured_routers(model, cfg: WideConfig, calib_ids, capacity: float, structure: str, size: int,
                       seed: int = 0) -> Routers:
    """Random routers of a mask structure ("codebook": `size` prototypes per layer, random subsets; "nested":
    `size` width levels over the dense weights' group order), calibrated to `capacity` per router kind."""
    extra = {"codebook_size": size} if structure == "codebook" else {"nested_levels": size}
    r = _routers_to(Routers.init(model, dataclasses.replace(cfg, structure=structure, **extra), seed=seed), model)
    # one margin per router kind (a structured router has no per-group margins): attention and FFN each at
    # `capacity`, as the random masks' per-group rates give
    calibrate_offset_(model, r, calib_ids, capacity, target_attn=capacity, target_ffn=capacity, log=lambda *a: None)
    return r


def all_on_routers(model, cfg: WideConfig, seed: int = 0) -> Routers:
    r = _routers_to(Routers.init(model, cfg, seed=seed), model)
    with torch.no_grad():
        for rr in list(r.attn) + list(r.ffn):
            rr.proj.bias.fill_(1e4)
    return r


@contextmanager
@torch.no_grad()
def jittered_router_biases(routers: Routers, std: float = 1e-3, seed: int = 0):
    """Within the context every learned router's bias is moved by N(0, std^2) (restored on exit): the
    smallest change that flips the decisions sitting within `std` of 0, i.e. the noise floor of a
    compiled-vs-eager comparison with live routers. Yields the number of biases moved."""
    biases = [r.proj.bias for r in list(routers.attn) + list(routers.ffn)
              if hasattr(r, "proj") and r.proj.bias is not None]
    saved = [b.detach().clone() for b in biases]
    if biases:
        g = torch.Generator(device=biases[0].device).manual_seed(seed)
        for b in biases:
            b.add_(torch.randn(b.shape, generator=g, device=b.device, dtype=b.dtype) * std)
    try:
        yield len(biases)
    finally:
        for b, v in zip(biases, saved):
            b.copy_(v)


def _group_rates(rate: float, groups: int, s: float, gen: torch.Generator) -> torch.Tensor:
    """Per-group on-rates, logit-normal with std s around logit(rate), mean exactly `rate`."""
    if rate >= 0.999 or s <= 0:
        return torch.full((groups,), min(rate, 1.0))
    z = torch.randn(groups, generator=gen, dtype=torch.float64)
    lo, hi = -30.0, 30.0
    for _ in range(60):  # bisection on the shift so the mean rate is exact
        mid = (lo + hi) / 2
        m = torch.sigmoid(mid + s * z).mean().item()
        lo, hi = (mid, hi) if m < rate else (lo, mid)
    return torch.sigmoid((lo + hi) / 2 + s * z).float().clamp(1e-4, 1.0)


@torch.no_grad()
def calibrate_per_group_(routers: Routers, model, calib_ids, rates_attn, rates_ffn, iters: int = 2) -> Routers:
    """Set biases so group g of layer i is on for a fraction rates_*[i][g] of the calibration tokens."""
    for _ in range(iters):
        with routed(model, routers), record_logits(model) as rec:
            model(input_ids=calib_ids)
        for kind, mods, rates in (("attn", routers.attn, rates_attn), ("ffn", routers.ffn, rates_ffn)):
            for i, r in enumerate(mods):
                lg = rec[kind][i].reshape(-1, r.groups).float()
                rt = rates[i].to(lg.device)
                srt = lg.sort(dim=0).values                       # [N, G]
                N = srt.shape[0]
                pos = ((1.0 - rt) * (N - 1)).clamp(0, N - 1)      # linear-interpolated quantile per group
                lo, hi = pos.floor().long(), pos.ceil().long()
                w = (pos - lo.float())
                q = srt.gather(0, lo[None])[0] * (1 - w) + srt.gather(0, hi[None])[0] * w
                q = torch.where(rt >= 1, srt[0] - 1.0, q)
                r.proj.bias -= q.to(r.proj.bias.dtype)
    return routers


@torch.no_grad()
def correlated_routers(model, cfg: WideConfig, calib_ids, capacity: float, rho: float, stats: dict,
                       seed: int = 0, rank: int = LATENT_RANK) -> Routers:
    r = _routers_to(Routers.init(model, cfg, seed=seed), model)
    gen = torch.Generator().manual_seed(seed + 12345)
    D = r.spec.hidden_size
    for mods in (r.attn, r.ffn):
        for rr in mods:
            G = rr.groups
            P = torch.randn(rank, D, generator=gen) / math.sqrt(D)
            A = torch.randn(G, rank, generator=gen) / math.sqrt(rank)
            R = torch.randn(G, D, generator=gen) / math.sqrt(D)
            # (A @ P) h and R h both have per-logit variance ~ ||h||^2 / D: rho is the shared fraction
            W = math.sqrt(rho) * (A @ P) + math.sqrt(1 - rho) * R
            rr.proj.weight.copy_(W.to(rr.proj.weight.dtype))
            rr.proj.bias.zero_()
    rate = FlopCost.from_routers(r).uniform_rate(capacity)
    s = float(stats.get("rate_logit_std") or 0.0)
    ra = [_group_rates(rate, rr.groups, s, gen) for rr in r.attn]
    rf = [_group_rates(rate, rr.groups, s, gen) for rr in r.ffn]
    return calibrate_per_group_(r, model, calib_ids, ra, rf)


# -- statistics -----------------------------------------------------------------------------------
def _kappa(m: torch.Tensor, pairs: torch.Tensor) -> float:
    """m: bool [N, G]; pairs: long [P, 2] token index pairs -> chance-corrected agreement."""
    m = m.float()
    r = m.mean(0)
    agree = (m[pairs[:, 0]] == m[pairs[:, 1]]).float().mean().item()
    expect = (r * r + (1 - r) * (1 - r)).mean().item()
    if expect >= 1 - 1e-9:
        return 1.0
    return (agree - expect) / (1 - expect)


def tile_coherence(m: torch.Tensor, tile: int = TILE) -> float | None:
    """m: bool [N, G]. 0: masks as independent as their rates allow; 1: tiles of similar tokens share one mask."""
    N, G = m.shape
    if N < 2 * tile or G < 2:
        return None
    x = m.float()
    r = x.mean(0)
    xc = x - r
    try:
        v = torch.linalg.svd(xc, full_matrices=False).Vh[0]
    except Exception:  # noqa: BLE001
        return None
    order = torch.argsort(xc @ v)
    n = (N // tile) * tile
    tiles = x[order[:n]].reshape(-1, tile, G)
    u = tiles.amax(1).mean().item()
    u_ind = (1 - (1 - r).pow(tile)).mean().item()
    rm = r.mean().item()
    if u_ind - rm < 1e-6:
        return 1.0
    return (u_ind - u) / (u_ind - rm)


@torch.no_grad()
def mask_stats(model, routers: Routers, ids: torch.Tensor, n_pairs: int = 4096, seed: int = 0) -> dict:
    """Statistics of the masks `routers` produce on `ids` [B, S] through `model`:
    rate_logit_std (std over groups of logit(on-rate), mean over layers and kinds), kappa (random pairs of
    tokens), kappa_adjacent (neighbouring tokens), mean on-rates."""
    with routed(model, routers), record_masks(model) as rec:
        model(input_ids=ids)
    gen = torch.Generator().manual_seed(seed)
    out = {"rate_logit_std": [], "tile_coherence": [], "kappa": [], "kappa_adjacent": [], "rate": []}
    for kind in ("attn", "ffn"):
        for layer_masks in rec[kind]:
            m = torch.cat([t.reshape(-1, t.shape[-1]) for t in layer_masks]).bool().cpu()
            N = m.shape[0]
            if N < 4:
                continue
            rates = m.float().mean(0)
            out["rate"].append(rates.mean().item())
            lr = torch.logit(rates.clamp(0.01, 0.99))
            out["rate_logit_std"].append(lr.std().item() if lr.numel() > 1 else 0.0)
            a = torch.randint(0, N, (n_pairs,), generator=gen)
            b = torch.randint(0, N, (n_pairs,), generator=gen)
            keep = a != b
            out["kappa"].append(_kappa(m, torch.stack([a[keep], b[keep]], 1)))
            S = ids.shape[-1]
            idx = torch.arange(N - 1)
            idx = idx[(idx % S) != S - 1]  # stay inside one sequence
            out["kappa_adjacent"].append(_kappa(m, torch.stack([idx, idx + 1], 1)))
            c = tile_coherence(m)
            if c is not None:
                out["tile_coherence"].append(c)
    return {k: (sum(v) / len(v) if v else None) for k, v in out.items()}


def fit_rho(model, cfg_fn, calib_ids, capacity: float, stats: dict, seed: int = 0, log=print,
            grid=RHO_GRID) -> tuple[float, list]:
    """Grid search of rho so the synthetic masks' tile coherence matches stats["tile_coherence"]."""
    target = stats["tile_coherence"]
    tried = []
    for rho in grid:
        r = correlated_routers(model, cfg_fn(capacity), calib_ids, capacity, rho, stats, seed=seed)
        st = mask_stats(model, r, calib_ids)
        coh = st["tile_coherence"] if st["tile_coherence"] is not None else 0.0
        tried.append({"rho": rho, "tile_coherence": coh, "kappa": st["kappa"],
                      "rate_logit_std": st["rate_logit_std"]})
        log(f"    fit correlated masks: rho={rho:.2f} -> tile coherence {coh:.3f} (target {target:.3f}), "
            f"rate logit std {st['rate_logit_std']:.2f} (target {stats.get('rate_logit_std') or 0:.2f})")
        if coh >= target:
            break
    best = min(tried, key=lambda t: abs(t["tile_coherence"] - target))
    return best["rho"], tried


def trained_router_stats(device, dtype, text_ids_fn, log=print, gguf=None) -> dict | None:
    """Measure DEFAULT_STATS' quantities on the shipped SmolLM2 routers over real text; None if there
    are none (or the real SmolLM2 cannot be loaded), with the reason logged."""
    try:
        names = Routers.available()
    except Exception as e:  # noqa: BLE001
        log(f"  correlated masks: Routers.available() failed ({e}); using synthetic defaults")
        return None
    names = [n for n in names if "smollm" in n.lower()]
    if not names:
        log("  correlated masks: no trained SmolLM2 routers shipped yet (Routers.available() has none); "
            f"using the documented synthetic defaults {DEFAULT_STATS}")
        return None
    try:
        from .models import load_smollm2_real

        model, tok = load_smollm2_real(device, dtype, gguf)
    except Exception as e:  # noqa: BLE001
        log(f"  correlated masks: trained routers exist ({names}) but the real SmolLM2 could not be loaded "
            f"({type(e).__name__}: {str(e)[:200]}); using synthetic defaults")
        return None
    res = []
    for n in names:
        try:
            r = Routers.pretrained(n, model)
            st = mask_stats(model, r, text_ids_fn(tok, 1024).to(next(model.parameters()).device))
            st["name"] = n
            res.append(st)
            log(f"  correlated masks: trained routers {n}: {st}")
        except Exception as e:  # noqa: BLE001
            log(f"  correlated masks: could not measure trained routers {n}: {type(e).__name__}: {e}")
    del model
    if not res:
        return None
    pick = min(res, key=lambda s: abs((s["rate"] or 0.5) - 0.5))  # the ~50%-capacity routers if several
    if pick.get("tile_coherence") is None:
        log("  correlated masks: could not measure tile coherence on the trained routers; using defaults")
        return None
    return {"rate_logit_std": pick["rate_logit_std"], "tile_coherence": pick["tile_coherence"],
            "kappa": pick["kappa"], "kappa_adjacent": pick["kappa_adjacent"], "source": f"trained:{pick['name']}",
            "all": res}
