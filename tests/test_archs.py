"""The transformers architectures a new user may hand to wide_compile, each compiled through Inductor on the CPU
(backend="wide", one decoder layer, fp32): what the pass rewrites, exact against the eager reference
(wc.attach) with per-token routers at about half capacity and against the zeroed-weights oracle (DESIGN.md)
with constant masks, or the one clear error an unsupported model gets.

One compile per architecture serves both checks: the routers are model parameters in the traced graph, so
the constant masks are set in place (zero weights, +-30 biases) without recompiling.
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, field

import pytest
import torch

import wide_compile as wc
from wide_compile.api import _find_cause
from wide_compile.backend import wide_backend
from wide_compile.models import ModelSpec
from wide_compile.models.spec import UnsupportedModelError
from wide_compile.passes import RoutingDroppedError

CFG = wc.WideConfig(ffn_group_size=16, head_group_size=1, router_init="random", router_recipe="linear")
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
# -O0 C++ for Inductor's CPU kernels: the same code, compiled in a fraction of the time (CI budget)
FAST_CPP = {"aot_inductor.debug_compile": True}


@dataclass
class Arch:
    config: str                  # transformers config class
    overrides: dict = field(default_factory=dict)
    attn: str = "rewritten"      # rewritten | masked (the masked reference, with a warning saying why)
    q_rewritten: bool = True     # q_proj -> wide.q_proj (False: q stays dense, o is rewritten)
    attn_implementation: str = "sdpa"
    warns: str | None = None     # what the warning must say (attn "masked")
    activation: str = "silu"     # the gate activation wide.mlp runs (at these weight scales gelu and its tanh
                                 # approximation agree to rounding, so the detected kind is asserted directly)


ARCHS = {
    "llama": Arch("LlamaConfig"),
    "mistral": Arch("MistralConfig", {"sliding_window": 5}),
    "qwen2": Arch("Qwen2Config"),
    "qwen3": Arch("Qwen3Config", {"head_dim": 16}),  # q_norm over each head: q is rewritten
    "olmo": Arch("OlmoConfig"),
    # q_norm over the whole q projection mixes heads: q stays dense (exact either way), o is rewritten
    "olmo2": Arch("Olmo2Config", q_rewritten=False),
    "granite": Arch("GraniteConfig"),
    "stablelm": Arch("StableLmConfig"),
    "cohere": Arch("CohereConfig"),
    "phi3": Arch("Phi3Config"),  # fused qkv_proj / gate_up_proj: rewritten through views of the fused weights
    "gemma": Arch("GemmaConfig", {"head_dim": 16}, activation="gelu_tanh"),  # GeGLU
    # transformers runs Gemma2 with eager attention only: attention keeps the masked reference, the MLP is rewritten
    "gemma2": Arch("Gemma2Config", {"head_dim": 16}, attn="masked", attn_implementation="eager",
                   warns='eager attention.*attn_implementation="sdpa"', activation="gelu_tanh"),
}


def tiny(name: str, seed: int = 0, **overrides):
    import transformers as tf

    arch = ARCHS.get(name)
    cls = getattr(tf, arch.config) if arch else getattr(tf, name)
    cfg = cls(**{**COMMON, **(arch.overrides if arch else {}), **overrides})
    for t in ("pad_token_id", "bos_token_id", "eos_token_id"):  # the tiny vocabulary must hold them
        if isinstance(getattr(cfg, t, None), int):
            setattr(cfg, t, 0)
    cfg._attn_implementation = arch.attn_implementation if arch else "sdpa"
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # non-zero biases, so the checks see them
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0.0, 0.05)
    return model


def _set_constant_masks(routers, attn: torch.Tensor, ffn: torch.Tensor) -> None:
    """Turn the (linear) routers of layer 0 into token-independent ones in place: logits = +-30."""
    with torch.no_grad():
        for r, m in ((routers.attn[0], attn), (routers.ffn[0], ffn)):
            r.proj.weight.zero_()
            r.proj.bias.copy_(torch.where(m, 30.0, -30.0))


def _oracle(name: str, attn: torch.Tensor, ffn: torch.Tensor, head_dim: int):
    """The dense model with the inactive head groups' o_proj columns and FFN groups' down_proj columns zeroed."""
    oracle = tiny(name)
    layer = oracle.model.layers[0]
    with torch.no_grad():
        layer.self_attn.o_proj.weight[:, ~attn.repeat_interleave(CFG.head_group_size * head_dim)] = 0
        layer.mlp.down_proj.weight[:, ~ffn.repeat_interleave(CFG.ffn_group_size)] = 0
    return oracle


@pytest.mark.parametrize("name", list(ARCHS))
def test_arch_compiled_exact_against_eager_and_oracle(name):
    arch = ARCHS[name]
    model, ref = tiny(name), tiny(name)
    routers = wc.Routers.init(model, CFG, seed=1)
    wc.attach(ref, routers)
    ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        routers.calibrate_(ref, ids, capacity=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cm = wc.optimize(model, routers, dynamic=False, **FAST_CPP)
        with torch.no_grad():
            out = cm(input_ids=ids).logits
    ours = [str(w.message) for w in caught if issubclass(w.category, wc.passes.WideFallbackWarning)]
    # 1. per-token routers: compiled == the eager reference, on masks that really vary
    with torch.no_grad(), wc.routing.record_masks(ref) as rec:
        expect = ref(input_ids=ids).logits
    for kind in ("attn", "ffn"):
        m = rec[kind][0][0]
        assert 0 < m.float().mean() < 1 and not (m == m[..., :1, :]).all(), kind
    torch.testing.assert_close(out, expect, atol=2e-5, rtol=2e-5)
    # 2. what the pass did, and why where it did not rewrite
    (row,) = wc.explain(cm).layers
    assert row["mlp"]["status"] == "rewritten" and row["mlp"]["activation"] == arch.activation, row["mlp"]
    if arch.attn == "rewritten":
        assert row["attn"]["status"] == "rewritten" and row["attn"]["q_rewritten"] == arch.q_rewritten, row["attn"]
        assert not ours, ours
    else:
        assert row["attn"] is None and len(ours) == 1, ours
        assert __import__("re").search(arch.warns, ours[0]), ours[0]
    # 3. constant masks, same compiled model: == the dense model with the inactive columns zeroed
    spec = routers.spec
    attn = torch.tensor([True, False, True, False])
    ffn = torch.arange(CFG.num_ffn_groups(spec)) % 3 != 1
    _set_constant_masks(routers, attn, ffn)
    oracle = _oracle(name, attn, ffn, spec.head_dim)
    with torch.no_grad():
        torch.testing.assert_close(cm(input_ids=ids).logits, oracle(input_ids=ids).logits, atol=2e-5, rtol=2e-5)


# ----------------------------------------------------------------------------- unsupported models: one clear error
UNSUPPORTED = {
    "GPT2Config": (dict(vocab_size=128, n_embd=64, n_layer=1, n_head=4, n_positions=64), "decoder layers not "
                   "recognised"),
    "MixtralConfig": ({**COMMON, "num_local_experts": 4}, "mixture-of-experts"),
    "Qwen3MoeConfig": ({**COMMON, "num_experts": 4, "moe_intermediate_size": 32, "head_dim": 16},
                       "mixture-of-experts"),
}


@pytest.mark.parametrize("config", list(UNSUPPORTED))
def test_unsupported_architectures_are_one_clear_error(config):
    import transformers as tf

    kw, what = UNSUPPORTED[config]
    cfg = getattr(tf, config)(**kw)
    for t in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(getattr(cfg, t, None), int):
            setattr(cfg, t, 0)
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    with pytest.raises(UnsupportedModelError, match=f"{what}.*supports dense Llama-family causal LMs"):
        wc.Routers.init(model, CFG)
    # routers made from a ModelSpec are refused at optimize, before any compiling (no BackendCompilerFailed)
    routers = wc.Routers.init(ModelSpec(1, 64, 128, 4, 2, 16), CFG)
    with pytest.raises(UnsupportedModelError, match=what) as e:
        wc.optimize(model, routers)
    assert "Routers(" not in str(e.value) and len(str(e.value)) < 1000


def test_dense_graph_routers_for_blocks_not_found_is_an_error():
    """Routers inserted into a dense graph (form B) for blocks the pass cannot find (GPT-2's Conv1D projections)
    would be silently dropped: the pass raises, naming the blocks, why, and the fix; explain() reports it."""
    import transformers as tf

    model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=128, n_embd=64, n_layer=1, n_head=4, n_positions=64,
                                             bos_token_id=0, eos_token_id=0)).eval()
    routers = wc.Routers.init(ModelSpec(1, 64, 256, 4, 4, 16), CFG)
    torch._dynamo.reset()
    cm = torch.compile(model, backend=functools.partial(wide_backend, routers=routers, inductor=False),
                       fullgraph=True)
    with pytest.raises(Exception) as e, torch.no_grad():
        cm(input_ids=torch.randint(0, 128, (1, 5)))
    err = _find_cause(e.value, RoutingDroppedError)
    assert err is not None, e.value
    msg = str(err)
    assert "routers for 1 layers were given" in msg and "0 attention block(s) and 0 gated MLP(s)" in msg
    assert "h.0.attn" in msg and "comes from 0 linear projections" in msg and "Fix:" in msg


def test_explain_reports_dropped_routing_and_masked_reference():
    """explain() lists both kinds: routing the pass would drop (errors) and blocks kept on the masked reference
    (warnings), each with its reason."""
    import sys

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from test_passes_models import GptFast

    class NoSdpa(GptFast):  # attention written out with softmax: no sdpa for the pass to find
        pass

    model = NoSdpa().eval()
    for layer in model.layers:
        layer.attention.forward = functools.partial(_eager_attention, layer.attention)
    routers = wc.Routers.init(model.spec, CFG)
    ex = wc.explain(model, torch.randint(0, 128, (1, 6)), routers=routers)
    assert len(ex.errors) == 1 and "2 attention block(s) and 2 gated MLP(s)" not in ex.errors[0]
    assert "0 attention block(s) and 2 gated MLP(s)" in ex.errors[0] and "error: " in str(ex)
    # through optimize: the same error at the first call, with the backend named, not its options printed
    cm = wc.optimize(model, routers, inductor=False)
    with pytest.raises(Exception, match="backend='wide' raised:\nRoutingDroppedError") as e, torch.no_grad():
        cm(torch.randint(0, 128, (1, 6)))
    assert "Routers(" not in str(e.value)

    gemma2 = tiny("gemma2")
    wc.attach(gemma2, wc.Routers.init(gemma2, CFG))
    ex = wc.explain(gemma2)
    assert not ex.errors and len(ex.warnings) == 1 and 'attn_implementation="sdpa"' in ex.warnings[0]
    assert "masked reference: " in str(ex)


def _eager_attention(self, x, freqs_cis, route=None):
    import torch.nn.functional as F

    from test_passes_models import _group_mask, apply_rotary_emb

    bsz, seqlen, _ = x.shape
    mask = route(x) if route is not None else None
    q = self.wq(x).view(bsz, seqlen, self.n_head, self.head_dim)
    k = self.wk(x).view(bsz, seqlen, self.n_kv, self.head_dim)
    v = self.wv(x).view(bsz, seqlen, self.n_kv, self.head_dim)
    q, k = apply_rotary_emb(q, freqs_cis), apply_rotary_emb(k, freqs_cis)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    k = k.repeat_interleave(self.n_head // self.n_kv, dim=1)
    v = v.repeat_interleave(self.n_head // self.n_kv, dim=1)
    causal = torch.ones(seqlen, seqlen, dtype=torch.bool).tril()
    att = (q @ k.transpose(-1, -2) / self.head_dim ** 0.5).masked_fill(~causal, float("-inf"))
    y = F.softmax(att, dim=-1) @ v
    y = y.transpose(1, 2).contiguous().view(bsz, seqlen, self.dim)
    if mask is not None:
        y = _group_mask(y, mask)
    return self.wo(y)


def test_residual_routers_read_the_mlp_input_norm_of_gemma2():
    """router_input="residual": the FFN router reads the residual stream before the MLP's own norm, which in
    Gemma2 is pre_feedforward_layernorm (its post_attention_layernorm norms the attention output)."""
    from wide_compile.routing.attach import _route_points

    layer = tiny("gemma2").model.layers[0]
    assert _route_points(layer, 0, "residual") == (layer.input_layernorm, layer.pre_feedforward_layernorm)
    llama = tiny("llama").model.layers[0]
    assert _route_points(llama, 0, "residual") == (llama.input_layernorm, llama.post_attention_layernorm)
    phi3 = tiny("phi3").model.layers[0]
    assert _route_points(phi3, 0, "normed") == (phi3.self_attn.qkv_proj, phi3.mlp.gate_up_proj)
