"""rewrite_attention's K / V fusion: where q's path at the graph's token count is the one-token GEMV or the
dense-masked GEMM (QKV_PATHS), q, K and V run in one launch over [q; k; v]: wide.q_proj with K / V's groups always
on (GEMV), or, on the dense path, where q needs no mask (o's input mask routes the block), one plain linear.
The graph loses the K / V linears and its logits stay the eager reference's (fp32: 1e-5; float64: 1e-12); tile
paths, fused qkv linears and fuse_qkv=False keep K / V as their own linears. The kernel itself (the one-token GEMV
over the concatenated weight, K / V's groups on) is checked against a float64 oracle under the interpreter."""
import pytest
import torch
from kernel_checks import DEV, needs_device

import wide_compile as wc
from wide_compile.kernels.compact_attn import q_proj_triton
from wide_compile.models import ARCHS, tiny_model
from wide_compile.passes import PassManager, op_counts

from test_passes_models import capture, run_logits

CFG = wc.WideConfig(ffn_group_size=32, head_group_size=1, router_init="random")


def _run(arch="llama", batch=1, T=1, kernel_path="auto", dtype=torch.float32, fuse_qkv=True, seed=3):
    model = tiny_model(arch, dtype=dtype)
    wc.attach(model, wc.Routers.init(model, CFG, seed=seed).to(dtype))
    ids = torch.randint(0, 128, (batch, T), generator=torch.Generator().manual_seed(seed))
    (gm, ex), = capture(model, input_ids=ids)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    before = op_counts(gm).get("linear", 0)
    # routers stay linears (sum_routers off): the counts below are of linears the projections lose
    ctx = PassManager(fuse_qkv=fuse_qkv, sum_routers=False).run(gm, ex, kernel_path=kernel_path, mask_stats=0.5)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(run_logits(gm, ex, ref), ref, atol=tol, rtol=tol)
    return ctx, before - op_counts(gm).get("linear", 0), model.config.num_hidden_layers


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("batch,T,path", [(1, 1, "gemv"), (2, 3, "dense_masked")])
def test_k_and_v_join_q_on_the_gemv_and_dense_masked_paths(arch, batch, T, path):
    """Every architecture (qwen2: q / k / v biases; smollm2: 3 q heads per KV head, odd head count): K and V
    leave the graph, o, gate, up, down become wide ops, and q one too on the GEMV (7 linears fewer per layer); on
    the dense path q, K and V are one unmasked linear (6 fewer)."""
    ctx, removed, L = _run(arch, batch, T, kernel_path="auto" if path == "gemv" else "dense")
    assert ctx.report.counts[f"cost_model.q.{path}"] == L
    unmasked = path == "dense_masked"
    assert ctx.report.counts["rewrite_attention.q_unmasked"] == (L if unmasked else 0)
    assert ctx.report.counts["rewrite_attention.qkv_fused"] == L and removed == (6 if unmasked else 7) * L
    assert all(a.kv_fused for a in ctx.attns) and all(d["kv_fused"] for d in ctx.report.attn)
    assert all("K/V dense (in q's launch)" in d["detail"] for d in ctx.report.attn)


def test_float64_logits_are_the_eager_logits():
    ctx, _, L = _run("qwen2", dtype=torch.float64)
    assert ctx.report.counts["rewrite_attention.qkv_fused"] == L


def test_tile_paths_and_the_option_keep_k_and_v_linears():
    ctx, removed, L = _run("smollm2", batch=2, T=3, kernel_path="compact")  # q on the tile gather
    assert ctx.report.counts["cost_model.q.gather"] == L
    assert ctx.report.counts["rewrite_attention.qkv_fused"] == 0 and removed == 5 * L
    ctx, removed, L = _run(fuse_qkv=False)
    assert ctx.report.counts["cost_model.q.gemv"] == L
    assert ctx.report.counts["rewrite_attention.qkv_fused"] == 0 and removed == 5 * L


def test_constant_masks_fuse_too():
    """A constant router's mask is a graph constant: padded like any other."""
    model = tiny_model("llama")
    spec = wc.models.model_spec(model)
    ga, gf = CFG.num_head_groups(spec), CFG.num_ffn_groups(spec)
    wc.attach(model, wc.Routers.constant(model, CFG, attn=[torch.arange(ga) % 2 == 1] * spec.num_layers,
                                         ffn=[torch.arange(gf) % 3 == 0] * spec.num_layers))
    ids = torch.randint(0, 128, (1, 1))
    (gm, ex), = capture(model, input_ids=ids)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    ctx = PassManager().run(gm, ex, mask_stats=0.5)
    assert ctx.report.counts["rewrite_attention.qkv_fused"] == spec.num_layers
    torch.testing.assert_close(run_logits(gm, ex, ref), ref, atol=1e-5, rtol=1e-5)


def test_compiled_by_inductor_on_the_cpu():
    """The padded mask and the column slices through Inductor (optimize, one-token decode graph)."""
    torch._dynamo.reset()
    model = tiny_model("smollm2")
    routers = wc.Routers.init(model, CFG, seed=5)
    ids = torch.randint(0, 128, (1, 1))
    wc.attach(model, routers)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    wc.detach(model)
    fast = wc.optimize(model, routers, dynamic=False, kernel_path="auto")
    with torch.no_grad():
        out = fast(input_ids=ids).logits
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert sum(r.counts.get("rewrite_attention.qkv_fused", 0) for r in fast._wide_reports) == 2


@needs_device
@pytest.mark.parametrize("kind", ["random", "off", "on", "one"])
@pytest.mark.parametrize("path", ["gemv", "dense", "decode", "sorted"])
def test_q_proj_runs_the_groups_past_its_mask_always_on(kind, path):
    """wide.q_proj's kernels on [q; k; v] (q: 5 groups of 16, k / v: 2 groups each) with a mask of q's 5 groups:
    the one-token GEMV, the dense-masked GEMM and both tile paths. q's inactive columns exactly 0, K / V's columns
    computed; within 1e-5 (relative L2) of float64, and each case equal to the same call with the mask padded."""
    g = torch.Generator().manual_seed(1)
    D, gs, Gq, Gkv = 40, 16, 5, 2
    T = 1 if path == "gemv" else 3
    bias = kind in ("random", "one")
    x = torch.randn(T, D, generator=g)
    w = [torch.randn(n * gs, D, generator=g) / D ** 0.5 for n in (Gq, Gkv, Gkv)]
    wqkv = torch.cat(w)
    bqkv = torch.randn(wqkv.shape[0], generator=g) if bias else None
    mask = {"random": torch.rand(T, Gq, generator=g) < 0.5, "off": torch.zeros(T, Gq, dtype=torch.bool),
            "on": torch.ones(T, Gq, dtype=torch.bool), "one": torch.arange(Gq).expand(T, Gq) == Gq - 1}[kind]
    cfg = {"one_token": "gemv"} if path == "gemv" else {"path": path}
    dev = [t.to(DEV) if t is not None else None for t in (x, wqkv, bqkv)]
    out = q_proj_triton(*dev, mask.to(DEV), gs, config=cfg).cpu()
    padded = torch.nn.functional.pad(mask, (0, 2 * Gkv), value=True)
    assert torch.equal(out, q_proj_triton(*dev, padded.to(DEV), gs, config=cfg).cpu())
    col_on = padded.repeat_interleave(gs, dim=1)
    expect = torch.nn.functional.linear(x.double(), wqkv.double(), None if bqkv is None else bqkv.double()) * col_on
    assert torch.equal(out[~col_on], torch.zeros(int((~col_on).sum())))
    err = (out.double() - expect).norm() / expect.norm()
    assert err <= 1e-5, err


def test_a_mask_wider_than_the_projection_is_refused():
    from wide_compile.kernels import wide_q_proj

    with pytest.raises(ValueError, match="at most Nq // group_size"):
        wide_q_proj(torch.randn(1, 8), torch.randn(32, 8), None, torch.ones(1, 3, dtype=torch.bool), 16)


@pytest.mark.parametrize("arch,structure", [("smollm2", "codebook"), ("qwen2", "nested")])
@pytest.mark.parametrize("T", [1, 2])
def test_structured_routers_fuse_k_and_v_at_one_token(arch, structure, T):
    """A codebook / nested router's q runs wide.q_proj_bucket; at one token (its one-token GEMV) K / V join it,
    at two tokens they stay linears. Logits equal the eager reference either way (fp32: 1e-5)."""
    cfg = wc.WideConfig(ffn_group_size=32, head_group_size=1, router_init="random", structure=structure,
                        codebook_size=5, nested_levels=3)
    model, ref = tiny_model(arch, seed=5), tiny_model(arch, seed=5)
    routers = wc.Routers.init(model, cfg, seed=6)
    wc.attach(ref, routers)
    fast = wc.optimize(model, routers, dynamic=False, inductor=False, bucket_ops=True)
    ids = torch.randint(0, 128, (1, T), generator=torch.Generator().manual_seed(T))
    with torch.no_grad():
        torch.testing.assert_close(fast(input_ids=ids).logits, ref(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
    ex = wc.explain(fast)
    L = routers.spec.num_layers
    assert ex.counts["rewrite_attention.q_bucket"] == L
    assert ex.counts.get("rewrite_attention.qkv_fused", 0) == (L if T == 1 else 0)


@needs_device
@pytest.mark.parametrize("path", ["gemv", "dense", "union", "lists"])
def test_q_proj_bucket_runs_the_groups_past_its_table_always_on(path):
    """wide.q_proj_bucket's paths (one-token GEMV, few tokens dense or as a union block, bucket lists) on
    [q; k; v] with a prototype table of q's 5 groups (P = 3, one prototype all off): equal to the same call with
    the table padded with K / V's groups on, and to float64 within 1e-5."""
    from wide_compile.kernels.bucket_attn import q_proj_bucket_triton

    g = torch.Generator().manual_seed(2)
    D, gs, Gq, Gkv = 40, 16, 5, 2
    T = {"gemv": 1, "dense": 4, "union": 4, "lists": 20}[path]
    x = torch.randn(T, D, generator=g)
    wqkv = torch.randn((Gq + 2 * Gkv) * gs, D, generator=g) / D ** 0.5
    b = torch.randn(wqkv.shape[0], generator=g)
    protos = torch.stack([torch.rand(Gq, generator=g) < 0.5, torch.zeros(Gq, dtype=torch.bool),
                          torch.ones(Gq, dtype=torch.bool)])
    bucket = torch.randint(0, 3, (T,), generator=g)
    cfg = {"gemv": {"one_token": "gemv"}, "dense": {"few_tokens": "dense"}, "union": {"few_tokens": "union"},
           "lists": {}}[path]
    args = [t.to(DEV) for t in (x, wqkv, b, bucket)]
    out = q_proj_bucket_triton(*args[:3], args[3], protos.to(DEV), gs, config=cfg).cpu()
    padded = torch.nn.functional.pad(protos, (0, 2 * Gkv), value=True)
    assert torch.equal(out, q_proj_bucket_triton(*args[:3], args[3], padded.to(DEV), gs, config=cfg).cpu())
    col_on = padded[bucket].repeat_interleave(gs, dim=1)
    expect = torch.nn.functional.linear(x.double(), wqkv.double(), b.double()) * col_on
    assert torch.equal(out[~col_on], torch.zeros(int((~col_on).sum())))
    assert (out.double() - expect).norm() / expect.norm() <= 1e-5
