"""Structured routers from trained free ones, without training: a codebook or a nested router that picks, per
token, the prototype (or width level) closest to what the free router would have executed.

A free router's decision is the sign of its margins m(h) [..., G], which are affine in h for the linear and
"wide" (pair, rank r) recipes. For a table of allowed masks B [P, G] (0/1) a token's best allowed mask is
the one that agrees with the free decision most, weighting each group by how sure the free router is:

    pick(h) = argmax_p  sum_g (2 B[p, g] - 1) * m_g(h)

(executing a group with m_g > 0 gains |m_g|, executing one with m_g < 0 costs |m_g|; when the free mask
itself is in the table, it is the unique pick). The scores S m(h) with S = 2B - 1 are affine in h again, so
the structured router's scorer is the free router's own projection followed by S: the conversion is exact,
not fitted, and costs the scorer P outputs instead of G (or 2G).

The table: for a codebook, P prototypes fitted to the free margins of real tokens by alternating maximisation
of the same objective (assign each token its best prototype; set each prototype to the sign of its tokens'
mean margin; k-means++ seeding on the free masks); for a nested router, the prefixes of the groups ordered
by how often the free router executes them. Calibration then brings each kind's capacity to the free
routers' own on held-out tokens (routing/calibrate.py), so the two compare at equal measured capacity.
"""
from __future__ import annotations

import dataclasses

import torch

from ..config import STRUCTURES
from .attach import record_logits, routed
from .routers import CodebookRouter, GroupRouter, NestedRouter, PairRouter, Routers


def affine_margins(router) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """A free router's margins as m(h) = A (W h + c) + a, returned as (W [r, D] or None, A [G, r or D],
    a [G]) with the down projection's bias c folded into a: the margins are A (W h) + (A c + a). A and a are
    float64 (derived from the router's weights without rounding); W is the router's own weight.
    Raises for routers whose margins are not affine in h (a SiLU hidden layer)."""
    if isinstance(router, PairRouter):
        g = router.groups
        up_w = router.up.weight.detach().double().view(g, 2, -1)
        up_b = router.up.bias.detach().double().view(g, 2)
        a_mat = up_w[:, 1] - up_w[:, 0]
        return router.down.weight.detach(), a_mat, up_b[:, 1] - up_b[:, 0] + a_mat @ router.down.bias.detach().double()
    if isinstance(router, GroupRouter) and not router.hidden:
        return None, router.proj.weight.detach().double(), router.proj.bias.detach().double()
    raise ValueError(f"convert: a {type(router).__name__}"
                     f"{' with a SiLU hidden layer' if isinstance(router, GroupRouter) else ''} has margins that "
                     "are not affine in its input, so no structured router reproduces its picks exactly; convert "
                     "routers of the 'wide' recipe or linear ones (router_hidden=0)")


@torch.no_grad()
def record_margins(model, routers: Routers, blocks: torch.Tensor, batch_size: int = 8) -> dict:
    """{"attn": [L x float32 [N, G]], "ffn": [...]}: every router's margins on the tokens of `blocks` [B, S]
    (all real tokens), with `routers` attached (so each layer reads the residual stream that these routers'
    own earlier decisions produce)."""
    dev = next(model.parameters()).device
    L = routers.spec.num_layers
    out = {"attn": [[] for _ in range(L)], "ffn": [[] for _ in range(L)]}
    with routed(model, routers):
        for i in range(0, len(blocks), batch_size):
            with record_logits(model) as rec:
                model(input_ids=blocks[i:i + batch_size].to(dev))
            for k in out:
                for j in range(L):
                    out[k][j] += [x.reshape(-1, x.shape[-1]).float().cpu() for x in rec[k][j]]
    return {k: [torch.cat(v) for v in out[k]] for k in out}


def agreement(margins: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """scores [N, P] = margins [N, G] @ (2 table - 1)^T: each token's margin-weighted agreement with each row
    of the 0/1 table [P, G]."""
    return margins @ (2.0 * table.to(margins.dtype) - 1.0).t()


def fit_prototypes(margins: torch.Tensor, prototypes: int, iters: int = 50, seed: int = 0) -> torch.Tensor:
    """0/1 prototypes [P, G] (float) that maximise sum_t max_p agreement(margins, B)[t, p].

    k-means++ seeding on the free masks (margins > 0), then alternating maximisation: assign each token its
    best prototype, set each prototype to the sign of the mean margin of its tokens (the best 0/1 row for that
    set of tokens). An emptied prototype takes the free mask of the token served worst. Each round never lowers
    the objective; it stops when the table no longer changes."""
    n, g = margins.shape
    if prototypes < 1:
        raise ValueError(f"fit_prototypes: prototypes must be >= 1, got {prototypes}")
    if n == 0:
        raise ValueError("fit_prototypes: no tokens to fit to")
    gen = torch.Generator().manual_seed(seed)
    m = margins.double()
    masks = (m > 0).double()
    # k-means++ on the 0/1 masks (squared distance = Hamming distance)
    first = int(torch.randint(n, (1,), generator=gen))
    chosen = [first]
    dist = (masks - masks[first]).abs().sum(1)
    for _ in range(prototypes - 1):
        if float(dist.sum()) == 0.0:  # every token's mask is already in the table
            j = int(torch.randint(n, (1,), generator=gen))
        else:
            j = int(torch.multinomial(dist / dist.sum(), 1, generator=gen))
        chosen.append(j)
        dist = torch.minimum(dist, (masks - masks[j]).abs().sum(1))
    table = masks[chosen].clone()
    best_possible = m.abs().sum(1)  # agreement of the free mask itself
    for _ in range(iters):
        scores = agreement(m, table)
        best, pick = scores.max(1)
        worst_served = int((best_possible - best).argmax())
        new = table.clone()
        for p in range(prototypes):
            sel = pick == p
            new[p] = (m[sel].mean(0) > 0).double() if sel.any() else masks[worst_served]
        if torch.equal(new, table):
            break
        table = new
    return table.float()


def _scorer_weights(router, table: torch.Tensor):
    """(down W [r, D], down bias [r], up [P, r], up bias [P]) or (None, None, w [P, D], b [P]): the scorer whose
    scores are agreement(m(h), table)."""
    w_in, a_mat, a_vec = affine_margins(router)
    dtype = next(router.parameters()).dtype
    s = 2.0 * table.double() - 1.0  # [P, G]; the products in float64, rounded once to the router's dtype
    up, up_b = (s @ a_mat).to(dtype), (s @ a_vec).to(dtype)
    if w_in is None:
        return None, None, up, up_b
    # the scorer applies its own down bias before up: up (W h + 0) + (S a) with the bias folded into a
    return w_in, torch.zeros(w_in.shape[0], dtype=w_in.dtype), up, up_b


def _load_scorer(dst, router, table: torch.Tensor) -> None:
    w_in, b_in, w_up, b_up = _scorer_weights(router, table)
    with torch.no_grad():
        if w_in is not None:
            dst.scorer_in.weight.copy_(w_in)
            dst.scorer_in.bias.copy_(b_in)
        dst.scorer.weight.copy_(w_up)
        dst.scorer.bias.copy_(b_up)


def codebook_from_router(router, margins: torch.Tensor, prototypes: int, seed: int = 0,
                         logit: float = 3.0) -> CodebookRouter:
    """A CodebookRouter with `prototypes` masks fitted to `margins` [N, G] (this router's, on real tokens) whose
    pick is the prototype of best agreement with `router`'s own decision. Prototype logits are +-`logit`."""
    w_in, _, _ = affine_margins(router)
    table = fit_prototypes(margins, prototypes, seed=seed)
    out = CodebookRouter(router.dim, router.groups, prototypes, 0 if w_in is None else w_in.shape[0])
    _load_scorer(out, router, table)
    with torch.no_grad():
        out.prototypes.copy_(torch.where(table > 0, logit, -logit))
    return out.to(next(router.parameters()).device)


def nested_from_router(router, margins: torch.Tensor, levels: int, order: torch.Tensor | None = None) -> NestedRouter:
    """A NestedRouter of `levels` widths over an order of the groups (default: by how often `router` executes each
    on `margins` [N, G], most often first; ties by mean margin), whose pick is the level of best agreement with
    `router`'s own decision."""
    w_in, _, _ = affine_margins(router)
    out = NestedRouter(router.dim, router.groups, levels, 0 if w_in is None else w_in.shape[0])
    if order is None:
        rate = (margins > 0).double().mean(0)
        key = rate + 1e-6 * torch.tanh(margins.double().mean(0))  # on-rate first; mean margin breaks ties
        order = torch.argsort(key, descending=True, stable=True)
    out.set_order_(order)
    _load_scorer(out, router, out.level_masks().float())
    return out.to(next(router.parameters()).device)


def structured_from_free(routers: Routers, margins: dict, structure: str, size: int, seed: int = 0,
                         orders: dict | None = None) -> Routers:
    """Routers of `structure` ("codebook": `size` prototypes per router; "nested": `size` levels) converted from the
    free `routers` with their recorded `margins` (record_margins). `orders` ({"attn": [L x order]}, optional):
    nested group orders to use instead of the on-rate order (e.g. attention orders that keep KV heads
    together). Uncalibrated: see convert_routers."""
    if structure not in STRUCTURES or structure == "free":
        raise ValueError(f"convert: structure must be 'codebook' or 'nested', got {structure!r}")
    if routers.cfg.structure != "free":
        raise ValueError(f"convert: the source routers must be free (per-group bits); these are "
                         f"{routers.cfg.structure!r}")
    field = "codebook_size" if structure == "codebook" else "nested_levels"
    cfg = dataclasses.replace(routers.cfg, structure=structure, **{field: size})
    made = {}
    for kind in ("attn", "ffn"):
        rs = []
        for i, r in enumerate(getattr(routers, kind)):
            if structure == "codebook":
                rs.append(codebook_from_router(r, margins[kind][i], size, seed=seed + i))
            else:
                order = None if orders is None else orders[kind][i]
                rs.append(nested_from_router(r, margins[kind][i], size, order))
        made[kind] = rs
    return Routers(routers.spec, cfg, made["attn"], made["ffn"])


def convert_routers(model, routers: Routers, structure: str, size: int, fit_blocks: torch.Tensor,
                    calib_blocks: torch.Tensor, batch_size: int = 8, seed: int = 0, log=print) -> tuple[Routers, dict]:
    """Free `routers` -> calibrated structured routers for `model` (with whatever LoRA the routers were trained
    with already merged). Margins are recorded on `fit_blocks` [B, S]; each kind's capacity is then calibrated
    on `calib_blocks` to the free routers' own capacity there. Returns (routers, {"free", "converted",
    "uncalibrated"}: the deterministic capacities on calib_blocks)."""
    from .calibrate import calibrate_offset_, deterministic_capacity

    margins = record_margins(model, routers, fit_blocks, batch_size=batch_size)
    out = structured_from_free(routers, margins, structure, size, seed=seed)
    keys = ("overall", "attn", "ffn")
    free_cap = deterministic_capacity(model, routers, calib_blocks, batch_size=batch_size)
    raw_cap = deterministic_capacity(model, out, calib_blocks, batch_size=batch_size)
    calibrate_offset_(model, out, calib_blocks, target=free_cap["overall"], target_attn=free_cap["attn"],
                      target_ffn=free_cap["ffn"], batch_size=batch_size, log=log, coarse=False)
    new_cap = deterministic_capacity(model, out, calib_blocks, batch_size=batch_size)
    caps = {"free": {k: free_cap[k] for k in keys}, "uncalibrated": {k: raw_cap[k] for k in keys},
            "converted": {k: new_cap[k] for k in keys}}
    return out, caps
