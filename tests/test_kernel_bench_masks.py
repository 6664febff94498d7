"""The kernel benchmark's router-fitted masks: requested density at any T, and rho really controls how
much tokens share masks (so fitting it to the trained routers' tile coherence means something)."""
import importlib
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    os.environ["WIDE_BENCH_DRYRUN"] = "1"  # CPU tensors
    sys.path.insert(0, str(ROOT))
    try:
        yield importlib.import_module("benchmarks.bench_kernels")
    finally:
        sys.path.remove(str(ROOT))
        os.environ.pop("WIDE_BENCH_DRYRUN", None)


@pytest.mark.parametrize("density", [0.25, 0.5, 0.75])
def test_fitted_masks_have_the_requested_density(bench, density):
    g = torch.Generator().manual_seed(0)
    m = bench.make_mask(4096, 224, density, "fitted", g)
    assert m.dtype == torch.bool and m.shape == (4096, 224)
    assert abs(m.float().mean().item() - density) < 0.03
    # analytic thresholds: a single token draws from the same distribution
    singles = torch.stack([bench.make_mask(1, 224, density, "fitted", g)[0] for _ in range(64)])
    assert abs(singles.float().mean().item() - density) < 0.05


def test_rho_controls_tile_coherence(bench):
    from benchmarks.e2e.masks import tile_coherence

    g = torch.Generator().manual_seed(1)
    low = tile_coherence(bench.fitted_mask(1024, 24, 0.5, g, rho=0.0))
    high = tile_coherence(bench.fitted_mask(1024, 24, 0.5, g, rho=1.0))
    assert low < 0.15 < 0.6 < high
    assert bench.fit_fitted_rho(24, 0.5) in (0.9, 0.95, 0.98, 0.99, 1.0)
