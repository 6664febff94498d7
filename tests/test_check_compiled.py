"""The GPU check script's verdicts, exercised on the CPU: the replayed-mask check passes on a correct
compile and fails when the compiled model's masks or numbers are wrong."""
import importlib
import sys
from pathlib import Path

import pytest
import torch

import wide_compile as wc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
C = importlib.import_module("check_compiled_gpu")


@pytest.fixture(autouse=True)
def _fresh_frames():
    """Each case compiles the same model code afresh (the GPU check runs each in its own process): here they share
    one, so each starts with no compiled frames and cannot meet Dynamo's recompile limit."""
    torch._dynamo.reset()


def test_replay_verdict_passes_and_fails():
    g = torch.Generator().manual_seed(0)
    exact = torch.randn(2, 5, 50, generator=g, dtype=torch.float64)
    eager = exact + 1e-2 * torch.randn(exact.shape, generator=g, dtype=torch.float64)  # ~40 dB
    good = exact + 1e-2 * torch.randn(exact.shape, generator=g, dtype=torch.float64)
    bad = exact + 1e-1 * torch.randn(exact.shape, generator=g, dtype=torch.float64)  # 20 dB worse
    assert C.replay_verdict(good, eager, exact)["ok"]
    v = C.replay_verdict(bad, eager, exact)
    assert not v["ok"] and v["sqnr_compiled_db"] < v["sqnr_eager_db"] - 15
    keep = torch.ones(2, 5, dtype=torch.bool)
    keep[0, :2] = False
    junk = good.clone()
    junk[0, :2] = 1e6  # pad positions: excluded
    assert C.replay_verdict(junk, eager, exact, keep)["ok"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_check_replay_cpu(dtype):
    r = C.check_replay("llama", lambda: wc.models.tiny_model("llama", seed=0), torch.device("cpu"), dtype,
                       seqs=((1, 40), (3, 1)))
    assert r["ok"], r
    assert all(0 < c["ffn_on"] < 1 for c in r["cases"])


def test_replay_check_catches_wrong_masks(monkeypatch):
    """A compiled model that runs other masks than the reference must fail the verdict."""
    real_optimize = wc.optimize

    def optimize_with_flipped_masks(model, routers, **kw):
        flipped = wc.Routers.replay(model, routers.cfg,
                                    {k: [~getattr(routers, k)[i].mask for i in range(len(getattr(routers, k)))]
                                     for k in ("attn", "ffn")})
        return real_optimize(model, flipped, **kw)

    monkeypatch.setattr(C.wc, "optimize", optimize_with_flipped_masks)
    r = C.check_replay("llama", lambda: wc.models.tiny_model("llama", seed=0), torch.device("cpu"), torch.float32,
                       seqs=((1, 24),))
    assert not r["ok"], r


def test_check_tiny_sparse_attention_cpu():
    """The GPU check's sparse-attention case runs on the CPU too (the ops run their references there): constant
    masks, KV-aligned groups, and generate()'s decode graphs rewritten to wide.attn_decode."""
    r = C.check_tiny("llama", "constant", torch.device("cpu"), torch.float32, "sparse-attention")
    assert r["ok"], r
    assert r["sdpa_decode_rewritten"] > 0 and r["generate_identical"]


def test_check_tiny_lean_cpu():
    """The GPU check's lean case runs on the CPU too (the ops run their references there): pair routers fused with
    each block's residual add and norm, a batch-1 decode on the one-token GEMV path, generate() identical."""
    r = C.check_tiny("llama", "random", torch.device("cpu"), torch.float32, "lean")
    assert r["ok"], r
    assert r["residual_adds_fused"] > 0 and r["gemv_ops"] > 0 and r["generate_identical"]


def test_check_tiny_summed_cpu():
    """The GPU check's summed case on the CPU: the decode-size routers as reductions, generate() identical at
    batch 2 and 1."""
    r = C.check_tiny("llama", "random", torch.device("cpu"), torch.float32, "summed")
    assert r["ok"], r
    assert r["routers_summed"] > 0 and r["generate_identical"]


def test_check_tiny_split_cpu():
    """The GPU check's split case on the CPU in bf16 (the split needs bf16 inputs): the prefill graph's composed
    pair routers run over a bf16 pair (router_dtype="bf16x2"), logits within the check's tolerance, generate()
    identical."""
    r = C.check_tiny("llama", "random", torch.device("cpu"), torch.bfloat16, "split")
    assert r["ok"], r
    assert r["routers_split"] > 0 and r["generate_identical"]


def test_check_tiny_fused_prefill_cpu():
    """The GPU check's fused-prefill case on the CPU (the fused op's reference body): the prefill graphs' norms and
    routers fused, the decode steps' routers summed, logits within the check's tolerance, generate() identical."""
    r = C.check_tiny("llama", "random", torch.device("cpu"), torch.float32, "fused-prefill")
    assert r["ok"], r
    assert r["routers_fused"] > 0 and r["routers_summed"] > 0 and r["generate_identical"]
