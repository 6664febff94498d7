"""The "wide" router recipe (PairRouter on the residual stream): config, eager semantics by hand, relaxation,
checkpoints (old ones load as the linear recipe), compiled forms A and B against the eager reference."""
from __future__ import annotations

import json

import pytest
import torch

import wide_compile as wc
from wide_compile.models import decoder_layers, tiny_model
from wide_compile.routing import PairRouter
from wide_compile.routing import router_fns as fns

WIDE = wc.WideConfig(ffn_group_size=32, head_group_size=1, router_recipe="wide", router_rank=8, router_init="random")


def wide_routers(model, seed):
    """Random wide-recipe routers with random biases: with zero biases a margin only scales with the input's
    norm, so routing the normed input or the residual stream would decide alike and a test could not tell."""
    r = wc.Routers.init(model, WIDE, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in r.parameters():
            if p.dim() == 1:
                p.copy_(torch.randn(p.shape, generator=g))
    return r


def test_config_fields_and_errors():
    assert WIDE.router_input == "residual" and wc.WideConfig().router_input == "normed"
    assert wc.WideConfig(router_recipe="wide", router_input="normed").router_input == "normed"
    for kw in (dict(router_recipe="mlp"), dict(router_rank=0), dict(router_input="pre")):
        with pytest.raises(ValueError, match="router_"):
            wc.WideConfig(**kw)
    with pytest.raises(ValueError, match="router_rank"):
        wc.Routers.init(tiny_model("llama"), wc.WideConfig(router_recipe="wide", router_hidden=4))


def test_old_checkpoint_config_loads_as_linear_recipe():
    old = json.loads(wc.WideConfig().to_json())
    for k in ("router_recipe", "router_rank", "router_input"):
        old.pop(k)
    cfg = wc.WideConfig.from_json(json.dumps(old))
    assert cfg.router_recipe == "linear" and cfg.router_input == "normed"


def test_dense_init_is_all_on_and_equals_dense():
    model = tiny_model("smollm2", seed=1)
    ids = torch.randint(0, 128, (2, 9))
    dense = model(input_ids=ids).logits
    r = wc.Routers.init(model, wc.WideConfig(ffn_group_size=32, router_recipe="wide"))
    assert all(isinstance(x, PairRouter) for x in list(r.attn) + list(r.ffn))
    wc.attach(model, r)
    with wc.routing.record_masks(model) as rec:
        out = model(input_ids=ids).logits
    assert all(m[0].all() for k in ("attn", "ffn") for m in rec[k])
    torch.testing.assert_close(out, dense, atol=0, rtol=0)
    wc.detach(model)


def _by_hand(model, routers, ids):
    """The wide recipe written out: routers read each norm's input; masks zero o_proj / down_proj inputs."""
    seen = {}
    layers = decoder_layers(model)
    hooks = []
    for i, layer in enumerate(layers):
        for kind, norm in (("attn", layer.input_layernorm), ("ffn", layer.post_attention_layernorm)):
            hooks.append(norm.register_forward_pre_hook(lambda m, a, i=i, k=kind: seen.__setitem__((k, i), a[0])))

        def zero(kind, i, gs):
            def pre(m, a):
                r = getattr(routers, kind)[i]
                z = fns.pair_logits(seen[(kind, i)].double(), r.down.weight.double(), r.down.bias.double(),
                                    r.up.weight.double(), r.up.bias.double())
                mask = z.argmax(-1).bool()  # index 1 = execute
                x = a[0]
                return (x * mask.repeat_interleave(gs, -1).to(x.dtype),)
            return pre

        spec = routers.spec
        hooks.append(layer.self_attn.o_proj.register_forward_pre_hook(zero("attn", i, spec.head_dim)))
        hooks.append(layer.mlp.down_proj.register_forward_pre_hook(zero("ffn", i, routers.cfg.ffn_group_size)))
    try:
        return model(input_ids=ids).logits
    finally:
        for h in hooks:
            h.remove()


def test_attach_executes_the_recipe_exactly():
    model = tiny_model("smollm2", seed=2).double()
    routers = wide_routers(model, 3).double()
    ids = torch.randint(0, 128, (2, 11))
    want = _by_hand(model, routers, ids)
    wc.attach(model, routers)
    cap = wc.measure_capacity(model, ids)
    assert 0.2 < cap["ffn"] < 0.95  # random routers: masks really vary
    torch.testing.assert_close(model(input_ids=ids).logits, want, atol=1e-10, rtol=0)
    wc.detach(model)


def test_relaxed_is_hard_pair_gumbel_softmax_with_st_gradient():
    torch.manual_seed(0)
    r = PairRouter(16, 5, rank=4)
    h = torch.randn(7, 16)
    m = r.relaxed(h, 1.0, noise=False)
    assert torch.equal(m.bool(), r(h) > 0) and set(m.unique().tolist()) <= {0.0, 1.0}
    m.sum().backward()
    z = fns.pair_logits(h, r.down.weight, r.down.bias, r.up.weight, r.up.bias)
    s = torch.softmax(z / 1.0, -1)[..., 1]
    g = torch.autograd.grad(s.sum(), r.up.bias)[0]
    torch.testing.assert_close(r.up.bias.grad, g)
    # noise: decisions vary across draws; the temperature changes only the gradient
    a, b = r.relaxed(h, 5.0, noise=True), r.relaxed(h, 5.0, noise=True)
    assert not torch.equal(a, b)


def test_calibrate_and_checkpoint_round_trip(tmp_path):
    model = tiny_model("llama")
    routers = wc.Routers.init(model, WIDE, seed=4)
    ids = torch.randint(0, 128, (4, 64))
    routers.calibrate_(model, ids, capacity=0.6)
    wc.attach(model, routers)
    assert wc.measure_capacity(model, ids)["overall"] == pytest.approx(0.6, abs=0.03)
    a = model(input_ids=ids).logits
    routers.save(tmp_path / "r.safetensors")
    loaded = wc.Routers.load(tmp_path / "r.safetensors", model)
    assert loaded.cfg == WIDE
    wc.attach(model, loaded)
    assert torch.equal(model(input_ids=ids).logits, a)
    wc.detach(model)


@pytest.mark.parametrize("arch", ["llama", "smollm2"])
def test_compiled_form_a_equals_eager(arch):
    model, ref = tiny_model(arch, seed=5), tiny_model(arch, seed=5)
    routers = wide_routers(model, 6)
    routers.calibrate_(ref, torch.randint(0, 128, (4, 16)), capacity=0.5)
    wc.attach(ref, routers)
    cm = wc.optimize(model, routers, inductor=False)
    ids = torch.randint(0, 128, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(cm(input_ids=ids).logits, ref(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
    ex = wc.explain(cm)
    assert all(r["mlp"]["status"] == "rewritten" and r["attn"]["status"] == "rewritten" for r in ex.layers)


def test_compiled_form_b_inserts_pair_routers_on_the_norm_input():
    from test_passes_models import gptfast_pair

    model, ref = gptfast_pair(seed=9)
    routers = wide_routers(model.spec, 10)
    # the gpt-fast reference hands routers the normed input; record each norm's input and route on that

    def route_on_norm_input(block, i):
        def pre(mod, a):
            block._wide_h = a[0]
        return pre

    for i, blk in enumerate(ref.layers):
        blk.attention_norm.register_forward_pre_hook(route_on_norm_input(blk.attention, i))
        blk.ffn_norm.register_forward_pre_hook(route_on_norm_input(blk.feed_forward, i))
    ref.ref_routers = _ResidualRef(routers, ref)
    cm = wc.optimize(model, routers, inductor=False)
    idx = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(cm(idx), ref(idx), atol=1e-5, rtol=1e-5)
    ex = wc.explain(cm)
    assert ex.counts["insert_routers.inserted"] == 4 * len(ex.graphs)


class _ResidualRef:
    """Stands in for Routers in the gpt-fast reference: decide() ignores the normed input it is given and
    uses the norm input recorded by the pre-hooks above."""

    def __init__(self, routers, model):
        self.routers, self.model = routers, model
        self.attn = [("attn", i) for i in range(len(model.layers))]
        self.ffn = [("ffn", i) for i in range(len(model.layers))]

    def decide(self, which, h):
        kind, i = which
        blk = self.model.layers[i]
        src = blk.attention if kind == "attn" else blk.feed_forward
        return getattr(self.routers, kind)[i](src._wide_h) > 0


def test_form_b_without_a_recognised_norm_is_a_clear_error():
    from wide_compile.passes.insert_routers import norm_input
    from torch import fx

    g = fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(torch.relu, (x,))
    assert norm_input(y) is None
    from wide_compile.passes.insert_routers import _router_input

    with pytest.raises(ValueError, match=r"layer 3: the MLP routers read the residual stream.*router_input='normed'"):
        _router_input(y, "residual", "MLP", 3)
