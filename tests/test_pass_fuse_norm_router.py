"""passes/fuse_norm_router.py: op counts before / after (vLLM style: the norm's rsqrt and the router's
linears go, one wide.rmsnorm_router per routed block comes) and outputs equal to the eager reference, for
routers traced (attached) and inserted (gpt-fast-style dense graph), reading the normed input or the residual
stream; router kinds that cannot fuse are left as they are, with the reason in the report."""
import pytest
import torch

import wide_compile as wc
from wide_compile.models import tiny_model
from wide_compile.passes import PassManager, op_counts

from test_passes_models import CFG, capture, gptfast_pair, run_logits


def counts(gm):
    c = op_counts(gm)
    out = {k: c.get(k, 0) for k in ("wide_rmsnorm_router_nd", "wide_add_rmsnorm_router_nd", "rsqrt", "linear", "gt",
                                    "linear_router_mask", "pair_router_mask", "mlp_router_mask", "add")}
    out["fused"] = out["wide_rmsnorm_router_nd"] + out["wide_add_rmsnorm_router_nd"]
    return out


def compile_and_compare(model, ids, fuse=True):
    (gm, ex), = capture(model, input_ids=ids)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    before = counts(gm)
    ctx = PassManager(fuse_norm_router=fuse).run(gm, ex)
    torch.testing.assert_close(run_logits(gm, ex, ref), ref, atol=1e-5, rtol=1e-5)
    return before, counts(gm), ctx


@pytest.mark.parametrize("recipe,hidden", [("linear", 0), ("linear", 8), ("wide", 0)])
@pytest.mark.parametrize("router_input", ["normed", "residual"])
def test_attached_routers_fuse_into_the_norms(recipe, hidden, router_input):
    model = tiny_model("llama")
    L = model.config.num_hidden_layers
    cfg = wc.WideConfig(ffn_group_size=32, head_group_size=1, router_init="random", router_recipe=recipe,
                        router_hidden=hidden, router_input=router_input)
    wc.attach(model, wc.Routers.init(model, cfg, seed=3))
    before, after, ctx = compile_and_compare(model, torch.randint(0, 128, (2, 7)))
    # per router: 1 (linear), 2 (pair, SiLU-MLP) router linears; the final norm stays
    per = 1 if recipe == "linear" and not hidden else 2
    assert after["fused"] == 2 * L and ctx.report.counts["fuse_norm_router.fused"] == 2 * L
    # every norm but the first layer's (its input is the embedding) takes the residual add before it
    assert after["wide_add_rmsnorm_router_nd"] == 2 * L - 1 == ctx.report.counts["fuse_norm_router.residual_add"]
    assert after["add"] == before["add"] - (2 * L - 1) - 2 * L  # those adds, and each fused norm's + eps
    # every router runs as one linear map: a pair router (recipe "wide") composed at compile time
    kinds = {n.args[5 if n.target.__name__.startswith("wide_add") else 4] for n in ctx.gm.graph.nodes
             if n.op == "call_function" and "rmsnorm_router" in getattr(n.target, "__name__", "")}
    assert kinds == ({"mlp"} if hidden else {"linear"})
    assert after["rsqrt"] == before["rsqrt"] - 2 * L == 1
    # and o, gate, up, down -> wide ops; q, k and v -> one linear (14 tokens run q on the dense path, which
    # leaves q unmasked: o's input mask routes the block)
    assert ctx.report.counts["rewrite_attention.qkv_fused"] == L == ctx.report.counts["rewrite_attention.q_unmasked"]
    assert after["linear"] == before["linear"] - 2 * L * per - 6 * L
    assert after["gt"] == 0


def test_without_the_option_nothing_is_fused():
    model = tiny_model("llama")
    wc.attach(model, wc.Routers.init(model, CFG, seed=3))
    before, after, _ = compile_and_compare(model, torch.randint(0, 128, (1, 3)), fuse=False)
    assert after["fused"] == 0 and after["rsqrt"] == before["rsqrt"]


def test_inserted_routers_fuse_in_a_dense_gptfast_graph():
    model, ref = gptfast_pair(seed=4)
    routers = wc.Routers.init(model.spec, CFG, seed=5)
    ref.ref_routers = routers
    idx = torch.randint(0, 128, (2, 6))
    (gm, ex), = capture(model, idx)
    ctx = PassManager(fuse_norm_router=True).run(gm, ex, routers=routers)
    c = counts(gm)
    assert c["fused"] == 4 and c["wide_add_rmsnorm_router_nd"] == 3 and c["linear_router_mask"] == 0 and c["rsqrt"] == 1
    with torch.no_grad():
        expect = ref(idx)
    torch.testing.assert_close(run_logits(gm, ex, expect), expect, atol=1e-5, rtol=1e-5)


def test_routers_that_cannot_fuse_are_left_with_the_reason():
    """Constant routers (masks that read no activation) and bf16 routers stay as they are."""
    model = tiny_model("llama")
    spec = wc.models.model_spec(model)
    ga, gf = CFG.num_head_groups(spec), CFG.num_ffn_groups(spec)
    wc.attach(model, wc.Routers.constant(model, CFG, attn=[torch.arange(ga) % 2 == 0] * spec.num_layers,
                                         ffn=[torch.arange(gf) % 3 == 0] * spec.num_layers))
    before, after, ctx = compile_and_compare(model, torch.randint(0, 128, (1, 5)))
    assert after["fused"] == 0 and after["rsqrt"] == before["rsqrt"]
    model = tiny_model("llama")
    wc.attach(model, wc.Routers.init(model, CFG, seed=3).to(torch.bfloat16))
    before, after, ctx = compile_and_compare(model, torch.randint(0, 128, (1, 5)))
    # per layer o, gate, up, down -> wide ops and k, v into q's linear (q on the dense path runs unmasked)
    assert after["fused"] == 0 and after["linear"] == before["linear"] - (4 + 2) * 2
    assert any("not float32" in u for u in ctx.report.unmatched)


def test_bf16_hf_norm_fuses_and_a_bf16_native_norm_does_not():
    """HF's norm upcasts to fp32 and rounds once, as the kernel does: it fuses (bf16 model, fp32 routers). The
    gpt-fast norm in bf16 computes its statistic in bf16, which the kernel does not: it is left."""
    model = tiny_model("llama", dtype=torch.bfloat16)
    wc.attach(model, wc.Routers.init(model, CFG, seed=3))
    (gm, ex), = capture(model, input_ids=torch.randint(0, 128, (1, 4)))
    PassManager(fuse_norm_router=True).run(gm, ex)
    assert counts(gm)["fused"] == 4
    model, _ = gptfast_pair(seed=4)
    model = model.to(torch.bfloat16)
    (gm, ex), = capture(model, torch.randint(0, 128, (1, 4)))
    ctx = PassManager(fuse_norm_router=True).run(gm, ex, routers=wc.Routers.init(model.spec, CFG, seed=5))
    assert counts(gm)["fused"] == 0
    assert sum("not an RMSNorm of the form" in u for u in ctx.report.unmatched) == 4


def test_compiled_through_inductor_matches_the_reference():
    """optimize(..., fuse_norm_router=True) through Inductor (the op's CPU body): the method's recipe (pair
    routers on the residual stream), logits equal to the eager reference; the report names the fusion."""
    model = tiny_model("llama")
    cfg = wc.WideConfig(ffn_group_size=32, head_group_size=1, router_init="random", router_recipe="wide")
    wc.attach(model, wc.Routers.init(model, cfg, seed=1))
    ids = torch.randint(0, 128, (1, 5))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    torch._dynamo.reset()
    cm = wc.optimize(model, fuse_norm_router=True, dynamic=False)
    with torch.no_grad():
        out = cm(input_ids=ids).logits
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert "with its norm in one wide.rmsnorm_router launch" in str(wc.explain(model))
