"""benchmarks/layer_allocation.py on a tiny model (the SmolLM2 loader replaced): every router's gain measured from
one all-on forward each, every allocation row brought back to the overall capacity on the calibration blocks and
scored on the evaluation blocks only, the dense NLL the model's own LM loss, the shipped routers not moved; the
standardized log gains."""
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from test_convert import FREE_WIDE, _random_free, fake_set_on_text
from wide_compile.models import tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import layer_allocation  # noqa: E402


def test_z_scores_standardize_the_log_gains_and_zero_the_rest():
    rows = [{"gain_per_capacity": g} for g in (1.0, math.e, None, -1.0)]
    assert layer_allocation.z_scores(rows) == pytest.approx([-1.0, 1.0, 0.0, 0.0])
    assert layer_allocation.z_scores(rows[:1] + rows[2:]) == [0.0, 0.0, 0.0]  # one usable gain: no spread


def test_nll_and_capacity_are_the_lm_loss_and_the_measured_capacity():
    from wide_compile.routing.calibrate import deterministic_capacity

    model = tiny_model("smollm2", seed=3)
    free = _random_free(model, FREE_WIDE)
    blocks = torch.randint(0, 128, (3, 16), generator=torch.Generator().manual_seed(1))
    nll, cap = layer_allocation.nll_and_capacity(model, None, blocks, batch_size=2)
    with torch.no_grad():
        assert nll == pytest.approx(model(input_ids=blocks, labels=blocks).loss.item(), rel=1e-5) and cap is None
    nll_r, cap_r = layer_allocation.nll_and_capacity(model, free, blocks, batch_size=2)
    assert cap_r["overall"] == pytest.approx(deterministic_capacity(model, free, blocks)["overall"], abs=1e-6)
    assert nll_r != nll


def test_layer_allocation_script_rows(monkeypatch, tmp_path):
    model, free, blocks, asked, before = fake_set_on_text(monkeypatch, 8)
    L = model.config.num_hidden_layers
    out = tmp_path / "alloc.json"
    rec = layer_allocation.main(["--routers", "x", "--capacity", "0.6", "--lams", "0", "1", "-1",
                                 "--calib-tokens", "64", "--eval-tokens", "128", "--sens-tokens", "64",
                                 "--seq-len", "32", "--text-file", "t.raw", "--out", str(out)])
    assert asked == {"n_blocks": 8, "seq_len": 32, "text_file": "t.raw"}
    assert [(g["kind"], g["layer"]) for g in rec["gains"]] == [(k, i) for k in ("attn", "ffn") for i in range(L)]
    assert all(g["capacity_added"] > 0 for g in rec["gains"])  # all-on adds capacity wherever a group was off
    assert [r["lam"] for r in rec["rows"]] == [0.0, 1.0, -1.0]
    assert rec["rows"][0]["router_shifts"] == [] and len(rec["rows"][1]["router_shifts"]) == 2 * L
    for r in rec["rows"]:
        assert r["capacity_calib"]["overall"] == pytest.approx(0.6, abs=0.01)
        assert math.isfinite(r["nll"]) and r["nll"] > 0
    with torch.no_grad():
        dense = model(input_ids=blocks[2:6], labels=blocks[2:6]).loss.item()
    assert rec["dense_nll"] == pytest.approx(dense, rel=1e-5) and rec["eval_tokens"] == 128
    assert all(torch.equal(v, before[k]) for k, v in free.state_dict().items())
    assert json.loads(out.read_text())["rows"] and "| +1 |" in out.with_suffix(".md").read_text()
