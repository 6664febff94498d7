"""benchmarks/generation_floor.py end to end on tiny random models standing in for SmolLM2 (CPU): each variant's
continuations are compared with the reference model's, and the records name their command and machine."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


class WordTokenizer:
    """Enough of a tokenizer for encode_prompts / greedy_continuations: one id per character, no chat template."""
    chat_template = None
    pad_token_id = 0
    eos_token_id = 1
    unk_token_id = 2

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3 + ord(c) % 120 for c in text]}

    def convert_tokens_to_ids(self, token):
        return self.unk_token_id


def test_variants_are_scored_against_the_fp32_reference(tmp_path, monkeypatch):
    import generation_floor

    from wide_compile.models import smollm2, tiny_model

    def load(dtype=torch.float32, device="cpu", gguf_path=None, download=True):
        # the "bf16" model differs in its weights too, so its answers must differ from the reference's
        seed = 0 if dtype == torch.float32 else 1
        return tiny_model("llama", seed=seed, dtype=dtype), WordTokenizer()

    monkeypatch.setattr(smollm2, "load_smollm2", load)
    out = generation_floor.main(["--out", str(tmp_path), "--limit", "6", "--max-new-tokens", "8", "--agree-at", "4",
                                 "--batch-size", "4"])
    assert json.loads((tmp_path / "generation-floor.json").read_text()) == json.loads(json.dumps(out))
    md = (tmp_path / "generation-floor.md").read_text()
    assert out["command"] in md and out["n_prompts"] == 6
    same, other = out["variants"]["fp32_eager"], out["variants"]["bf16"]
    assert same["agreement_per_prompt"] == [8] * 6 and same["mean_agreement"] == 8 and same["frac_agree_at"] == 1
    assert len(other["agreement_per_prompt"]) == 6 and other["mean_agreement"] < 8
    assert other["dense_nll_of_dense"] == same["dense_nll_of_dense"]   # both scored by the one reference model
