"""Chat-formatted training blocks (training/chat.py) and the recipe's baselines (training/recipe.py)."""
import json

import numpy as np
import pytest
import torch

from wide_compile.models import tiny_model
from wide_compile.training.chat import ChatFormat, wrap_blocks
from wide_compile.training.data import TokenBlocks

# template / instruction ids are < 100; passage ids are >= 1000, so the passage is recoverable
FMT = ChatFormat(first_user=(1, 2, 3), to_assistant=(4, 5), to_user=(6, 7), instructions=((10, 11), ()),
                 user_tokens=(3, 9), assistant_tokens=(10, 40))


def _passage(w: np.ndarray) -> np.ndarray:
    return w[w >= 1000]


@pytest.mark.parametrize("L", [17, 64, 301])
def test_wrap_keeps_length_and_the_passage_in_order(L):
    block = np.arange(1000, 1000 + L, dtype=np.int64)
    w = FMT.wrap(block, np.random.default_rng(L))
    assert w.shape == (L,) and w.dtype == block.dtype
    assert tuple(w[:3]) == FMT.first_user
    p = _passage(w)
    # the passage tokens are a prefix of the block (template tokens take room, the tail is dropped) ...
    np.testing.assert_array_equal(p, block[: len(p)])
    assert len(p) >= L - 3 - 2 * 6 * (L // 13 + 1)
    # ... and the first user turn is followed by an assistant header and then passage tokens
    heads = [i for i in range(L - 1) if w[i] == 4 and w[i + 1] == 5]
    assert heads, "no assistant turn"
    assert w[heads[0] + 2] >= 1000 or heads[0] + 2 >= L


def test_wrap_turns_follow_the_template_order():
    block = np.arange(1000, 1400, dtype=np.int64)
    w = FMT.wrap(block, np.random.default_rng(0)).tolist()
    # markers in order: first_user, then alternating (to_assistant, to_user)
    marks = [t for t in w if t in (1, 4, 6)]
    assert marks[0] == 1 and marks.count(1) == 1
    alt = marks[1:]
    assert alt[0::2] == [4] * len(alt[0::2]) and alt[1::2] == [6] * len(alt[1::2])
    assert len(alt) >= 3


def test_wrap_blocks_wraps_a_seeded_fraction_only():
    blocks = (np.arange(40 * 64).reshape(40, 64) + 1000).astype(np.int64)
    w, idx = wrap_blocks(blocks, FMT, 0.25, seed=3)
    assert len(idx) == 10 and len(set(idx.tolist())) == 10
    others = np.setdiff1d(np.arange(40), idx)
    np.testing.assert_array_equal(w[others], blocks[others])
    assert all((w[i] != blocks[i]).any() for i in idx)
    w2, idx2 = wrap_blocks(blocks, FMT, 0.25, seed=3)
    np.testing.assert_array_equal(w, w2)
    np.testing.assert_array_equal(idx, idx2)
    w0, idx0 = wrap_blocks(blocks, FMT, 0.0)
    np.testing.assert_array_equal(w0, blocks)
    assert len(idx0) == 0
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        wrap_blocks(blocks, FMT, 1.5)


def test_token_blocks_wrap_train_blocks_and_keep_heldout_plain():
    toks = np.arange(1000, 1000 + 64 * 100)
    plain = TokenBlocks(toks, 64)
    chat = TokenBlocks(toks, 64, chat=FMT, chat_frac=0.5)
    torch.testing.assert_close(chat.heldout, plain.heldout)
    assert len(chat.chat_rows) == round(0.5 * len(plain.train))
    diff = (chat.train != plain.train).any(1)
    assert diff.sum().item() == len(chat.chat_rows)
    assert chat.train.dtype == torch.int64
    with pytest.raises(ValueError, match="ChatFormat"):
        TokenBlocks(toks, 64, chat_frac=0.5)


class _FakeTok:
    """A character-level tokenizer with a SmolLM2-like template."""
    chat_template = "x"

    def apply_chat_template(self, msgs, tokenize=False, add_generation_prompt=False):
        s = "<s>sys</s>"
        for m in msgs:
            s += f"<{m['role']}>{m['content']}</e>"
        return s + ("<assistant>" if add_generation_prompt else "")

    def __call__(self, s, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in s]}


def test_from_tokenizer_splits_the_template_into_its_pieces():
    f = ChatFormat.from_tokenizer(_FakeTok())
    dec = lambda ids: "".join(map(chr, ids))  # noqa: E731
    assert dec(f.first_user) == "<s>sys</s><user>"
    assert dec(f.to_assistant) == "</e><assistant>"
    assert dec(f.to_user) == "</e><user>"
    assert dec(f.instructions[0]) == "Continue this text:"

    class NoTemplate(_FakeTok):
        chat_template = None

    with pytest.raises(ValueError, match="chat template"):
        ChatFormat.from_tokenizer(NoTemplate())


def test_static_baseline_stage1_is_constant_routers_at_the_capacity(tmp_path):
    from wide_compile.routing import Routers, measure_capacity, routed
    from wide_compile.training.recipe import _apply_baseline, _static_stage1, configs, parse

    a = parse(["--out", str(tmp_path), "--smoke", "--baseline", "static", "--capacity", "0.6"])
    c1, c2 = configs(a)
    model = tiny_model("smollm2", intermediate_size=512)
    _apply_baseline("static", model, c1, c2)
    assert c2.joint is False
    blocks = TokenBlocks(np.random.default_rng(0).integers(0, model.config.vocab_size, 64 * 200), 64)
    r = _static_stage1(model, blocks, c1, tmp_path / "stage1", log=lambda *_: None)
    assert r.kind == "constant"
    again = Routers.load(tmp_path / "stage1" / "routers.safetensors", model)
    x = blocks.heldout[:2]
    with routed(model, again):
        cap = measure_capacity(model, x)["overall"]
    assert abs(float(cap) - 0.6) < 0.03
    assert json.loads((tmp_path / "stage1" / "ckpt" / "state.json").read_text())["trained"] is True


def test_skipgpt_baseline_has_one_group_per_module():
    from wide_compile.training.recipe import _apply_baseline, configs, parse

    a = parse(["--out", "x", "--smoke", "--baseline", "skipgpt"])
    c1, c2 = configs(a)
    model = tiny_model("smollm2", intermediate_size=512)
    _apply_baseline("skipgpt", model, c1, c2)
    cfg = c1.wide_config(model)
    assert cfg.head_group_size == model.config.num_attention_heads and cfg.ffn_group_size == 512


class _IntTokenizer:
    """Text of space-separated token ids -> those ids (the smoke model has no tokenizer)."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [int(w) for w in text.split()]}


def _executed_fraction(model, routers, windows) -> float:
    """Reference capacity: per scored token, executed linear FLOPs over dense, from the recorded masks and the
    DESIGN.md accounting written out (k, v always; q, o per head group; gate, up, down per FFN group; routers)."""
    from wide_compile.routing import record_masks, routed

    c = model.config
    hd = c.hidden_size // c.num_attention_heads
    qo, kv = 4 * c.hidden_size * c.num_attention_heads * hd, 4 * c.hidden_size * c.num_key_value_heads * hd
    ffn = 6 * c.hidden_size * c.intermediate_size
    ra, rf = routers.flops_per_token()
    executed, tokens = 0.0, 0
    with routed(model, routers), record_masks(model) as rec, torch.no_grad():
        for w in windows:
            model(input_ids=w[None])
    for k in range(len(windows)):
        for i in range(c.num_hidden_layers):
            fa = rec["attn"][i][k][0, 1:].double().mean(-1)  # [S-1]: the scored tokens' active head-group share
            ff = rec["ffn"][i][k][0, 1:].double().mean(-1)
            executed += float((kv + ra[i] + rf[i] + fa * qo + ff * ffn).sum())
        tokens += windows[k].numel() - 1
    return executed / (tokens * c.num_hidden_layers * (qo + kv + ffn))


@pytest.mark.parametrize("baseline", ["static", "skipgpt"])
def test_baseline_run_gives_a_quality_record_with_its_measured_capacity(tmp_path, baseline):
    """recipe --baseline static|skipgpt -> its routers + LoRA load as `wide eval quality` loads them -> the ppl
    record carries the FLOP-weighted capacity measured on the scored tokens -> the capacity sweep reads it."""
    import argparse
    import copy
    import sys
    from pathlib import Path

    from wide_compile.eval import quality_metrics, records
    from wide_compile.eval.quality import Models
    from wide_compile.routing import Routers
    from wide_compile.training import recipe
    from wide_compile.training.options import smoke_model_and_tokens
    from wide_compile.training.stage2 import load_lora_merged

    run = tmp_path / "run"
    assert recipe.main(["--smoke", "--baseline", baseline, "--capacity", "0.5", "--out", str(run),
                        "--s1-epochs", "0.01", "--s2-epochs", "0.01", "--s1-eval-every", "100", "--s2-eval-every", "100",
                        "--s1-eval-blocks", "2", "--s2-eval-blocks", "2", "--s1-calib-blocks", "4"]) == 0
    model, toks = smoke_model_and_tokens("cpu")
    routers = Routers.load(run / "routers.safetensors", model)  # as wide_compile/eval/quality.py loads them
    wide = load_lora_merged(copy.deepcopy(model), run / "lora.safetensors")
    (tmp_path / "data" / "wikitext-2").mkdir(parents=True)
    ids = torch.as_tensor(toks[-64 * 5:])
    (tmp_path / "data" / "wikitext-2" / "wiki.test.raw").write_text(" ".join(map(str, ids.tolist())))
    models = Models(model, wide, routers, _IntTokenizer(), {"model": {"name": "smoke"}, "dtype": "float32"})
    a = argparse.Namespace(ctx=64, stride=64, batch_size=2, max_tokens=None, dense_cache="none", device="cpu")
    result, settings = quality_metrics.run_ppl(models, a, tmp_path / "data")
    rec = records.make_record("ppl", result, command="test", models=models.describe, settings=settings, device="cpu")
    records.write_record(run / "quality", rec)

    cap = result["wide"]["capacity"]
    assert cap["tokens"] == 5 * 63
    assert cap["overall"] == pytest.approx(_executed_fraction(wide, routers, list(ids.reshape(5, 64))), abs=1e-6)
    if baseline == "static":  # constant masks: no router FLOPs, the same share for every token, at the target
        assert routers.kind == "constant" and routers.flops_per_token() == ([0, 0], [0, 0])
        assert abs(cap["overall"] - 0.5) < 0.03
    else:  # one bit per module
        assert routers.cfg.num_head_groups(routers.spec) == 1 and routers.cfg.num_ffn_groups(routers.spec) == 1

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import capacity_sweep

    got = capacity_sweep.load_run(run)
    assert got.method == {"static": "static", "skipgpt": "SkipGPT-style"}[baseline] and got.target == 0.5
    assert got.capacity == pytest.approx({k: cap[k] for k in ("overall", "attn", "ffn")})
