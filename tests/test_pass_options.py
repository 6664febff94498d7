"""PassOptions: the one config of which optional passes run — its pass lists, its checks, and the backend and
optimize reading it."""
from __future__ import annotations

import pytest
import torch

import wide_compile as wc
from wide_compile.backend import wide_backend
from wide_compile.models import tiny_model
from wide_compile.passes import PassManager, PassOptions, default_passes


def _names(passes) -> list[str]:
    return [type(p).__name__ for p in passes]


def test_default_pass_order():
    assert _names(default_passes()) == ["DetectSwiGLU", "DetectAttention", "InsertRouters", "MatchBuckets",
                                        "RewriteMLP", "RewriteAttention", "RewriteSDPA", "ComposeRouters",
                                        "FuseRouterGemm", "SplitRouters", "SumRouters"]
    assert _names(default_passes(PassOptions())) == _names(default_passes())


def test_every_optional_pass_on_keeps_the_order():
    on = PassOptions(fuse_norm_router=True, fuse_router_select=True, fuse_gate_up=True)
    assert _names(default_passes(on))[-6:] == ["ComposeRouters", "FuseRouterGemm", "FuseNormRouter", "SplitRouters",
                                               "SumRouters", "FuseRouterSelect"]


@pytest.mark.parametrize("field,cls", [("compose_routers", "ComposeRouters"), ("fuse_router_gemm", "FuseRouterGemm"),
                                       ("split_routers", "SplitRouters"), ("sum_routers", "SumRouters"),
                                       ("sparse_attention", "RewriteSDPA")])
def test_each_default_pass_turns_off(field, cls):
    assert cls in _names(default_passes())
    assert cls not in _names(default_passes(**{field: False}))


def test_bad_values_and_names_are_errors():
    for kw in ({"sum_routers": 1}, {"fuse_router_gemm": "yes"}, {"fuse_norm_router": "decode"},
               {"sparse_attention": None}):
        with pytest.raises(ValueError, match=f"{next(iter(kw))} must be"):
            PassOptions(**kw)
    with pytest.raises(TypeError):
        PassOptions(fuse_routers=True)
    with pytest.raises(TypeError, match="not both"):
        default_passes(PassOptions(), sum_routers=False)
    with pytest.raises(TypeError, match="not both"):
        PassManager(default_passes(), sum_routers=False)


def test_from_mapping_picks_its_keys_and_reads_truth():
    o = PassOptions.from_mapping({"sum_routers": 0, "fuse_norm_router": "prefill", "mode": "default",
                                  "fuse_router_gemm": 1})
    assert o == PassOptions(sum_routers=False, fuse_norm_router="prefill", fuse_router_gemm=True)
    with pytest.raises(ValueError, match="fuse_norm_router must be"):
        PassOptions.from_mapping({"fuse_norm_router": "decode"})  # a string is a choice, not a truth value


def test_backend_and_optimize_take_the_options():
    """torch.compile's options reach the pass list: with fuse_router_gemm / split_routers / sum_routers off no router
    pass runs, and a bad string is an error before anything compiles."""
    model = tiny_model("llama")
    wc.attach(model, wc.Routers.init(model, wc.WideConfig(router_init="random"), seed=1))

    def routing_counts(**options) -> dict:
        seen = []
        torch._dynamo.reset()
        fn = torch.compile(model, backend=wide_backend, options={"inductor": False, "report": seen.append, **options})
        with torch.no_grad():
            fn(torch.randint(0, 100, (1, 9)))  # 9 tokens: a decode-size graph, where sum_routers takes the routers
        return {k: v for r in seen for k, v in r.counts.items()
                if v and k.startswith(("split_routers.", "sum_routers.", "fuse_router_gemm."))}

    assert routing_counts().get("sum_routers.summed", 0) > 0
    seen = []
    torch._dynamo.reset()
    fn = torch.compile(model, backend=wide_backend, options={"inductor": False, "report": seen.append,
                                                             "fuse_router_gemm": False, "fuse_norm_router": True})
    with torch.no_grad():
        fn(torch.randint(0, 100, (1, 9)))
    assert seen[0].passes == [p.name for p in default_passes(fuse_router_gemm=False, fuse_norm_router=True)]
    assert "fuse_norm_router" in seen[0].passes and "fuse_router_gemm" not in seen[0].passes
    assert "  passes: detect_mlp, detect_attention, insert_routers" in str(seen[0])
    assert routing_counts(fuse_router_gemm=False, split_routers=0, sum_routers=False) == {}
    torch._dynamo.reset()
    with pytest.raises(ValueError, match="fuse_norm_router must be"):
        wc.optimize(tiny_model("llama"), wc.Routers.init(tiny_model("llama"), wc.WideConfig(router_init="random")),
                    fuse_norm_router="decode")
