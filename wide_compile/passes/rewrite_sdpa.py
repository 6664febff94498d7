"""Pass 7: attention that skips. A routed attention block's sdpa call becomes

* `wide.attn_decode` when the query has one token per sequence (a decode step over a KV cache): only the KV
  heads of the active head groups are read; the cache's bool mask [B, 1, 1, L] becomes the key mask;
* `wide.attn_prefill` when sdpa is causal without a mask over keys as long as the queries (a prefill with
  no cache): only the active (token, head group) pairs are computed.

Both give exactly 0 on an inactive group's rows, which o_proj drops anyway. K and V are never skipped where
they are written: the cache stays complete. transformers repeats K / V per query head (`repeat_kv`:
index with None, expand, reshape) when it passes a mask; the pass reads the cache under that repeat, so the
kernel reads each KV head once. Anything else (float masks, a window the graph does not state, groups that
straddle KV heads, a mask computed after the query) keeps the dense sdpa and says why in the report.
"""
from __future__ import annotations

import operator

import torch
from torch import fx

from ._graph import arg, meta, node_index
from ._ops import wide_attn_decode_nd, wide_attn_prefill_nd
from .base import Pass, PassContext, log


def _static_shape(n) -> tuple | None:
    v = meta(n)
    if v is None or not all(isinstance(s, int) for s in v.shape):
        return None
    return tuple(v.shape)


def _unrepeated(kv: fx.Node) -> fx.Node:
    """The [B, Hkv, L, d] source of a repeat_kv (x[:, :, None].expand(...).reshape(B, Hq, L, d)), or kv."""
    if not (kv.op == "call_method" and kv.target == "reshape"):
        return kv
    ex = kv.args[0]
    if not (isinstance(ex, fx.Node) and ex.op == "call_method" and ex.target == "expand"):
        return kv
    gi = ex.args[0]
    if not (isinstance(gi, fx.Node) and gi.op == "call_function" and gi.target is operator.getitem):
        return kv
    idx = gi.args[1]
    full = slice(None, None, None)
    if isinstance(idx, tuple) and len(idx) == 5 and idx[2] is None and all(i == full for i in idx[:2] + idx[3:]):
        src = gi.args[0]
        if isinstance(src, fx.Node) and meta(src) is not None and meta(src).dim() == 4:
            return src
    return kv


def _kv_heads_ok(Hq: int, Hkv: int, heads_per_group: int) -> str | None:
    from ..kernels.attn_decode import check_groups

    try:
        check_groups(Hq, Hkv, heads_per_group)
    except ValueError as e:
        return str(e)
    return None


class RewriteSDPA(Pass):
    """prefill_kv_aligned_only (optimize's sparse_attention="auto"): a prefill's attention is rewritten only in
    blocks whose head groups are whole KV heads; the others keep sdpa there and the report says why. Decode
    steps are rewritten for every grouping the kernel takes: even where 1-head groups leave nearly every KV
    head active, wide.attn_decode reads each KV head once where the dense graph first copies the cache per
    query head (repeat_kv). The measured choice: benchmarks/results/lean-h100/README.md (fifth run)."""
    name = "rewrite_sdpa"

    def __init__(self, prefill_kv_aligned_only: bool = False):
        self.prefill_kv_aligned_only = prefill_kv_aligned_only

    def __call__(self, ctx: PassContext) -> None:
        order = node_index(ctx.gm)
        for a in ctx.attns:
            if a.status != "rewritten" or a.mask is None:
                continue
            why = self._rewrite(ctx, a, order)
            if why:
                a.sdpa_reason = why
                ctx.count("rewrite_sdpa.kept_dense")
                log.info("wide: layer %d: attention itself stays dense sdpa (%s)", a.layer, why)

    def _rewrite(self, ctx: PassContext, a, order) -> str | None:
        sd = a.sdpa
        q, k, v = arg(sd, 0, "query"), arg(sd, 1, "key"), arg(sd, 2, "value")
        mask = arg(sd, 3, "attn_mask")
        causal, scale = arg(sd, 5, "is_causal", False), arg(sd, 6, "scale")
        if arg(sd, 4, "dropout_p", 0.0) not in (0, 0.0):
            return "sdpa has dropout"
        if a.mask.op != "get_attr" and order.get(a.mask, -1) > order.get(sd, 0):
            return "the router mask is computed after sdpa"
        qs = _static_shape(q)
        if qs is None or len(qs) != 4:
            return "the query's shape is not static [B, H, T, d]"
        B, Hq, Tq, d = qs
        hg = a.group_size // d if a.group_size and a.group_size % d == 0 else None
        if hg is None or Hq % hg:
            return f"head groups of {a.group_size} q columns are not whole heads of {d}"
        k, v = _unrepeated(k), _unrepeated(v)
        ks, vs = _static_shape(k), _static_shape(v)
        if ks is None or vs is None or ks != vs or ks[0] != B or ks[3] != d:
            return "K / V shapes are not static [B, Hkv, L, d]"
        why = _kv_heads_ok(Hq, ks[1], hg)
        if why:
            return why
        n_rep = Hq // ks[1]
        if Tq == 1 and not causal:
            key_mask = None
            if mask is not None:
                ms = meta(mask)
                if ms is None or ms.dtype != torch.bool or ms.dim() != 4 or tuple(ms.shape[1:3]) != (1, 1) \
                        or ms.shape[3] != ks[2]:
                    return "the decode mask is not a bool [B, 1, 1, L] key mask"
                key_mask = mask
            with ctx.gm.graph.inserting_before(sd):
                new = ctx.weights.call(wide_attn_decode_nd, (q, k, v, a.mask, hg, key_mask, scale))
            kind = "decode"
        elif Tq > 1 and causal and mask is None and ks[2] == Tq:
            if self.prefill_kv_aligned_only and hg % n_rep:
                return (f"sparse_attention='auto' rewrites a prefill's attention for KV-aligned head groups only: "
                        f"groups of {hg} head(s), {n_rep} query heads per KV head, where the dense causal kernel "
                        "is faster (WideConfig(head_group_size='kv') aligns them; sparse_attention=True rewrites "
                        "anyway)")
            with ctx.gm.graph.inserting_before(sd):
                new = ctx.weights.call(wide_attn_prefill_nd, (q, k, v, a.mask, hg, scale))
            kind = "prefill"
        else:
            return ("not a decode step (one query, no causal flag) nor a causal prefill without a mask "
                    f"(T={Tq}, is_causal={causal}, mask={'yes' if mask is not None else 'no'})")
        sd.replace_all_uses_with(new)
        ctx.gm.graph.erase_node(sd)
        a.sdpa_kind = kind
        ctx.count(f"rewrite_sdpa.{kind}")
        log.info("wide: layer %d: sdpa -> wide.attn_%s (%d head groups of %d heads)", a.layer, kind,
                 Hq // hg, hg)
        return None
