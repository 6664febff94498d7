"""Quality metrics of `wide eval` against plain references on tiny random models (CPU, float64)."""
import json
import math

import pytest
import torch

import wide_compile as wc
from wide_compile.eval import eval_main
from wide_compile.eval.generation import (agreement_length, agreement_summary, continuation_nll, greedy_continuations,
                                         repeating, teacher_forced_summary, top1_along)
from wide_compile.eval.quality_metrics import summary_line
from wide_compile.eval.perplexity import perplexity, sliding_windows
from wide_compile.eval.positions import bucketize, compare_buckets, position_nll, split_articles
from wide_compile.eval.zeroshot import compare_tasks, retention_above_chance
from wide_compile.models import tiny_model


def _model():
    return tiny_model("llama", dtype=torch.float64)


def _nll_next(model, ctx_ids, target):  # brute force: one forward per scored token
    lp = torch.log_softmax(model(input_ids=ctx_ids[None]).logits[0, -1].double(), -1)
    return -float(lp[target].detach())


@pytest.mark.parametrize("n,ctx,stride", [(97, 32, 16), (64, 32, 32), (50, 64, 16), (81, 20, 7)])
def test_sliding_window_ppl_equals_brute_force(n, ctx, stride):
    model = _model()
    ids = torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(n))
    got = perplexity(model, ids=ids, ctx=ctx, stride=stride, batch_size=3)
    # reference: token t is scored in the first window (begin = k*stride, end = begin+ctx) that holds it,
    # from that window's tokens before it; a window's first token has no context and is not scored
    # (only happens when stride == ctx, as in HF's loop)
    tot, cnt = 0.0, 0
    for t in range(1, n):
        k = 0
        while k * stride + ctx <= t:
            k += 1
        if k * stride == t:
            continue
        tot += _nll_next(model, ids[k * stride:t], int(ids[t]))
        cnt += 1
    assert got["tokens"] == cnt == (n - 1 if stride < ctx else n - math.ceil(n / ctx))
    assert got["nll"] == pytest.approx(tot / cnt, rel=1e-9, abs=1e-9)
    assert got["ppl"] == pytest.approx(math.exp(tot / cnt), rel=1e-9)


def test_sliding_windows_score_each_target_once_with_enough_context():
    for n, ctx, stride in [(1000, 64, 16), (7, 4, 3), (65, 64, 32), (2, 2, 1)]:
        seen = []
        for b, e, t0 in sliding_windows(n, ctx, stride):  # stride < ctx: every target once
            seen += [b + j for j in range(t0, e - b)]
            if b > 0:
                assert t0 == ctx - stride or e == n
        assert seen == list(range(1, n))
    with pytest.raises(ValueError):
        sliding_windows(10, 4, 5)


def test_position_buckets_sum_to_total_and_match_brute_force():
    model = _model()
    g = torch.Generator().manual_seed(1)
    passages = [torch.randint(0, 128, (n,), generator=g) for n in (70, 41, 70, 9)]
    nlls = position_nll(model, passages, batch_size=3)
    for p, v in zip(passages, nlls):
        assert v.shape == (len(p) - 1,)
        for j in (1, len(p) - 1):  # position j predicted from p[:j]
            assert float(v[j - 1]) == pytest.approx(_nll_next(model, p[:j], int(p[j])), rel=1e-9)
    rows = bucketize(nlls, (0, 8, 16, 64, 128))
    assert [r["tokens"] for r in rows] == [7 * 4, 8 * 3 + 1, 48 * 2 + 25, 6 * 2]  # positions 1..len-1
    total = sum(float(v.sum()) for v in nlls)
    assert sum(r["nll_sum"] for r in rows) == pytest.approx(total, rel=1e-12)
    assert sum(r["tokens"] for r in rows) == sum(len(p) - 1 for p in passages)
    cmp = compare_buckets(rows, rows)
    assert all(r["diff"] == 0 for r in cmp if r["tokens"])


def test_split_articles_on_top_level_headings():
    text = " = A = \n x \n = = Sub = = \n y \n = B = \n z \n"
    arts = split_articles(text)
    assert len(arts) == 2 and arts[0].startswith(" = A =") and "Sub" in arts[0] and arts[1].startswith(" = B =")


def test_agreement_length():
    assert agreement_length([1, 2, 3], [1, 2, 3], cap=64) == 64  # identical (both stopped at EOS)
    assert agreement_length([5, 2, 3], [1, 2, 3], cap=64) == 0  # first token differs
    assert agreement_length([1, 2, 3, 4], [1, 2, 9, 4], cap=64) == 2
    assert agreement_length(list(range(80)), list(range(80)), cap=64) == 64
    assert agreement_length(list(range(70)), list(range(69)) + [0], cap=64) == 64  # differs after the cap
    assert agreement_length([1, 2], [1, 2, 3], cap=64) == 2


def test_batched_left_padded_generation_equals_one_by_one():
    model = _model()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 128, (n,), generator=g).tolist() for n in (5, 9, 3, 12)]
    kw = dict(max_new=8, pad_id=0, eos_ids=[7])
    batched = greedy_continuations(model, prompts, batch_size=4, **kw)
    single = [greedy_continuations(model, [p], batch_size=1, **kw)[0] for p in prompts]
    assert batched == single
    for c in batched:
        assert len(c) <= 8 and (7 not in c[:-1])
    # routed: WIDE generation takes the same batched path
    wc.attach(model, wc.Routers.init(model, wc.WideConfig(ffn_group_size=32, router_init="random")))
    assert greedy_continuations(model, prompts, batch_size=4, **kw) == \
        [greedy_continuations(model, [p], batch_size=1, **kw)[0] for p in prompts]
    wc.detach(model)


def test_continuation_nll_and_summary():
    model = _model()
    prompts = [[3, 4, 5], [9, 8]]
    conts = [[1, 2], [6, 6, 6]]
    got = continuation_nll(model, prompts, conts, batch_size=2)
    for p, c, (s, n) in zip(prompts, conts, got):
        ref = sum(_nll_next(model, torch.tensor(p + c[:j]), c[j]) for j in range(len(c)))
        assert n == len(c) and s == pytest.approx(ref, rel=1e-9)
    r = agreement_summary(prompts, conts, [[1, 2], [6, 5, 6]], model, max_new=3, agree_at=2)
    assert [x["agreement"] for x in r["per_prompt"]] == [3, 1] and r["frac_agree_at"] == 0.5
    assert r["dense_nll_of_dense"] == pytest.approx(sum(s for s, _ in got) / 5, rel=1e-9)
    assert r["wide_repeating"] == 0.0 and r["dense_repeating"] == 0.0  # no 4-token run three times in 3 tokens


@pytest.mark.parametrize("cont,loops", [
    ([5, 6, 7, 8] * 3, True),                    # one sentence three times
    ([5, 6, 7, 8] * 2 + [5, 6, 7], False),       # twice and a partial third
    ([9] * 6, True),                             # one token six times: the run (9, 9, 9, 9) three times
    ([9] * 5, False),
    ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], False),
    ([], False), ([3, 3], False),
])
def test_repeating_sees_loops_the_fluency_figure_cannot(cont, loops):
    assert repeating(cont) is loops


def test_summary_counts_repeating_answers():
    model = _model()
    loop, plain = [5, 6, 7, 8] * 3, list(range(10, 22))
    r = agreement_summary([[3, 4], [9, 8], [7]], [plain, plain, loop], [loop, loop, plain], model, max_new=12)
    assert r["wide_repeating"] == pytest.approx(2 / 3) and r["dense_repeating"] == pytest.approx(1 / 3)
    assert [p["wide_repeating"] for p in r["per_prompt"]] == [True, True, False]
    assert "repeating itself (4 tokens 3+ times): WIDE 67%, dense 33%" in summary_line("generation", r)


def test_top1_along_reproduces_greedy_and_matches_one_forward_per_prefix():
    model = _model()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 128, (n,), generator=g).tolist() for n in (4, 9)]
    conts = greedy_continuations(model, prompts, max_new=4, batch_size=2, pad_id=0, eos_ids=[])
    top = top1_along(model, prompts, conts, batch_size=1)
    for p, c, t in zip(prompts, conts, top):
        assert [x[0] for x in t] == c  # the model's own greedy answer is its argmax along itself
        for j in range(len(c)):  # each position against a forward of that prefix alone
            with torch.no_grad():
                pr = torch.softmax(model(input_ids=torch.tensor([p + c[:j]])).logits[0, -1].double(), -1)
            a, b = pr.topk(2).values.tolist()
            assert t[j][1] == pytest.approx(a, rel=1e-5) and t[j][2] == pytest.approx(b, rel=1e-5)
            assert t[j][1] >= t[j][2]


def test_teacher_forced_summary_rates_buckets_and_first_token_split():
    dense = [[1, 2, 3, 4, 5], [1, 2, 3], [7, 8]]
    # WIDE's argmax: prompt 0 differs at positions 0 and 4, prompt 1 at position 1, prompt 2 nowhere
    wide = [[(9, .5, .1), (2, .5, .1), (3, .5, .1), (4, .5, .1), (0, .5, .1)],
            [(1, .5, .1), (0, .5, .1), (3, .5, .1)], [(7, .5, .1), (8, .5, .1)]]
    # dense's own margins at the first token: a near tie for prompt 0, clear for 1 and 2
    dtop = [[(1, .40, .35)] + [(0, .9, .05)] * 4, [(1, .9, .05)] * 3, [(7, .6, .1)] * 2]
    r = teacher_forced_summary(dense, wide, dtop, agree_at=3)
    assert r["top1_agreement"] == pytest.approx(7 / 10)
    assert r["implied_frac_agree_at"] == pytest.approx((2 / 3) * (2 / 3) * 1.0)
    b = {(x["lo"], x["hi"]): x for x in r["by_position"]}
    assert b[(0, 1)]["top1_agreement"] == pytest.approx(2 / 3) and b[(0, 1)]["positions"] == 3
    assert b[(1, 4)]["top1_agreement"] == pytest.approx(5 / 6) and b[(1, 4)]["positions"] == 6
    assert b[(4, 16)]["top1_agreement"] == 0.0 and b[(16, 64)]["top1_agreement"] is None
    f = r["first_token"]
    assert f["agreement"] == pytest.approx(2 / 3) and f["dense_near_tie_prompts"] == 1
    assert f["agreement_near_tie"] == 0.0 and f["agreement_clear"] == 1.0


def test_retention_above_chance():
    assert retention_above_chance(0.55, 0.6, 0.5) == pytest.approx(0.5)
    assert retention_above_chance(0.3, 0.25, 0.25) is None
    dense = {"piqa": {"acc": 0.65, "n": 10}, "boolq": {"acc": 0.52, "n": 10}}
    wide = {"piqa": {"acc": 0.6}, "boolq": {"acc": 0.6}}
    r = compare_tasks(dense, wide, margin=0.05)
    assert r["tasks"]["piqa"]["retention_above_chance"] == pytest.approx(0.1 / 0.15)
    assert r["uninformative"] == ["boolq"] and r["mean_retention_informative"] == pytest.approx(0.1 / 0.15)


def test_ppl_without_data_fails_before_loading_the_model(tmp_path, monkeypatch, capsys):
    import wide_compile.models as models

    def boom(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(models, "load_smollm2", boom)
    monkeypatch.setenv("WIDE_DATA_DIR", str(tmp_path / "nowhere"))
    assert eval_main(["ppl"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "wiki.test.raw not found: pass --data PATH" in err[0]
    assert eval_main(["quality", "--routers", "x", "--out", str(tmp_path / "o"), "--metrics", "ppl"]) == 2
    assert "pass --data PATH" in capsys.readouterr().err
    for cmd in (["pipeline", "--out", str(tmp_path / "p")], ["tasks", "--tasks-dir", str(tmp_path / "t")],
                ["prepare", "--out", str(tmp_path / "t")]):
        assert eval_main(cmd) == 2, cmd
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "not found: pass --data PATH" in err[0] and "WIDE_DATA_DIR" in err[0], (cmd, err)


def test_help_lists_every_command_with_defaults(capsys):
    from wide_compile.eval.cli import COMMANDS

    assert eval_main([]) == 2
    out = " ".join(capsys.readouterr().out.split())  # undo argparse's line wrapping
    for name in COMMANDS:
        assert f"wide eval {name}" in out
    assert "(default: 1024)" in out and "(default: instructions-v1)" in out


def test_committed_prompt_set():
    from wide_compile.eval import prompts

    rows = prompts.load()
    assert len(rows) >= 100 and len({r["id"] for r in rows}) == len(rows)
    assert all(r["prompt"] and r["source"]["file"] for r in rows)
    assert json.loads(json.dumps(rows)) == rows


def test_generation_record_has_teacher_forced_agreement(tmp_path):
    """run_generation end to end on a tiny model with live routers: exact-prefix agreement and the teacher-forced
    figures in one record; with every group on, WIDE is dense (agreement everywhere)."""
    import types

    from wide_compile.eval.quality_metrics import run_generation

    class CharTokenizer:
        chat_template, pad_token_id, eos_token_id, unk_token_id = None, 0, 1, 2

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [3 + ord(c) % 120 for c in text]}

        def convert_tokens_to_ids(self, token):
            return self.unk_token_id

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    prompts = tmp_path / "short.jsonl"  # short prompts: the character tokenizer makes one id per character
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": t, "source": {"file": "-", "item": i}}) + "\n"
                               for i, t in enumerate(["Why is the sky blue?", "Name a tree.", "2 + 2 =", "Hi", "Go on"])))
    a = types.SimpleNamespace(prompts=str(prompts), limit=5, max_new_tokens=6, batch_size=4, agree_at=3)
    model = _model()
    for routers, full in ((wc.Routers.init(model, wc.WideConfig(ffn_group_size=32, router_init="random")), False),
                          (wc.Routers.init(model, wc.WideConfig(ffn_group_size=32, capacity=1.0)), True)):
        models = types.SimpleNamespace(dense=model, wide=model, routers=routers, tokenizer=CharTokenizer())
        res, settings = run_generation(models, a, None)
        tf = res["teacher_forced"]
        assert 0.0 <= tf["top1_agreement"] <= 1.0 and len(res["per_prompt"]) == 5
        assert all(0.0 <= p["tf_top1_agreement"] <= 1.0 and p["dense_first_margin"] >= 0 for p in res["per_prompt"])
        # a first token that agrees under teacher forcing is exactly a prefix agreement of at least one token
        assert all(p["tf_first_match"] == (p["agreement"] > 0) for p in res["per_prompt"])
        if full:
            assert tf["top1_agreement"] == 1.0 and tf["implied_frac_agree_at"] == 1.0 and res["frac_agree_at"] == 1.0


def test_capacity_along_matches_each_sequence_measured_alone():
    """capacity_along, on the masks of a batched, right-padded teacher-forced pass, equals the token-weighted capacity
    of each prompt + answer measured alone: the prompt's positions, and the positions that predict the answer's
    tokens."""
    from wide_compile.eval.generation import capacity_along
    from wide_compile.routing import record_masks
    from wide_compile.routing.measure import capacity_from_record

    model = _model()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 128, (n,), generator=g).tolist() for n in (5, 9, 3, 12, 7)]
    conts = [torch.randint(1, 128, (n,), generator=g).tolist() for n in (4, 1, 6, 3, 5)]
    routers = wc.Routers.init(model, wc.WideConfig(ffn_group_size=32, router_init="random"), seed=3)
    wc.attach(model, routers)
    try:
        with record_masks(model) as rec:
            top1_along(model, prompts, conts, batch_size=2)  # the teacher-forced pass the metric records
        got = capacity_along(routers, rec, prompts, conts, batch_size=2)
        want = {"prompt": [], "answer": []}
        for p, c in zip(prompts, conts):
            with torch.no_grad(), record_masks(model) as rec:
                model(input_ids=torch.tensor(p + c)[None])  # one sequence, no padding
            for name, (lo, hi) in (("prompt", (0, len(p))), ("answer", (len(p) - 1, len(p) - 1 + len(c)))):
                w = torch.zeros(len(p) + len(c))
                w[lo:hi] = 1  # its positions lo .. hi - 1 counted
                want[name].append((capacity_from_record(routers, rec, w), hi - lo))
    finally:
        wc.detach(model)
    for name in ("prompt", "answer"):
        tokens = sum(k for _, k in want[name])
        assert got[name]["tokens"] == tokens
        for part in ("overall", "attn", "ffn"):
            expect = sum(m[part] * k for m, k in want[name]) / tokens
            assert got[name][part] == pytest.approx(expect, abs=1e-6)
