"""passes/split_routers.py (optimize(..., router_dtype="bf16x2")): in bf16 graphs of more than DECODE_T tokens each
linear router, composed pair routers included, runs as router_fns.split_router_mask over its weight as a bf16 pair.
The maths against the float64 pair margin (within 2^-14 of the sum of |products|); the pass by op counts (smaller
graphs, fp32 graphs and the option off are left alone) and by the graph's logits against the eager two-layer
reference (bf16: 2e-2). fuse_router_gemm (default), which takes prefill-size routers first, is off here."""
import pytest
import torch

import wide_compile as wc
from wide_compile.kernels.tuning import DECODE_T
from wide_compile.models import tiny_model
from wide_compile.passes import PassManager, op_counts

from test_passes_models import attach_random_routers, capture, run_logits


def _pair_tensors(D, R, G, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(R, D, generator=g) * 0.2, torch.randn(R, generator=g) * 0.5,
            torch.randn(2 * G, R, generator=g) * 0.2, torch.randn(2 * G, generator=g) * 0.5)


@pytest.mark.parametrize("pad_to", [1, 4])
@pytest.mark.parametrize("T,D,R,G", [(1, 64, 32, 4), (33, 96, 16, 9), (200, 576, 32, 24)])
def test_split_composed_logits_are_the_pair_margin(T, D, R, G, pad_to):
    """The composed weight as a bf16 pair over bf16 inputs (router_fns.split_logits) against the two-layer margin
    in float64: within 2^-14 of the sum of |products| (the pair holds W to about 2^-16; fp32 accumulation), and
    every decision whose margin is clear of that bound agrees."""
    from wide_compile.kernels.norm_router import compose_pair
    from wide_compile.routing import router_fns as fns
    from wide_compile.routing.routers import split_bf16

    wd, bd, wu, bu = _pair_tensors(D, R, G, seed=T)
    h = torch.randn(T, D, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    w, c = compose_pair(wd, bd, wu, bu)
    w2 = split_bf16(w, pad_to=pad_to)
    assert w2.shape == (2 * (-(-G // pad_to) * pad_to), D)
    got = fns.split_logits(h, w2, c).double()
    want = fns.pair_margin(h.double(), wd.double(), bd.double(), wu.double(), bu.double())
    bound = 2.0 ** -14 * ((h.double().abs() @ w.double().abs().t()) + c.double().abs())
    assert ((got - want).abs() <= bound).all(), float(((got - want).abs() / bound).max())
    clear = want.abs() > bound
    assert torch.equal((got > 0)[clear], (want > 0)[clear]) and clear.float().mean() > 0.99


@pytest.mark.parametrize("recipe", ["wide", "linear"])
@pytest.mark.parametrize("T,dtype,split,on", [(DECODE_T + 1, torch.bfloat16, True, True),
                                              (3, torch.bfloat16, False, True),
                                              (DECODE_T + 1, torch.float32, False, True),
                                              (DECODE_T + 1, torch.bfloat16, False, False)])
def test_routers_split_in_bf16_graphs_of_prefill_size(recipe, T, dtype, split, on):
    """Pair routers (composed first) and linear routers: split in a bf16 graph of more than DECODE_T tokens, left
    in smaller graphs (summed there), fp32 graphs and with the option off."""
    model = tiny_model("llama").to(dtype)
    attach_random_routers(model, recipe)
    ids = torch.randint(0, 128, (1, T))
    (gm, ex), = capture(model, input_ids=ids)
    ctx = PassManager(split_routers=on, fuse_router_gemm=False).run(gm, ex)
    L = model.config.num_hidden_layers
    c = op_counts(gm)
    assert ctx.report.counts["split_routers.split"] == c.get("split_router_mask", 0) == (2 * L if split else 0)
    if split:
        assert c.get("linear_router_mask", 0) == 0
        assert not [n for n in gm.graph.nodes if n.op == "get_attr" and str(n.target).startswith("_wide_router_w_")]
        assert "on tensor cores over a bf16 pair" in str(ctx.report)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(run_logits(gm, ex, ref), ref, atol=tol, rtol=tol)


def test_optimize_bf16x2_splits_pair_routers_through_inductor():
    """optimize(..., router_dtype="bf16x2") on a bf16 model with pair routers, through Inductor on the CPU: the
    prefill-size graph's routers run split and the logits stay the eager reference's (bf16: 5e-2)."""
    torch._dynamo.reset()
    model, ref = tiny_model("llama").to(torch.bfloat16), tiny_model("llama").to(torch.bfloat16)
    cfg = wc.WideConfig(ffn_group_size=32, head_group_size=1, router_init="random", router_recipe="wide")
    routers = wc.Routers.init(model, cfg, seed=5)
    wc.attach(ref, routers)
    ids = torch.randint(0, 128, (1, DECODE_T + 4))
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        got = wc.optimize(model, routers, router_dtype="bf16x2", fuse_router_gemm=False)(input_ids=ids).logits
    torch.testing.assert_close(got.float(), want.float(), atol=5e-2, rtol=5e-2)
    L = model.config.num_hidden_layers
    assert sum(r.counts.get("split_routers.split", 0) for r in model._wide_reports) == 2 * L


@pytest.mark.parametrize("fuse", [True, "prefill"])
def test_routers_fused_into_their_norms_are_not_split(fuse):
    """fuse_norm_router runs before split_routers: in a bf16 prefill-size graph every router fuses into its norm
    (the fused kernel runs its own tensor-core tiles there) and none is split."""
    model = tiny_model("llama").to(torch.bfloat16)
    attach_random_routers(model, "wide")
    ids = torch.randint(0, 128, (1, DECODE_T + 1))
    (gm, ex), = capture(model, input_ids=ids)
    ctx = PassManager(fuse_norm_router=fuse, fuse_router_gemm=False).run(gm, ex)
    L = model.config.num_hidden_layers
    assert ctx.report.counts["fuse_norm_router.fused"] == 2 * L
    assert ctx.report.counts["split_routers.split"] == 0 == op_counts(gm).get("split_router_mask", 0)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    torch.testing.assert_close(run_logits(gm, ex, ref), ref, atol=2e-2, rtol=2e-2)


def test_split_halves_are_padded_to_an_aligned_gemm():
    """The pass pads each half of the pair to a multiple of PAD_GROUPS rows (the GEMM's N a multiple of 8); a
    router without a bias gets a zero one (its length says G); the logits stay the eager reference's."""
    from wide_compile.passes.split_routers import PAD_GROUPS

    model = tiny_model("llama").to(torch.bfloat16)
    attach_random_routers(model, "linear")
    ids = torch.randint(0, 128, (1, DECODE_T + 1))
    (gm, ex), = capture(model, input_ids=ids)
    PassManager().run(gm, ex)
    from wide_compile.passes._graph import meta

    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target.__name__ == "split_router_mask"]
    assert calls
    padded = 0
    for n in calls:
        w2, G = getattr(gm, n.args[1].target), meta(n.args[2]).shape[0]
        assert w2.shape[0] % (2 * PAD_GROUPS) == 0 and w2.shape[0] // 2 >= G
        Gp = w2.shape[0] // 2
        assert (w2[G:Gp] == 0).all() and (w2[Gp + G:] == 0).all()
        padded += Gp > G
    assert padded  # some router's groups are not a multiple of PAD_GROUPS
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    torch.testing.assert_close(run_logits(gm, ex, ref), ref, atol=2e-2, rtol=2e-2)
