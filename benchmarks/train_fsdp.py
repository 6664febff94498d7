#!/usr/bin/env python
"""Stage-1 router training on 1 vs N GPUs (torchrun + FSDP2): tokens/s and peak memory per GPU.

    for n in 1 2 4; do torchrun --nproc-per-node $n benchmarks/train_fsdp.py --out $OUT/train-fsdp-8b-${n}gpu.json; done

The 8B shape (Llama-3.1-8B: 32 layers, hidden 4096, FFN 14336, 32 query / 8 KV heads, vocabulary 128256) with
random bf16 weights, routers of the "wide" recipe (one bit per KV group of query heads and per 128 FFN
channels, capacity 0.5), and the stage-1 training step itself (training/stage1.py: dense teacher forward,
routed student forward and backward through the frozen backbone, KD + LM + capacity losses, AdamW on the
routers, bf16 autocast as on the GPU recipe). With one process (`torchrun --nproc-per-node 1` or plain
`python`) the model is whole on the GPU, as one-GPU training runs it; with N it is built on the meta device,
sharded with the training's own FSDP2 layout (training/distributed.py: one unit per decoder layer, then the
root) and initialised shard by shard, so no process ever holds the whole model.

Every process runs --batch-per-gpu sequences of --seq-len tokens per step, so the global batch is N times
larger (weak scaling, the way a fixed per-GPU memory budget is used). Timed: --steps steps after --warmup
steps, synchronised at both ends; tokens/s = global tokens per step x steps / seconds. Peak memory: each
GPU's torch.cuda.max_memory_allocated (and _reserved) over the timed steps. Rank 0 writes one JSON record
with the command, the machine and the date. CPU check of the script itself (gloo, no timings worth
keeping): `torchrun --nproc-per-node 2 benchmarks/train_fsdp.py --shape tiny --device cpu --out /tmp/t.json`.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

from e2e.models import SHAPES, _materialize_rotary, build_model, make_config


def _build_sharded(config, env, seed: int):
    """The model on the meta device, sharded (DistEnv.shard), materialised on this rank's device, each
    rank's shards drawn from its own seed (N(0, 0.02), norms 1), rotary buffers recomputed."""
    import transformers as tf

    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16 if env.device.type == "cuda" else torch.float32)
    try:
        with torch.device("meta"):
            model = tf.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(old)
    env.shard(model)
    model.to_empty(device=env.device)
    gen = torch.Generator(device=env.device).manual_seed(seed + env.rank)
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            if "norm" in name and p.dim() == 1:
                local.fill_(1.0)
            else:
                local.normal_(0.0, 0.02, generator=gen)
    _materialize_rotary(model, env.device)
    return model.eval().requires_grad_(False)


def _command(world: int) -> str:
    args = " ".join(sys.argv)
    return f"torchrun --nproc-per-node {world} {args}" if world > 1 else f"python {args}"


def _machine(device: torch.device) -> dict:
    import transformers

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {"gpu": gpu, "gpus_visible": torch.cuda.device_count() if device.type == "cuda" else 0,
            "host": platform.node(), "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "transformers": transformers.__version__, "python": platform.python_version()}


def _time_steps(phase, warmup: int, steps: int, env, device) -> tuple[float, dict]:
    """Seconds for `steps` training steps after `warmup` ones, and the last step's logged values."""
    it = phase.batches(0)
    for step in range(warmup):
        phase.step_fn(step, next(it))
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    env.barrier()
    t0 = time.perf_counter()
    out = {}
    for step in range(warmup, warmup + steps):
        out = phase.step_fn(step, next(it))
    out = {k: float(v) for k, v in out.items()}  # waits for the last step
    if cuda:
        torch.cuda.synchronize(device)
    env.barrier()
    return time.perf_counter() - t0, out


def main(argv=None) -> int:
    from wide_compile.routing import Routers, attach
    from wide_compile.training.data import TokenBlocks
    from wide_compile.training.options import training_device
    from wide_compile.training.stage1 import Stage1Config, _stage1_phase

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    ap.add_argument("--batch-per-gpu", type=int, default=8, help="sequences per process and step")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=10, help="timed steps")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--capacity", type=float, default=0.5)
    ap.add_argument("--ffn-group-size", type=int, default=128)
    ap.add_argument("--head-group-size", default="kv")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, help="JSON record (written by rank 0)")
    a = ap.parse_args(argv)

    env, device, _ = training_device(a.device)
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    config = make_config(a.shape, a.layers, max_positions=max(a.seq_len, 2048))
    if env.active:
        model = _build_sharded(config, env, a.seed)
    else:
        model = build_model(config, device, torch.bfloat16 if device.type == "cuda" else torch.float32, a.seed)
    hgs = a.head_group_size if a.head_group_size == "kv" else int(a.head_group_size)
    cfg = Stage1Config.for_recipe("wide", capacity=a.capacity, batch_size=a.batch_per_gpu * env.world_size,
                                  seq_len=a.seq_len, steps=a.warmup + a.steps, amp=device.type == "cuda",
                                  ffn_group_size=a.ffn_group_size, head_group_size=hgs, ramp_frac=0.0,
                                  calib_blocks=1, eval_blocks=1)
    routers = Routers.init(model, cfg.wide_config(model), seed=a.seed).to(device).train().requires_grad_(True)
    env.broadcast_module_(routers)
    env.seed(a.seed)
    # random tokens: as many blocks as the steps draw, plus the held-out split TokenBlocks keeps
    n_blocks = cfg.batch_size * cfg.steps + 8
    toks = np.random.default_rng(a.seed).integers(0, config.vocab_size, n_blocks * a.seq_len)
    blocks = TokenBlocks(toks, a.seq_len, heldout_frac=4 / n_blocks)
    phase = _stage1_phase(model, routers, blocks, cfg, None, device)
    attach(model, routers)
    seconds, last = _time_steps(phase, a.warmup, a.steps, env, device)

    gib = 2 ** 30
    mem = ({"peak_allocated_gib": torch.cuda.max_memory_allocated(device) / gib,
            "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / gib} if device.type == "cuda" else {})
    per_rank = [mem]
    if env.active:
        per_rank = [None] * env.world_size
        torch.distributed.all_gather_object(per_rank, mem)
    tokens = cfg.batch_size * a.seq_len * a.steps
    rec = {"command": _command(env.world_size), "machine": _machine(device),
           "date": _dt.datetime.now().isoformat(timespec="seconds"), "processes": env.world_size,
           "sharded": env.active, "shape": a.shape, "layers": config.num_hidden_layers, "weights": "random",
           "router_recipe": "wide", "capacity": a.capacity, "ffn_group_size": a.ffn_group_size,
           "head_group_size": hgs, "batch_per_gpu": a.batch_per_gpu, "global_batch": cfg.batch_size,
           "seq_len": a.seq_len, "warmup_steps": a.warmup, "timed_steps": a.steps, "seconds": seconds,
           "step_s": seconds / a.steps, "tokens_per_s": tokens / seconds,
           "tokens_per_s_per_gpu": tokens / seconds / env.world_size, "memory_per_gpu": per_rank,
           "last_step": last}
    if env.is_main:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(rec, indent=1))
        print(json.dumps({k: rec[k] for k in ("processes", "global_batch", "step_s", "tokens_per_s",
                                               "memory_per_gpu")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
