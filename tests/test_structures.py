"""Mask structures (WideConfig.structure): the codebook router (one of P learned prototype masks per token).

Config and checkpoint errors; the eager reference against a float64 computation by hand; the constant-mask
oracle (a codebook of one repeated mask == Routers.constant); the relaxation's gradients; FLOP accounting;
calibration; compiled forms A and B against eager; a few stage-1 steps."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import wide_compile as wc
from wide_compile.models import decoder_layers, tiny_model
from wide_compile.routing import CodebookRouter
from wide_compile.routing import router_fns as fns

P = 5
CB = wc.WideConfig(ffn_group_size=32, head_group_size=1, router_init="random", structure="codebook", codebook_size=P)
CB_WIDE = wc.WideConfig(ffn_group_size=32, head_group_size=1, router_init="random", structure="codebook",
                        codebook_size=P, router_recipe="wide", router_rank=8)


def codebook_routers(model, cfg, seed):
    """Random codebook routers: random scorers (zero bias: the tokens' inputs decide the picks) and random
    prototype masks."""
    return wc.Routers.init(model, cfg, seed=seed)


def every_router(r):
    return list(r.attn) + list(r.ffn)


# ------------------------------------------------------------------------------------------------ config
def test_config_defaults_and_errors():
    assert wc.WideConfig().structure == "free" and wc.WideConfig().codebook_size == 16
    for kw, what in ((dict(structure="banded"), "structure"), (dict(structure="Codebook"), "structure"),
                     (dict(codebook_size=1), "codebook_size"), (dict(codebook_size=True), "codebook_size"),
                     (dict(codebook_size=4.0), "codebook_size"),
                     (dict(structure="codebook", router_hidden=8), "router_hidden")):
        with pytest.raises(ValueError, match=what):
            wc.WideConfig(**kw)
    assert wc.WideConfig.from_json(CB_WIDE.to_json()) == CB_WIDE
    old = json.loads(wc.WideConfig().to_json())
    for k in ("structure", "codebook_size"):
        old.pop(k)
    assert wc.WideConfig.from_json(json.dumps(old)).structure == "free"  # older checkpoints: free masks


def test_init_builds_codebook_routers_and_counts_scorer_flops():
    model = tiny_model("llama")
    spec = wc.models.model_spec(model)
    D, L = spec.hidden_size, spec.num_layers
    for cfg, flops in ((CB, 2 * D * P), (CB_WIDE, 2 * (D * 8 + 8 * P))):
        r = wc.Routers.init(model, cfg)
        assert all(isinstance(x, CodebookRouter) for x in every_router(r))
        assert r.ffn[0].prototypes.shape == (P, cfg.num_ffn_groups(spec))
        assert r.attn[0].prototypes.shape == (P, cfg.num_head_groups(spec))
        assert r.flops_per_token() == ([flops] * L, [flops] * L)
        cost = wc.routing.FlopCost.from_routers(r)
        # the mask is a subset of groups: the same capacity formula, plus the scorer as router FLOPs
        ea, ef = cost.executed(0, 0.5, 0.25)
        assert ea == 0.5 * cost.qo + cost.kv + flops and ef == 0.25 * cost.ffn + flops
        wc.attach(model, r)
        m = wc.measure_capacity(model, torch.randint(0, 128, (1, 6)))
        assert m["router_flops_fraction"] == pytest.approx(2 * L * flops / (L * cost.dense_layer))
        wc.detach(model)


def test_dense_init_is_all_on_and_equals_dense():
    model = tiny_model("smollm2", seed=1)
    ids = torch.randint(0, 128, (2, 9))
    dense = model(input_ids=ids).logits
    r = wc.Routers.init(model, wc.WideConfig(ffn_group_size=32, structure="codebook", codebook_size=4))
    assert all((x.prototypes > 0).all() for x in every_router(r))
    assert all(len(x.prototypes.unique()) > 1 for x in every_router(r))  # distinct, so training can tell them apart
    wc.attach(model, r)
    torch.testing.assert_close(model(input_ids=ids).logits, dense, atol=0, rtol=0)
    wc.detach(model)


# ---------------------------------------------------------------------------------------- eager semantics
def _run_by_hand(model, routers, ids, min_gap, mask_of):
    """The model run with each layer's o_proj / down_proj input groups zeroed by hand: a scorer written out
    in float64 on q_proj's / gate_proj's input (the linear recipe's normed input), then
    `mask_of(router, scores)` -> bool [B, S, G]. Records the smallest gap between the best and second-best
    score, so a test can tell that no pick sits within rounding of a tie."""
    seen, hooks = {}, []
    spec = routers.spec
    for i, layer in enumerate(decoder_layers(model)):
        for kind, mod in (("attn", layer.self_attn.q_proj), ("ffn", layer.mlp.gate_proj)):
            hooks.append(mod.register_forward_pre_hook(lambda m, a, i=i, k=kind: seen.__setitem__((k, i), a[0])))

        def zero(kind, i, gs):
            def pre(m, a):
                r = getattr(routers, kind)[i]
                s = seen[(kind, i)].double() @ r.scorer.weight.double().T + r.scorer.bias.double()  # [B, S, P]
                top2 = s.topk(2, -1).values
                min_gap.append(float((top2[..., 0] - top2[..., 1]).min().detach()))
                return (a[0] * mask_of(r, s).repeat_interleave(gs, -1).to(a[0].dtype),)
            return pre

        hooks.append(layer.self_attn.o_proj.register_forward_pre_hook(zero("attn", i, spec.head_dim)))
        hooks.append(layer.mlp.down_proj.register_forward_pre_hook(zero("ffn", i, routers.cfg.ffn_group_size)))
    try:
        return model(input_ids=ids).logits
    finally:
        for h in hooks:
            h.remove()


def _by_hand(model, routers, ids, min_gap):
    """The codebook by hand: argmax over the P scores, the chosen prototype's row > 0 is the mask."""
    return _run_by_hand(model, routers, ids, min_gap,
                        lambda r, s: (r.prototypes.double() > 0)[s.argmax(-1)])  # [B, S, G]


def test_attach_executes_the_codebook_exactly():
    model = tiny_model("smollm2", seed=2).double()
    routers = codebook_routers(model, CB, 3).double()
    ids = torch.randint(0, 128, (2, 11))
    gaps = []
    want = _by_hand(model, routers, ids, gaps)
    assert min(gaps) > 1e-6  # every pick is far from a tie: float64 and the router agree on it
    wc.attach(model, routers)
    with wc.routing.record_masks(model) as rec:
        got = model(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-10, rtol=0)
    for k in ("attn", "ffn"):
        for i, r in enumerate(getattr(routers, k)):
            m = rec[k][i][0].reshape(-1, r.groups)
            protos = r.prototypes > 0
            # every token's mask is one of the prototypes, and the tokens use several of them
            assert (m[:, None, :] == protos[None]).all(-1).any(-1).all()
            assert len({tuple(x.tolist()) for x in m}) > 1
    wc.detach(model)


def test_codebook_of_one_constant_mask_equals_constant_routers():
    model = tiny_model("llama", seed=3)
    spec = wc.models.model_spec(model)
    ga, gf = CB.num_head_groups(spec), CB.num_ffn_groups(spec)
    g = torch.Generator().manual_seed(0)
    attn = [torch.rand(ga, generator=g) < 0.5 for _ in range(spec.num_layers)]
    ffn = [torch.rand(gf, generator=g) < 0.5 for _ in range(spec.num_layers)]
    ffn[0][:] = True  # all-on next to random masks
    attn[-1][:] = False  # all-off
    cb = codebook_routers(model, CB, 4)
    with torch.no_grad():
        for r, m in zip(every_router(cb), attn + ffn):
            # every prototype the same mask, with logits of different sizes: any pick gives that mask
            r.prototypes.copy_(torch.where(m, 1.0, -1.0) * torch.rand(P, 1, generator=g).add(0.5))
    const = wc.Routers.constant(model, CB, attn=attn, ffn=ffn)
    ids = torch.randint(0, 128, (2, 13))
    with torch.no_grad(), wc.routing.routed(model, const):
        want = model(input_ids=ids).logits
    with torch.no_grad(), wc.routing.routed(model, cb):
        got = model(input_ids=ids).logits
    assert torch.equal(got, want)


# ------------------------------------------------------------------------------------------- relaxation
@pytest.mark.parametrize("rank", [0, 4])
def test_relaxed_is_hard_prototype_pick_with_gradient_to_scorer_and_prototypes(rank):
    torch.manual_seed(0)
    r = CodebookRouter(16, 6, prototypes=4, rank=rank)
    with torch.no_grad():
        r.prototypes.normal_()
    h = torch.randn(3, 7, 16)
    m = r.relaxed(h, 0.7, noise=False)
    assert m.shape == (3, 7, 6) and torch.equal(m.bool(), r(h) > 0) and set(m.unique().tolist()) <= {0.0, 1.0}
    w = torch.randn(3, 7, 6)
    (m * w).sum().backward()
    # the backward is that of softmax(scores / tau) @ sigmoid(prototypes / tau)
    soft = torch.softmax(r.scores(h) / 0.7, -1) @ torch.sigmoid(r.prototypes / 0.7)
    want = torch.autograd.grad((soft * w).sum(), [r.prototypes, r.scorer.weight])
    torch.testing.assert_close(r.prototypes.grad, want[0])
    torch.testing.assert_close(r.scorer.weight.grad, want[1])
    assert r.prototypes.grad.abs().sum() > 0 and r.scorer.weight.grad.abs().sum() > 0
    if rank:
        assert r.scorer_in.weight.grad.abs().sum() > 0
    # Gumbel noise changes the picks from draw to draw (hard 0/1 still)
    a, b = r.relaxed(h, 1.0, noise=True), r.relaxed(h, 1.0, noise=True)
    assert not torch.equal(a, b) and set(a.unique().tolist()) <= {0.0, 1.0}


def test_relaxed_capacity_through_attach_has_gradient():
    from wide_compile.training.stage1 import relaxed_capacity

    model = tiny_model("llama")
    routers = codebook_routers(model, CB, 1)
    wc.attach(model, routers)
    ids = torch.randint(0, 128, (2, 16))
    with routers.relax(0.5, noise=False), wc.routing.record_masks(model) as rec:
        model(input_ids=ids)
    c = relaxed_capacity(routers, rec)
    c["overall"].backward()
    assert all(r.prototypes.grad.abs().sum() > 0 for r in every_router(routers))
    assert float(c["overall"].detach()) == pytest.approx(wc.measure_capacity(model, ids)["overall"], abs=1e-5)
    wc.detach(model)


# ------------------------------------------------------------------------------ calibration, checkpoints
def test_calibrate_shifts_prototypes_to_the_capacity():
    from wide_compile.routing.calibrate import calibrate_offset_

    model = tiny_model("llama")
    ids = torch.randint(0, 128, (4, 64))
    routers = codebook_routers(model, CB_WIDE, 4)
    routers.calibrate_(model, ids, capacity=0.6)
    wc.attach(model, routers)
    assert wc.measure_capacity(model, ids)["overall"] == pytest.approx(0.6, abs=0.05)
    wc.detach(model)
    # the bisection that follows training shifts all prototypes of a kind by one offset
    routers = codebook_routers(model, CB_WIDE, 5)
    calibrate_offset_(model, routers, ids, 0.5, tol=0.02, log=lambda *_: None)
    with wc.routing.routed(model, routers):
        assert wc.measure_capacity(model, ids)["overall"] == pytest.approx(0.5, abs=0.02)


def test_checkpoint_round_trip_and_structure_mismatch(tmp_path):
    model = tiny_model("llama")
    routers = codebook_routers(model, CB_WIDE, 5)
    ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad(), wc.routing.routed(model, routers):
        want = model(input_ids=ids).logits
    path = tmp_path / "cb.safetensors"
    routers.save(path)
    for structure in (None, "codebook"):
        loaded = wc.Routers.load(path, model, structure=structure)
        assert loaded.cfg == CB_WIDE and all(isinstance(x, CodebookRouter) for x in every_router(loaded))
        with torch.no_grad(), wc.routing.routed(model, loaded):
            assert torch.equal(model(input_ids=ids).logits, want)
    with pytest.raises(ValueError, match="holds structure='codebook' routers, but structure='free'"):
        wc.Routers.load(path, model, structure="free")
    free = tmp_path / "free.safetensors"
    wc.Routers.init(model, wc.WideConfig(ffn_group_size=32)).save(free)
    with pytest.raises(ValueError, match="holds structure='free' routers, but structure='codebook'"):
        wc.Routers.load(free, model, structure="codebook")
    with pytest.raises(ValueError, match="structure must be one of"):
        wc.Routers.load(free, model, structure="banded")


def test_checkpoint_of_an_unknown_structure_is_a_clear_error(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    model = tiny_model("llama")
    path = tmp_path / "cb.safetensors"
    wc.Routers.init(model, CB).save(path)
    with safe_open(str(path), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    cfg = json.loads(meta["config"])
    save_file(tensors, str(tmp_path / "n.safetensors"),
              metadata={**meta, "structure": "banded", "config": json.dumps({**cfg, "structure": "banded"})})
    with pytest.raises(ValueError, match="structure 'banded', which this version of wide_compile cannot load"):
        wc.Routers.load(tmp_path / "n.safetensors", model)
    save_file(tensors, str(tmp_path / "x.safetensors"), metadata={**meta, "structure": "free"})
    with pytest.raises(ValueError, match="inconsistent"):
        wc.Routers.load(tmp_path / "x.safetensors", model)


# ------------------------------------------------------------------------------------------ compiled
@pytest.mark.parametrize("cfg", [CB, CB_WIDE], ids=["linear", "wide"])
def test_compiled_form_a_equals_eager(cfg):
    model, ref = tiny_model("smollm2", seed=5), tiny_model("smollm2", seed=5)
    routers = codebook_routers(model, cfg, 6)
    wc.attach(ref, routers)
    cm = wc.optimize(model, routers, inductor=False)
    ids = torch.randint(0, 128, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(cm(input_ids=ids).logits, ref(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
    ex = wc.explain(cm)
    assert all(r["mlp"]["status"] == "rewritten" and r["attn"]["status"] == "rewritten" for r in ex.layers)


@pytest.mark.parametrize("cfg", [CB, "nested"])
def test_compiled_form_b_inserts_structured_routers(cfg):
    from test_passes_models import gptfast_pair

    model, ref = gptfast_pair(seed=9)
    if cfg == "nested":  # the gpt-fast layers are not HF-named: a ModelSpec and a random order per router
        cfg = wc.WideConfig(ffn_group_size=32, head_group_size=1, router_init="random", structure="nested",
                            nested_levels=3)
    routers = codebook_routers(model.spec, cfg, 10)
    g = torch.Generator().manual_seed(1)
    for r in every_router(routers):
        if hasattr(r, "set_order_"):
            r.set_order_(torch.randperm(r.groups, generator=g))
    ref.ref_routers = routers
    cm = wc.optimize(model, routers, inductor=False)
    idx = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(cm(idx), ref(idx), atol=1e-5, rtol=1e-5)
    ex = wc.explain(cm)
    assert ex.graphs[0].form == "dense+routers" and ex.counts["insert_routers.inserted"] == 4 * len(ex.graphs)


@pytest.mark.parametrize("cfg,fn", [(CB, fns.codebook_router_mask), (CB_WIDE, fns.codebook_router_mask),
                                    ("nested", fns.nested_router_mask)])
def test_graph_form_is_the_forward_decision(cfg, fn):
    if cfg == "nested":
        cfg = wc.WideConfig(ffn_group_size=32, router_init="random", structure="nested", nested_levels=3,
                            router_recipe="wide", router_rank=8)
    r = codebook_routers(tiny_model("llama"), cfg, 7).ffn[1]
    h = torch.randn(2, 50, r.dim)
    got_fn, tensors = r.graph_form(torch.float32, 100)
    assert got_fn is fn
    m = got_fn(h, *(t for _, t in tensors))
    assert torch.equal(m, r(h) > 0) and 0 < m.float().mean() < 1


# ------------------------------------------------------------------------------------------- training
def test_stage1_trains_codebook_routers():
    from wide_compile.training import Stage1Config, train_stage1
    from wide_compile.training.data import TokenBlocks
    from wide_compile.training.stage1 import router_optimizer

    torch.manual_seed(0)
    model = tiny_model("smollm2")
    blocks = TokenBlocks(np.random.default_rng(0).integers(0, 128, 3000), 32, heldout_frac=0.1)
    cfg = Stage1Config(capacity=0.5, steps=6, batch_size=2, seq_len=32, lr=5e-2, cap_weight=50.0, ramp_frac=0.2,
                       ckpt_every=1000, calibrate=False, log_every=1, eval_every=1000, eval_blocks=2,
                       calib_blocks=2, structure="codebook", codebook_size=4, ffn_group_size=32,
                       router_init_bias=1.0)
    start = wc.Routers.init(model, cfg.wide_config(model), seed=cfg.seed)
    opt = router_optimizer(start, cfg)
    assert [p for p in opt.param_groups[1]["params"]] == [r.prototypes for r in every_router(start)]
    r = train_stage1(model, blocks, cfg, progress=False, log=lambda *_: None)
    assert r.train_status == "done" and r.cfg.structure == "codebook"
    assert all(isinstance(x, CodebookRouter) for x in every_router(r))
    for name, before in start.named_parameters():
        assert not torch.equal(r.state_dict()[name], before), name  # scorers and prototypes all moved
    assert r.train_history[-1]["cap"] < r.train_history[0]["cap"]


# ------------------------------------------------------------------------------------------- nested
NL = 3
NEST = wc.WideConfig(ffn_group_size=32, head_group_size=1, router_init="random", structure="nested", nested_levels=NL)
NEST_WIDE = wc.WideConfig(ffn_group_size=32, head_group_size=1, router_init="random", structure="nested",
                          nested_levels=NL, router_recipe="wide", router_rank=8)


def test_nested_config_init_and_errors():
    from wide_compile.routing import NestedRouter
    from wide_compile.routing.routers import group_importance

    with pytest.raises(ValueError, match="nested_levels"):
        wc.WideConfig(structure="nested", nested_levels=1)
    with pytest.raises(ValueError, match="router_hidden"):
        wc.WideConfig(structure="nested", router_hidden=4)
    model = tiny_model("llama", seed=1)
    spec = wc.models.model_spec(model)
    with pytest.raises(ValueError, match=r"nested_levels=5 must be in \[2, 4\]"):  # 4 head groups
        wc.Routers.init(model, wc.WideConfig(ffn_group_size=32, structure="nested", nested_levels=5))
    r = wc.Routers.init(model, NEST)
    assert all(isinstance(x, NestedRouter) for x in every_router(r))
    gf = NEST.num_ffn_groups(spec)
    assert r.ffn[0].widths.tolist() == [-(-gf * (lv + 1) // NL) for lv in range(NL)] and r.ffn[0].widths[-1] == gf
    assert r.flops_per_token()[1] == [2 * spec.hidden_size * NL] * spec.num_layers
    # the order is the dense weights' importance, most important first
    imp_attn, imp_ffn = group_importance(model, spec, NEST)
    q, o = model.model.layers[1].self_attn.q_proj.weight, model.model.layers[1].self_attn.o_proj.weight
    hd = spec.head_dim
    by_hand = torch.stack([q[g * hd:(g + 1) * hd].norm() * o[:, g * hd:(g + 1) * hd].norm() for g in range(4)])
    torch.testing.assert_close(imp_attn[1], by_hand)
    assert torch.equal(r.attn[1].order, torch.argsort(by_hand, descending=True))
    assert torch.equal(r.ffn[0].order, torch.argsort(imp_ffn[0], descending=True))
    assert not torch.equal(r.ffn[0].order, torch.arange(gf))  # a real permutation, not the identity
    with pytest.raises(ValueError, match="permutation"):
        r.ffn[0].set_order_(torch.zeros(gf))
    with pytest.raises(ValueError, match="calibrate_offset_"):
        r.calibrate_(model, torch.randint(0, 128, (1, 8)), capacity=0.5)


def test_nested_dense_init_equals_dense():
    model = tiny_model("smollm2", seed=1)
    ids = torch.randint(0, 128, (2, 9))
    dense = model(input_ids=ids).logits
    with wc.routing.routed(model, wc.Routers.init(model, wc.WideConfig(ffn_group_size=32, structure="nested", nested_levels=NL))):
        torch.testing.assert_close(model(input_ids=ids).logits, dense, atol=0, rtol=0)


def _nested_by_hand(model, routers, ids, min_gap):
    """Nested routing by hand: level = argmax of the scorer, mask = the first widths[level] groups of the
    layer's order."""
    def prefix_of_order(r, s):
        width = r.widths[s.argmax(-1)]  # [B, S]
        mask = torch.zeros(*width.shape, r.groups, dtype=torch.bool)
        for g_rank, g in enumerate(r.order.tolist()):
            mask[..., g] = g_rank < width
        return mask

    return _run_by_hand(model, routers, ids, min_gap, prefix_of_order)


def test_nested_attach_executes_prefixes_of_the_order_exactly():
    model = tiny_model("smollm2", seed=2).double()
    routers = wc.Routers.init(model, NEST, seed=3).double()
    ids = torch.randint(0, 128, (2, 11))
    gaps = []
    want = _nested_by_hand(model, routers, ids, gaps)
    assert min(gaps) > 1e-6
    wc.attach(model, routers)
    with wc.routing.record_masks(model) as rec:
        got = model(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-10, rtol=0)
    m = rec["ffn"][0][0].reshape(-1, routers.ffn[0].groups)
    assert len({int(x) for x in m.sum(-1)}) > 1  # tokens take several widths
    wc.detach(model)


def test_nested_constant_level_equals_constant_routers():
    model = tiny_model("llama", seed=3)
    r = wc.Routers.init(model, NEST, seed=4)
    masks = {"attn": [], "ffn": []}
    with torch.no_grad():
        for k in ("attn", "ffn"):
            for i, x in enumerate(getattr(r, k)):
                lv = (i + (k == "ffn")) % NL  # different levels per layer and kind
                x.scorer.weight.zero_()
                x.scorer.bias.copy_(torch.nn.functional.one_hot(torch.tensor(lv), NL).float())
                masks[k].append(torch.isin(torch.arange(x.groups), x.order[:int(x.widths[lv])]))
    const = wc.Routers.constant(model, NEST, attn=masks["attn"], ffn=masks["ffn"])
    ids = torch.randint(0, 128, (2, 13))
    with torch.no_grad(), wc.routing.routed(model, const):
        want = model(input_ids=ids).logits
    with torch.no_grad(), wc.routing.routed(model, r):
        assert torch.equal(model(input_ids=ids).logits, want)


def test_nested_relaxed_is_a_hard_level_pick_with_gradient_to_the_scorer():
    from wide_compile.routing import NestedRouter

    torch.manual_seed(0)
    r = NestedRouter(16, 6, levels=3, rank=4).set_order_(torch.tensor([3, 1, 5, 0, 2, 4]))
    h = torch.randn(3, 7, 16)
    m = r.relaxed(h, 0.7, noise=False)
    assert torch.equal(m.bool(), r(h) > 0) and set(m.unique().tolist()) <= {0.0, 1.0}
    w = torch.randn(3, 7, 6)
    (m * w).sum().backward()
    soft = torch.softmax(fns.lowrank_scores(h, r.scorer_in.weight, r.scorer_in.bias, r.scorer.weight,
                                            r.scorer.bias) / 0.7, -1) @ r.level_masks().float()
    want = torch.autograd.grad((soft * w).sum(), [r.scorer.weight, r.scorer_in.weight])
    torch.testing.assert_close(r.scorer.weight.grad, want[0])
    torch.testing.assert_close(r.scorer_in.weight.grad, want[1])
    assert r.scorer.weight.grad.abs().sum() > 0


def test_nested_calibrate_offset_checkpoint_and_compiled(tmp_path):
    from wide_compile.routing.calibrate import calibrate_offset_

    model, ref = tiny_model("smollm2", seed=5), tiny_model("smollm2", seed=5)
    ids = torch.randint(0, 128, (4, 32))
    routers = wc.Routers.init(model, NEST_WIDE, seed=6)
    calibrate_offset_(model, routers, ids, 0.5, tol=0.03, log=lambda *_: None)
    assert float(routers.ffn[0].tilt) != 0.0
    with wc.routing.routed(model, routers):
        assert wc.measure_capacity(model, ids)["overall"] == pytest.approx(0.5, abs=0.03)
    routers.save(tmp_path / "n.safetensors")
    with pytest.raises(ValueError, match="holds structure='nested' routers, but structure='codebook'"):
        wc.Routers.load(tmp_path / "n.safetensors", model, structure="codebook")
    loaded = wc.Routers.load(tmp_path / "n.safetensors", model, structure="nested")
    for a, b in zip(every_router(loaded), every_router(routers)):
        assert torch.equal(a.order, b.order) and torch.equal(a.tilt, b.tilt)
    wc.attach(ref, loaded)
    cm = wc.optimize(model, routers, inductor=False)
    x = torch.randint(0, 128, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(cm(input_ids=x).logits, ref(input_ids=x).logits, atol=1e-5, rtol=1e-5)
    assert all(r["mlp"]["status"] == "rewritten" for r in wc.explain(cm).layers)


def test_stage1_trains_nested_routers():
    from wide_compile.routing import NestedRouter
    from wide_compile.training import Stage1Config, train_stage1
    from wide_compile.training.data import TokenBlocks

    torch.manual_seed(0)
    model = tiny_model("smollm2")
    blocks = TokenBlocks(np.random.default_rng(0).integers(0, 128, 3000), 32, heldout_frac=0.1)
    cfg = Stage1Config(capacity=0.5, steps=6, batch_size=2, seq_len=32, lr=5e-2, cap_weight=50.0, ramp_frac=0.2,
                       ckpt_every=1000, calibrate=False, log_every=1, eval_every=1000, eval_blocks=2,
                       calib_blocks=2, structure="nested", nested_levels=3, ffn_group_size=32, router_init_bias=0.5)
    start = wc.Routers.init(model, cfg.wide_config(model), seed=cfg.seed)
    r = train_stage1(model, blocks, cfg, progress=False, log=lambda *_: None)
    assert r.train_status == "done" and all(isinstance(x, NestedRouter) for x in every_router(r))
    for name, before in start.state_dict().items():
        moved = not torch.equal(r.state_dict()[name], before)
        assert moved == (".scorer" in name), name  # the scorers train; the orders and widths stay
    assert r.train_history[-1]["cap"] < r.train_history[0]["cap"]


def test_nested_attention_order_keeps_kv_heads_together():
    """With 1-head groups and 2 query heads per KV head, the nested order lists both groups of a KV head
    next to each other: KV heads by total importance, then the groups within each."""
    from wide_compile.config import GroupGeometry
    from wide_compile.routing.routers import attention_order

    geo = GroupGeometry(hidden_size=64, num_heads=6, num_kv_heads=3, head_dim=16, head_group_size=1,
                        intermediate_size=64, ffn_group_size=16)
    imp = torch.tensor([0.1, 5.0, 3.0, 2.9, 0.2, 0.3])         # KV heads: 5.1, 5.9, 0.5
    assert attention_order(imp, geo).tolist() == [2, 3, 1, 0, 5, 4]
    model = tiny_model("llama")                                  # 4 query heads, 2 KV heads
    r = wc.Routers.init(model, wc.WideConfig(structure="nested", nested_levels=4, head_group_size=1,
                                             ffn_group_size=16))
    for a in r.attn:
        kv = (a.order // 2).tolist()
        assert kv[0] == kv[1] and kv[2] == kv[3] and sorted(a.order.tolist()) == [0, 1, 2, 3]


def test_codebook_calibration_lands_on_the_target_when_prototype_logits_sit_near_zero():
    """The state a trained codebook reaches (prototype logits pushed to near 0 by the capacity loss) on the smoke
    model (training.options.smoke_model_and_tokens): a uniform shift of the prototype logits moves capacity in
    steps (a group flips for every token of a prototype), so calibration follows it with the width tilt and the
    deterministic capacity lands within 0.01 of each target (0.003 is the bisection's own tolerance; 0.01 leaves
    room for one token of the 4 x 48 calibration tokens switching prototype per step)."""
    from wide_compile.routing.calibrate import calibrate_offset_, deterministic_capacity
    from wide_compile.training.options import smoke_model_and_tokens

    model, toks = smoke_model_and_tokens("cpu", n_tokens=4 * 48)
    blocks = torch.as_tensor(toks).reshape(4, 48)
    routers = wc.Routers.init(model, CB_WIDE, seed=11)
    g = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for r in every_router(routers):
            r.prototypes.copy_(torch.randn(r.prototypes.shape, generator=g) * 0.05)
    calibrate_offset_(model, routers, blocks, 0.5, tol=0.003, log=lambda *_: None, target_attn=0.55,
                      target_ffn=0.45)
    cap = deterministic_capacity(model, routers, blocks)
    assert cap["attn"] == pytest.approx(0.55, abs=0.01) and cap["ffn"] == pytest.approx(0.45, abs=0.01)
    assert any(float(r.tilt) != 0.0 for r in every_router(routers))
    # the tilt only moves tokens between the learned prototypes: the prototype masks are those of the shift
    with wc.routing.routed(model, routers), wc.routing.record_masks(model) as rec:
        model(input_ids=blocks)
    r = routers.ffn[0]
    picked = rec["ffn"][0][0].reshape(-1, r.groups)
    assert all(any(torch.equal(m, p) for p in r.prototypes > 0) for m in picked)


def test_codebook_checkpoint_without_tilt_loads_with_tilt_zero(tmp_path):
    """Codebook checkpoints saved before the width tilt existed load with tilt 0 (the same picks)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    model = tiny_model("llama")
    routers = codebook_routers(model, CB, 5)
    routers.save(tmp_path / "cb.safetensors")
    with safe_open(str(tmp_path / "cb.safetensors"), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys() if not k.endswith(".tilt")}
    save_file(tensors, str(tmp_path / "old.safetensors"), metadata=meta)
    loaded = wc.Routers.load(tmp_path / "old.safetensors", model)
    assert all(float(r.tilt) == 0.0 for r in every_router(loaded))
    h = torch.randn(3, 5, 64)
    assert torch.equal(loaded.ffn[0](h), routers.ffn[0](h))
