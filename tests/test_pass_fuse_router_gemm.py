"""passes/fuse_router_gemm.py (default; fuse_router_gemm=False turns it off): a linear router on the residual stream as
extra output columns of the GEMM that reads the block's RMSNorm output. Op counts (the router's own GEMM goes: no
split_router_mask / linear_router_mask is left, normed_router_mask comes), which blocks are left alone (the option
off, decode-size graphs, a norm weight with a zero, a router on the normalized input, compact paths), the margin
identity against float64, the graph's logits against the unfused graph's (fp32: 2e-4, the same decisions), its bf16
decisions against split_routers' (at least 97 % equal), and the logits against the eager reference through Inductor
on the CPU."""
import pytest
import torch

import wide_compile as wc
from wide_compile.kernels.tuning import DECODE_T
from wide_compile.models import tiny_model
from wide_compile.passes import PassManager, op_counts
from wide_compile.routing import router_fns as fns

from test_passes_models import attach_random_routers, capture, run_logits

KEYS = ("normed_router_mask", "split_router_mask", "linear_router_mask", "wide_mlp_down_nd", "wide_mlp_nd",
        "wide_mlp_gate_up_nd", "wide_o_proj_nd", "linear")


def build(T, dtype=torch.float32, arch="smollm2", recipe="wide", router_input="residual", seed=0):
    model = tiny_model(arch).to(dtype)
    attach_random_routers(model, recipe, router_input=router_input)
    ids = torch.randint(0, 128, (1, T), generator=torch.Generator().manual_seed(T + seed))
    return model, ids


def compile_pair(model, ids, path="dense", **pm):
    """(graph without the pass, graph with it): each with its example inputs and the pass context."""
    (gm0, ex0), = capture(model, input_ids=ids)
    PassManager(**{**pm, "fuse_router_gemm": False}).run(gm0, ex0, kernel_path=path)
    (gm, ex), = capture(model, input_ids=ids)
    ctx = PassManager(**{"fuse_router_gemm": True, **pm}).run(gm, ex, kernel_path=path)
    return (gm0, ex0), (gm, ex), ctx


def counts(gm):
    c = op_counts(gm)
    return {k: c.get(k, 0) for k in KEYS}


def masks_of(gm, ex, like, target):
    """The graph's router masks, in graph order, recorded while it runs."""
    got = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in target:
            n.target = _recording(n.target, got)
    run_logits(gm, ex, like)
    return got


def _recording(fn, out):
    def rec(*a):
        m = fn(*a)
        out.append(m)
        return m
    rec.__name__ = fn.__name__
    return rec


@pytest.mark.parametrize("arch", ["smollm2", "llama"])
@pytest.mark.parametrize("gate_up", [False, True])
def test_routers_become_projection_columns(arch, gate_up):
    model, ids = build(DECODE_T + 40, arch=arch)
    (gm0, ex0), (gm, ex), ctx = compile_pair(model, ids, fuse_gate_up=gate_up)
    L = model.config.num_hidden_layers
    c0, c = counts(gm0), counts(gm)
    assert ctx.report.counts["fuse_router_gemm.fused"] == 2 * L
    assert c["normed_router_mask"] == 2 * L and c["linear_router_mask"] == c["split_router_mask"] == 0
    assert c["wide_mlp_down_nd"] == L and c["wide_mlp_nd"] == c["wide_mlp_gate_up_nd"] == 0
    # the routers' own GEMMs (one per linear_router_mask) are gone; the only new linears are the MLPs' GEMMs over
    # [gate; up; router], which were inside their wide.mlp ops before
    assert c0["linear_router_mask"] == 2 * L and c["linear"] == c0["linear"] + L
    assert "columns of the projection GEMM after its norm" in str(ctx.report)
    with torch.no_grad():
        like = model(input_ids=ids).logits
    # fp32: the same decisions but for margins within rounding of 0, so the same logits
    torch.testing.assert_close(run_logits(gm, ex, like), run_logits(gm0, ex0, like), atol=2e-4, rtol=2e-4)


def test_margin_identity_against_float64():
    """normed_margin(n @ (W/g)^T, c, r) = r (W h + c) for n = g * h * r, against float64 on odd sizes (fp32: 1e-4),
    so its sign is the reference decision."""
    g = torch.Generator().manual_seed(0)
    T, D, G = 37, 53, 7
    h = torch.randn(T, D, generator=g, dtype=torch.float64) * 3
    gam = torch.rand(D, generator=g, dtype=torch.float64) + 0.2
    W, c = torch.randn(G, D, generator=g, dtype=torch.float64), torch.randn(G, generator=g, dtype=torch.float64)
    r = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
    n = (gam * (h * r)).float()
    z = n @ (W / gam).float().t()
    want = h @ W.t() + c
    got = fns.normed_margin(z, c.float(), r.float())
    torch.testing.assert_close(got.double(), r * want, atol=1e-4, rtol=1e-4)
    clear = (r * want).abs() > 1e-4  # decisions clear of the fp32 rounding of the margin
    assert torch.equal(fns.normed_router_mask(z, c.float(), r.float())[clear], (want > 0)[clear])
    assert torch.equal(fns.normed_margin(z, None, r.float()), z)


def test_bf16_decisions_agree_with_the_split_routers():
    """bf16: the router reads the norm's rounded output and leaves the GEMM rounded; at least 97 % of the decisions
    agree with split_routers' (the fp32 router up to 2^-16), the logits within bf16 tolerance of the eager model."""
    model, ids = build(DECODE_T + 90, dtype=torch.bfloat16)
    (gm0, ex0), (gm, ex), ctx = compile_pair(model, ids)
    with torch.no_grad():
        like = model(input_ids=ids).logits
    want = masks_of(gm0, ex0, like, {fns.split_router_mask})
    got = masks_of(gm, ex, like, {fns.normed_router_mask})
    assert len(want) == len(got) == 2 * model.config.num_hidden_layers
    agree = sum((a == b).sum().item() for a, b in zip(want, got)) / sum(a.numel() for a in want)
    assert agree >= 0.97, agree


@pytest.mark.parametrize("T,on,path,router_input", [(DECODE_T + 40, False, "dense", "residual"),
                                                    (DECODE_T, True, "dense", "residual"),
                                                    (DECODE_T + 40, True, "dense", "normed"),
                                                    (DECODE_T + 40, True, "compact", "residual")])
def test_left_alone(T, on, path, router_input):
    """The option off; a decode-size graph (routers summed); a router on the normalized input (its GEMM already
    reads n: nothing to gain from the identity); compact MLP paths (the mask feeds the sorted kernels first); the
    attention routers there still move where q's linear reads the norm."""
    model, ids = build(T, router_input=router_input)
    (gm0, ex0), (gm, ex), ctx = compile_pair(model, ids, path=path, fuse_router_gemm=on)
    fused = ctx.report.counts.get("fuse_router_gemm.fused", 0)
    L = model.config.num_hidden_layers
    if path == "compact" and on:
        assert counts(gm)["wide_mlp_nd"] == L and fused <= L
    else:
        assert fused == 0 and counts(gm)["normed_router_mask"] == 0


def test_a_norm_weight_with_a_zero_keeps_the_router():
    model, ids = build(DECODE_T + 40)
    with torch.no_grad():
        model.model.layers[0].post_attention_layernorm.weight[3] = 0.0
    (_, _), (gm, ex), ctx = compile_pair(model, ids)
    L = model.config.num_hidden_layers
    assert ctx.report.counts["fuse_router_gemm.fused"] == 2 * L - 1
    assert any("layer 0 mlp: router not in the projection GEMM: W / g is not finite" in u
               for u in ctx.report.unmatched)


@pytest.mark.parametrize("on", [True, False])
def test_optimize_through_inductor_on_the_cpu(on):
    """optimize(..., kernel_path="dense") on an fp32 model: by default the prefill graph's routers are projection
    columns, with fuse_router_gemm=False none is; the logits stay the eager reference's either way (fp32: 1e-3)."""
    torch._dynamo.reset()
    model, ref = tiny_model("smollm2"), tiny_model("smollm2")
    ref.load_state_dict(model.state_dict())
    cfg = wc.WideConfig(ffn_group_size=32, head_group_size=1, router_init="random", router_recipe="wide",
                        router_input="residual")
    routers = wc.Routers.init(model, cfg, seed=5)
    wc.attach(ref, routers)
    ids = torch.randint(0, 128, (1, DECODE_T + 4))
    L = model.config.num_hidden_layers
    opts = {} if on else {"fuse_router_gemm": False}
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        got = wc.optimize(model, routers, kernel_path="dense", **opts)(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
    assert sum(r.counts.get("fuse_router_gemm.fused", 0) for r in model._wide_reports) == (2 * L if on else 0)
    torch._dynamo.reset()


def test_norm_router_fusion_leaves_the_gemm_routers_alone():
    """fuse_norm_router=True with the pass on: the routers already in the projection GEMMs are not fused with their
    norm a second time (their router nodes are gone: a second fusion would read a stale router)."""
    model, ids = build(DECODE_T + 40)
    (gm0, ex0), (gm, ex), ctx = compile_pair(model, ids, fuse_norm_router=True)
    L = model.config.num_hidden_layers
    assert ctx.report.counts["fuse_router_gemm.fused"] == 2 * L
    assert ctx.report.counts["fuse_norm_router.fused"] == 0
    assert "wide.rmsnorm_router" not in str(ctx.report)
    with torch.no_grad():
        like = model(input_ids=ids).logits
    torch.testing.assert_close(run_logits(gm, ex, like), run_logits(gm0, ex0, like), atol=2e-4, rtol=2e-4)
