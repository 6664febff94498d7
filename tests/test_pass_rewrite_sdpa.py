"""rewrite_sdpa: a routed block's sdpa runs wide.attn_decode (a decode step over a static cache) or
wide.attn_prefill (a causal prefill without a cache), compiled through Inductor on the CPU (the ops' PyTorch
references), against the eager WIDE reference (wc.attach) on a separate copy of the model.

fp32, tolerance 1e-5 on the logits. Counters say which rewrite ran; a grouping that straddles KV heads keeps
sdpa dense with the reason in explain(), and so does a prefill whose grouping is not KV-aligned under the
default sparse_attention="auto"."""
import pytest
import torch
from torch._dynamo.utils import counters

import wide_compile as wc
from wide_compile.models.tiny import tiny_model


def _routers(model, head_group_size):
    r = wc.Routers.init(model, wc.WideConfig(ffn_group_size=16, head_group_size=head_group_size, capacity=0.5))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in r.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)   # about half the groups on, varying per token
    return r


def _prefill_then_decode(model, ids, nxt, cache_len=16):
    cache = wc.static_cache(model, ids.shape[0], cache_len)
    with torch.no_grad():
        a = model(ids, past_key_values=cache, use_cache=True).logits
        b = model(nxt, past_key_values=cache, use_cache=True,
                  cache_position=torch.tensor([ids.shape[1]])).logits
    return a, b


@pytest.mark.parametrize("head_group_size", [1, 2])   # tiny llama: 4 query heads, 2 KV heads (2 = KV-aligned)
def test_decode_reads_the_cache_through_attn_decode(head_group_size):
    counters.clear()
    torch._dynamo.reset()
    ids, nxt = torch.randint(0, 100, (2, 7)), torch.randint(0, 100, (2, 1))
    model = tiny_model("llama")
    r = _routers(model, head_group_size)
    got = _prefill_then_decode(wc.optimize(model, r, sparse_attention=True), ids, nxt)
    assert counters["wide"]["rewrite_sdpa.decode"] == 2        # both layers of the decode graph
    ref_model = tiny_model("llama")
    wc.attach(ref_model, r)
    want = _prefill_then_decode(ref_model, ids, nxt)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def _unpadded_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA without the mask when queries and keys have the same length (an unpadded prefill),
    so sdpa runs causal-only as gpt-fast style models call it."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.shape[2] == key.shape[2]:
        attention_mask = None
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def test_causal_prefill_runs_attn_prefill():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register("wide_test_unpadded", _unpadded_sdpa)
    AttentionMaskInterface.register("wide_test_unpadded", sdpa_mask)
    counters.clear()
    torch._dynamo.reset()
    ids = torch.randint(0, 100, (2, 9))
    model, ref_model = tiny_model("llama"), tiny_model("llama")
    for m in (model, ref_model):
        m.config._attn_implementation = "wide_test_unpadded"
    r = _routers(model, 2)
    with torch.no_grad():
        got = wc.optimize(model, r, sparse_attention=True)(ids, use_cache=False).logits
    assert counters["wide"]["rewrite_sdpa.prefill"] == 2
    wc.attach(ref_model, r)
    with torch.no_grad():
        want = ref_model(ids, use_cache=False).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_groups_straddling_kv_heads_keep_sdpa_dense():
    counters.clear()
    torch._dynamo.reset()
    kw = dict(num_attention_heads=6, num_key_value_heads=2, hidden_size=96, head_dim=16)
    ids, nxt = torch.randint(0, 100, (1, 5)), torch.randint(0, 100, (1, 1))
    model = tiny_model("llama", **kw)
    r = _routers(model, 2)                                    # 3 query heads per KV head, groups of 2
    got = _prefill_then_decode(wc.optimize(model, r, sparse_attention=True), ids, nxt)
    assert counters["wide"]["rewrite_sdpa.decode"] == 0 and counters["wide"]["rewrite_sdpa.kept_dense"] >= 2
    assert "straddle KV heads" in str(wc.explain(model))
    ref_model = tiny_model("llama", **kw)
    wc.attach(ref_model, r)
    for g, w in zip(got, _prefill_then_decode(ref_model, ids, nxt)):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_sparse_attention_choices():
    from wide_compile.passes.manager import default_passes
    from wide_compile.passes.rewrite_sdpa import RewriteSDPA

    def rewrite(passes):
        return [p for p in passes if isinstance(p, RewriteSDPA)]

    assert [p.prefill_kv_aligned_only for p in rewrite(default_passes())] == [True]           # "auto"
    assert [p.prefill_kv_aligned_only for p in rewrite(default_passes(sparse_attention=True))] == [False]
    assert rewrite(default_passes(sparse_attention=False)) == []
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="sparse_attention must be"):
            default_passes(sparse_attention=bad)
    with pytest.raises(ValueError, match="sparse_attention must be"):
        wc.optimize(tiny_model("llama"), _routers(tiny_model("llama"), 2), sparse_attention="on")


@pytest.mark.parametrize("head_group_size", [1, 2])   # tiny llama: 2 query heads per KV head
def test_auto_rewrites_every_decode(head_group_size):
    """optimize's default (sparse_attention="auto"): decode steps run wide.attn_decode for KV-aligned and 1-head
    groups alike; both equal the eager reference."""
    counters.clear()
    torch._dynamo.reset()
    ids, nxt = torch.randint(0, 100, (2, 7)), torch.randint(0, 100, (2, 1))
    model = tiny_model("llama")
    r = _routers(model, head_group_size)
    got = _prefill_then_decode(wc.optimize(model, r), ids, nxt)
    assert counters["wide"]["rewrite_sdpa.decode"] == 2
    ref_model = tiny_model("llama")
    wc.attach(ref_model, r)
    for g, w in zip(got, _prefill_then_decode(ref_model, ids, nxt)):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_group_size, rewritten", [(2, 2), (1, 0)])
def test_auto_rewrites_kv_aligned_prefills_only(head_group_size, rewritten):
    """Under "auto" a causal prefill's attention is rewritten for KV-aligned groups only; 1-head groups keep sdpa
    with the reason in explain(), and sparse_attention=True rewrites them. Every result equals the eager
    reference."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register("wide_test_unpadded", _unpadded_sdpa)
    AttentionMaskInterface.register("wide_test_unpadded", sdpa_mask)
    ids = torch.randint(0, 100, (2, 9))
    ref_model = tiny_model("llama")
    ref_model.config._attn_implementation = "wide_test_unpadded"
    r = _routers(ref_model, head_group_size)
    wc.attach(ref_model, r)
    with torch.no_grad():
        want = ref_model(ids, use_cache=False).logits
    for choice, n in (("auto", rewritten), (True, 2)):
        counters.clear()
        torch._dynamo.reset()
        model = tiny_model("llama")
        model.config._attn_implementation = "wide_test_unpadded"
        with torch.no_grad():
            got = wc.optimize(model, r, sparse_attention=choice)(ids, use_cache=False).logits
        assert counters["wide"]["rewrite_sdpa.prefill"] == n, choice
        if not n:
            assert counters["wide"]["rewrite_sdpa.kept_dense"] == 2
            assert "KV-aligned head groups only" in str(wc.explain(model))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
