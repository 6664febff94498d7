"""Pass-level tests: op counts before/after each pass on Dynamo graphs of every tiny architecture and of a
hand-written gpt-fast-style Llama; rewritten graph (run without Inductor) == eager attached reference."""
from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from torch import nn

import wide_compile as wc
from wide_compile.models import ModelSpec, tiny_model
from wide_compile.config import GroupGeometry
from wide_compile.kernels.tuning import table_for
from wide_compile.passes import PassManager, WideFallbackWarning, op_counts
from wide_compile.passes.detect_attention import DetectAttention
from wide_compile.passes.detect_mlp import DetectSwiGLU
from wide_compile.passes.insert_routers import InsertRouters
from wide_compile.passes.rewrite_attention import RewriteAttention
from wide_compile.passes.rewrite_mlp import RewriteMLP

ARCHS = ("llama", "mistral", "qwen2", "smollm2")
CFG = wc.WideConfig(ffn_group_size=32, head_group_size=1, router_init="random")


def capture(fn, *args, **kwargs):
    """Dynamo graphs (with example inputs) of fn(*args), without compiling."""
    graphs = []

    def be(gm, ex):
        graphs.append((gm, list(ex)))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(fn, backend=be)(*args, **kwargs)
    return graphs


def attach_random_routers(model, recipe="linear", hidden=0, seed=3, **cfg_options):
    """Routers of `recipe` attached to `model` with every parameter random (biases too: they start at 0, so a rewrite
    that drops or miscomputes one could not fail otherwise); cfg_options go to WideConfig (e.g. router_input)."""
    cfg = wc.WideConfig(ffn_group_size=32, head_group_size=1, router_init="random", router_recipe=recipe,
                        router_hidden=hidden, **cfg_options)
    routers = wc.Routers.init(model, cfg, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in routers.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    wc.attach(model, routers)
    return routers


def run_logits(gm, ex, like):
    """Run a captured graph and pick the output that has the logits' shape."""
    with torch.no_grad():
        outs = gm(*ex)
    outs = outs if isinstance(outs, (tuple, list)) else [outs]
    cand = [o for o in outs if isinstance(o, torch.Tensor) and o.shape == like.shape]
    assert len(cand) == 1, [getattr(o, "shape", o) for o in outs]
    return cand[0]


def wide_op_count(gm):
    c = op_counts(gm)
    return {k: c.get(k, 0) for k in ("wide_mlp_nd", "wide_q_proj_nd", "wide_o_proj_nd", "linear", "silu",
                                     "linear_router_mask", "constant_router_mask")}


# ---------------------------------------------------------------------------------------- gpt-fast Llama
def precompute_freqs_cis(seq_len, n_elem, base=10000.0):
    freqs = 1.0 / (base ** (torch.arange(0, n_elem, 2)[: (n_elem // 2)].float() / n_elem))
    t = torch.arange(seq_len)
    freqs = torch.outer(t, freqs)
    cis = torch.polar(torch.ones_like(freqs), freqs)
    return torch.stack([cis.real, cis.imag], dim=-1)


def apply_rotary_emb(x, freqs_cis):
    xshaped = x.float().reshape(*x.shape[:-1], -1, 2)
    freqs_cis = freqs_cis.view(1, xshaped.size(1), 1, xshaped.size(3), 2)
    x_out2 = torch.stack([xshaped[..., 0] * freqs_cis[..., 0] - xshaped[..., 1] * freqs_cis[..., 1],
                          xshaped[..., 1] * freqs_cis[..., 0] + xshaped[..., 0] * freqs_cis[..., 1]], -1)
    return x_out2.flatten(3).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + self.eps) * self.weight


def _group_mask(x, mask):  # eager WIDE reference for the gpt-fast model
    g = mask.shape[-1]
    return (x.unflatten(-1, (g, x.shape[-1] // g)) * mask.to(x.dtype).unsqueeze(-1)).flatten(-2)


class Attention(nn.Module):
    def __init__(self, dim, n_head, n_kv, qk_norm=False):
        super().__init__()
        self.n_head, self.n_kv, self.head_dim, self.dim = n_head, n_kv, dim // n_head, dim
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, n_kv * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.qk_norm = qk_norm

    def forward(self, x, freqs_cis, route=None):
        bsz, seqlen, _ = x.shape
        mask = route(x) if route is not None else None
        q = self.wq(x)
        if self.qk_norm:  # OLMo-style norm over the whole projection: mixes heads
            q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-5)
        q = q.view(bsz, seqlen, self.n_head, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, self.n_kv, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, self.n_kv, self.head_dim)
        q, k = apply_rotary_emb(q, freqs_cis), apply_rotary_emb(k, freqs_cis)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        k = k.repeat_interleave(self.n_head // self.n_kv, dim=1)
        v = v.repeat_interleave(self.n_head // self.n_kv, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(bsz, seqlen, self.dim)
        if mask is not None:
            y = _group_mask(y, mask)
        return self.wo(y)


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x, route=None):
        h = F.silu(self.w1(x)) * self.w3(x)
        if route is not None:
            h = _group_mask(h, route(x))
        return self.w2(h)


class Block(nn.Module):
    def __init__(self, dim, n_head, n_kv, hidden, qk_norm=False):
        super().__init__()
        self.attention = Attention(dim, n_head, n_kv, qk_norm)
        self.feed_forward = FeedForward(dim, hidden)
        self.attention_norm, self.ffn_norm = RMSNorm(dim), RMSNorm(dim)

    def forward(self, x, freqs_cis, ra=None, rf=None):
        h = x + self.attention(self.attention_norm(x), freqs_cis, ra)
        return h + self.feed_forward(self.ffn_norm(h), rf)


class GptFast(nn.Module):
    """gpt-fast-style Llama (tok_embeddings / layers / attention.wq... / feed_forward.w1,w2,w3 / output)."""

    def __init__(self, vocab=128, dim=64, n_layer=2, n_head=4, n_kv=2, hidden=192, qk_norm=False):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, n_head, n_kv, hidden, qk_norm) for _ in range(n_layer))
        self.norm, self.output = RMSNorm(dim), nn.Linear(dim, vocab, bias=False)
        self.register_buffer("freqs_cis", precompute_freqs_cis(64, dim // n_head), persistent=False)
        self.spec = ModelSpec(num_layers=n_layer, hidden_size=dim, intermediate_size=hidden, num_heads=n_head,
                              num_kv_heads=n_kv, head_dim=dim // n_head)
        self.ref_routers = None  # eager WIDE reference when set

    def forward(self, idx):
        x = self.tok_embeddings(idx)
        fc = self.freqs_cis[: idx.shape[1]]
        r = self.ref_routers
        for i, layer in enumerate(self.layers):
            ra = rf = None
            if r is not None:
                ra = (lambda h, i=i: r.decide(r.attn[i], h))
                rf = (lambda h, i=i: r.decide(r.ffn[i], h))
            x = layer(x, fc, ra, rf)
        return self.output(self.norm(x))


def gptfast_pair(seed=0, **kw):
    torch.manual_seed(seed)
    a = GptFast(**kw).eval()
    b = GptFast(**kw).eval()
    b.load_state_dict(a.state_dict())
    return a, b


# ---------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("arch", ARCHS)
def test_op_counts_per_pass_hf_attached(arch):
    """Form A: routers attached -> each pass's effect on the op histogram of the Dynamo graph."""
    model = tiny_model(arch)
    L = model.config.num_hidden_layers
    wc.attach(model, wc.Routers.init(model, CFG))
    (gm, ex), = capture(model, input_ids=torch.randint(0, 128, (2, 5)))
    before = wide_op_count(gm)
    # q,k,v,o,gate,up,down per layer + 2 routers per layer + lm_head
    assert before["linear"] == 9 * L + 1 and before["silu"] == L and before["wide_mlp_nd"] == 0
    mgr = PassManager([DetectSwiGLU(), DetectAttention()])
    ctx = mgr.run(gm, ex)
    assert len(ctx.mlps) == L and len(ctx.attns) == L
    assert all(m.form == "masked" for m in ctx.mlps) and all(a.form == "masked" for a in ctx.attns)
    assert all(len(a.kv) == 2 and a.q_ok for a in ctx.attns)
    assert wide_op_count(gm) == before  # detection does not touch the graph
    InsertRouters()(ctx)
    assert wide_op_count(gm) == before  # routers were traced already: nothing inserted
    RewriteMLP()(ctx)
    after_mlp = wide_op_count(gm)
    assert after_mlp["wide_mlp_nd"] == L and after_mlp["linear"] == before["linear"] - 3 * L
    assert after_mlp["silu"] == 0
    RewriteAttention()(ctx)
    after = wide_op_count(gm)
    # 10 tokens: q's path is the dense one (the tuning table's), where q runs unmasked (o's input mask routes the
    # block) and k, v join its linear (QKV_PATHS)
    assert after["wide_q_proj_nd"] == 0 and after["wide_o_proj_nd"] == L
    assert ctx.report.counts["rewrite_attention.qkv_fused"] == L == ctx.report.counts["rewrite_attention.q_unmasked"]
    assert after["linear"] == before["linear"] - 6 * L  # routers, lm_head stay linears
    # the traced mask multiplies are gone
    assert op_counts(gm)[".unflatten"] == 0


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", ["random", "constant"])
def test_rewritten_graph_matches_eager(arch, kind):
    model = tiny_model(arch)
    if kind == "random":
        routers = wc.Routers.init(model, CFG, seed=1)
    else:
        g = torch.Generator().manual_seed(2)
        spec = wc.models.model_spec(model)
        ga, gf = CFG.num_head_groups(spec), CFG.num_ffn_groups(spec)
        routers = wc.Routers.constant(model, CFG, attn=[torch.rand(ga, generator=g) > 0.5 for _ in range(spec.num_layers)],
                                      ffn=[torch.rand(gf, generator=g) > 0.5 for _ in range(spec.num_layers)])
    wc.attach(model, routers)
    ids = torch.randint(0, 128, (2, 9))
    (gm, ex), = capture(model, input_ids=ids)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    ctx = PassManager().run(gm, ex)
    assert ctx.report.counts["rewrite_mlp.rewritten"] == 2 and ctx.report.counts["rewrite_attention.q_rewritten"] == 2
    torch.testing.assert_close(run_logits(gm, ex, ref), ref, atol=1e-5, rtol=1e-5)
    if kind == "random":  # the routers really route per token
        with wc.routing.record_masks(model) as rec, torch.no_grad():
            model(input_ids=ids)
        m = rec["ffn"][0][0]
        assert 0 < m.float().mean() < 1 and not (m == m[:, :1]).all()


def test_gptfast_dense_graph_routers_inserted():
    """Form B: dense gpt-fast graph; routers inserted by layer order, then rewritten."""
    model, ref = gptfast_pair()
    routers = wc.Routers.init(model.spec, CFG, seed=3)
    ref.ref_routers = routers
    idx = torch.randint(0, 128, (2, 11))
    (gm, ex), = capture(model, idx)
    before = wide_op_count(gm)
    assert before["linear"] == 7 * 2 + 1
    ctx = PassManager([DetectSwiGLU(), DetectAttention()]).run(gm, ex, routers=routers)
    assert len(ctx.mlps) == 2 and len(ctx.attns) == 2 and all(a.form == "dense" for a in ctx.attns)
    assert [n.name for n in ctx.attns[0].kv]  # k/v found as q's siblings
    InsertRouters()(ctx)
    ins = wide_op_count(gm)
    assert ins["linear_router_mask"] == 4 and ins["linear"] == before["linear"]
    RewriteMLP()(ctx)
    RewriteAttention()(ctx)
    gm.recompile()
    after = wide_op_count(gm)
    assert after["wide_mlp_nd"] == 2 and after["wide_q_proj_nd"] == 2 and after["wide_o_proj_nd"] == 2
    assert after["linear"] == 2 * 2 + 1
    with torch.no_grad():
        expect = ref(idx)
    torch.testing.assert_close(run_logits(gm, ex, expect), expect, atol=1e-5, rtol=1e-5)


def test_gptfast_constant_routers():
    model, ref = gptfast_pair(seed=4)
    spec = model.spec
    ga, gf = CFG.num_head_groups(spec), CFG.num_ffn_groups(spec)
    assert ga == 4  # the hand-written attention masks below have one entry per head group
    routers = wc.Routers.constant(spec, CFG, attn=[torch.tensor([1, 0, 1, 1], dtype=torch.bool)] * 2,
                                  ffn=[torch.arange(gf) % 2 == 0] * 2)
    ref.ref_routers = routers
    idx = torch.randint(0, 128, (1, 7))
    (gm, ex), = capture(model, idx)
    ctx = PassManager().run(gm, ex, routers=routers)
    assert op_counts(gm)["constant_router_mask"] == 4
    with torch.no_grad():
        expect = ref(idx)
    torch.testing.assert_close(run_logits(gm, ex, expect), expect, atol=1e-5, rtol=1e-5)
    assert ctx.report.form == "dense+routers"


def test_q_path_mixing_heads_keeps_q_dense():
    """A norm over the whole q projection mixes heads: q stays dense (o still rewritten), still exact."""
    model, ref = gptfast_pair(seed=5, qk_norm=True)
    routers = wc.Routers.init(model.spec, CFG, seed=6)
    ref.ref_routers = routers
    idx = torch.randint(0, 128, (2, 6))
    (gm, ex), = capture(model, idx)
    ctx = PassManager().run(gm, ex, routers=routers)
    assert all(not a.q_ok for a in ctx.attns) and op_counts(gm)["wide_q_proj_nd"] == 0
    assert op_counts(gm)["wide_o_proj_nd"] == 2
    with torch.no_grad():
        expect = ref(idx)
    torch.testing.assert_close(run_logits(gm, ex, expect), expect, atol=1e-5, rtol=1e-5)


def test_fallback_warns_and_stays_exact():
    """gate/up with bias (mlp_bias=True) cannot go to wide.mlp: the masked reference + a warning naming the
    layer and the subgraph, why, and how to get the kernels; strict=True raises, claiming no fallback."""
    model = tiny_model("llama", mlp_bias=True)
    wc.attach(model, wc.Routers.init(model, CFG, seed=7))
    ids = torch.randint(0, 128, (1, 6))
    (gm, ex), = capture(model, input_ids=ids)
    with pytest.raises(ValueError, match=r"strict=True\): layer 0: gated MLP at %\S+ .*cannot run on the WIDE "
                       r"kernels: .*bias.*To rewrite it: use bias-free") as e:
        PassManager().run(gm, ex, strict=True)
    assert "masked reference" not in str(e.value) and "dense" not in str(e.value)
    (gm, ex), = capture(model, input_ids=ids)
    with pytest.warns(WideFallbackWarning, match=r"layer 0: gated MLP at %\S+ .*keeps its routing but runs the "
                      r"masked reference.*bias.*For the WIDE kernels: use bias-free"):
        ctx = PassManager().run(gm, ex)
    assert op_counts(gm)["wide_mlp_nd"] == 0 and op_counts(gm)["wide_o_proj_nd"] == 2
    assert [m.status for m in ctx.mlps] == ["fallback", "fallback"]
    with torch.no_grad():
        expect = model(input_ids=ids).logits
    torch.testing.assert_close(run_logits(gm, ex, expect), expect, atol=1e-5, rtol=1e-5)


def test_unrecognised_attention_warns():
    """Eager (non-sdpa) attention: the masked o_proj is not recognised -> a warning that says why and how to get
    the fast path (attn_implementation="sdpa"), exact masked-reference result."""
    model = tiny_model("llama", attn_implementation="eager")
    model.config._attn_implementation = "eager"
    wc.attach(model, wc.Routers.init(model, CFG, seed=8))
    ids = torch.randint(0, 128, (1, 5))
    (gm, ex), = capture(model, input_ids=ids)
    with pytest.warns(WideFallbackWarning, match=r"attention at %\S+ .*masked reference.*eager attention.*"
                      r'attn_implementation="sdpa"'):
        ctx = PassManager().run(gm, ex)
    assert len(ctx.report.fallbacks) == 2 and "masked reference" in str(ctx.report)
    assert op_counts(gm)["wide_mlp_nd"] == 2 and op_counts(gm)["wide_o_proj_nd"] == 0
    with torch.no_grad():
        expect = model(input_ids=ids).logits
    torch.testing.assert_close(run_logits(gm, ex, expect), expect, atol=1e-5, rtol=1e-5)


def test_dense_graph_without_routers_is_an_error():
    model = tiny_model("llama")
    (gm, ex), = capture(model, input_ids=torch.randint(0, 128, (1, 4)))
    with pytest.raises(ValueError, match="no WIDE routers"):
        PassManager().run(gm, ex)


def test_layer_count_mismatch_is_an_error():
    model, _ = gptfast_pair()
    spec3 = ModelSpec(3, 64, 192, 4, 2, 16)
    (gm, ex), = capture(model, torch.randint(0, 128, (1, 4)))
    with pytest.raises(wc.passes.RoutingDroppedError, match="routers for 3 layers were given"):
        PassManager().run(gm, ex, routers=wc.Routers.init(spec3, CFG))


def test_geometry_from_the_routers_is_checked_against_the_traced_grouping():
    """Form A: the grouping read off the traced mask multiply must be the routers' GroupGeometry; another
    geometry (a config the graph was not traced with) leaves every block dense with the reason, never
    rewrites with the wrong group size."""
    model = tiny_model("llama")
    routers = wc.Routers.init(model, CFG)
    wc.attach(model, routers)
    (gm, ex), = capture(model, input_ids=torch.randint(0, 128, (2, 5)))
    spec = routers.spec
    other = GroupGeometry.of(wc.WideConfig(ffn_group_size=CFG.ffn_group_size * 2, head_group_size=CFG.head_group_size),
                             spec)
    with pytest.warns(WideFallbackWarning, match="routers' geometry"):
        ctx = PassManager().run(gm, ex, geometry=other)
    assert all(m.status == "fallback" and "geometry" in m.reason for m in ctx.mlps)
    assert all(a.status == "rewritten" for a in ctx.attns)  # the attention grouping is the same in both
    assert wide_op_count(gm)["wide_mlp_nd"] == 0


def test_kernel_tuning_reaches_the_rewritten_ops():
    model = tiny_model("llama")
    wc.attach(model, wc.Routers.init(model, CFG))
    (gm, ex), = capture(model, input_ids=torch.randint(0, 128, (2, 5)))
    tuning = table_for().with_overrides(decode={"lists": "none"}).to_json()
    PassManager().run(gm, ex, kernel_tuning=tuning)
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target.__name__.startswith("wide_")]
    # o, mlp per layer (q is on the dense path at 10 tokens: an unmasked linear)
    assert len(calls) == 4 and all(tuning in n.args for n in calls)


def test_dense_graph_block_that_cannot_be_rewritten_keeps_its_routing():
    """Form B: routers inserted into a dense graph; an MLP that wide.mlp cannot take (gate with a bias) keeps its
    routing through the inserted mask multiply (the eager reference's semantics), with a warning, never dense."""
    model, ref = gptfast_pair(seed=12)
    torch.manual_seed(13)
    for m in (model, ref):
        for layer in m.layers:
            layer.feed_forward.w1 = nn.Linear(64, 192, bias=True)
    ref.load_state_dict(model.state_dict())
    routers = wc.Routers.init(model.spec, CFG, seed=14)
    ref.ref_routers = routers
    idx = torch.randint(0, 128, (2, 7))
    (gm, ex), = capture(model, idx)
    with pytest.warns(WideFallbackWarning, match="gated MLP at .*keeps its routing.*bias"):
        ctx = PassManager().run(gm, ex, routers=routers)
    assert [m.status for m in ctx.mlps] == ["fallback", "fallback"] and op_counts(gm)["wide_mlp_nd"] == 0
    assert op_counts(gm)["group_masked_nd"] == 2 and op_counts(gm)["wide_o_proj_nd"] == 2
    with torch.no_grad():
        expect = ref(idx)
        model.ref_routers = None
        dense = model(idx)
    assert (expect - dense).abs().max() > 1e-3  # the routing changes the result, so dropping it would fail
    torch.testing.assert_close(run_logits(gm, ex, expect), expect, atol=1e-5, rtol=1e-5)


def test_unsupported_gate_activation_warns():
    """A gated MLP whose activation wide.mlp does not compute (ReLU) keeps its routing on the masked reference,
    with a warning naming the activation and what is supported; the result is exact."""
    model = tiny_model("llama", hidden_act="relu")
    wc.attach(model, wc.Routers.init(model, CFG, seed=9))
    ids = torch.randint(0, 128, (1, 5))
    (gm, ex), = capture(model, input_ids=ids)
    with pytest.warns(WideFallbackWarning, match=r"gated MLP at %\S+ .*masked reference.*gate activation \(\S*relu"
                      r"\S*\) is not one wide.mlp computes.*silu.*gelu"):
        ctx = PassManager().run(gm, ex)
    assert op_counts(gm)["wide_mlp_nd"] == 0 and op_counts(gm)["wide_o_proj_nd"] == 2 and not ctx.mlps
    with torch.no_grad():
        expect = model(input_ids=ids).logits
    torch.testing.assert_close(run_logits(gm, ex, expect), expect, atol=1e-5, rtol=1e-5)
