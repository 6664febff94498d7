"""passes/sum_routers.py: in graphs of decode size each unfused linear / pair router becomes one
multiply-and-sum (router_fns.summed_linear_router_mask) and the logits stay the eager reference's; larger graphs,
SiLU-MLP routers and routers fused into their norm are left as they are."""
import pytest
import torch

import wide_compile as wc
from wide_compile.kernels.tuning import DECODE_T
from wide_compile.models import tiny_model
from wide_compile.passes import PassManager, op_counts
from wide_compile.routing import router_fns as fns

from test_passes_models import attach_random_routers, capture, gptfast_pair, run_logits


def _run(recipe, T, hidden=0, fuse=False, batch=1, summed=True, compose=True):
    model = tiny_model("llama")
    attach_random_routers(model, recipe, hidden)
    ids = torch.randint(0, 128, (batch, T))
    (gm, ex), = capture(model, input_ids=ids)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    ctx = PassManager(sum_routers=summed, fuse_norm_router=fuse, compose_routers=compose).run(gm, ex)
    torch.testing.assert_close(run_logits(gm, ex, ref), ref, atol=1e-5, rtol=1e-5)
    return op_counts(gm), ctx, model.config.num_hidden_layers


@pytest.mark.parametrize("recipe,compose", [("linear", True), ("wide", True), ("wide", False)])
@pytest.mark.parametrize("T,batch", [(1, 1), (3, 2)])
def test_decode_size_routers_are_summed(recipe, compose, T, batch):
    """Linear routers and the method's pair routers (composed first, by compose_routers or by this pass): one
    summed router per block, no router linears or thresholds left."""
    c, ctx, L = _run(recipe, T, batch=batch, compose=compose)
    assert ctx.report.counts["sum_routers.summed"] == 2 * L == c.get("summed_linear_router_mask", 0)
    assert c.get("gt", 0) == 0 and c.get("unflatten", 0) == 0


def test_prefill_size_and_mlp_routers_keep_their_gemm():
    c, ctx, _ = _run("linear", DECODE_T + 1)
    assert ctx.report.counts["sum_routers.summed"] == 0 and c.get("summed_linear_router_mask", 0) == 0
    c, ctx, _ = _run("linear", 1, hidden=8)  # a SiLU between the layers: not one reduction
    assert ctx.report.counts["sum_routers.summed"] == 0


def test_routers_fused_into_their_norms_stay_fused():
    c, ctx, L = _run("linear", 1, fuse=True)
    assert ctx.report.counts["fuse_norm_router.fused"] == 2 * L and ctx.report.counts["sum_routers.summed"] == 0


def test_prefill_option_fuses_prefills_and_leaves_decode_to_sum_routers():
    """fuse_norm_router="prefill": a decode-size graph's routers are summed, not fused; a larger graph's fuse."""
    c, ctx, L = _run("wide", 1, fuse="prefill")
    assert ctx.report.counts["fuse_norm_router.fused"] == 0 and ctx.report.counts["sum_routers.summed"] == 2 * L
    assert ctx.report.counts["fuse_norm_router.decode_kept"] == 2 * L
    c, ctx, L = _run("wide", DECODE_T + 1, fuse="prefill")
    assert ctx.report.counts["fuse_norm_router.fused"] == 2 * L and ctx.report.counts["sum_routers.summed"] == 0
    assert c.get("wide_add_rmsnorm_router_nd", 0) + c.get("wide_rmsnorm_router_nd", 0) == 2 * L


def test_fuse_norm_router_option_is_checked():
    with pytest.raises(ValueError, match="fuse_norm_router must be one of True, False, 'prefill'"):
        PassManager(fuse_norm_router="decode")
    with pytest.raises(ValueError, match="fuse_norm_router must be"):
        wc.optimize(tiny_model("llama"), wc.Routers.init(tiny_model("llama"), wc.WideConfig(router_init="random")),
                    fuse_norm_router="always")


def test_inserted_routers_in_a_dense_gptfast_graph_are_summed():
    model, ref = gptfast_pair(seed=4)
    cfg = wc.WideConfig(ffn_group_size=32, head_group_size=1, router_init="random")
    routers = wc.Routers.init(model.spec, cfg, seed=5)
    ref.ref_routers = routers
    idx = torch.randint(0, 128, (1, 1))
    (gm, ex), = capture(model, idx)
    ctx = PassManager(sum_routers=True).run(gm, ex, routers=routers)
    assert ctx.report.counts["sum_routers.summed"] == 4 and op_counts(gm).get("linear_router_mask", 0) == 0
    with torch.no_grad():
        expect = ref(idx)
    torch.testing.assert_close(run_logits(gm, ex, expect), expect, atol=1e-5, rtol=1e-5)


def test_summed_logits_are_the_linear_logits():
    """The same fp32 products, summed in another order: within fp32 rounding of the GEMM, in float64 exact."""
    g = torch.Generator().manual_seed(0)
    for shape, G, D, bias in [((1, 1), 5, 37, True), ((3, 2), 24, 576, False), ((1,), 1, 1, True)]:
        h = torch.randn(*shape, D, generator=g)
        w, b = torch.randn(G, D, generator=g), (torch.randn(G, generator=g) if bias else None)
        torch.testing.assert_close(fns.summed_linear_logits(h, w, b), fns.linear_logits(h, w, b), atol=1e-4,
                                   rtol=1e-5)
        h64, w64, b64 = h.double(), w.double(), (b.double() if bias else None)
        torch.testing.assert_close(fns.summed_linear_logits(h64, w64, b64), fns.linear_logits(h64, w64, b64),
                                   atol=1e-12, rtol=1e-12)
        assert torch.equal(fns.summed_linear_router_mask(h64, w64, b64), fns.linear_router_mask(h64, w64, b64))
