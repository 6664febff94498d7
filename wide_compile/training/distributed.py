"""Router training on several GPUs (or CPU processes): torchrun + FSDP2 (`torch.distributed.fsdp.fully_shard`).

`torchrun --nproc-per-node N -m wide_compile.training stage1 ...` runs the unchanged command on N processes;
`setup` reads what torchrun sets (WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR / MASTER_PORT) and joins the
process group: nccl with one GPU per process (cuda:LOCAL_RANK) on CUDA, gloo on CPU. With one process
(no torchrun, or --nproc-per-node 1) every method here is the identity and training is exactly the
single-process code. What changes with N > 1:

* Model: the frozen backbone (with stage 2's LoRA adapters) is sharded with FSDP2, one unit per decoder
  layer, then the root (embeddings, final norm, lm_head). On CUDA, MixedPrecisionPolicy computes in bf16
  and reduces gradients in fp32; the LoRA adapters keep fp32 sharded master weights, and the optimizer
  sees them as DTensors.
* Routers are replicated and stay outside the FSDP units (attached after sharding): they are a fraction
  of a percent of the model, so their fp32 weights and AdamW state fit on every GPU; outside the units
  FSDP's bf16 policy never casts them, so they train in fp32 as on one GPU, and a checkpoint holds them
  as they are. Their gradients are averaged across ranks with one flat all_reduce per step
  (`reduce_grads_`), which FSDP does for the LoRA adapters with its reduce-scatter.
* Data: each step's global batch (the same batches, in the same order, as one process draws) is split
  into contiguous per-rank slices, so the global batch and the data position (the step) are unchanged.
* Losses: KD and LM are token means over equal slices, so the average of the per-rank gradients (and of
  the logged values) is the single-process one. The capacity regulariser is a square of the capacity,
  not a mean over tokens, so the capacity itself is averaged across ranks before the square
  (`global_capacity`).
* Checkpoints: every rank gathers full tensors (DTensor.full_tensor), rank 0 writes the single-process
  files, and all ranks wait for it: outputs load on one GPU or CPU without torch.distributed, and a run may
  resume on another number of processes (only the Gumbel noise stream of a rank the checkpoint has no RNG
  state for starts afresh).
* Held-out evaluation and calibration run the same forwards on every rank (each FSDP forward needs every
  rank) with rank 0's router logits broadcast (`rank0_decisions`): the hard decisions, hence the measured
  capacities and the calibration's bisection path, are the same on every rank even where two ranks' forwards
  differ in the last bit (a rank that took another path would wait forever in a collective). Rank 0's
  evaluation result is broadcast, so early stopping and the best checkpoint agree, and so is the
  wall-clock deadline decision.
* Gumbel noise: rank r seeds seed + r, so each rank draws its own noise (the same distribution as one
  process, not the same sample); rank 0's stream is the single-process one.
"""
from __future__ import annotations

import atexit
import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _dist():
    import torch.distributed as dist

    return dist


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the run: rank, world_size and the device it trains on (None: the caller's)."""

    rank: int = 0
    world_size: int = 1
    device: torch.device | None = None

    @property
    def active(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # -- model -----------------------------------------------------------------------------------------
    def shard(self, model: nn.Module) -> nn.Module:
        """Shard `model` in place with FSDP2: each decoder layer, then the root. Frozen parameters are sharded
        too (that is the memory FSDP saves here); trainable ones (LoRA) get sharded fp32 master weights.
        Attach routers afterwards, so they stay replicated outside the units."""
        if not self.active:
            return model
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from ..models.spec import decoder_layers

        mesh = init_device_mesh(self.device.type, (self.world_size,))
        mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if self.device.type == "cuda" else MixedPrecisionPolicy())
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        return model

    def broadcast_module_(self, module: nn.Module) -> nn.Module:
        """Rank 0's parameters and buffers on every rank (replicated routers start equal)."""
        if self.active:
            with torch.no_grad():
                for t in list(module.parameters()) + list(module.buffers()):
                    if t.dtype == torch.bool:  # constant routers' masks: collectives take no bool
                        buf = t.data.to(torch.uint8)
                        _dist().broadcast(buf, src=0)
                        t.data.copy_(buf.bool())
                    else:
                        _dist().broadcast(t.data, src=0)
        return module

    def seed(self, seed: int) -> None:
        """Each rank its own Gumbel-noise stream; rank 0 keeps the single-process one."""
        torch.manual_seed(seed + self.rank)

    # -- data and losses -------------------------------------------------------------------------------
    def check_batch(self, batch_size: int) -> None:
        if batch_size % self.world_size:
            raise ValueError(f"batch size {batch_size} does not split evenly over {self.world_size} processes: "
                             f"use a multiple of {self.world_size} (--batch-size is the global batch)")

    def local_batch(self, ids: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous slice of the global batch ids [B, S] -> [B / world, S]."""
        if not self.active:
            return ids
        self.check_batch(ids.shape[0])
        b = ids.shape[0] // self.world_size
        return ids[self.rank * b:(self.rank + 1) * b]

    def global_capacity(self, cap: dict) -> dict:
        """`cap` (losses.relaxed_capacity of this rank's tokens) with overall / attn / ffn averaged over the
        ranks (equal token counts: the global token mean), differentiably (GlobalMean)."""
        if not self.active:
            return cap
        return {**cap, **{k: _GlobalMean.apply(cap[k], self.world_size) for k in ("overall", "attn", "ffn")}}

    def mean_scalars(self, values: dict) -> dict:
        """Detached scalars averaged over the ranks (logged values: KD, LM, loss), in one all_reduce."""
        if not self.active:
            return values
        keys = list(values)
        flat = torch.stack([values[k].detach().float().reshape(()) for k in keys])
        _dist().all_reduce(flat)
        flat /= self.world_size
        return {k: flat[i] for i, k in enumerate(keys)}

    # -- gradients -------------------------------------------------------------------------------------
    def reduce_grads_(self, params) -> None:
        """Average the gradients of replicated (non-FSDP) parameters over the ranks, one flat all_reduce.
        A parameter without a gradient on this rank contributes zeros, so every rank sends the same shape."""
        if not self.active:
            return
        params = [p for p in params if p.requires_grad]
        if not params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        _dist().all_reduce(flat)
        flat /= self.world_size
        i = 0
        for p, g in zip(params, grads):
            n = g.numel()
            p.grad = flat[i:i + n].view_as(p).to(p.dtype)
            i += n

    def clip_grad_norm_(self, params, max_norm: float) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over a mix of sharded (DTensor) and replicated gradients: the norm of
        the full gradients, the same on every rank."""
        params = [p for p in params if p.grad is not None]
        if not self.active:
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        sharded = [p for p in params if _is_dtensor(p.grad)]
        plain = [p for p in params if not _is_dtensor(p.grad)]
        norms = []
        if sharded:
            norms.append(torch.nn.utils.get_total_norm([p.grad for p in sharded]).full_tensor())
        if plain:
            norms.append(torch.nn.utils.get_total_norm([p.grad for p in plain]))
        total = torch.linalg.vector_norm(torch.stack([n.to(self.device) for n in norms]))
        for group in (sharded, plain):  # foreach kernels take one tensor kind per call
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
        return total

    # -- agreement and logging -------------------------------------------------------------------------
    def broadcast_object(self, obj):
        """Rank 0's `obj` (picklable) on every rank."""
        if not self.active:
            return obj
        box = [obj]
        _dist().broadcast_object_list(box, src=0)
        return box[0]

    def agree(self, flag: bool) -> bool:
        """Rank 0's decision (e.g. whether a step still fits before the deadline) on every rank."""
        return bool(self.broadcast_object(bool(flag)))

    @contextmanager
    def rank0_decisions(self):
        """Within: every learned router's logits are rank 0's (broadcast as each router runs), so hard
        decisions and everything computed from them agree across ranks. For evaluation and calibration,
        where every rank runs the same blocks; training steps (each rank its own tokens) never use it."""
        if not self.active:
            yield
            return
        from ..routing.routers import LEARNED

        def hook(module, args, out):
            if isinstance(module, LEARNED):
                out = out.contiguous()
                _dist().broadcast(out, src=0)
                return out
            return None

        handle = torch.nn.modules.module.register_module_forward_hook(hook)
        try:
            yield
        finally:
            handle.remove()

    def agreed(self, fn):
        """fn run under rank0_decisions, its result rank 0's on every rank (the held-out evaluation)."""
        if not self.active:
            return fn

        def run(*args, **kw):
            with self.rank0_decisions():
                out = fn(*args, **kw)
            return self.broadcast_object(out)

        return run

    def barrier(self) -> None:
        if self.active:
            _dist().barrier()

    def main_only(self, log):
        """`log` on rank 0; nothing on the others (one copy of every line)."""
        return log if self.is_main else (lambda *a, **k: None)

    # -- checkpoint tensors ----------------------------------------------------------------------------
    def rng_state(self) -> dict:
        """This rank's RNG state (CPU, and this rank's GPU only: no CUDA context on the other GPUs)."""
        d = {"cpu": torch.get_rng_state()}
        if self.device is not None and self.device.type == "cuda":
            d[f"cuda{self.device.index}"] = torch.cuda.get_rng_state(self.device)
        return d

    def gather_rng(self, local: dict) -> dict:
        """Every rank's RNG state in one dict: rank 0's keys as one process writes them ("cpu", "cuda<i>"),
        rank r's as "rank<r>.<key>"."""
        if not self.active:
            return local
        everyone = [None] * self.world_size
        _dist().all_gather_object(everyone, {k: v.cpu() for k, v in local.items()})
        out = dict(everyone[0])
        for r in range(1, self.world_size):
            out.update({f"rank{r}.{k}": v for k, v in everyone[r].items()})
        return out

    def local_rng(self, saved: dict) -> dict | None:
        """This rank's part of `gather_rng`'s dict, or None when the checkpoint has none for it."""
        if self.rank == 0:
            return {k: v for k, v in saved.items() if not k.startswith("rank")}
        p = f"rank{self.rank}."
        mine = {k[len(p):]: v for k, v in saved.items() if k.startswith(p)}
        return mine or None

    @staticmethod
    def ranks_with_rng(saved: dict) -> int:
        """How many processes wrote `gather_rng`'s dict (1 for a single-process checkpoint)."""
        return 1 + max((int(k[4:k.index(".")]) for k in saved if k.startswith("rank")), default=0)

    def set_rng_state(self, state: dict) -> None:
        torch.set_rng_state(state["cpu"])
        for k, v in state.items():
            if k.startswith("cuda") and self.device is not None and self.device.type == "cuda":
                torch.cuda.set_rng_state(v, self.device)


class _GlobalMean(torch.autograd.Function):
    """Forward: the mean of a tensor over the ranks. Backward: the gradient passes through unchanged. Every
    rank then holds f'(mean) * d(own share)/dθ; the gradient average across ranks that follows (FSDP's
    reduce-scatter, DistEnv.reduce_grads_) sums those shares and divides by N, which is exactly
    f'(mean) * d(mean)/dθ."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, world_size: int) -> torch.Tensor:
        y = x.detach().clone()
        _dist().all_reduce(y)
        return y / world_size

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def is_sharded(model: nn.Module) -> bool:
    """Whether `model` is already an FSDP2 module (e.g. built on the meta device and sharded by its owner)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


# -- full <-> sharded tensors (need no DistEnv: a DTensor carries its mesh) -------------------------------
def full_tensors(d: dict) -> dict:
    """d with every DTensor replaced by the full tensor (a collective: call on every rank)."""
    return {k: v.full_tensor() if _is_dtensor(v) else v for k, v in d.items()}


def shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`full` laid out as `like`: a DTensor with like's mesh and placements (this rank's slice, no
    communication: every rank holds `full`), or `full` itself when `like` is a plain tensor."""
    if not _is_dtensor(like):
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.to(like.device_mesh.device_type), like.device_mesh, like.placements,
                             src_data_rank=None)


@torch.no_grad()
def copy_into_(targets: dict, full: dict) -> None:
    """Copy full tensors into `targets` (parameters or views of them, plain or DTensor), key by key."""
    if set(targets) != set(full):
        missing, extra = sorted(set(targets) - set(full)), sorted(set(full) - set(targets))
        raise ValueError(f"checkpoint tensors do not match the model's: missing {missing[:5]}, unexpected {extra[:5]}")
    for k, t in targets.items():
        src = shard_like(full[k].to(t.dtype), t)
        if _is_dtensor(t):
            t.to_local().copy_(src.to_local())
        else:
            t.copy_(src)


# -- joining the run -------------------------------------------------------------------------------------
def current() -> DistEnv:
    """The run this process belongs to: the initialised process group (world size > 1), else one process."""
    dist = _dist()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return DistEnv()
    nccl = "nccl" in str(dist.get_backend()).lower()
    dev = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    return DistEnv(dist.get_rank(), dist.get_world_size(), dev)


def setup(device: str | None = None) -> DistEnv:
    """Join the process group torchrun describes (WORLD_SIZE > 1; once per process), or stay one process.

    device: the command's --device. Under torchrun a CUDA device ("cuda", "cuda:0") becomes this process's
    GPU, cuda:LOCAL_RANK (nccl); "cpu" runs every process on the CPU (gloo)."""
    dist = _dist()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or (dist.is_available() and dist.is_initialized()):
        return current()
    missing = [v for v in TORCHRUN_VARS if v not in os.environ]
    if missing:
        raise RuntimeError(f"WORLD_SIZE={world} is set but {', '.join(missing)} are not: start the command with "
                           "`torchrun --nproc-per-node N ...`")
    local = int(os.environ["LOCAL_RANK"])
    cuda = str(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    if cuda:
        if local >= torch.cuda.device_count():
            raise RuntimeError(f"LOCAL_RANK {local} but {torch.cuda.device_count()} GPU(s) visible: start at most "
                               "one process per GPU (--nproc-per-node), or pass --device cpu")
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    else:
        dist.init_process_group("gloo")
    atexit.register(_leave)
    return current()


def _leave() -> None:
    dist = _dist()
    if dist.is_initialized():
        dist.destroy_process_group()
