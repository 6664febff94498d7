"""The pass on structured routers (passes/match_buckets.py, rewrite_mlp / rewrite_attention's bucket branch):
codebook and nested routers run wide.mlp_bucket / q_proj_bucket / o_proj_bucket, fed the router's own argmax
and its prototype table > 0, and the compiled model equals the eager WIDE reference (attach hooks).

Checks: compiled (optimize, torch.compile(backend="wide") without and with Inductor on the CPU) == eager, forms
A (attached) and B (gpt-fast graph, routers inserted); the op histogram of the rewritten graph (bucket ops for
every block, no free-mask op); the constant-prototype oracle (all-on == dense, all-off == the blocks' zero
contribution); the graph wrappers with int32 / int64 ids against the free-mask reference in float64; a block the
bucket ops refuse falls back to the free-mask ops on protos[bucket] with the reason in the report.
Tolerances: fp32 CPU runs the ops' PyTorch references, so compiled == eager to 1e-5 (Inductor: 1e-4, its fused
fp32 arithmetic reorders sums); float64 wrapper checks to 1e-10."""
from __future__ import annotations

import pytest
import torch

import wide_compile as wc
from wide_compile.models import decoder_layers, tiny_model
from wide_compile.passes import _ops
from wide_compile.kernels import reference as ref_ops

CB = wc.WideConfig(ffn_group_size=32, head_group_size=1, router_init="random", structure="codebook", codebook_size=5)
CB_WIDE = wc.WideConfig(ffn_group_size=32, head_group_size=1, router_init="random", structure="codebook",
                        codebook_size=4, router_recipe="wide", router_rank=8)
NEST = wc.WideConfig(ffn_group_size=32, head_group_size=1, router_init="random", structure="nested", nested_levels=3)
CFGS = {"codebook": CB, "codebook-wide": CB_WIDE, "nested": NEST}
BUCKET_OPS = ("wide_mlp_bucket_nd", "wide_q_proj_bucket_nd", "wide_o_proj_bucket_nd")
FREE_OPS = ("wide_mlp_nd", "wide_q_proj_nd", "wide_o_proj_nd")


def _eager_and_compiled(arch, cfg, seed=5, **opts):
    model, ref = tiny_model(arch, seed=seed), tiny_model(arch, seed=seed)
    routers = wc.Routers.init(model, cfg, seed=seed + 1)
    wc.attach(ref, routers)
    return ref, wc.optimize(model, routers, **opts), routers


def _ops_after(cm):
    ex = wc.explain(cm)
    c = sum((g.ops_after for g in ex.graphs), start=__import__("collections").Counter())
    return ex, {k: c.get(k, 0) for k in BUCKET_OPS + FREE_OPS}


@pytest.mark.parametrize("arch,name", [("smollm2", "codebook"), ("llama", "codebook-wide"), ("qwen2", "nested"),
                                       ("mistral", "nested")])
def test_optimize_runs_bucket_ops_and_equals_eager(arch, name):
    ref, cm, routers = _eager_and_compiled(arch, CFGS[name], inductor=False, bucket_ops=True)
    ids = torch.randint(0, 128, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(cm(input_ids=ids).logits, ref(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
    L = routers.spec.num_layers
    ex, ops = _ops_after(cm)
    assert ops == {"wide_mlp_bucket_nd": L, "wide_q_proj_bucket_nd": L, "wide_o_proj_bucket_nd": L,
                   "wide_mlp_nd": 0, "wide_q_proj_nd": 0, "wide_o_proj_nd": 0}
    for key in ("match_buckets.mlp", "match_buckets.attn", "rewrite_mlp.bucket", "rewrite_attention.o_bucket",
                "rewrite_attention.q_bucket"):
        assert ex.counts[key] == L, key
    for row in ex.layers:
        assert row["mlp"]["ops"] == {"mlp": "mlp_bucket"} and "wide.mlp_bucket" in row["mlp"]["detail"]
        assert row["attn"]["ops"] == {"o": "o_proj_bucket", "q": "q_proj_bucket"}


@pytest.mark.parametrize("name", ["codebook", "nested"])
def test_structured_routers_run_the_free_mask_ops_by_default(name):
    """Without bucket_ops the pass runs a structured router's blocks on the free-mask ops over protos[bucket] (the
    same masks), equal to the eager reference, and the report says why and how to get the bucket ops."""
    from wide_compile.passes.match_buckets import BUCKET_OPS_OFF

    ref, cm, routers = _eager_and_compiled("smollm2", CFGS[name], inductor=False)
    ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(cm(input_ids=ids).logits, ref(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
    ex, ops = _ops_after(cm)
    L = routers.spec.num_layers
    assert sum(ops[k] for k in BUCKET_OPS) == 0 and ops["wide_mlp_nd"] == L and ops["wide_o_proj_nd"] == L
    assert ex.counts["match_buckets.mlp"] == L  # found, then left on the free-mask ops
    assert ex.counts["rewrite_mlp.bucket_off"] == L and ex.counts["rewrite_attention.bucket_off"] == L
    assert all(BUCKET_OPS_OFF in r["mlp"]["detail"] and BUCKET_OPS_OFF in r["attn"]["detail"] for r in ex.layers)
    assert "bucket_ops=True" in BUCKET_OPS_OFF


def test_free_masks_stay_on_the_free_mask_ops():
    ref, cm, routers = _eager_and_compiled("smollm2", wc.WideConfig(ffn_group_size=32, head_group_size=1,
                                                                    router_init="random"), inductor=False)
    with torch.no_grad():
        cm(input_ids=torch.randint(0, 128, (2, 5)))
    ex, ops = _ops_after(cm)
    L = routers.spec.num_layers
    assert ops["wide_mlp_nd"] == L and ops["wide_o_proj_nd"] == L and sum(ops[k] for k in BUCKET_OPS) == 0
    assert ex.counts.get("match_buckets.mlp", 0) == 0 and all(r["mlp"]["ops"] == {"mlp": "mlp"} for r in ex.layers)


@pytest.mark.parametrize("name", ["codebook", "nested"])
def test_torch_compile_backend_wide_equals_eager(name):
    model, ref = tiny_model("smollm2", seed=3), tiny_model("smollm2", seed=3)
    routers = wc.Routers.init(model, CFGS[name], seed=4)
    wc.attach(ref, routers)
    wc.attach(model, routers)
    torch._dynamo.reset()
    cm = torch.compile(model, backend="wide", options={"inductor": False, "bucket_ops": True})
    ids = torch.randint(0, 128, (3, 9))
    with torch.no_grad():
        torch.testing.assert_close(cm(input_ids=ids).logits, ref(input_ids=ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["codebook", pytest.param("nested", marks=pytest.mark.slow)])
def test_torch_compile_with_inductor_on_cpu_equals_eager(name):
    """backend="wide" with Inductor (one decoder layer: Inductor's CPU compile is the slow part)."""
    model, ref = tiny_model("smollm2", seed=3, num_hidden_layers=1), tiny_model("smollm2", seed=3, num_hidden_layers=1)
    routers = wc.Routers.init(model, CFGS[name], seed=4)
    wc.attach(ref, routers)
    wc.attach(model, routers)
    torch._dynamo.reset()
    cm = torch.compile(model, backend="wide", options={"bucket_ops": True})
    ids = torch.randint(0, 128, (2, 13))
    with torch.no_grad():
        torch.testing.assert_close(cm(input_ids=ids).logits, ref(input_ids=ids).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["codebook", "nested"])
def test_form_b_inserts_the_bucket_form(name):
    from test_passes_models import gptfast_pair

    model, ref = gptfast_pair(seed=9)
    routers = wc.Routers.init(model.spec, CFGS[name], seed=10)
    g = torch.Generator().manual_seed(1)
    for r in list(routers.attn) + list(routers.ffn):
        if hasattr(r, "set_order_"):
            r.set_order_(torch.randperm(r.groups, generator=g))
    ref.ref_routers = routers
    cm = wc.optimize(model, routers, inductor=False, bucket_ops=True)
    idx = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(cm(idx), ref(idx), atol=1e-5, rtol=1e-5)
    ex, ops = _ops_after(cm)
    L = routers.spec.num_layers
    assert ex.graphs[0].form == "dense+routers"
    assert ops["wide_mlp_bucket_nd"] == L and ops["wide_o_proj_bucket_nd"] == L and ops["wide_mlp_nd"] == 0
    assert ops["wide_o_proj_nd"] == 0


@pytest.mark.parametrize("on", [True, False], ids=["all-on", "all-off"])
def test_constant_prototypes_oracle(on):
    """Every prototype the same constant mask: all on == the dense model; all off == the dense model with
    o_proj and down_proj zeroed (each block contributes exactly 0)."""
    model, dense = tiny_model("llama", seed=2), tiny_model("llama", seed=2)
    routers = wc.Routers.init(model, CB, seed=3)
    with torch.no_grad():
        for r in list(routers.attn) + list(routers.ffn):
            r.prototypes.fill_(1.0 if on else -1.0)
        if not on:
            for layer in decoder_layers(dense):
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
    cm = wc.optimize(model, routers, inductor=False, bucket_ops=True)
    ids = torch.randint(0, 128, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(cm(input_ids=ids).logits, dense(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
    assert _ops_after(cm)[1]["wide_mlp_bucket_nd"] == routers.spec.num_layers


def _protos(P, G, kind, g):
    if kind == "random":
        p = torch.rand(P, G, generator=g) < 0.5
        p[0] = True   # an all-on prototype
        p[-1] = False  # an all-off one
        p[1 % P, :] = False
        p[1 % P, G // 2] = True  # a single-group one
        return p
    return torch.full((P, G), kind == "on")


@pytest.mark.parametrize("kind", ["random", "on", "off"])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_graph_wrappers_equal_the_free_mask_reference(kind, id_dtype):
    """The N-d wrappers the pass inserts, ids as int32 or int64 with a leading [B, T] shape, against the
    free-mask references on protos[bucket] in float64 (odd sizes, ragged token counts)."""
    g = torch.Generator().manual_seed(7)
    D, F, gs, Nq, hgs, P = 24, 96, 16, 40, 8, 4
    x = torch.randn(3, 7, D, generator=g, dtype=torch.float64)
    a = torch.randn(3, 7, Nq, generator=g, dtype=torch.float64)
    wg, wu = torch.randn(F, D, generator=g, dtype=torch.float64), torch.randn(F, D, generator=g, dtype=torch.float64)
    wd, wq = torch.randn(D, F, generator=g, dtype=torch.float64), torch.randn(Nq, D, generator=g, dtype=torch.float64)
    wo, bq, bo = (torch.randn(D, Nq, generator=g, dtype=torch.float64), torch.randn(Nq, generator=g, dtype=torch.float64),
                  torch.randn(D, generator=g, dtype=torch.float64))
    pf, pa = _protos(P, F // gs, kind, g), _protos(P, Nq // hgs, kind, g)
    bucket = torch.randint(0, P, (3, 7), generator=g).to(id_dtype)
    mf, ma = pf[bucket.long()], pa[bucket.long()]
    flat = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
    got = _ops.wide_mlp_bucket_nd(x, wg, wu, wd, bucket, pf, gs)
    want = ref_ops.mlp_ref(flat(x), wg, wu, wd.t(), flat(mf), gs).reshape(3, 7, D)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    got = _ops.wide_q_proj_bucket_nd(x, wq, bq, bucket, pa, hgs)
    torch.testing.assert_close(got, ref_ops.q_proj_ref(flat(x), wq, bq, flat(ma), hgs).reshape(3, 7, Nq),
                               atol=1e-10, rtol=1e-10)
    got = _ops.wide_o_proj_bucket_nd(a, wo, bo, bucket, pa, hgs)
    torch.testing.assert_close(got, ref_ops.o_proj_ref(flat(a), wo.t(), bo, flat(ma), hgs).reshape(3, 7, D),
                               atol=1e-10, rtol=1e-10)
    if kind == "off":  # no group on: the MLP contributes exactly 0, o_proj only its bias
        assert torch.equal(_ops.wide_mlp_bucket_nd(x, wg, wu, wd, bucket, pf, gs), torch.zeros_like(x))


def test_refused_block_runs_the_free_mask_ops_and_says_why(monkeypatch):
    from wide_compile.passes import match_buckets
    from wide_compile.passes.base import AttnMatch

    refusal = match_buckets.bucket_refusal  # the attention blocks are refused, the MLPs keep the bucket op
    monkeypatch.setattr(match_buckets, "bucket_refusal",
                        lambda blk, x: "refused for the test" if isinstance(blk, AttnMatch) else refusal(blk, x))
    ref, cm, routers = _eager_and_compiled("smollm2", CB, inductor=False, bucket_ops=True)
    ids = torch.randint(0, 128, (2, 6))
    with torch.no_grad():
        torch.testing.assert_close(cm(input_ids=ids).logits, ref(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
    ex, ops = _ops_after(cm)
    L = routers.spec.num_layers
    # q on the free-mask path: wide.q_proj, or unmasked where that path is dense-masked at a static token count
    # (o_proj's mask routes the block); which one depends on whether Dynamo traced this size statically
    assert ops["wide_q_proj_nd"] + ex.counts.get("rewrite_attention.q_unmasked", 0) == L
    assert ops["wide_o_proj_nd"] == L and ops["wide_o_proj_bucket_nd"] == 0
    assert ops["wide_mlp_bucket_nd"] == L and ex.counts["rewrite_attention.bucket_refused"] == L
    assert all("refused for the test" in r["attn"]["detail"] and r["attn"]["ops"]["o"] == "o_proj"
               for r in ex.layers)
