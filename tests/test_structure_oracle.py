"""benchmarks/structure_oracle.py's measure on planted margins: a structure that can express every free mask keeps
every decision (wloss 0), one that cannot loses exactly the margin mass it overrides."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import structure_oracle as so  # noqa: E402


def test_parse_structure():
    assert so.parse_structure("cb64") == (1, 64) and so.parse_structure("pq3x16") == (3, 16)
    assert so.parse_structure("win64") == (1, 64) and so.parse_structure("win") == (1, 0)
    assert so.parse_structure("win16-id") == (1, 16)
    for bad in ("cb", "pq2", "free", "pq0x4", "win-x"):
        with pytest.raises(Exception):
            so.parse_structure(bad)


def test_expressible_masks_are_kept_and_overrides_are_counted():
    gen = torch.Generator().manual_seed(0)
    g = 12
    halves = [(torch.rand(3, g // 2, generator=gen) < 0.5).float() for _ in range(2)]
    # every free mask is (row of half 0's table, row of half 1's table): 9 distinct masks, 3 per half
    a_rows = torch.randint(3, (600,), generator=gen)
    b_rows = torch.randint(3, (600,), generator=gen)
    table = torch.cat([halves[0][a_rows], halves[1][b_rows]], 1)
    mag = torch.rand(600, g, generator=gen, dtype=torch.float64) + 0.1
    m = (2 * table.double() - 1) * mag
    fit, test = m[:400], m[400:]
    # a product codebook of 2 parts x 3 prototypes and a codebook of 9 express every mask: nothing overridden
    for parts, protos in ((2, 3), (1, 9)):
        mask = so.structured_masks(fit, test, parts, protos)
        assert torch.equal(mask, test > 0), (parts, protos)
        assert so.weighted_disagreement(test, mask) == 0.0
    # one prototype cannot: its loss is exactly the overridden margin mass, computed by hand
    mask = so.structured_masks(fit, test, 1, 1)
    assert mask.shape == test.shape and (mask == mask[0]).all()
    wrong = mask != (test > 0)
    assert wrong.any()
    assert so.weighted_disagreement(test, mask) == pytest.approx(float(test.abs()[wrong].sum() / test.abs().sum()))


def test_oracle_rows_skip_parts_that_do_not_divide():
    gen = torch.Generator().manual_seed(1)
    fit = {"attn": [torch.randn(64, 9, generator=gen)], "ffn": [torch.randn(64, 12, generator=gen)]}
    test = {"attn": [torch.randn(32, 9, generator=gen)], "ffn": [torch.randn(32, 12, generator=gen)]}
    rows = so.oracle(fit, test, ["cb4", "pq2x4"], log=lambda *a: None)
    assert [(r["kind"], r["structure"]) for r in rows] == [("attn", "cb4"), ("ffn", "cb4"), ("ffn", "pq2x4")]
    for r in rows:
        assert 0.0 <= r["wloss"] <= r["wloss_max_layer"] <= 1.0 and 0.0 <= r["capacity"] <= 1.0


def _planted_ranges(n: int, g: int, seed: int):
    """Margins whose free masks are each one contiguous range of a hidden order of the g groups."""
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(g, generator=gen)
    a, b = torch.randint(g, (n,), generator=gen), torch.randint(g, (n,), generator=gen)
    lo, hi = torch.minimum(a, b), torch.maximum(a, b) + 1
    pos = torch.arange(g)
    inside = (pos >= lo[:, None]) & (pos < hi[:, None])
    m = torch.where(inside, 1.0, -1.0).double() * (torch.rand(n, g, generator=gen, dtype=torch.float64) + 0.1)
    margins = torch.empty_like(m)
    margins[:, order] = m  # group order[j] sits at position j of the hidden order
    return margins


def test_windows_recover_a_hidden_order_and_keep_every_range():
    m = _planted_ranges(500, 12, seed=2)
    fit, test = m[:400], m[400:]
    # every free mask is a range of an order the spectral order must find (up to reversal): nothing overridden
    mask = so.window_masks(fit, test, 0)
    assert torch.equal(mask, test > 0)
    assert so.weighted_disagreement(test, mask) == 0.0
    # the groups' own order is not that order: ranges over it override some mass
    assert so.weighted_disagreement(test, so.window_masks(fit, test, 0, spectral=False)) > 0.05
    # a table of 3 ranges cannot express 78 ranges; each mask is still one range of the spectral order
    few = so.window_masks(fit, test, 3)
    assert len({tuple(r.tolist()) for r in few}) <= 3 and so.weighted_disagreement(test, few) > 0.0
    order = so.spectral_order(fit > 0)
    assert all(int(r.long().diff().abs().sum()) <= 2 for r in few[:, order])  # one run of ones


def test_oracle_rows_for_windows():
    gen = torch.Generator().manual_seed(3)
    fit = {"attn": [torch.randn(64, 9, generator=gen)], "ffn": [torch.randn(64, 12, generator=gen)]}
    test = {"attn": [torch.randn(32, 9, generator=gen)], "ffn": [torch.randn(32, 12, generator=gen)]}
    rows = so.oracle(fit, test, ["win", "win4", "win4-id"], log=lambda *a: None)
    assert [(r["kind"], r["structure"]) for r in rows] == [(k, s) for k in ("attn", "ffn")
                                                           for s in ("win", "win4", "win4-id")]
    every, four = rows[3], rows[4]
    assert every["wloss"] <= four["wloss"] + 1e-12  # more ranges never keep less (same order)
