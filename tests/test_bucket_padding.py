"""benchmarks/bucket_padding.py: the padding factor of token blocks per bucket, counted by hand on small cases,
and the script end to end on uniform and recorded buckets."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bucket_padding as BP  # noqa: E402


def test_padding_factor_by_hand():
    widths = torch.tensor([2, 6])
    # bucket 0: 3 tokens -> one block of 4 rows; bucket 1: 5 tokens -> two blocks (8 rows)
    bucket = torch.tensor([0, 1, 1, 0, 1, 1, 0, 1])
    assert BP.padding_factor(bucket, widths, 4) == pytest.approx((4 * 2 + 8 * 6) / (3 * 2 + 5 * 6))
    assert BP.padding_factor(bucket, widths, 1) == 1.0                   # one-row blocks never pad
    assert BP.padding_factor(torch.zeros(8, dtype=torch.long), widths, 4) == 1.0   # full blocks of one bucket
    assert BP.padding_factor(torch.tensor([0]), torch.tensor([0]), 4) == 1.0        # nothing asked


def test_union_block_factor_by_hand():
    a, b = [1, 1, 0, 0], [0, 1, 1, 0]
    m = torch.tensor([a, b, a, b, a, a], dtype=torch.bool)               # sorted: a a a a | b b (blocks of 4)
    # blocks: [b b a a] -> union 3 groups, [a a pad pad] -> 2 groups; asked 6 tokens x 2 groups
    assert BP.union_block_factor(m, 4) == pytest.approx((3 * 4 + 2 * 4) / 12)
    assert BP.union_block_factor(m, 1) == 1.0
    assert BP.union_block_factor(torch.zeros(4, 3, dtype=torch.bool), 2) == 1.0


def test_buckets_of_distinct_rows():
    m = torch.tensor([[1, 0, 1], [0, 0, 1], [1, 0, 1], [1, 1, 1]], dtype=torch.bool)
    bucket, widths = BP.buckets_of(m)
    assert bucket[0] == bucket[2] and len({int(b) for b in bucket}) == 3
    assert widths[bucket].tolist() == [2, 1, 2, 3]


def test_script_uniform_and_recorded(tmp_path):
    from record_router_masks import pack
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    protos = torch.rand(4, 6, generator=gen) < 0.5
    masks = [protos[torch.randint(0, 4, (64,), generator=gen)] for _ in range(2)]       # 2 layers, 64 tokens
    meta = {"routers": "test", "tokens": 64, "layers": 2, "window": 64}
    save_file({**{f"ffn.{i}": pack(m) for i, m in enumerate(masks)},
               **{f"attn.{i}": pack(m[:, :3]) for i, m in enumerate(masks)}}, str(tmp_path / "m.safetensors"),
              metadata={"wide": json.dumps(meta)})
    out = BP.main(["--out", str(tmp_path / "o"), "--masks", str(tmp_path / "m.safetensors"), "--ts", "32",
                   "--block-m", "8", "--prototypes", "4", "--draws", "3"])
    rows = out["rows"]
    assert [r["source"] for r in rows] == ["uniform", "recorded"]
    assert rows[1]["n"] == 4                                              # 2 layers x 2 windows of 32
    expect = [BP.padding_factor(*BP.buckets_of(m[s: s + 32]), 8) for m in masks for s in (0, 32)]
    assert rows[1]["median"] == pytest.approx(torch.tensor(expect, dtype=torch.float64).median().item(), abs=1e-4)
    assert all(r["min"] >= 1.0 for r in rows)
    assert (tmp_path / "o" / "bucket-padding.md").read_text().count("| uniform |") == 1
