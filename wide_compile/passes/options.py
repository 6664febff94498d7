"""Which optional WIDE passes run, as one frozen config (the pass manager's, the backend's and optimize's options).

    PassOptions()                                   # the defaults optimize uses
    PassOptions(fuse_router_gemm=False)             # one change
    PassOptions.from_mapping(backend_options)       # picks this config's keys out of torch.compile options

Each field names one pass or one choice inside a pass; default_passes (manager.py) turns a PassOptions into the
ordered pass list. Where each default comes from (what it measured against the alternative) is in the field's
comment and in benchmarks/results/lean-h100/README.md.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

SPARSE_ATTENTION = ("auto", True, False)
FUSE_NORM_ROUTER = (True, False, "prefill")
THREE_WAY = ("sparse_attention", "fuse_norm_router")


@dataclass(frozen=True)
class PassOptions:
    # rewrite_sdpa: attention over the active head groups only (wide.attn_decode / wide.attn_prefill). "auto": every
    # decode step the kernel takes and the prefills of blocks whose head groups are KV-aligned (whole KV heads);
    # True: also the prefills of 1-head groups; False: attention stays dense sdpa. Measured: lean-h100 (fifth run),
    # benchmarks/results/attention/README.md.
    sparse_attention: bool | str = "auto"
    # fuse_norm_router: each block's RMSNorm and router in one wide.rmsnorm_router launch; "prefill": only in graphs
    # of more than DECODE_T tokens, where the kernel runs a linear router as tiles of rows on tensor cores. Opt-in:
    # at decode it was not faster than the unfused step.
    fuse_norm_router: bool | str = False
    # sum_routers: in graphs of at most DECODE_T tokens each unfused linear / pair router's logits as one Inductor
    # reduction instead of an fp32 GEMM.
    sum_routers: bool = True
    # rewrite_attention: K / V run in q's launch over a concatenated weight where q's path allows it
    # (rewrite_attention.QKV_PATHS).
    fuse_qkv: bool = True
    # compose_routers: each pair router runs as the one linear map it is (one fp32 GEMM where its layers ran two).
    compose_routers: bool = True
    # split_routers: in bf16 graphs of prefill size each linear router (composed ones too) runs on tensor cores over
    # its weight as a bf16 pair.
    split_routers: bool = True
    # fuse_router_select: a split router whose one reader is a dense-masked op's select runs inside that select
    # (wide.routed_select / wide.routed_gated_select). Opt-in: at SmolLM2's prefill it was slower than the router
    # GEMM and Inductor's select it replaces.
    fuse_router_select: bool = False
    # rewrite_mlp: gate and up as one GEMM over a concatenated copy of their weights where the MLP's path is
    # dense-masked at a static token count. Opt-in, untimed alone (fuse_router_gemm makes the same GEMM).
    fuse_gate_up: bool = False
    # fuse_router_gemm: in prefill-size graphs a linear router on the residual stream runs as extra output columns
    # of the GEMM that reads the block's RMSNorm output (decisions the same up to rounding in the model's dtype);
    # the routers it takes are fused, so the passes after it leave them alone. Measured: lean-h100 (ninth run).
    fuse_router_gemm: bool = True
    # rewrite_mlp / rewrite_attention: a structured (codebook / nested) router's blocks on the bucket ops
    # (wide.mlp_bucket, wide.q_proj_bucket, wide.o_proj_bucket); off, they run the free-mask ops on protos[bucket],
    # the same masks. Opt-in: on an H100 the bucket ops were slower than the free-mask ops at every end-to-end
    # workload timed (benchmarks/results/structures-h100/README.md).
    bucket_ops: bool = False

    def __post_init__(self):
        for name, choices in (("sparse_attention", SPARSE_ATTENTION), ("fuse_norm_router", FUSE_NORM_ROUTER)):
            if not _one_of(getattr(self, name), choices):
                raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {getattr(self, name)!r}")
        for name in self.names():
            if name not in THREE_WAY and not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any]) -> "PassOptions":
        """This config's keys out of `options` (others ignored). A value that is not a string counts by its truth
        (as an options dict from a command line gives them); a string must be one of its option's choices."""
        return cls(**{name: v if isinstance(v, str) else bool(v)
                      for name, v in options.items() if name in cls.names()})


def _one_of(value, choices) -> bool:
    """`value` is one of `choices`, booleans by identity (1 is not True here)."""
    return any(value is c if isinstance(c, bool) else value == c for c in choices)
