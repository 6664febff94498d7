"""Router training under torchrun (training/distributed.py): 2 CPU processes on gloo against one process.

The same commands (`wide train stage1|stage2 --smoke`: the tiny random SmolLM2-shaped model, random tokens,
the same global batch of 4 blocks, Gumbel noise off so both runs draw nothing random) run in this process and
under `torchrun --nproc-per-node 2` (tests/_distributed_worker.py, one launch, localhost, a free port). Stage 1
runs from scratch on both sides; stage 2 (LoRA + jointly trained routers) pauses after 2 of 4 steps in one
process, then the 2-process run resumes that checkpoint, pauses again after a step and finishes: its
checkpoints hold sharded adapters and AdamW state.

Tolerances (fp32 throughout). The runs differ only in the order of floating-point sums: two half-batch token
means averaged across ranks instead of one mean, gradients all-reduced. Logged losses: rtol 1e-5 (fp32 sums of
~10^4 terms round at ~1e-6 relative). Trained tensors: atol 2e-5. AdamW moves every weight by up to lr per step
(3e-3 routers, 1e-2 LoRA: 1e-2 to 4e-2 over 4 steps), and a missing or doubled cross-rank reduction changes
the weights by that order; reordered sums change gradients in the 7th digit, which AdamW's normalisation turns
into weight differences below 1e-5 even for gradient entries near its eps.
"""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from wide_compile.training import train_main
from wide_compile.training.distributed import DistEnv, current

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("_distributed_worker.py")
LOSS_RTOL, WEIGHT_ATOL = 1e-5, 2e-5
COMMON = ["--smoke", "--device", "cpu", "--steps", "4", "--log-every", "1", "--eval-every", "100"]
# router bias 0: about half the groups start off and each rank's tokens give it its own capacity, so the
# capacity regulariser's cross-rank average matters from the first step (ramp 0: the target is 0.5 at once)
S1 = COMMON + ["--router-init-bias", "0", "--ramp-frac", "0", "--noise-off-frac", "1"]
S2 = COMMON + ["--joint", "true", "--noise-off-frac", "1", "--rank", "4", "--alpha", "8", "--lr", "1e-2"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(args: list[str], nproc: int = 2, timeout_s: float = 240) -> tuple[int, str, str]:
    """(return code, stdout, stderr) of the worker under torchrun; on timeout torchrun gets SIGTERM, which
    it passes on to its workers (they run in their own sessions), so no rank is left behind."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
           f"--master-port={_free_port()}", str(WORKER), *args]
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        p.terminate()
        try:
            out, err = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        pytest.fail(f"torchrun did not finish in {timeout_s} s (ranks out of step?):\n{err[-6000:]}")
    return p.returncode, out, err


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("dist")
    s2 = S2 + ["--routers", str(d / "s1" / "routers.safetensors")]  # every stage 2 starts from the same routers
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each torchrun rank (OMP_NUM_THREADS=1); tiny matmuls gain nothing from more
    try:
        assert train_main(["stage1", "--out", str(d / "s1"), *S1]) == 0
        assert train_main(["stage2", "--out", str(d / "s2"), *s2]) == 0
        assert train_main(["stage2", "--out", str(d / "p2"), *s2, "--stop-after-steps", "2"]) == 75
    finally:
        torch.set_num_threads(threads)
    rc, out, err = _torchrun([str(d / "d1"), str(d / "p2"), json.dumps(S1), json.dumps(s2)])
    assert rc == 0, f"torchrun failed:\n{out[-3000:]}\n{err[-6000:]}"
    return d, out


def _curve(folder: Path) -> list[dict]:
    return json.loads((folder / "curve.json").read_text())["train"]


def _assert_same_losses(dist_dir: Path, single_dir: Path) -> None:
    a, b = _curve(dist_dir), _curve(single_dir)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        for k in ("loss", "kd", "lm", "cap", "attn", "ffn"):
            assert ra[k] == pytest.approx(rb[k], rel=LOSS_RTOL, abs=1e-9), (ra["step"], k)


def _assert_same_tensors(path_a: Path, path_b: Path, atol: float = WEIGHT_ATOL, rtol: float = 0.0) -> None:
    a, b = load_file(str(path_a)), load_file(str(path_b))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k].float(), b[k].float(), atol=atol, rtol=rtol, msg=lambda m: f"{k}: {m}")


def test_stage1_on_two_processes_equals_one(runs):
    d, out = runs
    _assert_same_losses(d / "d1", d / "s1")
    # the routers moved (so equality says something), and equally on both sides
    s1 = load_file(str(d / "s1" / "ckpt" / "train.safetensors"))
    assert max(float((v - 0).abs().max()) for k, v in s1.items() if k.endswith("bias")) > 1e-3
    for f in ("ckpt/train.safetensors", "ckpt/opt.safetensors", "ckpt/best.safetensors"):
        _assert_same_tensors(d / "d1" / f, d / "s1" / f)
    # written once, by rank 0; every rank's RNG state in it
    assert out.count('"out":') == 1
    assert set(load_file(str(d / "d1" / "ckpt" / "rng.safetensors"))) == {"cpu", "rank1.cpu"}
    # the saved routers load in one process without torch.distributed and equal the single-process ones
    import wide_compile as wc
    from wide_compile.models import tiny_model

    assert not current().active
    model = tiny_model("smollm2")
    ra = wc.Routers.load(d / "d1" / "routers.safetensors", model).state_dict()
    rb = wc.Routers.load(d / "s1" / "routers.safetensors", model).state_dict()
    for k in rb:
        torch.testing.assert_close(ra[k], rb[k], atol=WEIGHT_ATOL, rtol=0.0)


def test_stage2_resumed_on_two_processes_equals_one(runs):
    d, _ = runs
    _assert_same_losses(d / "p2", d / "s2")
    train = load_file(str(d / "p2" / "ckpt" / "train.safetensors"))
    assert any(k.startswith("lora.") for k in train) and any(k.startswith("routers.") for k in train)
    for f in ("ckpt/train.safetensors", "ckpt/opt.safetensors"):
        _assert_same_tensors(d / "p2" / f, d / "s2" / f)
    # lora.safetensors is bf16: equal up to one bf16 rounding; it merges into a model in one process
    _assert_same_tensors(d / "p2" / "lora.safetensors", d / "s2" / "lora.safetensors", atol=1e-6, rtol=2 ** -8)
    from wide_compile.models import tiny_model
    from wide_compile.training.stage2 import load_lora_merged

    merged = load_lora_merged(tiny_model("smollm2"), d / "p2" / "lora.safetensors")
    assert not any("lora_" in n for n, _ in merged.named_parameters())


def test_local_batch_takes_this_ranks_slice():
    ids = torch.arange(12).view(6, 2)
    assert torch.equal(DistEnv(rank=1, world_size=3).local_batch(ids), ids[2:4])
    assert DistEnv().local_batch(ids) is ids  # one process: the global batch
    with pytest.raises(ValueError, match="multiple of 4"):
        DistEnv(rank=0, world_size=4).local_batch(ids)


def test_rng_states_round_trip_per_rank():
    saved = {"cpu": torch.zeros(3), "rank1.cpu": torch.ones(3), "rank2.cpu": torch.full((3,), 2.0)}
    assert DistEnv.ranks_with_rng(saved) == 3 and DistEnv.ranks_with_rng({"cpu": torch.zeros(1)}) == 1
    assert torch.equal(DistEnv(rank=2, world_size=4).local_rng(saved)["cpu"], saved["rank2.cpu"])
    assert set(DistEnv(rank=0, world_size=4).local_rng(saved)) == {"cpu"}
    assert DistEnv(rank=3, world_size=4).local_rng(saved) is None
