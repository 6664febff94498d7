"""passes/fuse_router_select.py: a split router read only by a dense-masked op's select runs inside that select;
and rewrite_mlp's fuse_gate_up (gate and up in one GEMM on the dense-masked path), which it composes with.
Op counts (vLLM style: split_router_mask, wide.o_proj and wide.mlp go, wide_routed_* come), which blocks are left
alone (compact paths, a mask with a second reader, decode-size graphs, the option off) and the graph's logits
against the unfused graph and the eager reference (bf16: 5e-2), without Inductor and through it on the CPU."""
import pytest
import torch

import wide_compile as wc
from wide_compile.kernels.tuning import DECODE_T
from wide_compile.models import tiny_model
from wide_compile.passes import PassManager, op_counts

from test_passes_models import attach_random_routers, capture, run_logits

KEYS = ("wide_routed_o_proj_nd", "wide_routed_mlp_nd", "wide_o_proj_nd", "wide_mlp_nd", "split_router_mask",
        "wide_attn_prefill_nd", "wide_mlp_gate_up_nd")


def compile_counts(T, recipe="wide", dtype=torch.bfloat16, arch="smollm2", **pm):
    """The pass manager's graph with options pm, its op counts, report and layer count; its logits checked against
    the same graph with fuse_router_select off (the split routers' own decisions, which may differ from the eager
    fp32 routers' within rounding of 0: test_pass_split_routers) at 5e-2: the fused MLP rounds g and u to bf16 as
    the GPU's dense-masked GEMMs do, where the unfused graph's CPU reference keeps them in fp32."""
    model = tiny_model(arch).to(dtype)
    attach_random_routers(model, recipe)
    ids = torch.randint(0, 128, (1, T), generator=torch.Generator().manual_seed(T))
    path = pm.pop("kernel_path", "dense")
    (gm0, ex0), = capture(model, input_ids=ids)
    pm = {"fuse_router_gemm": False, **pm}  # it would take the routers first
    PassManager(**{**pm, "fuse_router_select": False, "fuse_gate_up": False}).run(gm0, ex0, kernel_path=path)
    (gm, ex), = capture(model, input_ids=ids)
    ctx = PassManager(**{"fuse_router_select": True, **pm}).run(gm, ex, kernel_path=path)
    with torch.no_grad():
        like = model(input_ids=ids).logits
    ref = run_logits(gm0, ex0, like)
    torch.testing.assert_close(run_logits(gm, ex, like), ref, atol=5e-2, rtol=5e-2)
    c = op_counts(gm)
    return {k: c.get(k, 0) for k in KEYS}, ctx, model.config.num_hidden_layers


@pytest.mark.parametrize("recipe", ["wide", "linear"])
@pytest.mark.parametrize("arch", ["smollm2", "llama"])
def test_dense_masked_blocks_compute_their_routers_in_the_select(recipe, arch):
    c, ctx, L = compile_counts(DECODE_T + 40, recipe, arch=arch)
    assert ctx.report.counts["fuse_router_select.fused"] == 2 * L
    assert c["wide_routed_o_proj_nd"] == c["wide_routed_mlp_nd"] == L
    assert c["wide_o_proj_nd"] == c["wide_mlp_nd"] == c["split_router_mask"] == 0
    assert "computed in its dense-masked op's select" in str(ctx.report)


@pytest.mark.parametrize("T,dtype,on,path", [(DECODE_T + 40, torch.bfloat16, False, "dense"),
                                             (DECODE_T, torch.bfloat16, True, "dense"),
                                             (DECODE_T + 40, torch.float32, True, "dense"),
                                             (DECODE_T + 40, torch.bfloat16, True, "compact")])
def test_left_alone(T, dtype, on, path):
    """The option off; a decode-size graph (routers summed, not split); an fp32 graph (not split); compact paths
    (the mask feeds the sorted kernels): no router moves into a select."""
    c, ctx, L = compile_counts(T, dtype=dtype, fuse_router_select=on, kernel_path=path)
    assert ctx.report.counts.get("fuse_router_select.fused", 0) == 0
    assert c["wide_routed_o_proj_nd"] == c["wide_routed_mlp_nd"] == 0


def test_a_mask_with_a_second_reader_keeps_its_router():
    """Attention over the active heads reads the attention mask too: that router stays a node of its own (computing
    it twice would cost what fusing saves); the MLP's moves into its select."""
    c, ctx, L = compile_counts(DECODE_T + 40, sparse_attention=True)
    assert c["wide_attn_prefill_nd"] == L
    assert c["wide_routed_mlp_nd"] == L and c["wide_routed_o_proj_nd"] == 0
    assert c["split_router_mask"] == L and c["wide_o_proj_nd"] == L
    assert ctx.report.counts["fuse_router_select.fused"] == L


def test_optimize_through_inductor_on_the_cpu():
    """optimize(..., kernel_path="dense") on a bf16 model: the prefill-size graph's routers run in their selects and
    the logits stay the eager reference's (bf16: 5e-2); without the option (the default) they stay out."""
    torch._dynamo.reset()
    model, ref = tiny_model("smollm2").to(torch.bfloat16), tiny_model("smollm2").to(torch.bfloat16)
    ref.load_state_dict(model.state_dict())
    cfg = wc.WideConfig(ffn_group_size=32, head_group_size=1, router_init="random", router_recipe="wide")
    routers = wc.Routers.init(model, cfg, seed=5)
    wc.attach(ref, routers)
    ids = torch.randint(0, 128, (1, DECODE_T + 4))
    L = model.config.num_hidden_layers
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        got = wc.optimize(model, routers, kernel_path="dense", fuse_router_select=True,
                          fuse_router_gemm=False)(input_ids=ids).logits
    torch.testing.assert_close(got.float(), want.float(), atol=5e-2, rtol=5e-2)
    assert sum(r.counts.get("fuse_router_select.fused", 0) for r in model._wide_reports) == 2 * L
    torch._dynamo.reset()
    off = tiny_model("smollm2").to(torch.bfloat16)
    off.load_state_dict(ref.state_dict(), strict=False)
    with torch.no_grad():
        got = wc.optimize(off, routers, kernel_path="dense", fuse_router_gemm=False)(input_ids=ids).logits
    torch.testing.assert_close(got.float(), want.float(), atol=5e-2, rtol=5e-2)
    assert sum(r.counts.get("fuse_router_select.fused", 0) for r in off._wide_reports) == 0


@pytest.mark.parametrize("select", [False, True])
def test_gate_and_up_in_one_gemm_on_the_dense_path(select):
    """fuse_gate_up: the dense-masked MLP runs one GEMM over [gate; up] (a graph constant) and, with
    fuse_router_select, its router in the select that reads both halves; logits as the unfused graph's."""
    c, ctx, L = compile_counts(DECODE_T + 40, fuse_gate_up=True, fuse_router_select=select)
    assert ctx.report.counts["rewrite_mlp.gate_up_fused"] == L and c["wide_mlp_nd"] == 0
    assert c["wide_routed_mlp_nd" if select else "wide_mlp_gate_up_nd"] == L
    assert "gate and up in one GEMM" in str(ctx.report)


def test_gate_and_up_stay_apart_on_compact_paths():
    c, ctx, L = compile_counts(DECODE_T + 40, fuse_gate_up=True, kernel_path="compact")
    assert ctx.report.counts.get("rewrite_mlp.gate_up_fused", 0) == 0 and c["wide_mlp_nd"] == L


def test_gate_up_ops_compute_the_dense_masked_mlp():
    """The graph-side ops against the reference MLP on random weights and masks (fp32: 1e-5), and the routed form
    against the unfused gate / up one (bf16, the same split router: 1e-2)."""
    from wide_compile.kernels.reference import mlp_ref
    from wide_compile.passes._ops import wide_mlp_gate_up_nd, wide_routed_mlp_nd
    from wide_compile.routing.routers import split_bf16

    g = torch.Generator().manual_seed(0)
    T, D, F, GS = 23, 48, 96, 16
    x, wg, wu = torch.randn(1, T, D, generator=g), torch.randn(F, D, generator=g), torch.randn(F, D, generator=g)
    wdt = torch.randn(F, D, generator=g)
    mask = torch.rand(1, T, F // GS, generator=g) < 0.5
    got = wide_mlp_gate_up_nd(x, torch.cat([wg, wu]), wdt, mask, GS)
    torch.testing.assert_close(got[0], mlp_ref(x[0], wg, wu, wdt, mask[0], GS), atol=1e-4, rtol=1e-5)
    xb, wgb, wub, wdb = (t.to(torch.bfloat16) for t in (x, wg, wu, wdt))
    w2, b = split_bf16(torch.randn(F // GS, D, generator=g), pad_to=4), torch.randn(F // GS, generator=g)
    want = wide_routed_mlp_nd(xb, wgb, wub, wdb, xb, w2, b, GS)
    got = wide_routed_mlp_nd(xb, torch.cat([wgb, wub]), None, wdb, xb, w2, b, GS)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)
