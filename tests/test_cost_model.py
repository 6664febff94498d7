"""The cost model (passes/cost_model.py): which path it picks per (model shape, T) on synthetic device data,
that every path it can pick computes the routed result (Triton kernels under the interpreter vs the float64
reference, tiny shapes), and that the pass records its choice and hands it to the ops."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

import wide_compile as wc  # noqa: E402
from wide_compile.kernels import reference as R  # noqa: E402
from wide_compile.kernels.compact_attn import o_proj_triton, q_proj_triton  # noqa: E402
from wide_compile.kernels.compact_mlp import mlp_triton  # noqa: E402
from wide_compile.kernels.tuning import KernelTuning, table_for  # noqa: E402
from wide_compile.models import tiny_model  # noqa: E402
from wide_compile.passes import PassManager  # noqa: E402
from wide_compile.passes import cost_model as cm  # noqa: E402
from wide_compile.passes.base import DENSE_EVERYWHERE  # noqa: E402

from test_passes_models import CFG, capture, run_logits  # noqa: E402

# the kernel cases run under the interpreter on the CPU, compiled on a CUDA GPU with TRITON_INTERPRET=0
DEV = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
needs_dev = pytest.mark.skipif(DEV == "cuda" and not torch.cuda.is_available(),
                               reason="compiled Triton kernels need a CUDA GPU: on a CPU run with TRITON_INTERPRET=1")

# a synthetic Hopper-like device: round ceilings, cuBLAS and the gather kernel at the same bandwidth share
DEVICE = cm.DeviceCost("synthetic", hbm_bytes_per_s=4e12, matmul_flop_per_s=800e12, launch_s=2e-6,
                       efficiency={"gemm": {"bandwidth": 0.7, "flops": 0.9},
                                   "gather": {"bandwidth": 0.7, "flops": 0.6},
                                   "kskip": {"bandwidth": 0.55, "flops": 0.6},
                                   "pointwise": {"bandwidth": 0.65, "flops": 1.0},
                                   "reorder": {"bandwidth": 0.65, "flops": 1.0}}, margin=0.05)
# (D, F, Nq, FFN group, q columns per head group) of Llama-3.1-8B and SmolLM2-135M
SHAPES = {"8b": (4096, 14336, 4096, 128, 128), "135m": (576, 1536, 576, 64, 64)}
BASE = KernelTuning.load(cm.CONFIG_DIR / "default.json")


def pick(model, op, T, density=0.5, kernel_path="auto"):
    D, F, Nq, gf, ga = SHAPES[model]
    n, gs = (F, gf) if op == "mlp" else (Nq, ga)
    s = cm.Shape(T, D, n, gs)
    return cm.choose(op, s, cm.MaskStats(density), BASE.row(T, gs), DEVICE, kernel_path), s


def test_decode_batch1_runs_the_one_token_gemvs():
    """One token: the GEMVs read the same bytes as the tile kernels in fewer launches (no tile lists). At 135M
    o_proj's GEMV and its split sum are two launches, as dense_masked's select and GEMM: the margin keeps dense."""
    for model, op in [("8b", "mlp"), ("8b", "q"), ("8b", "o"), ("135m", "mlp"), ("135m", "q")]:
        assert pick(model, op, 1)[0] == "gemv", (model, op)
    assert pick("135m", "o", 1)[0] == "dense_masked"


def test_the_gemvs_are_a_path_at_one_token_only():
    for op in ("mlp", "q", "o"):
        name, s = pick("135m", op, 2, kernel_path="compact")
        assert name != "gemv" and "gemv" not in cm.path_seconds(op, s, cm.MaskStats(0.5), BASE.row(2, 64), DEVICE)
    row = {**BASE.row(1, 64), **cm.PATH_FIELDS["mlp"]["gemv"]}
    assert cm.table_path("mlp", row, 1) == "gemv" and cm.table_path("mlp", row, 2) == "gather+kskip"


def test_8b_decode_batch1_without_the_gemvs_runs_the_gather():
    """The tile kernels' choice where the one-token GEMVs are overridden away (a phase override of the path)."""
    base = BASE.with_overrides(decode={"path": "decode"})
    table, d = cm.plan("mlp", cm.Shape(1, 4096, 14336, 128), base, DEVICE, cm.MaskStats(0.5))
    assert d.path == "gather+kskip"


def test_8b_decode_batch8_at_half_capacity_runs_dense_masked():
    """Eight tokens' groups cover 1 - 0.5^8 of the rows: nothing left to skip, the dense GEMMs win."""
    for op in ("mlp", "q", "o"):
        assert pick("8b", op, 8)[0] == "dense_masked", op


def test_8b_long_prefill_runs_the_sorted_gather():
    assert pick("8b", "mlp", 2048)[0] == "sorted+dense"


@pytest.mark.parametrize("op", ["mlp", "q", "o"])
@pytest.mark.parametrize("T", [1, 4, 16])
def test_135m_picks_a_fewest_launch_path(op, T):
    """A 135M model's decode step is launch-bound: the pick has no more launches than any other path."""
    name, s = pick("135m", op, T)
    launches = {p: len(ks) for p, ks in cm.KERNELS[op](s, cm.MaskStats(0.5), BASE.row(T, s.group_size)).items()}
    assert launches[name] == min(launches.values()), (name, launches)


def test_low_density_decode_keeps_compact_and_full_density_goes_dense():
    assert pick("8b", "o", 1, density=0.1)[0] == "gemv"
    assert pick("8b", "o", 2, density=0.1)[0] == "kskip"
    assert pick("8b", "mlp", 1, density=1.0)[0] == "dense_masked"


def test_forced_paths():
    assert pick("8b", "mlp", 1, kernel_path="dense")[0] == "dense_masked"
    assert pick("8b", "mlp", 8, kernel_path="compact")[0] != "dense_masked"
    assert pick("8b", "mlp", 8, kernel_path="table")[0] == cm.table_path("mlp", BASE.row(8, 128))
    with pytest.raises(ValueError, match="kernel_path must be one of"):
        pick("8b", "mlp", 1, kernel_path="fastest")


@pytest.mark.parametrize("op", ["mlp", "q", "o"])
def test_path_fields_round_trip(op):
    """Each path's table fields make the kernels run that path (tuning.row -> table_path)."""
    row = BASE.row(1, 64)
    for name, fields in cm.PATH_FIELDS[op].items():
        assert cm.table_path(op, {**row, **fields}) == name


def test_union_share_measured_and_independent():
    st = cm.MaskStats(0.5, {4: 0.6})
    assert st.union_share(4) == 0.6 and st.union_share(2) == pytest.approx(0.75)
    m = torch.zeros(8, 4, dtype=torch.bool)
    m[:, 0] = True  # every token uses group 0 only
    got = cm.MaskStats.measure(m, rows=(1, 4))
    assert got.density == 0.25 and got.union == {1: 0.25, 4: 0.25}
    with pytest.raises(ValueError, match="lie in"):
        cm.MaskStats(1.5)


def test_plan_with_dynamic_T_cuts_the_table_where_the_choice_changes():
    table, d = cm.plan("mlp", cm.Shape(0, 4096, 14336, 128), BASE, DEVICE, cm.MaskStats(0.5))
    assert d.T is None and d.path == "gemv" and d.rows[0] == (1, "gemv") and d.rows[1][0] == 2
    assert [p for _, p in d.rows][-1] == "sorted+dense"
    for t, name in d.rows:  # the table's rows run what the decision says
        assert cm.table_path("mlp", table.row(t, 128), t) == name
    assert cm.table_path("mlp", table.row(8, 128), 8) == "dense_masked"


def test_plan_without_mask_stats_keeps_the_table():
    table, d = cm.plan("mlp", cm.Shape(1, 4096, 14336, 128), BASE, DEVICE, None)
    assert table is BASE and "no mask density" in d.source


def test_a_kernel_class_ramp_prices_small_tile_grids():
    """fixed_s (a kernel class's time beyond its roofline at a small shape) is added to each tile launch of the
    class, never to the one-token GEMVs; with the shipped data the 135M prefill MLP runs dense-masked (its tile
    gather measured at twice its roofline) while the 8B prefill keeps the sorted gather."""
    eff = {k: dict(v) for k, v in DEVICE.efficiency.items()}
    eff["gather"]["fixed_s"] = 5e-6
    ramped = cm.DeviceCost("ramped", DEVICE.hbm_bytes_per_s, DEVICE.matmul_flop_per_s, DEVICE.launch_s, eff,
                           DEVICE.margin)
    assert ramped.seconds("gather", 1e6, 0) == pytest.approx(DEVICE.seconds("gather", 1e6, 0) + 5e-6)
    assert ramped.seconds("gather", 1e6, 0, ramp=False) == DEVICE.seconds("gather", 1e6, 0)
    s1 = cm.Shape(1, 4096, 14336, 128)
    for dev in (DEVICE, ramped):  # the GEMV path's estimate does not move
        assert cm.path_seconds("mlp", s1, cm.MaskStats(0.5), BASE.row(1, 128), dev)["gemv"] == pytest.approx(
            cm.path_seconds("mlp", s1, cm.MaskStats(0.5), BASE.row(1, 128), DEVICE)["gemv"])
    shipped = cm._load("default")
    assert shipped.efficiency["gather"].get("fixed_s", 0) > 0
    D, F, _, gf, _ = SHAPES["135m"]
    assert cm.choose("mlp", cm.Shape(2048, D, F, gf), cm.MaskStats(0.5), BASE.row(2048, gf), shipped) == "dense_masked"
    D, F, _, gf, _ = SHAPES["8b"]
    assert cm.choose("mlp", cm.Shape(2048, D, F, gf), cm.MaskStats(0.5), BASE.row(2048, gf), shipped) == "sorted+dense"


def test_device_data_files_load():
    for p in sorted(cm.COST_DIR.glob("*.json")):
        dev = cm._load(p.stem)
        assert dev.hbm_bytes_per_s > 0 and 0 <= dev.margin < 1
    with pytest.raises(ValueError, match="efficiency"):
        cm.DeviceCost.from_dict({"hbm_bytes_per_s": 1, "matmul_flop_per_s": 1, "launch_s": 0, "efficiency": {}})


# -------------------------------------------------------------- every path the model can pick is exact
def _mask(T, G, density, gen):
    if density == "one":
        m = torch.zeros(T, G, dtype=torch.bool)
        m[torch.arange(T), torch.randint(0, G, (T,), generator=gen)] = True
        return m
    return torch.rand(T, G, generator=gen) < density


def _forced(op, name, T, gs):
    base = table_for(DEV)
    return KernelTuning(base.device, ((1, {**base.row(T, gs), **cm.PATH_FIELDS[op][name]}),))


def _rel(out, ref):
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _layout(w_t, layout):
    """w_t [K, N] as the pass may hand it: a contiguous copy, or the transposed view of the Linear's weight [N, K]."""
    return w_t if layout == "copy" else w_t.t().contiguous().t()


@needs_dev
@pytest.mark.parametrize("layout", ["copy", "view"])
@pytest.mark.parametrize("T,density", [(1, 0.5), (5, "one"), (19, 0.3), (7, 1.0), (3, 0.0)])
@pytest.mark.parametrize("name", list(cm.PATH_FIELDS["mlp"]))
def test_every_mlp_path_matches_the_reference(name, T, density, layout):
    gen = torch.Generator().manual_seed(T)
    D, G, gs = 24, 3, 16
    x, wg, wu = torch.randn(T, D, generator=gen), torch.randn(G * gs, D, generator=gen), torch.randn(G * gs, D, generator=gen)
    wd, m = torch.randn(G * gs, D, generator=gen), _mask(T, G, density, gen)
    out = mlp_triton(*(t.to(DEV) for t in (x, wg, wu)), _layout(wd.to(DEV), layout), m.to(DEV), gs,
                     tuning=_forced("mlp", name, T, gs)).cpu()
    ref = R.mlp_ref(x.double(), wg.double(), wu.double(), wd.double(), m, gs)
    assert _rel(out, ref) <= 1e-4 if density != 0.0 else out.abs().max() == 0


@needs_dev
@pytest.mark.parametrize("T,density", [(1, 0.5), (6, "one"), (18, 0.5)])
@pytest.mark.parametrize("op,name,layout", [(op, n, lay) for op in ("q", "o") for n in cm.PATH_FIELDS[op]
                                            for lay in (("copy", "view") if op == "o" else ("copy",))])
def test_every_attention_projection_path_matches_the_reference(op, name, T, density, layout):
    gen = torch.Generator().manual_seed(T)
    D, G, gs = 20, 4, 8
    m = _mask(T, G, density, gen)
    tuning = _forced(op, name, T, gs)
    if op == "q":
        x, w, b = torch.randn(T, D, generator=gen), torch.randn(G * gs, D, generator=gen), torch.randn(G * gs, generator=gen)
        out = q_proj_triton(*(t.to(DEV) for t in (x, w, b, m)), gs, tuning=tuning)
        ref = R.q_proj_ref(x.double(), w.double(), b.double(), m, gs)
    else:
        a, w, b = torch.randn(T, G * gs, generator=gen), torch.randn(G * gs, D, generator=gen), torch.randn(D, generator=gen)
        out = o_proj_triton(a.to(DEV), _layout(w.to(DEV), layout), b.to(DEV), m.to(DEV), gs, tuning=tuning)
        ref = R.o_proj_ref(a.double(), w.double(), b.double(), m, gs)
    assert _rel(out.cpu(), ref) <= 1e-4


# ------------------------------------------------------------------ the pass records and applies its choice
@pytest.mark.parametrize("kernel_path", ["auto", "dense", "compact", "table"])
def test_pass_records_its_choice_and_stays_exact(kernel_path):
    model = tiny_model("llama")
    wc.attach(model, wc.Routers.init(model, CFG, seed=1))
    ids = torch.randint(0, 128, (1, 7))
    (gm, ex), = capture(model, input_ids=ids)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    ctx = PassManager().run(gm, ex, mask_stats=0.5, kernel_path=kernel_path)
    ops = [n for n in gm.graph.nodes if "wide_path" in n.meta]
    assert len(ops) == 6  # mlp, q, o per layer
    for n in ops:
        d = n.meta["wide_path"]
        assert d.T == 7 and d.path in cm.PATH_FIELDS[d.op]
        if n.target is torch.nn.functional.linear:  # q (with K / V) on the dense path: an unmasked linear
            assert d.op == "q" and d.path == "dense_masked"
            continue
        tuning = KernelTuning.from_json(n.args[-2] if d.op == "mlp" else n.args[-1]) if kernel_path != "table" \
            else table_for()
        assert cm.table_path(d.op, tuning.row(7, 16), 7) == d.path  # the op runs what was recorded
        if kernel_path == "dense":
            assert d.path == "dense_masked"
    assert all("path" in (r["mlp"]["detail"]) for r in ctx.report.layers())
    # the report says when the routed graph cannot beat dense: every op on its dense-masked path
    every_dense = all(n.meta["wide_path"].path == "dense_masked" for n in ops)
    assert ctx.report.dense_everywhere == every_dense and (DENSE_EVERYWHERE in str(ctx.report)) == every_dense
    assert every_dense if kernel_path == "dense" else (not every_dense if kernel_path == "compact" else True)
    torch.testing.assert_close(run_logits(gm, ex, ref), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("T,kernel_path", [(1, "compact"), (7, "compact"), (7, "dense"), (7, "auto")])
def test_reduction_weight_is_the_linears_own_unless_a_kskip_path_runs(T, kernel_path):
    """down_proj / o_proj's own weight through a transposed view (no copy) wherever no token count of the graph
    runs the K-skipping tile kernel (which reads a transposed copy's rows); the logits are the reference's."""
    model = tiny_model("llama")
    wc.attach(model, wc.Routers.init(model, CFG, seed=1))
    ids = torch.randint(0, 128, (1, T))
    (gm, ex), = capture(model, input_ids=ids)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    ctx = PassManager().run(gm, ex, mask_stats=0.5, kernel_path=kernel_path)
    views, copies = 0, 0
    for n in gm.graph.nodes:
        d = n.meta.get("wide_path")
        if d is None or d.op == "q":
            continue
        w = n.args[3] if d.op == "mlp" else n.args[1]
        view = w.op == "call_function" and w.target is torch.t
        assert view == ("kskip" not in d.path), (d, w)
        if view:
            assert w.args[0].op in ("get_attr", "placeholder")  # the Linear's weight itself
        views, copies = views + view, copies + (not view)
    assert ctx.report.counts["rewrite.weight_view"] == views and views + copies == 4
    if T == 1 or kernel_path == "dense":
        assert views == 4
    if kernel_path == "compact" and T == 7:
        assert copies > 0  # the tile kernels' K-skipping reduction
    torch.testing.assert_close(run_logits(gm, ex, ref), ref, atol=1e-5, rtol=1e-5)


def test_gemv_split_follows_the_layout_the_pass_hands_over():
    """A one-token graph's reduction GEMV runs the k_contiguous tiles (the Linear's weight), a graph of dynamic T
    the d_contiguous ones (the transposed copy); an unsplit GEMV is one launch, a split one adds its split sum."""
    from wide_compile.kernels.gemv import config_for

    for op, name in (("mlp", "mlp"), ("o", "o_proj")):
        assert cm.gemv_split(op, True, {}) == config_for("k_contiguous", None, name)["gd_split"]
        assert cm.gemv_split(op, False, {}) == config_for("d_contiguous", None, name)["gd_split"]
        assert cm.gemv_split(op, True, {"gd_split": 4}) == 4  # the row's override, as the kernels take it
    assert cm.gemv_split("q", True, {}) == 1
    s = cm.Shape(1, 576, 576, 64)
    assert len(cm.o_kernels(s, cm.MaskStats(0.5), BASE.row(1, 64), split=1)["gemv"]) == 1
    assert len(cm.o_kernels(s, cm.MaskStats(0.5), BASE.row(1, 64), split=8)["gemv"]) == 2
    # at 135M the unsplit o_proj GEMV is one launch against dense_masked's two: it wins
    assert cm.choose("o", s, cm.MaskStats(0.5), BASE.row(1, 64), DEVICE, split=1) == "gemv"
    assert cm.choose("o", s, cm.MaskStats(0.5), BASE.row(1, 64), DEVICE, split=8) == "dense_masked"


def test_unknown_kernel_path_is_one_clear_error():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="kernel_path must be one of"):
        wc.optimize(model, wc.Routers.init(model, CFG), kernel_path="fast")


def test_bench_e2e_paths_column():
    """bench_e2e's "WIDE path (cost model)" column: the paths of the compiled graphs' report, per op."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from e2e.report import COLS
    from e2e.variants import paths_summary

    model = tiny_model("llama")
    wc.attach(model, wc.Routers.init(model, CFG, seed=1))
    (gm, ex), = capture(model, input_ids=torch.randint(0, 128, (1, 1)))
    ctx = PassManager().run(gm, ex, mask_stats=0.5, kernel_path="dense")
    assert paths_summary([ctx.report]) == "mlp dense_masked; q dense_masked; o dense_masked"
    assert ("wide_paths", "WIDE path (cost model)") in COLS


def test_phase_overrides_of_the_table_win_and_are_recorded():
    """A kernel_config override of the decode path (applied by the kernels after the row) is what runs and
    what the decision records."""
    base = BASE.with_overrides(decode={"path": "dense"})
    table, d = cm.plan("mlp", cm.Shape(1, 4096, 14336, 128), base, DEVICE, cm.MaskStats(0.5))
    assert d.path == "dense_masked" and table.overrides == base.overrides
    # ... and the kernels run it: the override of the path drops the row's one-token switch
    from wide_compile.kernels.compact_mlp import kernel_config

    assert table.row(1, 128).get("one_token") == "gemv"
    cfg = kernel_config(1, 4096, 14336, 128, 4096, tuning=table)
    assert cfg["path"] == "dense" and "one_token" not in cfg
    assert kernel_config(1, 4096, 14336, 128, 4096, tuning=BASE.with_overrides(decode={"one_token": "gemv"}))[
        "one_token"] == "gemv"


def test_device_cost_reads_the_current_gpus_file(monkeypatch):
    """device_cost("cuda") looks up the GPU that "cuda" means now (torch.cuda.current_device()), the same lookup as
    the kernel tuning tables; another device type, or no device, reads default.json."""
    import torch

    from wide_compile.passes import cost_model as cm

    names = {0: "NVIDIA A10", 1: "NVIDIA H200"}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: names[1 if i is None else i])
    h200, default = cm._load("NVIDIA_H200"), cm._load("default")
    assert h200 != default
    assert cm.device_cost("cuda") == h200 and cm.device_cost("cuda:1") == h200
    assert cm.device_cost("cuda:0") == default  # no cost file for that card
    assert cm.device_cost("cpu") == default and cm.device_cost(None) == default
