"""training/lora_rank.py: a LoRA cut to a lower rank by the SVD of each update, checked against the SVD of the
update itself in float64 (the best rank-k approximation is unique for distinct singular values); a LoRA grown to a
higher rank, checked to keep its update exactly."""
import json

import pytest
import torch
from safetensors.torch import save_file

from wide_compile.training.lora_rank import lower_rank, main, raise_rank
from wide_compile.training.stage2 import read_lora

MODS = {"base_model.model.model.layers.0.self_attn.q_proj": (24, 24), "base_model.model.model.layers.0.mlp.down_proj":
        (24, 40), "base_model.model.model.layers.1.mlp.gate_proj": (40, 24)}   # module: (out, in)


def lora(rank, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {**{f"{m}.lora_A.weight": torch.randn(rank, i, generator=gen, dtype=torch.float64) for m, (o, i) in MODS.items()},
            **{f"{m}.lora_B.weight": torch.randn(o, rank, generator=gen, dtype=torch.float64) for m, (o, i) in MODS.items()}}


def updates(state, rank, alpha):
    return {m: alpha / rank * state[f"{m}.lora_B.weight"].double() @ state[f"{m}.lora_A.weight"].double() for m in MODS}


def best(dw, k):
    u, s, vh = torch.linalg.svd(dw)
    return (u[:, :k] * s[:k]) @ vh[:k], float((s[:k] ** 2).sum()), float((s ** 2).sum())


@pytest.mark.parametrize("k", [1, 3, 8])
def test_each_update_becomes_its_best_rank_k_approximation(k):
    state, rank, alpha = lora(8), 8, 16
    out, new_alpha, kept = lower_rank(state, rank, alpha, k)
    assert new_alpha == alpha * k // rank and set(out) == set(state)
    got, want = updates(out, k, new_alpha), updates(state, rank, alpha)
    num = den = 0.0
    for m in MODS:
        ref, e_k, e = best(want[m], k)
        assert out[f"{m}.lora_A.weight"].shape == (k, MODS[m][1]) and out[f"{m}.lora_B.weight"].shape == (MODS[m][0], k)
        assert torch.allclose(got[m], ref, atol=1e-9 * ref.abs().max()), m
        num, den = num + e_k, den + e
    assert kept == pytest.approx(num / den, rel=1e-9)
    if k == rank:
        assert kept == pytest.approx(1.0) and all(torch.allclose(got[m], want[m], atol=1e-9) for m in MODS)


def test_bad_ranks_and_states_are_clear_errors():
    state = lora(8)
    with pytest.raises(ValueError, match=r"in \[1, 8\]"):
        lower_rank(state, 8, 16, 9)
    with pytest.raises(ValueError, match="not an integer"):
        lower_rank(state, 8, 12, 3)  # alpha 12 * 3 / 8 = 4.5
    with pytest.raises(ValueError, match="not a LoRA state"):
        lower_rank({"x.lora_A.weight": state[next(iter(state))]}, 8, 16, 4)


def test_command_writes_a_lora_the_loaders_read(tmp_path, capsys):
    state, src = lora(8, seed=1), tmp_path / "r8.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in state.items()}, str(src),
              metadata={"rank": "8", "alpha": "16", "targets": json.dumps(["down_proj", "gate_proj", "q_proj"])})
    assert main([str(src), "--rank", "4", "--out", str(tmp_path / "r4.safetensors")]) == 0
    rec = json.loads(capsys.readouterr().out)
    sd, rank, alpha, targets = read_lora(tmp_path / "r4.safetensors")
    assert (rank, alpha, targets) == (4, 8, ["down_proj", "gate_proj", "q_proj"]) and rec["source_rank"] == 8
    assert all(v.dtype == torch.bfloat16 for v in sd.values())
    src_sd = read_lora(src)[0]
    for m, dw in updates(sd, 4, 8).items():
        ref = best(updates(src_sd, 8, 16)[m], 4)[0]
        assert ((dw - ref).norm() / ref.norm()).item() < 1e-2   # bf16 factors


@pytest.mark.parametrize("k", [9, 16, 32])
def test_a_grown_adapter_keeps_its_update_and_gets_fresh_directions(k):
    state, rank, alpha = lora(8, seed=2), 8, 16
    out, new_alpha = raise_rank(state, rank, alpha, k, seed=3)
    assert new_alpha == alpha * k // rank and set(out) == set(state)
    got, want = updates(out, k, new_alpha), updates(state, rank, alpha)
    for m, (o, i) in MODS.items():
        a, b = out[f"{m}.lora_A.weight"], out[f"{m}.lora_B.weight"]
        assert a.shape == (k, i) and b.shape == (o, k)
        assert torch.equal(a[:rank], state[f"{m}.lora_A.weight"]) and torch.equal(b[:, :rank], state[f"{m}.lora_B.weight"])
        assert torch.all(b[:, rank:] == 0) and a[rank:].abs().max() <= i ** -0.5
        assert torch.linalg.matrix_rank(a[rank:]) == min(k - rank, i)   # new rows: directions, not zeros
        assert torch.allclose(got[m], want[m], rtol=0, atol=1e-12 * want[m].abs().max()), m


def test_growing_errors_and_the_command_grows(tmp_path, capsys):
    state = lora(8, seed=4)
    with pytest.raises(ValueError, match="above 8"):
        raise_rank(state, 8, 16, 8)
    with pytest.raises(ValueError, match="not an integer"):
        raise_rank(state, 8, 12, 9)  # alpha 12 * 9 / 8 = 13.5
    src = tmp_path / "r8.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in state.items()}, str(src),
              metadata={"rank": "8", "alpha": "16", "targets": json.dumps(["down_proj", "gate_proj", "q_proj"])})
    assert main([str(src), "--rank", "32", "--out", str(tmp_path / "r32.safetensors")]) == 0
    rec = json.loads(capsys.readouterr().out)
    sd, rank, alpha, _ = read_lora(tmp_path / "r32.safetensors")
    assert (rank, alpha, rec["kept_update_energy"]) == (32, 64, 1.0)
    src_sd = read_lora(src)[0]
    for m, dw in updates(sd, 32, 64).items():
        assert torch.equal(dw, updates(src_sd, 8, 16)[m])   # bf16 in, bf16 out: the same factors, zeros beside them
