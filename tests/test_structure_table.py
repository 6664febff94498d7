"""benchmarks/structure_table.py: issue 24's table joins each router set's quality records with the speed records
of its own capacity and structure, and never borrows another structure's timing."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def _quality(root: Path, cap: str, name: str, ratio: float, agree=None):
    d = root / cap / name
    d.mkdir(parents=True)
    cap_rec = dict(overall=0.5, attn=0.52, ffn=0.49, tokens=1000)
    (d / "ppl.json").write_text(json.dumps(dict(result=dict(ppl_ratio=ratio, wide=dict(tokens=1000, capacity=cap_rec)))))
    if agree is not None:
        (d / "generation.json").write_text(json.dumps(dict(result=dict(
            mean_agreement=agree, agree_at=16, frac_agree_at=0.25, dense_nll_of_wide=1.1, dense_nll_of_dense=0.76))))


def _mlp(root: Path, name: str, capacity: float, prototypes: int, structure, rows):
    d = root / name
    d.mkdir(parents=True)
    (d / "bucket-mlp.json").write_text(json.dumps(dict(
        device="GPU X", args=dict(capacity=capacity, prototypes=prototypes), masks_structure=structure,
        rows=[dict(variant=v, T=T, speedup_vs_dense=x) for v, T, x in rows])))
    return d


@pytest.fixture
def study(tmp_path):
    q = tmp_path / "q"
    _quality(q, "c50", "free", 2.0, agree=2.0)
    _quality(q, "c50", "codebook64", 2.2, agree=1.0)
    _quality(q, "c50", "nested8", 8.0)
    _quality(q, "c70", "free", 1.25)
    (q / "c70" / "notes").mkdir()  # folders that are not router sets are ignored
    return q


def test_rows_pick_their_own_structures_timing(study, tmp_path):
    import structure_table as ST

    common = [("free", 1, 1.5), ("free", 2048, 1.1), ("bucket_codebook", 1, 1.8), ("bucket_codebook", 2048, 1.05),
              ("bucket_nested", 1, 1.9), ("bucket_nested", 2048, 1.2), ("bucket_recorded_unionblocks", 2048, 1.3)]
    cb = _mlp(tmp_path, "cb", 0.5, 64, "codebook", common)
    nest = _mlp(tmp_path, "nest", 0.5, 8, "nested", common)
    other_cap = _mlp(tmp_path, "c7", 0.7, 64, "codebook", [("free", 1, 9.0)])
    e2e = tmp_path / "e2e.json"
    e2e.write_text(json.dumps(dict(gpu="GPU X", records=[
        dict(phase="prefill", tokens=2048, batch=1, capacity=0.5, masks="random", speedup=1.1, static_speedup=1.8),
        dict(phase="prefill", tokens=2048, batch=1, capacity=0.5, masks="codebook64", speedup=0.9),
        dict(phase="decode", tokens=1024, batch=1, capacity=0.5, masks="nested8", speedup=1.4),
        dict(phase="decode", tokens=1024, batch=8, capacity=0.7, masks="random", speedup=0.95)])))
    rows = {(r["capacity"], r["set"]): r for r in ST.build(study, [cb, nest, other_cap], [e2e])}
    assert list(rows) == [(0.5, "free"), (0.5, "codebook64"), (0.5, "nested8"), (0.7, "free")]
    free, cb64, n8, free70 = rows.values()
    assert free["relative_to_free"] == 1 and cb64["relative_to_free"] == pytest.approx(1.1)
    assert free["mlp"][1][0] == 1.5 and free["mlp"][2048][0] == 1.1            # capacity 0.7's record not read
    assert cb64["mlp"][1][0] == 1.8 and cb64["mlp"][2048][:2] == (1.3, "bucket_recorded_unionblocks")
    assert n8["mlp"][1][0] == 1.9 and n8["mlp"][2048][:2] == (1.3, "bucket_recorded_unionblocks")  # nest's record
    assert free["e2e"][("prefill", 2048, 1)][0] == 1.1 and cb64["e2e"][("prefill", 2048, 1)][0] == 0.9
    assert n8["e2e"] == {("decode", 1024, 1): (1.4, None, "GPU X")}
    assert free70["e2e"] == {("decode", 1024, 8): (0.95, None, "GPU X")} and free70["mlp"] == {1: (9.0, "free", "GPU X", None)}
    assert n8["agreement"] is None and cb64["agreement"]["mean"] == 1.0
    md = ST.markdown(list(rows.values()))
    assert "| 0.50 | codebook 64 | 2.200 | 1.100 |" in md and "1.0 / 25 % / 1.100" in md
    assert "on GPU X" in md


def test_a_timing_at_another_capacity_says_its_capacity(study, tmp_path):
    import structure_table as ST

    # one token's nested draw runs at that token's level (0.19), not at the row's 0.5: the cell must say so
    d = tmp_path / "nest"
    d.mkdir()
    (d / "bucket-mlp.json").write_text(json.dumps(dict(
        device="GPU X", args=dict(capacity=0.5, prototypes=8), masks_structure="nested",
        rows=[dict(variant="bucket_nested", T=1, speedup_vs_dense=4.0, capacity=0.19),
              dict(variant="bucket_nested", T=16, speedup_vs_dense=0.8, capacity=0.47),
              dict(variant="bucket_recorded_unionblocks", T=2048, speedup_vs_dense=1.2, capacity=0.6)])))
    row = [r for r in ST.build(study, [d], []) if r["set"] == "nested8"][0]
    assert row["mlp"][1] == (4.0, "bucket_nested", "GPU X", 0.19)
    line = [ln for ln in ST.markdown([row]).splitlines() if ln.startswith("| 0.50 | nested 8")][0]
    assert "| 4.00x (at 0.19) / 0.80x / 1.20x (at 0.60) / - |" in line  # 0.47 is within the slack


def test_a_recording_of_another_structure_is_not_used(study, tmp_path):
    import structure_table as ST

    # a codebook-64 recording must not give the nested row its prefill figure, nor a nested one the codebook row's
    cb = _mlp(tmp_path, "cb", 0.5, 8, "codebook", [("bucket_recorded_unionblocks", 2048, 1.3),
                                                   ("bucket_nested", 1, 1.9)])
    rows = {r["set"]: r for r in ST.build(study, [cb], []) if r["capacity"] == 0.5}
    assert rows["nested8"]["mlp"] == {}
    unknown = _mlp(tmp_path, "old", 0.5, 64, None, [("bucket_recorded_unionblocks", 2048, 1.3),
                                                    ("bucket_codebook", 2048, 1.0)])
    rows = {r["set"]: r for r in ST.build(study, [unknown], []) if r["capacity"] == 0.5}
    assert rows["codebook64"]["mlp"][2048][:2] == (1.0, "bucket_codebook")  # an unlabelled recording is not trusted


def test_bad_inputs_say_what_to_do(study, tmp_path):
    import structure_table as ST

    with pytest.raises(SystemExit, match="no bucket-mlp.json"):
        ST.build(study, [tmp_path / "missing"], [])
    old = tmp_path / "old"
    old.mkdir()
    (old / "bucket-mlp.json").write_text(json.dumps(dict(rows=[], command="python other.py --x 1")))
    with pytest.raises(SystemExit, match="re-run it"):
        ST.build(study, [old], [])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit, match="no <c NN>/<set>/ppl.json"):
        ST.build(empty, [], [])


def test_a_record_without_args_is_read_through_its_command(study, tmp_path):
    import structure_table as ST

    d = tmp_path / "old"
    d.mkdir()
    rows = [dict(variant="free", T=2048, speedup_vs_dense=1.2), dict(variant="bucket_codebook", T=2048,
                                                                      speedup_vs_dense=1.1)]
    for cmd, free_seen in (("python benchmarks/bench_bucket_mlp.py --out /x --prototypes 64", True),
                           ("python benchmarks/bench_bucket_mlp.py --out /x --capacity 0.7", False)):
        (d / "bucket-mlp.json").write_text(json.dumps(dict(rows=rows, device="GPU Y", command=cmd)))
        got = {r["set"]: r["mlp"] for r in ST.build(study, [d], []) if r["capacity"] == 0.5}
        assert (got["free"] == {2048: (1.2, "free", "GPU Y", None)}) is free_seen     # defaults: capacity 0.5, P = 16
        assert (got["codebook64"] == {2048: (1.1, "bucket_codebook", "GPU Y", None)}) is free_seen


def test_a_set_scored_elsewhere_is_read_through_records_json(study, tmp_path):
    import structure_table as ST

    elsewhere = tmp_path / "elsewhere"
    _quality(elsewhere, "cX", "free", 1.5, agree=4.0)
    d = study / "c70" / "free"
    for f in d.iterdir():
        f.unlink()
    rel = lambda p: str(p.relative_to(ST.ROOT)) if p.is_relative_to(ST.ROOT) else str(p)  # noqa: E731
    (d / "records.json").write_text(json.dumps(dict(ppl=rel(elsewhere / "cX" / "free" / "ppl.json"),
                                                    generation=rel(elsewhere / "cX" / "free" / "generation.json"))))
    row = [r for r in ST.build(study, [], []) if r["capacity"] == 0.7][0]
    assert row["ppl_ratio"] == 1.5 and row["agreement"]["mean"] == 4.0
    assert row["sources"]["ppl"].endswith("cX/free/ppl.json")
    inside = [r for r in ST.build(ST.ROOT / "benchmarks/results/quality-smollm2/structures", [], [])
              if r["set"] == "free"][0]["sources"]
    assert inside["generation"].startswith("benchmarks/results/") and inside["ppl"].startswith("benchmarks/")
    (d / "records.json").write_text(json.dumps(dict(ppl="no/such/file.json")))
    with pytest.raises(SystemExit, match="is not a file"):
        ST.build(study, [], [])
    (d / "records.json").write_text(json.dumps(dict(positions="x")))
    with pytest.raises(SystemExit, match="expected ppl and generation"):
        ST.build(study, [], [])


def test_main_writes_the_table(study, tmp_path, capsys):
    import structure_table as ST

    ST.main(["--quality", str(study), "--out", str(tmp_path / "out")])
    md = (tmp_path / "out" / "structure-table.md").read_text()
    assert "not timed yet" in md and md.count("\n| 0.") == 4
    data = json.loads((tmp_path / "out" / "structure-table.json").read_text())
    assert [r["set"] for r in data["rows"]] == ["free", "codebook64", "nested8", "free"]
