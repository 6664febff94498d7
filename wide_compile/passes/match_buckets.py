"""Pass 4: find the bucket form of structured (codebook / nested) router masks.

A codebook or nested router's mask is one row of a small table per token:

    mask = embedding(bucket, table) > 0        (router_fns.bucket_mask; traced from attach()'s routers, or
                                                inserted by insert_routers from the router's bucket_form)

with bucket [...] int64 the token's prototype / level id (the router's own argmax node, so the decision and its
tie-breaking stay the eager reference's) and table [P, G] the prototype logits (a codebook's parameter, a
nested router's +-30 level table). For each routed block whose mask has this form the pass adds
protos = table > 0 (bool [P, G]: one node per router, computed once per graph call, not per token) and records
(bucket, protos) on the match; rewrite_mlp / rewrite_attention then call the bucket ops (wide.mlp_bucket,
wide.q_proj_bucket, wide.o_proj_bucket) on them. (table > 0)[bucket] is the mask bit for bit. Free masks keep
no bucket and stay on the free-mask ops.
"""
from __future__ import annotations

import operator

import torch
from torch import fx

from ..routing import router_fns as fns
from ._graph import arg, is_call, meta
from .base import Pass, PassContext, log

_EMBEDDING = {torch.nn.functional.embedding}
_GT = {operator.gt, torch.gt}


def _plain_lookup(e: fx.Node) -> bool:
    # F.embedding(input, weight, padding_idx, max_norm, ...): max_norm would renormalise the table's rows
    return arg(e, 3, "max_norm") is None


def bucket_of(mask) -> tuple[fx.Node, fx.Node] | None:
    """(bucket, table) when `mask` = router_fns.bucket_mask(bucket, table) (inserted) or
    embedding(bucket, table) > 0 (traced; a plain lookup: no max_norm renormalising the table), with an integer
    bucket and a float table [P, G]; else None."""
    if is_call(mask, {fns.bucket_mask}):
        bucket, table = mask.args[:2]
    elif is_call(mask, _GT, ("gt",)) and len(mask.args) == 2 and mask.args[1] in (0, 0.0) and \
            is_call(mask.args[0], _EMBEDDING) and _plain_lookup(mask.args[0]):
        bucket, table = mask.args[0].args[:2]
    else:
        return None
    vb, vt = meta(bucket), meta(table)
    if vb is None or vt is None or vb.dtype not in (torch.int32, torch.int64) or vt.dim() != 2 or \
            not vt.dtype.is_floating_point:
        return None
    return bucket, table


class MatchBuckets(Pass):
    name = "match_buckets"

    def __call__(self, ctx: PassContext) -> None:
        protos_of: dict[fx.Node, fx.Node] = {}  # table -> its bool form, one per router
        for kind, blocks in (("mlp", ctx.mlps), ("attn", ctx.attns)):
            for blk in blocks:
                if blk.status == "fallback" or blk.mask is None:
                    continue
                found = bucket_of(blk.mask)
                if found is None:
                    continue
                bucket, table = found
                if table not in protos_of:
                    with ctx.gm.graph.inserting_before(blk.mask):
                        protos_of[table] = ctx.weights.call(operator.gt, (table, 0))
                blk.bucket, blk.protos = bucket, protos_of[table]
                ctx.count(f"match_buckets.{kind}")
                log.info("wide: layer %d %s: structured router: bucket %%%s, prototypes %%%s > 0", blk.layer, kind,
                         bucket.name, table.name)


_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def bucket_refusal(blk, x: fx.Node) -> str:
    """Why block `blk` (an MLPMatch / AttnMatch with a bucket) cannot run the bucket ops on input x, or "": then
    it runs the free-mask ops on its mask (= protos[bucket], the same routing). Recorded as blk.bucket_reason."""
    vp, vb, vx = meta(blk.protos), meta(blk.bucket), meta(x)
    if vp is not None and (vp.dim() != 2 or vp.shape[-1] != blk.groups):
        return f"its prototype table {tuple(vp.shape)} is not [P, {blk.groups}] (one bit per group of the block)"
    if vb is not None and vx is not None:
        try:
            torch.broadcast_shapes(tuple(vb.shape), tuple(vx.shape[:-1]))
        except RuntimeError:
            return f"its bucket ids {tuple(vb.shape)} are not one per token of the input {tuple(vx.shape[:-1])}"
    if vx is not None and vx.device.type == "cuda" and vx.dtype not in _KERNEL_DTYPES:
        return f"the bucket kernels take float16 / bfloat16 / float32 on the GPU, the input is {vx.dtype}"
    return ""


BUCKET_OPS_OFF = ("bucket_ops=False, the default: the bucket ops measured slower than the free-mask ops "
                  "(optimize(..., bucket_ops=True) runs them)")


def takes_bucket(ctx: PassContext, blk, x: fx.Node, enabled: bool, pass_name: str, what: str) -> bool:
    """Block `blk` has a structured router, the bucket ops are on (`enabled`, PassOptions.bucket_ops) and they take
    it on input x; else the reason goes on blk.bucket_reason and is counted as `<pass_name>.bucket_off` /
    `.bucket_refused` (`what` names the block in the refusal's warning)."""
    if blk.bucket is None:
        return False
    if not enabled:
        blk.bucket_reason = BUCKET_OPS_OFF
        ctx.count(f"{pass_name}.bucket_off")
        return False
    blk.bucket_reason = bucket_refusal(blk, x)
    if blk.bucket_reason:
        ctx.count(f"{pass_name}.bucket_refused")
        log.warning("wide: layer %d: %s: structured router on the free-mask ops (mask = protos[bucket]): %s",
                    blk.layer, what, blk.bucket_reason)
    return not blk.bucket_reason
