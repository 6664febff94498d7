"""Dense-answer distillation blocks (training/dense_answers.py) and their mixing into the train blocks."""
import json

import numpy as np
import pytest
import torch

from wide_compile.models import tiny_model
from wide_compile.training.chat import ChatFormat
from wide_compile.training.data import TokenBlocks
from wide_compile.training.dense_answers import build_prompts, generate, load_answers, pack_blocks

# template / instruction ids are < 100; passage ids are >= 1000
FMT = ChatFormat(first_user=(1, 2, 3), to_assistant=(4, 5), to_user=(6, 7), instructions=((10, 11), ()))
EOS = 999


def _stream(n=5000, seed=0):
    t = np.random.default_rng(seed).integers(1000, 1200, n)
    t[np.random.default_rng(seed + 1).choice(n, n // 50, replace=False)] = EOS  # document boundaries
    return t


def test_prompts_are_template_instruction_and_one_documents_span():
    toks = _stream()
    word = np.zeros(1300, bool)
    word[1000:1100] = True  # ids 1000-1099 begin a word
    ps = build_prompts(FMT, toks, 200, np.random.default_rng(0), (5, 30), eos_id=EOS, word_start=word)
    assert len(ps) == 200
    s = "," + ",".join(map(str, toks.tolist())) + ","
    for p in ps:
        assert tuple(p[:3]) == FMT.first_user and tuple(p[-2:]) == FMT.to_assistant
        body = p[3:-2]
        if body[:2] == [10, 11]:
            body = body[2:]
        assert 1 <= len(body) <= 30 and EOS not in body
        assert 1000 <= body[0] < 1100  # starts at a word
        assert "," + ",".join(map(str, body)) + "," in s  # a contiguous span of the stream
    assert {tuple(p[3:5]) == (10, 11) for p in ps} == {True, False}  # both instructions drawn


def test_prompts_refuse_bad_passage_lengths_and_streams_without_word_starts():
    with pytest.raises(ValueError, match="passage lengths"):
        build_prompts(FMT, _stream(), 3, np.random.default_rng(0), (0, 4))
    with pytest.raises(ValueError, match="starts a word"):
        build_prompts(FMT, _stream(), 3, np.random.default_rng(0), (2, 4), word_start=np.zeros(1300, bool))


@pytest.mark.parametrize("L", [7, 16, 50])
def test_pack_blocks_holds_every_exchange_in_order_without_padding(L):
    rng = np.random.default_rng(L)
    prompts = [[1, 2, 3] + [1000 + i] * int(rng.integers(1, 6)) + [4, 5] for i in range(30)]
    answers = [[2000 + i] * int(rng.integers(0, 25)) for i in range(30)]
    b = pack_blocks(prompts, answers, L)
    assert b.shape[1] == L and b.dtype == np.int64 and (b > 0).all()
    flat = b.reshape(-1).tolist()
    # each exchange that fits a block appears whole somewhere, starting a template turn
    for p, a in zip(prompts, answers):
        ex = p + a
        if len(ex) <= L:
            assert any(flat[k:k + len(ex)] == ex for k in range(0, len(flat) - len(ex) + 1)), ex
    # every block starts with an exchange's first tokens
    assert all(tuple(r[:3]) == (1, 2, 3) for r in b.tolist())
    with pytest.raises(ValueError, match="answers"):
        pack_blocks(prompts, answers[:-1], L)


def test_pack_blocks_truncates_an_exchange_longer_than_a_block():
    b = pack_blocks([[1, 2, 3, 4, 5]], [[7] * 20], 8)
    assert b.tolist() == [[1, 2, 3, 4, 5, 7, 7, 7]]


def test_generate_packs_the_models_own_greedy_answers():
    model = tiny_model("smollm2")
    v = model.config.vocab_size
    toks = np.random.default_rng(0).integers(10, v - 3, 3000)
    fmt = ChatFormat(first_user=(v - 1, 5), to_assistant=(v - 2, 8), to_user=(v - 2, 7), instructions=((9,), ()))
    blocks, st = generate(model, toks, fmt, n=6, seq_len=40, max_new=5, batch_size=4, eos_ids=[v - 3],
                          passage=(3, 8), log=lambda *_: None)
    assert st["prompts"] == 6 and blocks.shape[1] == 40
    # the first block starts with the first exchange: its answer is the model's greedy continuation of its prompt
    row = blocks[0].tolist()
    cut = row.index(8, 2) + 1  # the end of the first prompt (assistant header)
    x = torch.tensor([row[:cut]])
    with torch.no_grad():
        want = model.generate(input_ids=x, max_new_tokens=5, do_sample=False, pad_token_id=0)[0, cut:].tolist()
    if v - 3 in want:
        want = want[:want.index(v - 3) + 1]
    assert row[cut:cut + len(want)] == want


def test_token_blocks_mix_answers_into_plain_rows_only():
    chat_fmt = ChatFormat(first_user=(1, 2), to_assistant=(3,), to_user=(4,), instructions=((),),
                          user_tokens=(2, 4), assistant_tokens=(4, 8))
    toks = np.random.default_rng(0).integers(1000, 1100, 64 * 110)
    ans = np.full((7, 64), 5, np.int64) + np.arange(7)[:, None]
    plain = TokenBlocks(toks, 64)
    b = TokenBlocks(toks, 64, chat=chat_fmt, chat_frac=0.3, answers=ans, answers_frac=0.4, seed=2)
    n = len(b.train)
    assert len(b.answer_rows) == round(0.4 * n) and not set(b.answer_rows) & set(b.chat_rows.tolist())
    for k, i in enumerate(b.answer_rows):
        np.testing.assert_array_equal(b.train[i].numpy(), ans[k % 7])  # cycling through the answers
    rest = np.setdiff1d(np.arange(n), np.concatenate([b.answer_rows, b.chat_rows]))
    np.testing.assert_array_equal(b.train[rest].numpy(), plain.train[rest].numpy())
    np.testing.assert_array_equal(b.heldout.numpy(), plain.heldout.numpy())  # held-out stays plain text
    with pytest.raises(ValueError, match="add up"):
        TokenBlocks(toks, 64, chat=chat_fmt, chat_frac=0.7, answers=ans, answers_frac=0.4)
    with pytest.raises(ValueError, match="seq-len 64"):
        TokenBlocks(toks, 64, answers=ans[:, :32], answers_frac=0.1)
    with pytest.raises(ValueError, match="answer blocks"):
        TokenBlocks(toks, 64, answers_frac=0.1)


def test_answers_command_then_stage2_trains_on_them(tmp_path):
    from wide_compile.training import train_main

    out = tmp_path / "answers.npy"
    assert train_main(["answers", "--smoke", "--out", str(out), "--n", "24", "--max-new", "6", "--seq-len", "64",
                       "--batch-size", "12", "--passage-tokens", "4", "16", "--device", "cpu"]) == 0
    rec = json.loads(out.with_suffix(".json").read_text())
    assert rec["prompts"] == 24 and rec["max_new_tokens"] == 6 and "answers --smoke" in rec["command"]
    assert load_answers(out, 64).shape[1] == 64
    with pytest.raises(ValueError, match="--seq-len 128"):
        load_answers(out, 128)
    from wide_compile.config import WideConfig
    from wide_compile.routing import Routers
    from wide_compile.training.options import smoke_model_and_tokens

    Routers.init(smoke_model_and_tokens("cpu", n_tokens=10)[0], WideConfig()).save(tmp_path / "routers.safetensors")
    assert train_main(["stage2", "--smoke", "--routers", str(tmp_path / "routers.safetensors"),
                       "--out", str(tmp_path / "s2"), "--device", "cpu", "--steps", "2", "--eval-every", "100",
                       "--chat-frac", "0.2",
                       "--answers", str(out), "--answers-frac", "0.3"]) == 0
    assert (tmp_path / "s2" / "lora.safetensors").is_file()
