"""passes/compose_routers.py: each of the method's pair routers becomes one linear router over its composed map
(router_fns.linear_router_mask), at every token count; the logits stay the two-layer eager reference's (fp32,
1e-5: the composition is built in float64, so the difference is fp32 rounding). compose_routers=False, linear
routers and SiLU-MLP routers are left as they are; the passes after it (fuse_norm_router, sum_routers) take the
composed router as a linear one."""
import pytest
import torch

import wide_compile as wc
from wide_compile.kernels.tuning import DECODE_T
from wide_compile.models import tiny_model
from wide_compile.passes import PassManager, op_counts

from test_passes_models import attach_random_routers, capture, run_logits


def _run(recipe, T, batch=1, hidden=0, **opts):
    """(op counts after the passes, their report counts, layers, op counts after the same passes without
    compose_routers) for a tiny Llama with random routers of `recipe` (biases random too: a wrong composed bias
    must show), checked against eager."""
    model = tiny_model("llama")
    attach_random_routers(model, recipe, hidden)
    ids = torch.randint(0, 128, (batch, T))
    (gm, ex), = capture(model, input_ids=ids)
    (gm0, ex0), = capture(model, input_ids=ids)
    opts = {"fuse_router_gemm": False, **opts}  # it would take the composed routers of prefill-size graphs
    PassManager(**{**opts, "compose_routers": False}).run(gm0, ex0)
    before = op_counts(gm0)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    ctx = PassManager(**opts).run(gm, ex)
    torch.testing.assert_close(run_logits(gm, ex, ref), ref, atol=1e-5, rtol=1e-5)
    return op_counts(gm), ctx.report.counts, model.config.num_hidden_layers, before


@pytest.mark.parametrize("T,batch", [(1, 1), (3, 2), (DECODE_T + 1, 1), (9, 3)])
def test_pair_routers_run_as_one_linear_map(T, batch):
    """One linear router per block at decode and prefill sizes (sum_routers off: it would sum the decode ones); each
    router's two linears and its (skip, execute) difference are gone."""
    c, counts, L, before = _run("wide", T, batch, sum_routers=False)
    assert counts["compose_routers.composed"] == 2 * L == c.get("linear_router_mask", 0)
    assert before["linear"] - c["linear"] == 2 * 2 * L  # two layers per router, two routers per layer


def test_off_keeps_the_two_layers():
    c, counts, L, before = _run("wide", DECODE_T + 1, compose_routers=False)
    assert counts["compose_routers.composed"] == 0 and c.get("linear_router_mask", 0) == 0
    assert c["linear"] == before["linear"]


@pytest.mark.parametrize("recipe,hidden", [("linear", 0), ("linear", 8)])
def test_linear_and_mlp_routers_are_left(recipe, hidden):
    c, counts, _, before = _run(recipe, DECODE_T + 1, hidden=hidden)
    assert counts["compose_routers.composed"] == 0 and c["linear"] == before["linear"]


def test_later_passes_take_the_composed_router():
    """fuse_norm_router fuses the composed (linear) router with its norm; sum_routers sums it at decode size."""
    _, counts, L, _ = _run("wide", 1, fuse_norm_router=True)
    assert counts["compose_routers.composed"] == 2 * L and counts["fuse_norm_router.fused"] == 2 * L
    c, counts, L, _ = _run("wide", 1, sum_routers=True)
    assert counts["compose_routers.composed"] == 2 * L == counts["sum_routers.summed"]
    assert c.get("summed_linear_router_mask", 0) == 2 * L and c.get("linear_router_mask", 0) == 0


def test_compiled_model_matches_eager():
    """optimize's default passes through Inductor on the CPU: the composed routers give the two-layer logits."""
    torch._dynamo.reset()
    model, ref = tiny_model("llama"), tiny_model("llama")
    cfg = wc.WideConfig(ffn_group_size=32, head_group_size=1, router_init="random", router_recipe="wide")
    routers = wc.Routers.init(model, cfg, seed=5)
    wc.attach(ref, routers)
    ids = torch.randint(0, 128, (2, 11))
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        got = wc.optimize(model, routers)(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert any(r.counts.get("compose_routers.composed") for r in model._wide_reports)
    assert "router: pair composed into one linear map" in str(wc.explain(model))

