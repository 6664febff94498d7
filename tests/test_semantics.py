"""The eager WIDE reference (attach) against DESIGN.md's oracle, on every supported architecture."""
import copy

import pytest
import torch

import wide_compile as wc
from wide_compile.models import ARCHS, model_spec, tiny_model
from wide_compile.models.spec import decoder_layers

CFG = wc.WideConfig(ffn_group_size=32, head_group_size=2, capacity=0.5)


def random_masks(spec, cfg, gen):
    """Per-layer constant masks, with fully-on and fully-off modules mixed in."""
    ga, gf = cfg.num_head_groups(spec), cfg.num_ffn_groups(spec)
    attn, ffn = [], []
    for i in range(spec.num_layers):
        a = torch.rand(ga, generator=gen) < 0.5
        f = torch.rand(gf, generator=gen) < 0.5
        if i == 0:
            a[:] = True  # fully-on attention, fully-off FFN
            f[:] = False
        if i == 1:
            a[:] = False  # fully-off attention, fully-on FFN
            f[:] = True
        attn.append(a)
        ffn.append(f)
    return attn, ffn


def zeroed_model(model, cfg, attn, ffn):
    """DESIGN.md oracle: inactive FFN groups' down_proj columns and head groups' o_proj columns zeroed."""
    ref = copy.deepcopy(model)
    spec = model_spec(model)
    gcols = cfg.head_group_size * spec.head_dim
    with torch.no_grad():
        for layer, a, f in zip(decoder_layers(ref), attn, ffn):
            w_o = layer.self_attn.o_proj.weight  # [D, Nq]
            for g, on in enumerate(a.tolist()):
                if not on:
                    w_o[:, g * gcols:(g + 1) * gcols] = 0
            w_d = layer.mlp.down_proj.weight  # [D, F]
            for g, on in enumerate(f.tolist()):
                if not on:
                    w_d[:, g * cfg.ffn_group_size:(g + 1) * cfg.ffn_group_size] = 0
    return ref


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_constant_masks_equal_zeroed_dense(arch, dtype, tol):
    model = tiny_model(arch, num_hidden_layers=3, dtype=dtype)
    spec = model_spec(model)
    gen = torch.Generator().manual_seed(1)
    attn, ffn = random_masks(spec, CFG, gen)
    ref = zeroed_model(model, CFG, attn, ffn)
    ids = torch.randint(0, 128, (2, 11), generator=gen)
    expected = ref(ids).logits.double()
    wc.attach(model, wc.Routers.constant(model, CFG, attn=attn, ffn=ffn))
    got = model(ids).logits.double()
    rel = (got - expected).norm() / expected.norm()
    assert rel < tol, f"{arch} {dtype}: rel err {rel:.2e}"
    # the masks really changed the output (the test can fail)
    wc.detach(model)
    assert (model(ids).logits.double() - expected).norm() / expected.norm() > 10 * tol


@pytest.mark.parametrize("arch", ARCHS)
def test_all_on_is_dense_and_detach_is_bit_exact(arch):
    model = tiny_model(arch)
    ids = torch.randint(0, 128, (2, 9))
    dense = model(ids).logits
    state = {k: v.clone() for k, v in model.state_dict().items()}
    spec = model_spec(model)
    on = wc.Routers.constant(model, CFG, attn=[torch.ones(CFG.num_head_groups(spec), dtype=torch.bool)] * 2,
                             ffn=[torch.ones(CFG.num_ffn_groups(spec), dtype=torch.bool)] * 2)
    wc.attach(model, on)
    assert torch.equal(model(ids).logits, dense)
    wc.attach(model, wc.Routers.init(model, wc.WideConfig(ffn_group_size=32, router_init="random")))
    assert not torch.equal(model(ids).logits, dense)
    wc.detach(model)
    assert not wc.is_attached(model) and "wide_routers" not in dict(model.named_modules())
    assert torch.equal(model(ids).logits, dense)
    after = model.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], state[k]) for k in state)


def test_fresh_dense_init_routers_keep_every_group_on():
    model = tiny_model("llama")
    ids = torch.randint(0, 128, (2, 9))
    dense = model(ids).logits
    wc.attach(model, wc.Routers.init(model, CFG))
    assert torch.equal(model(ids).logits, dense)
    cap = wc.measure_capacity(model, ids)
    assert cap["attn"] >= 1.0 and cap["ffn"] >= 1.0  # all on, plus router FLOPs


def _random_routers(model, seed=0):
    cfg = wc.WideConfig(ffn_group_size=32, head_group_size=1, router_init="random")
    return wc.Routers.init(model, cfg, seed=seed)


@pytest.mark.parametrize("arch", ARCHS)
def test_incremental_decoding_equals_full_recompute(arch):
    from transformers import DynamicCache

    model = tiny_model(arch)
    wc.attach(model, _random_routers(model))
    ids = torch.randint(0, 128, (2, 12))
    with wc.routing.record_masks(model) as rec:
        full = model(ids).logits
    m = rec["ffn"][0][0].float().mean()
    assert 0.1 < m < 0.9, "random routers should make per-token decisions"
    cache = DynamicCache()
    out = model(ids[:, :5], past_key_values=cache, use_cache=True)  # kwarg accepted by 5.17 and newer
    steps = [out.logits]
    for t in range(5, 12):
        out = model(ids[:, t:t + 1], past_key_values=out.past_key_values, use_cache=True)
        steps.append(out.logits)
    inc = torch.cat(steps, 1)
    torch.testing.assert_close(inc, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_padded_batch_equals_unpadded_rows(arch):
    model = tiny_model(arch)
    wc.attach(model, _random_routers(model))
    a = torch.randint(1, 128, (10,))
    b = torch.randint(1, 128, (6,))
    ids = torch.zeros(2, 10, dtype=torch.long)
    mask = torch.zeros(2, 10, dtype=torch.long)
    ids[0], mask[0] = a, 1
    ids[1, 4:], mask[1, 4:] = b, 1  # left padding
    batch = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(batch[0], model(a[None]).logits[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(batch[1, 4:], model(b[None]).logits[0], rtol=1e-4, atol=1e-4)
    # capacity excludes padding: the padded batch measures like the two rows pooled
    cap = wc.measure_capacity(model, ids, mask)
    assert cap["tokens"] == 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generate_with_routers_matches_step_by_step(dtype, cache):
    model = tiny_model("llama", dtype=dtype)
    wc.attach(model, _random_routers(model))
    ids = torch.randint(1, 128, (2, 6))
    gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                         cache_implementation=cache, pad_token_id=0)
    # greedy by full recompute
    seq = ids
    for _ in range(6):
        nxt = model(seq).logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], 1)
    if dtype == torch.float32:
        assert torch.equal(gen, seq)
    else:  # bf16: cached and recomputed logits round differently; the first tokens must agree
        assert torch.equal(gen[:, :8], seq[:, :8])


def test_relaxed_routers_give_gradients():
    model = tiny_model("llama")
    for p in model.parameters():
        p.requires_grad_(False)
    routers = _random_routers(model)
    wc.attach(model, routers)
    ids = torch.randint(0, 128, (2, 8))
    model.train()
    routers.train()
    with routers.relax(tau=1.0), wc.routing.record_masks(model) as rec:
        loss = model(ids, labels=ids).loss
        masks = rec["attn"][0][0]
    assert masks.dtype == torch.float32 and set(masks.unique().tolist()) <= {0.0, 1.0}
    loss.backward()
    assert routers.attn[0].proj.weight.grad is not None and routers.attn[0].proj.weight.grad.abs().sum() > 0
    assert routers.ffn[1].proj.weight.grad.abs().sum() > 0
