"""Stage 1 / stage 2 on tiny random models (CPU, fast)."""
import json
import numpy as np

import pytest
import torch

import wide_compile as wc
from wide_compile.models import tiny_model
from wide_compile.training import Stage1Config, Stage2Config, train_stage1, train_stage2
from wide_compile.training.data import TokenBlocks, load_tokens, tokenize_corpus
from wide_compile.training.stage1 import (calibrate_offset_, deterministic_capacity, kd_loss, relaxed_capacity,
                                          schedule)


def _blocks(n=6000, seq=32, seed=0):
    return TokenBlocks(np.random.default_rng(seed).integers(0, 128, n), seq, heldout_frac=0.1)


def test_kd_loss_zero_for_identical_and_positive_otherwise():
    a = torch.randn(2, 5, 11)
    assert kd_loss(a, a).abs() < 1e-6
    assert kd_loss(a, torch.randn(2, 5, 11)) > 0


def test_schedule_ramps_capacity_and_anneals_tau():
    cfg = Stage1Config(capacity=0.5, steps=100, ramp_frac=0.5, tau_start=1.0, tau_end=0.1, noise_off_frac=0.2)
    tau0, t0, n0 = schedule(0, 100, cfg)
    tau1, t1, n1 = schedule(99, 100, cfg)
    assert t0 == pytest.approx(1.0) and t1 == pytest.approx(0.5)
    assert tau0 == pytest.approx(1.0) and tau1 == pytest.approx(0.1)
    assert n0 and not n1


def test_relaxed_capacity_has_gradient_and_matches_hard_count():
    model = tiny_model("llama")
    routers = wc.Routers.init(model, wc.WideConfig(ffn_group_size=32, capacity=0.5))
    wc.attach(model, routers)
    ids = torch.randint(0, 128, (2, 16))
    with routers.relax(0.5, noise=False), wc.routing.record_masks(model) as rec:
        model(input_ids=ids)
    c = relaxed_capacity(routers, rec)
    c["overall"].backward()
    assert routers.ffn[0].proj.bias.grad is not None and routers.ffn[0].proj.bias.grad.abs().sum() > 0
    hard = wc.measure_capacity(model, ids)["overall"]
    assert float(c["overall"]) == pytest.approx(hard, abs=1e-5)


def test_stage1_moves_capacity_toward_target_and_resumes(tmp_path):
    torch.manual_seed(0)
    model = tiny_model("smollm2")
    blocks = _blocks()
    cfg = Stage1Config(capacity=0.5, steps=30, batch_size=4, seq_len=32, lr=5e-2, cap_weight=50.0,
                       ramp_frac=0.2, ckpt_every=15, calibrate=False)
    r = train_stage1(model, blocks, cfg, out_dir=tmp_path / "s1", progress=False, log=lambda *_: None)
    h = r.train_history
    assert h[0]["cap"] > 0.9
    assert h[-1]["cap"] < 0.75  # moved from ~1.0 toward 0.5
    assert (tmp_path / "s1" / "routers.safetensors").is_file()
    assert (tmp_path / "s1" / "ckpt" / "opt.safetensors").is_file()
    # resume: a finished run restarts at its last step (nothing left to do) with the same routers, and
    # reports the history its first part wrote (the pipeline reads the last entry)
    r2 = train_stage1(model, blocks, cfg, out_dir=tmp_path / "s1", progress=False, log=lambda *_: None)
    assert r2.train_history == json.loads(json.dumps(h[-50:])) and r2.train_history
    for a, b in zip(r.state_dict().values(), r2.state_dict().values()):
        assert torch.equal(a, b)
    assert not wc.is_attached(model)


def test_calibrate_offset_hits_target():
    model = tiny_model("llama")
    routers = wc.Routers.init(model, wc.WideConfig(ffn_group_size=16, capacity=0.6, router_init="random"))
    blocks = _blocks().heldout
    calibrate_offset_(model, routers, blocks, 0.6, tol=0.01, log=lambda *_: None)
    assert deterministic_capacity(model, routers, blocks)["overall"] == pytest.approx(0.6, abs=0.01)


def test_stage2_lora_with_fixed_routers_reduces_kd(tmp_path):
    torch.manual_seed(0)
    model = tiny_model("llama")
    blocks = _blocks()
    cfg = wc.WideConfig(ffn_group_size=32, capacity=0.5, router_init="random")
    routers = wc.Routers.init(model, cfg)
    before = {k: v.clone() for k, v in routers.state_dict().items()}
    c2 = Stage2Config(steps=25, batch_size=4, seq_len=32, lr=1e-2, lm_weight=0.0, rank=4, alpha=8)
    merged, r2, lora = train_stage2(model, routers, blocks, c2, out_dir=tmp_path / "s2", progress=False,
                                    log=lambda *_: None)
    h = merged.train_history
    assert np.mean([x["kd"] for x in h[-5:]]) < np.mean([x["kd"] for x in h[:5]])
    for k, v in r2.state_dict().items():  # routers fixed
        assert torch.equal(v.cpu(), before[k])
    assert lora and (tmp_path / "s2" / "lora.safetensors").is_file()
    # the base model is untouched, the merged one differs, and loading the saved LoRA reproduces it
    from wide_compile.training.stage2 import load_lora_merged
    import copy
    m2 = load_lora_merged(copy.deepcopy(model), tmp_path / "s2" / "lora.safetensors")
    ids = torch.randint(0, 128, (1, 12))
    assert not torch.allclose(model(input_ids=ids).logits, merged(input_ids=ids).logits)
    torch.testing.assert_close(m2(input_ids=ids).logits, merged(input_ids=ids).logits, atol=2e-2, rtol=0)


def test_lora_hooks_wrap_lora_modules():
    from wide_compile.training.stage2 import apply_lora
    model = tiny_model("llama")
    pm = apply_lora(model, 4, 8)
    routers = wc.Routers.init(pm, wc.WideConfig(ffn_group_size=32))
    wc.attach(pm, routers)
    m = wc.measure_capacity(pm, torch.randint(0, 128, (1, 8)))
    assert 1.0 <= m["overall"] < 1.05  # all groups on (+ router FLOPs, large for a tiny model)
    names = [type(layer.self_attn.q_proj).__module__ for layer in wc.models.decoder_layers(pm)]
    assert all("peft" in n for n in names)
    wc.detach(pm)


def test_data_tokenize_and_blocks(tmp_path):
    import gzip, json
    p = tmp_path / "t"
    p.mkdir()
    with gzip.open(p / "a.jsonl.gz", "wt") as f:
        for i in range(20):
            f.write(json.dumps({"text": f"doc {i} " * 30}) + "\n")
    (p / "b.jsonl").write_text(json.dumps({"text": "hello world"}) + "\n")

    class Tok:
        eos_token_id = 0
        def __call__(self, docs, add_special_tokens=False):
            return {"input_ids": [[len(w) for w in d.split()] for d in docs]}

    from wide_compile.training.data import train_text_files
    arr = tokenize_corpus(Tok(), train_text_files(p))
    assert arr.dtype == np.uint16 and (arr == 0).sum() == 21
    np.savez_compressed(tmp_path / "c.npz", tokens=arr)
    assert np.array_equal(load_tokens(cache=tmp_path / "c.npz"), arr)
    b = TokenBlocks(arr, 16, heldout_frac=0.2)
    batches = list(b.batches(2, 5, seed=1))
    assert len(batches) == 5 and batches[0].shape == (2, 16)
    resumed = list(b.batches(2, 5, seed=1, start=3))
    assert len(resumed) == 2 and torch.equal(resumed[0], batches[3])
