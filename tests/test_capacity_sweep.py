"""benchmarks/capacity_sweep.py on synthetic run folders: the table, the log-ppl interpolation at equal
measured FLOPs, WIDE's advantage factor and one clear error per bad folder (no model, no GPU)."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import capacity_sweep as S  # noqa: E402

DENSE = 20.0
SETTINGS = {"file": "wikitext-2/wiki.test.raw", "ctx": 1024, "stride": 512, "max_tokens": None}


def _write_run(root: Path, name: str, baseline: str, target: float, measured: float, ppl: float,
               generation: dict | None = None, extra_argv=()) -> Path:
    run = root / name
    (run / "quality").mkdir(parents=True)
    argv = ["recipe", "--capacity", str(target), "--out", f"/runs/{name}", *extra_argv]
    if baseline != "none":
        argv += ["--baseline", baseline]
    (run / "summary.json").write_text(json.dumps({"baseline": baseline, "capacity": target, "argv": argv,
                                                  "device": "NVIDIA H100 80GB HBM3", "recipe": "wide"}))
    cap = {"overall": measured, "attn": measured + 0.01, "ffn": measured - 0.01, "tokens": 1000}
    rec = {"metric": "ppl", "command": "wide eval quality ...", "date": f"2026-12-06T10:{len(name):02d}:00+00:00",
           "machine": {"device_name": "NVIDIA H100 80GB HBM3"}, "settings": SETTINGS,
           "models": {"model": {"name": "SmolLM2-135M-Instruct"}},
           "result": {"ppl_ratio": ppl / DENSE, "dense": {"ppl": DENSE, "tokens": 1000},
                      "wide": {"ppl": ppl, "tokens": 1000, "capacity": cap}}}
    (run / "quality" / "ppl.json").write_text(json.dumps(rec))
    if generation is not None:
        (run / "quality" / "generation.json").write_text(json.dumps({"metric": "generation", "result": generation}))
    return run


# (method baseline, target, measured capacity, ppl): WIDE's curve 0.31 -> 0.69, the baselines' points chosen
# so that some fall between WIDE's runs, one on a WIDE run's capacity and one outside WIDE's range
POINTS = [("none", 0.3, 0.31, 80.0), ("none", 0.5, 0.49, 40.0), ("none", 0.7, 0.69, 25.0),
          ("skipgpt", 0.3, 0.29, 900.0), ("skipgpt", 0.5, 0.49, 120.0), ("skipgpt", 0.7, 0.72, 50.0),
          ("static", 0.5, 0.41, 300.0), ("static", 0.7, 0.60, 90.0)]
GEN = {"prompts": 110, "agree_at": 16, "frac_agree_at": 0.25, "mean_agreement": 9.5}


@pytest.fixture
def sweep(tmp_path):
    for base, t, m, p in POINTS:
        _write_run(tmp_path / "runs", f"{base}-{t}", base, t, m, p, generation=GEN if base == "none" and t == 0.7 else None)
    return tmp_path


def _geo(x, x0, y0, x1, y1):  # reference: straight line in log(ppl) between two points
    t = (x - x0) / (x1 - x0)
    return y0 ** (1 - t) * y1 ** t


def test_table_plot_and_advantage(sweep, capsys):
    out = sweep / "out"
    assert S.main([str(sweep / "runs"), "--out", str(out)]) == 0
    d = json.loads((out / "capacity-sweep.json").read_text())
    assert (out / "capacity-sweep.png").stat().st_size > 10_000
    assert [r["method"] for r in d["runs"]] == ["WIDE"] * 3 + ["SkipGPT-style"] * 3 + ["static"] * 2
    w7 = d["runs"][2]
    assert w7["target"] == 0.7 and w7["capacity"] == pytest.approx({"overall": 0.69, "attn": 0.7, "ffn": 0.68})
    assert w7["ratio"] == pytest.approx(25 / DENSE) and w7["generation"] == GEN
    assert w7["argv"][:3] == ["recipe", "--capacity", "0.7"]
    assert d["machines"] == {"training": ["NVIDIA H100 80GB HBM3"], "quality": ["NVIDIA H100 80GB HBM3"]}
    assert d["command"].startswith("python benchmarks/capacity_sweep.py") and d["date"]

    rows = {(e["method"], round(e["capacity"], 3)): e for e in d["equal_flops"]}
    # static at 0.41 (its own run) against WIDE interpolated between 0.31 and 0.49
    e = rows[("static", 0.41)]
    assert e["measured_by"] == "static run" and e["method_ppl"] == pytest.approx(300.0)
    assert e["wide_ppl"] == pytest.approx(_geo(0.41, 0.31, 80, 0.49, 40), rel=1e-12)
    assert e["advantage"] == pytest.approx(300 / _geo(0.41, 0.31, 80, 0.49, 40), rel=1e-12) and e["goal_met"]
    # at WIDE's run at 0.49: static's curve interpolated between 0.41 and 0.60
    e = rows[("static", 0.49)]
    assert e["wide_ppl"] == pytest.approx(40.0) and e["method_ppl"] == pytest.approx(_geo(0.49, 0.41, 300, 0.6, 90))
    # SkipGPT at WIDE's 0.69 (between its 0.49 and 0.72), and its own 0.49 run equals WIDE's measured capacity
    e = rows[("SkipGPT-style", 0.69)]
    assert e["advantage"] == pytest.approx(_geo(0.69, 0.49, 120, 0.72, 50) / 25, rel=1e-12)
    e = rows[("SkipGPT-style", 0.49)]
    assert e["advantage"] == pytest.approx(3.0) and e["measured_by"] == "WIDE run and SkipGPT-style run"
    # never extrapolated: SkipGPT's 0.29 and 0.72 lie outside WIDE's 0.31..0.69, static's curve starts at 0.41
    assert ("SkipGPT-style", 0.29) not in rows and ("SkipGPT-style", 0.72) not in rows
    assert ("static", 0.31) not in rows and ("static", 0.69) not in rows
    assert sorted(rows) == sorted([("SkipGPT-style", 0.31), ("SkipGPT-style", 0.49), ("SkipGPT-style", 0.69),
                                   ("static", 0.41), ("static", 0.49), ("static", 0.6)])
    # ratio goals: 0.5 interpolated on WIDE's curve (0.49 -> 0.69), 0.7 beyond its range
    g5, g7 = d["ratio_goals"]
    assert g5["wide_ratio"] == pytest.approx(_geo(0.5, 0.49, 40, 0.69, 25) / DENSE) and g5["met"] is False
    assert g7["wide_ratio"] is None and g7["met"] is None

    md = (out / "capacity-sweep.md").read_text()
    assert "`python benchmarks/capacity_sweep.py" in md and "NVIDIA H100 80GB HBM3" in md and "(SmolLM2-135M-Instruct," in md
    assert "| WIDE | `none-0.7` | 0.7 | 0.690 / 0.700 / 0.680 | 25.00 | **1.250** | 25% >= 16 (9.5) |" in md
    assert "log(ppl) linear in measured capacity" in md  # says how the comparison is made
    assert f"**{300 / _geo(0.41, 0.31, 80, 0.49, 40):.2f}x**" in md


def test_interpolate_log():
    pts = [(0.7, 25.0), (0.3, 100.0), (0.5, 50.0)]
    assert S.interpolate_log(pts, 0.5) == pytest.approx(50.0)
    assert S.interpolate_log(pts, 0.4) == pytest.approx(math.sqrt(100 * 50))
    assert S.interpolate_log(pts, 0.65) == pytest.approx(_geo(0.65, 0.5, 50, 0.7, 25))
    assert S.interpolate_log(pts, 0.29) is None and S.interpolate_log(pts, 0.71) is None
    assert S.interpolate_log([(0.5, 7.0)], 0.5) == 7.0 and S.interpolate_log([], 0.5) is None


def test_structure_is_its_own_method(tmp_path):
    _write_run(tmp_path, "w", "none", 0.5, 0.5, 40.0)
    _write_run(tmp_path, "cb", "none", 0.5, 0.5, 60.0, extra_argv=["--s1-structure", "codebook"])
    d = S.build([S.load_run(p) for p in S.find_runs([tmp_path])], "cmd")
    assert [r["method"] for r in d["runs"]] == ["WIDE", "WIDE (codebook)"]
    assert d["equal_flops"][0]["advantage"] == pytest.approx(1.5)


def _break(run: Path, how: str) -> None:
    if how == "no summary":
        (run / "summary.json").unlink()
    elif how == "no ppl":
        (run / "quality" / "ppl.json").unlink()
    elif how == "bad json":
        (run / "quality" / "ppl.json").write_text("{\"metric\": ")
    elif how == "no capacity":
        rec = json.loads((run / "quality" / "ppl.json").read_text())
        del rec["result"]["wide"]["capacity"]
        (run / "quality" / "ppl.json").write_text(json.dumps(rec))
    elif how == "bad generation":
        (run / "quality" / "generation.json").write_text(json.dumps({"result": {"prompts": 3}}))
    elif how == "other settings":
        rec = json.loads((run / "quality" / "ppl.json").read_text())
        rec["settings"]["max_tokens"] = 2048
        (run / "quality" / "ppl.json").write_text(json.dumps(rec))


@pytest.mark.parametrize("how,words", [("no summary", "no summary.json"), ("no ppl", "no quality/ppl.json"),
                                       ("bad json", "not valid JSON"), ("no capacity", "result.wide.capacity.overall"),
                                       ("bad generation", "result.agree_at"), ("other settings", "different ppl settings")])
def test_bad_run_folder_gives_one_clear_error(sweep, capsys, how, words):
    bad = sweep / "runs" / "none-0.7"
    _break(bad, how)
    assert S.main([str(p) for p in sorted((sweep / "runs").iterdir())] + ["--out", str(sweep / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and words in err[0], err
    assert str(bad) in err[0]
    assert not (sweep / "out").exists()


def test_duplicate_and_missing_folders(sweep, capsys):
    runs = sweep / "runs"
    assert S.main([str(runs / "none-0.5"), str(runs / "none-0.5"), "--out", str(sweep / "o")]) == 2
    assert "both WIDE at target capacity 0.5" in capsys.readouterr().err
    assert S.main([str(runs / "nope"), "--out", str(sweep / "o")]) == 2
    assert f"run folder {runs / 'nope'} does not exist" in capsys.readouterr().err
    (sweep / "empty").mkdir()
    assert S.main([str(sweep / "empty"), "--out", str(sweep / "o")]) == 2
    assert "holds none" in capsys.readouterr().err
