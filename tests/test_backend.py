"""The `wide` backend end to end on the CPU (Inductor): torch.compile(backend="wide"), optimize(), generate()
with a static cache and padded batches, dynamic shapes without a recompile per length, errors, explain."""
from __future__ import annotations

import importlib.metadata

import pytest
import torch

import wide_compile as wc
from wide_compile.backend import wide_backend
from wide_compile.models import tiny_model
from wide_compile.passes import counters

from test_passes_models import CFG, GptFast, gptfast_pair  # noqa: F401  (the gpt-fast-style Llama)


def pair(arch="llama", seed=0, routers_seed=1, **kw):
    """(model to compile, eager reference) with the same weights and the same routers attached to the reference."""
    model, ref = tiny_model(arch, seed=seed, **kw), tiny_model(arch, seed=seed, **kw)
    routers = wc.Routers.init(model, CFG, seed=routers_seed)
    wc.attach(ref, routers)
    return model, ref, routers


def test_backend_registered_and_entry_point():
    import wide_compile.backend  # noqa: F401

    assert torch._dynamo.lookup_backend("wide") is wide_backend
    eps = importlib.metadata.entry_points(group="torch_dynamo_backends")
    assert any(e.name == "wide" and e.value == "wide_compile.backend:wide_backend" for e in eps)


def test_torch_compile_backend_wide_attached():
    model, ref, routers = pair("llama")
    wc.attach(model, routers)
    torch._dynamo.reset()  # no frames compiled by earlier tests: exactly one compile below, whatever ran before
    c0 = counters()["rewrite_mlp.rewritten"]
    cm = torch.compile(model, backend="wide")
    ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(cm(input_ids=ids).logits, ref(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
    assert counters()["rewrite_mlp.rewritten"] - c0 == 2


@pytest.mark.parametrize("arch,inductor", [("qwen2", False), ("smollm2", False), ("mistral", False),
                                          pytest.param("qwen2", True, marks=pytest.mark.slow),
                                          pytest.param("smollm2", True, marks=pytest.mark.slow),
                                          pytest.param("mistral", True, marks=pytest.mark.slow)])
def test_optimize_each_arch(arch, inductor):
    """inductor=False runs the rewritten graph's Python code (the pass result) without Inductor: fast in CI."""
    model, ref, routers = pair(arch, routers_seed=2)
    cm = wc.optimize(model, routers, inductor=inductor)
    assert cm is model and wc.is_attached(model)
    ids = torch.randint(0, 128, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(cm(input_ids=ids).logits, ref(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
    ex = wc.explain(cm)
    assert ex.layers and len(ex.layers) % 2 == 0  # 2 layers per compiled graph
    assert all(r["mlp"]["status"] == "rewritten" and r["attn"]["status"] == "rewritten" for r in ex.layers)
    assert "layer   0: attention rewritten" in str(ex)


def test_optimize_constant_masks_matches_zeroed_dense_oracle():
    """DESIGN oracle: constant masks == dense model with inactive down_proj / o_proj columns zeroed."""
    model, oracle = tiny_model("llama", seed=3), tiny_model("llama", seed=3)
    spec = wc.models.model_spec(model)
    ga, gf = CFG.num_head_groups(spec), CFG.num_ffn_groups(spec)
    assert ga == 4  # the hand-written attention masks below have one entry per head group
    attn = [torch.tensor([1, 0, 1, 0], dtype=torch.bool), torch.tensor([0, 1, 1, 1], dtype=torch.bool)]
    ffn = [torch.arange(gf) % 3 != 0, torch.arange(gf) % 2 == 0]
    routers = wc.Routers.constant(model, CFG, attn=attn, ffn=ffn)
    with torch.no_grad():
        for i, layer in enumerate(oracle.model.layers):
            layer.mlp.down_proj.weight[:, ~ffn[i].repeat_interleave(CFG.ffn_group_size)] = 0
            layer.self_attn.o_proj.weight[:, ~attn[i].repeat_interleave(spec.head_dim)] = 0
    cm = wc.optimize(model, routers, inductor=False)
    ids = torch.randint(0, 128, (1, 10))
    with torch.no_grad():
        torch.testing.assert_close(cm(input_ids=ids).logits, oracle(input_ids=ids).logits, atol=1e-5, rtol=1e-5)


def test_optimize_gptfast_dense_graph():
    model, ref = gptfast_pair(seed=9)
    routers = wc.Routers.init(model.spec, CFG, seed=10)
    ref.ref_routers = routers
    cm = wc.optimize(model, routers, inductor=False)
    idx = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(cm(idx), ref(idx), atol=1e-5, rtol=1e-5)
    ex = wc.explain(cm)
    assert ex.graphs[0].form == "dense+routers" and len(ex.layers) == 2 * len(ex.graphs)
    assert ex.counts["insert_routers.inserted"] == 4 * len(ex.graphs)


@pytest.mark.slow
def test_optimize_gptfast_inductor():
    model, ref = gptfast_pair(seed=9)
    routers = wc.Routers.init(model.spec, CFG, seed=10)
    ref.ref_routers = routers
    cm = wc.optimize(model, routers)
    idx = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(cm(idx), ref(idx), atol=1e-5, rtol=1e-5)


def test_no_routers_is_a_clear_error():
    # earlier tests may have filled Dynamo's per-code recompile cache for LlamaForCausalLM.forward; past
    # that limit Dynamo runs frames eagerly and the backend (and its error) would never be reached
    torch._dynamo.reset()
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="no WIDE routers"):
        wc.optimize(model)
    with pytest.raises(Exception, match="no WIDE routers"):
        with torch.no_grad():
            torch.compile(model, backend="wide")(input_ids=torch.randint(0, 128, (1, 4)))


def test_explain_uncompiled_model():
    model, _, routers = pair("smollm2")
    wc.attach(model, routers)
    ex = wc.explain(model)
    assert len(ex.layers) == 2 and all(r["mlp"]["status"] == "rewritten" for r in ex.layers)
    assert ex.layers[0]["attn"]["groups"] == 6 and not ex.warnings


# ------------------------------------------------------------- one compiled model: generate + dynamic shapes
@pytest.fixture(scope="module")
def compiled_llama():
    model, ref, routers = pair("llama", seed=11, routers_seed=12)
    with torch.no_grad():  # calibrate to ~50% capacity so masks really vary per token
        routers.calibrate_(ref, torch.randint(0, 128, (4, 16)), capacity=0.5)
    return wc.optimize(model, routers), ref


def test_generate_static_cache_batch_padding(compiled_llama):
    cm, ref = compiled_llama
    torch.manual_seed(0)
    ids = torch.randint(1, 128, (2, 7))
    am = torch.ones_like(ids)
    am[1, :3] = 0  # left padding in the second row
    kw = dict(attention_mask=am, max_new_tokens=8, do_sample=False, cache_implementation="static", pad_token_id=0)
    with torch.no_grad():
        out = cm.generate(ids, **kw)
        expect = ref.generate(ids, **kw)
    assert torch.equal(out, expect)
    assert counters()["rewrite_mlp.rewritten"] > 0
    cap = wc.measure_capacity(ref, ids, attention_mask=am)
    assert 0.2 < cap["overall"] < 0.9


def test_dynamic_lengths_do_not_recompile_each_time(compiled_llama):
    cm, ref = compiled_llama
    seen = []
    c0 = counters()["compiled_graphs"]
    with torch.no_grad():
        for b in (1, 3):
            for s in range(2, 15):
                ids = torch.randint(0, 128, (b, s))
                out = cm(input_ids=ids).logits
                if s in (2, 14):
                    torch.testing.assert_close(out, ref(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
                seen.append((b, s))
    new = counters()["compiled_graphs"] - c0
    assert new <= 3, f"{new} graphs compiled for {len(seen)} shapes"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_replayed_masks_compiled_equals_eager(arch):
    """Masks recorded from live routers, replayed in the compiled model and in the eager reference: the
    comparison the GPU checks use to separate kernel/pass error from router flips near 0."""
    model, ref, routers = pair(arch, routers_seed=3)
    ids = torch.randint(0, 128, (2, 11))
    with torch.no_grad(), wc.routing.record_masks(ref) as rec:
        live = ref(input_ids=ids).logits
    replay = wc.Routers.replay(ref, CFG, rec)
    assert replay.kind == "replay" and replay.flops_per_token() == ([0] * 2, [0] * 2)
    wc.attach(ref, replay)
    with torch.no_grad():
        torch.testing.assert_close(ref(input_ids=ids).logits, live, atol=0, rtol=0)  # same masks, same math
    on = torch.cat([rec["ffn"][i][0].flatten() for i in range(2)])
    assert 0 < on.float().mean() < 1  # the recorded masks are mixed, so the check can fail
    cm = wc.optimize(model, replay, inductor=False)
    with torch.no_grad():
        torch.testing.assert_close(cm(input_ids=ids).logits, live, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="recorded on"):
        with torch.no_grad():
            ref(input_ids=ids[:, :5])
    with pytest.raises(ValueError, match="not saved"):
        replay.save("/tmp/never.safetensors")


def test_replayed_masks_dense_graph():
    """Form B (routers inserted into a dense graph): replayed masks become graph constants."""
    model, ref = gptfast_pair(seed=9)
    spec = model.spec
    ids = torch.randint(0, 128, (2, 6))
    g = torch.Generator().manual_seed(4)
    rec = {"attn": [[torch.rand(2, 6, CFG.num_head_groups(spec), generator=g) > 0.5] for _ in range(spec.num_layers)],
           "ffn": [[torch.rand(2, 6, CFG.num_ffn_groups(spec), generator=g) > 0.5] for _ in range(spec.num_layers)]}
    replay = wc.Routers.replay(spec, CFG, rec)
    ref.ref_routers = replay
    cm = wc.optimize(model, replay, inductor=False)
    with torch.no_grad():
        out, exp = cm(ids), ref(ids)
        torch.testing.assert_close(out, exp, atol=1e-5, rtol=1e-5)
        ref.ref_routers = wc.Routers.constant(spec, CFG, attn=[torch.ones(CFG.num_head_groups(spec), dtype=torch.bool)] * spec.num_layers,
                                              ffn=[torch.ones(CFG.num_ffn_groups(spec), dtype=torch.bool)] * spec.num_layers)
        assert (ref(ids) - exp).abs().max() > 1e-3  # the replayed masks matter


def test_bf16_routers_in_graph():
    """optimize(router_dtype=torch.bfloat16): the router GEMMs run in bf16 (tensor cores on the GPU) in the
    compiled graph exactly as in the eager reference, which shares the cast routers."""
    model, ref, routers = pair("llama", routers_seed=5)
    cm = wc.optimize(model, routers, inductor=False, router_dtype=torch.bfloat16)
    assert all(r.proj.weight.dtype == torch.bfloat16 for r in list(routers.attn) + list(routers.ffn))
    ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(cm(input_ids=ids).logits, ref(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
        m = wc.measure_capacity(ref, ids)["overall"]
    assert 0 < m < 1


def test_router_dtype_model_and_errors():
    model, ref, routers = pair("llama", routers_seed=6)
    wc.optimize(model, routers, inductor=False, router_dtype="model")  # fp32 model: stays fp32
    assert routers.attn[0].proj.weight.dtype == torch.float32
    with pytest.raises(ValueError, match="router_dtype"):
        wc.optimize(model, routers, inductor=False, router_dtype="half please")
    with pytest.raises(ValueError, match="floating-point"):
        wc.optimize(model, routers, inductor=False, router_dtype=torch.int8)


def test_static_cache_helper_generate(compiled_llama):
    """wc.static_cache: an early-allocated StaticCache; generate() with it == with a lazily allocated one."""
    cm, ref = compiled_llama
    ids = torch.randint(1, 128, (2, 7))
    cache = wc.static_cache(cm, 2, 20)
    assert cache.is_initialized if not callable(cache.is_initialized) else cache.is_initialized()
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        from wide_compile.api import cache_arg_name

        out = cm.generate(ids, **{cache_arg_name(ref): cache}, **kw)
        exp = ref.generate(ids, cache_implementation="static", **kw)
    assert torch.equal(out, exp)


def test_split_bf16_routers_keep_fp32_decisions():
    """Routers.split_bf16_: the fp32 weight as a bf16 pair, one bf16 GEMM with fp32 output. On bf16 inputs
    its logits equal the fp32 router's to ~1e-6 (the bf16-cast router's are ~1e-3 off), so decisions
    agree with fp32 where a bf16 cast flips some."""
    from wide_compile.routing.routers import GroupRouter, split_bf16, split_logits

    torch.manual_seed(0)
    r = GroupRouter(256, 64)
    w = r.proj.weight.detach()
    w2 = split_bf16(w)
    assert w2.dtype == torch.bfloat16 and w2.shape == (128, 256)
    assert ((w2[:64].float() + w2[64:].float()) - w).abs().max() <= w.abs().max() * 2 ** -15
    h = torch.randn(8192, 256).to(torch.bfloat16)
    with torch.no_grad():
        ref = (h.double() @ w.double().t() + r.proj.bias.double())  # fp64 of the fp32 router
        got = split_logits(h, w2, r.proj.bias).double()
        cast = torch.nn.functional.linear(h, w.to(torch.bfloat16), r.proj.bias.to(torch.bfloat16)).double()
    scale = ref.abs().mean()
    assert (got - ref).abs().max() < 1e-5 * scale * 16
    assert (cast - ref).abs().max() > 100 * (got - ref).abs().max()
    flips_split = ((got > 0) != (ref > 0)).sum().item()
    flips_cast = ((cast > 0) != (ref > 0)).sum().item()
    assert flips_split <= 1 and flips_cast > 10 * max(1, flips_split), (flips_split, flips_cast)


def test_split_bf16_routers_in_graph_form_a_and_b(monkeypatch):
    """optimize(router_dtype="bf16x2") on a bf16 model. Eager: the split routers make the fp32 routers'
    decisions on a real (tiny) model. Compiled: form A (attached routers) matches the eager reference to
    bf16 rounding of the layer ops; form B (gpt-fast, routers inserted into the dense graph) runs the split
    router function for every layer's two routers."""
    from wide_compile.routing import router_fns

    model, ref, routers = pair("llama", routers_seed=7, dtype=torch.bfloat16)
    ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad(), wc.routing.record_masks(ref) as fp32_masks:
        ref(input_ids=ids)
    cm = wc.optimize(model, routers, inductor=False, router_dtype="bf16x2")
    assert all(r.w_split is not None and r.proj.weight.dtype == torch.float32 for r in routers.attn)
    with torch.no_grad(), wc.routing.record_masks(ref) as split_masks:
        exp = ref(input_ids=ids).logits
    for k in ("attn", "ffn"):
        for a, b in zip(fp32_masks[k], split_masks[k]):
            assert torch.equal(a[0], b[0])
    with torch.no_grad():
        torch.testing.assert_close(cm(input_ids=ids).logits, exp, atol=3e-2, rtol=3e-2)

    calls = []
    orig = router_fns.split_router_mask
    monkeypatch.setattr(router_fns, "split_router_mask", lambda *a: calls.append(1) or orig(*a))
    g, gref = gptfast_pair(seed=3)
    g, gref = g.to(torch.bfloat16), gref.to(torch.bfloat16)
    rb = wc.Routers.init(g.spec, CFG, seed=8).split_bf16_()
    gref.ref_routers = rb
    cg = wc.optimize(g, rb, inductor=False)
    ids = torch.randint(0, 128, (2, 6))
    with torch.no_grad():
        cg(ids)  # compiles (tracing runs the function too)
        calls.clear()
        torch.testing.assert_close(cg(ids), gref(ids), atol=3e-2, rtol=3e-2)
    assert len(calls) == 2 * g.spec.num_layers  # one attention and one FFN router per layer, per run
    half = wc.Routers.init(g.spec, CFG, seed=8).to(torch.bfloat16)
    with pytest.raises(ValueError, match="fp32 router weights"):
        half.split_bf16_()


def test_split_bf16_routers_run_fp32_on_one_token(monkeypatch):
    """GroupRouter.split_for: a single token (batch-1 decode) runs the fp32 router, where the bf16 pair gains
    nothing (routers.SPLIT_MIN_ROWS), in eager and in the compiled graph alike; two or more tokens, or a
    symbolic token count, run the pair."""
    from wide_compile.routing import router_fns
    from wide_compile.routing.routers import SPLIT_MIN_ROWS, GroupRouter

    assert SPLIT_MIN_ROWS == 2
    r = GroupRouter(32, 4)
    assert r.split_for(torch.bfloat16) is None  # no pair yet
    g, gref = gptfast_pair(seed=3)
    g, gref = g.to(torch.bfloat16), gref.to(torch.bfloat16)
    rb = wc.Routers.init(g.spec, CFG, seed=8).split_bf16_()
    r0 = rb.ffn[0]
    assert r0.split_for(torch.bfloat16) is r0.w_split  # unknown token count: the pair
    assert r0.split_for(torch.bfloat16, 1) is None and r0.split_for(torch.bfloat16, 2) is r0.w_split
    assert r0.split_for(torch.float32, 8) is None  # fp32 inputs: the fp32 router

    seen = {"split": 0, "fp32": 0}
    split_orig, lin_orig = router_fns.split_router_mask, router_fns.linear_router_mask
    monkeypatch.setattr(router_fns, "split_router_mask",
                        lambda *a: seen.__setitem__("split", seen["split"] + 1) or split_orig(*a))
    monkeypatch.setattr(router_fns, "linear_router_mask",
                        lambda *a: seen.__setitem__("fp32", seen["fp32"] + 1) or lin_orig(*a))
    gref.ref_routers = rb
    L = g.spec.num_layers
    for shape, kind in (((1, 1), "fp32"), ((2, 1), "split"), ((1, 5), "split")):
        torch._dynamo.reset()
        cg = wc.optimize(g, rb, inductor=False, dynamic=False)
        ids = torch.randint(0, 128, shape)
        with torch.no_grad():
            cg(ids)  # compiles
            seen.update(split=0, fp32=0)
            torch.testing.assert_close(cg(ids), gref(ids), atol=3e-2, rtol=3e-2)
        other = "split" if kind == "fp32" else "fp32"
        assert seen[kind] == 2 * L and seen[other] == 0, (shape, seen)


def test_split_logits_cuda_branch_traces_to_mm_dtype():
    """The CUDA branch (aten::mm.dtype: bf16 GEMM, fp32 output) traced with fake CUDA tensors, as Inductor
    traces it on the GPU (mm.dtype has no CPU kernel, so it cannot run here)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from wide_compile.routing.routers import split_logits

    with FakeTensorMode(allow_non_fake_inputs=True):
        h = torch.empty(2, 5, 64, device="cuda", dtype=torch.bfloat16)
        w2 = torch.empty(16, 64, device="cuda", dtype=torch.bfloat16)
        b = torch.empty(8, device="cuda", dtype=torch.float32)
    gm = make_fx(split_logits, tracing_mode="fake")(h, w2, b)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.mm.dtype in targets, targets
    out = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
    val = out[0].meta["val"] if isinstance(out, (list, tuple)) else out.meta["val"]
    assert val.dtype == torch.float32 and tuple(val.shape) == (2, 5, 8)


def test_optimize_kernel_config_is_kept_in_the_graph_and_bad_ones_are_one_error():
    model, ref, routers = pair("llama", routers_seed=3)
    over = {"decode": {"lists": "none"}, "prefill": {"group_g": 4}}
    cm = wc.optimize(model, routers, inductor=False, kernel_config=over)
    ids = torch.randint(0, 128, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(cm(input_ids=ids).logits, ref(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
    assert all(g.counts["rewrite_mlp.rewritten"] for g in wc.explain(cm).graphs)
    bad_model, _, bad_routers = pair("llama")
    with pytest.raises(ValueError, match="per-phase overrides"):
        wc.optimize(bad_model, bad_routers, inductor=False, kernel_config={"decod": {}})
