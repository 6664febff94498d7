"""benchmarks/agreement_diagnosis.py end to end on tiny random models standing in for SmolLM2 (CPU): the dense
model against itself agrees everywhere, a routed variant and a LoRA-merged one are scored along dense's answers."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))


def test_variants_along_the_dense_answers(tmp_path, monkeypatch):
    import agreement_diagnosis
    from test_generation_floor import WordTokenizer

    import wide_compile as wc
    from wide_compile.models import smollm2, tiny_model
    from wide_compile.training.stage2 import apply_lora, save_lora

    def load(dtype=torch.float32, device="cpu", gguf_path=None, download=True):
        return tiny_model("llama", seed=0, dtype=dtype), WordTokenizer()

    monkeypatch.setattr(smollm2, "load_smollm2", load)
    base = tiny_model("llama", seed=0)
    r = tmp_path / "routers.safetensors"
    wc.Routers.init(base, wc.WideConfig(ffn_group_size=32, router_init="random")).save(r)
    pm = apply_lora(tiny_model("llama", seed=0), rank=4, alpha=8)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)  # a LoRA that changes the model
    lora = tmp_path / "lora.safetensors"
    save_lora(pm, lora)
    out = agreement_diagnosis.main(["--out", str(tmp_path / "o"), "--limit", "6", "--max-new-tokens", "8",
                                    "--agree-at", "4", "--batch-size", "4", "--variants", "same:none:none",
                                    f"routed:{r}:none", f"lora:none:{lora}"])
    rec = json.loads((tmp_path / "o" / "agreement-diagnosis.json").read_text())
    assert rec == json.loads(json.dumps(out)) and out["n_prompts"] == 6
    v = out["variants"]
    assert v["same"]["top1_agreement"] == 1.0 and v["same"]["implied_frac_agree_at"] == 1.0
    assert v["same"]["first_token"]["agreement"] == 1.0
    assert v["routed"]["top1_agreement"] < 1.0 and v["lora"]["top1_agreement"] < 1.0
    md = (tmp_path / "o" / "agreement-diagnosis.md").read_text()
    assert out["command"] in md and "| routed |" in md


def test_bad_variant_specs_are_one_clear_error():
    import agreement_diagnosis

    for spec in ("x", "a:b", ":r:l", "a:r:l:float16"):
        with pytest.raises(SystemExit, match="variants"):
            agreement_diagnosis.parse_variant(spec)
