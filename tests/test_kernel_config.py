"""Kernel tile configs against the device's shared memory (no GPU needed: the fit is arithmetic)."""
import pytest

from wide_compile.kernels import compact_mlp as cm
from wide_compile.kernels import tuning as tu

H200_SMEM = 232448
SHAPES = {  # (D, F, group_size, N_out) of the MLP, q_proj and o_proj calls at 8B and SmolLM2 sizes
    "8b-mlp": (4096, 14336, 64, 4096), "8b-q": (4096, 4096, 128, 4096), "8b-o": (4096, 4096, 128, 4096),
    "smol-mlp": (576, 1536, 64, 576), "smol-q": (576, 576, 64, 576), "smol-o": (576, 576, 64, 576),
}
TS = (1, 4, 16, 17, 128, 300, 2048, 8192)


@pytest.fixture(autouse=True)
def _compiled_configs(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the GPU configs, not the interpreter's small ones


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("T", TS)
def test_bf16_configs_fit_and_are_left_as_tuned(shape, T):
    cfg = cm.default_config(T, *SHAPES[shape])
    up, dn = cm.shared_memory_need(cfg, 2)
    assert up <= H200_SMEM and dn <= H200_SMEM
    assert cm.fit_shared_memory(cfg, 2, H200_SMEM) == cfg


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("T", TS)
@pytest.mark.parametrize("limit", [H200_SMEM, 166912, 101376])  # H100/H200, A100, consumer Ampere/Ada
def test_fp32_configs_are_cut_to_fit(shape, T, limit):
    cfg = cm.default_config(T, *SHAPES[shape])
    fit = cm.fit_shared_memory(cfg, 4, limit)
    up, dn = cm.shared_memory_need(fit, 4)
    assert up <= limit and dn <= limit
    # only stages and K tiles change; the output tiling (and so the launch grid) stays as tuned
    assert {k: v for k, v in fit.items() if k not in ("up_stages", "up_bk", "dn_stages", "dn_bk")} == \
        {k: v for k, v in cfg.items() if k not in ("up_stages", "up_bk", "dn_stages", "dn_bk")}
    assert fit["up_stages"] >= 2 or cfg["up_stages"] < 2


def test_fp32_decode_gather_config_over_the_hopper_limit_is_cut_to_fit():
    # SmolLM2 fp32: BK=256, 4 stages of (16x256 + 2x32x256) fp32: 3 resident x 81920 B = 245760
    cfg = cm.default_config(1, 576, 1536, 64, 576)
    assert cm.shared_memory_need(cfg, 4)[0] == 245760 > H200_SMEM
    fit = cm.fit_shared_memory(cfg, 4, H200_SMEM)
    assert fit["up_bk"] == cfg["up_bk"] and fit["up_stages"] == 3


def test_kernel_config_applies_overrides_after_the_fit():
    cfg = cm.kernel_config(1, 576, 1536, 64, 576, {"up_stages": 5}, elem_size=4)
    assert cfg["up_stages"] == 5  # an explicit sweep config is never rewritten
    assert cm.kernel_config(1, 576, 1536, 64, 576, elem_size=4)["up_stages"] == 3


def test_phase_overrides_apply_to_their_phase():
    tuning = tu.table_for().with_overrides(decode={"lists": "none"}, prefill={"group_g": 4})
    dec = cm.kernel_config(1, 576, 1536, 64, 576, tuning=tuning)
    pre = cm.kernel_config(2048, 576, 1536, 64, 576, tuning=tuning)
    assert dec["lists"] == "none" and "lists" not in pre and pre["group_g"] == 4
    assert cm.kernel_config(1, 576, 1536, 64, 576, {"lists": "kernel"}, tuning=tuning)["lists"] == "kernel"  # caller wins
    assert "lists" not in cm.kernel_config(1, 576, 1536, 64, 576)  # nothing process-wide changed
    # per-phase overrides given as a dict resolve against the device's table
    assert cm.kernel_config(1, 576, 1536, 64, 576, tuning={"decode": {"lists": "none"}})["lists"] == "none"


@pytest.mark.parametrize("T", TS)
def test_small_batches_default_to_the_dense_path(T):
    # 4..16 tokens: dense GEMMs + mask (their groups cover nearly every weight row); 1..3: the gather GEMV
    cfg = cm.default_config(T, *SHAPES["8b-mlp"])
    if 4 <= T <= tu.DECODE_T:
        assert cfg["path"] == "dense" and cfg["down"] == "dense"
    else:
        assert cfg["path"] in ("decode", "sorted")
    assert cm.kernel_config(T, *SHAPES["8b-mlp"], {"path": "decode"})["path"] == "decode"  # caller wins


@pytest.mark.parametrize("name", sorted(p.stem for p in tu.CONFIG_DIR.glob("*.json")))
def test_shipped_tables_load_and_round_trip(name):
    t = tu.KernelTuning.load(tu.CONFIG_DIR / f"{name}.json")
    assert t.rows[0][0] == 1 and [r[0] for r in t.rows] == sorted(r[0] for r in t.rows)
    assert tu.KernelTuning.from_json(t.to_json()) == t
    for T in TS:  # every row caps its group-bounded tiles at the group size
        cfg = t.row(T, 24)
        assert cfg["up_bn"] <= 32 and cfg["dn_bk"] <= 32


@pytest.mark.parametrize("gs", [1, 4, 8, 12])
def test_small_groups_keep_the_dot_k_minimum(gs):
    """dn_bk is the K of the K-skip kernel's tl.dot, which the GPU compiler refuses below 16 (groups of 8
    columns failed to compile on an H100): below 16 the K tile stays at 16 and the kernel masks the rows past
    the group; up_bn (an N tile) follows the group down."""
    t = tu.KernelTuning("x", ((1, {**BASE, "up_bn": 64, "dn_bk": 64}),))
    assert t.row(1, gs)["dn_bk"] == 16 and t.row(1, gs)["up_bn"] == 1 << max(gs - 1, 0).bit_length()
    assert t.row(1, 24)["dn_bk"] == 32 and t.row(1, 200)["dn_bk"] == 64


def test_table_rows_are_chosen_by_token_count():
    t = tu.KernelTuning("x", ((1, {**BASE, "up_bm": 1}), (10, {**BASE, "up_bm": 2}), (100, {**BASE, "up_bm": 3})))
    assert [t.row(T, 64)["up_bm"] for T in (1, 9, 10, 99, 100, 10**6)] == [1, 1, 2, 2, 3, 3]


def test_the_interpreter_and_a_gpu_without_a_table_get_the_shipped_ones(monkeypatch):
    assert tu.table_for().device == "default"  # this fixture turns the interpreter off
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert tu.table_for().device == tu.INTERPRETER


@pytest.mark.parametrize("bad, err", [
    ({"device": "x", "configs": {"2": {}}}, "T = 1"),
    ({"device": "x", "configs": {"1": {"path": "decode"}}}, "missing fields"),
    ({"device": "x"}, "configs"),
    ({"decod": {}}, "per-phase overrides"),
])
def test_bad_tables_get_one_clear_error(bad, err):
    with pytest.raises(ValueError, match=err):
        tu.resolve(bad)


BASE = {f: 1 for f in tu.FIELDS}
