"""Pass 2: detect attention blocks by structure.

    q(x), k(x), v(x)   three (or more) linears sharing the input x, or column ranges of one fused qkv linear
                       (Phi-3's qkv_proj: qkv[..., :Nq], qkv[..., Nq:Nq+Nkv], ...)
    q -> per-head ops (view/transpose/RoPE arithmetic/slicing/cat, a norm over each head as in Qwen3's
         q_norm) -> sdpa(query=...)
    sdpa -> shape plumbing (transpose/reshape/contiguous) [-> group-mask multiply, form A] -> o linear

K and V are found as q's siblings (linears on the same input); with a static KV cache they reach sdpa
through an in-place cache update, so their path to sdpa is not required. The q -> sdpa path is checked op
by op: anything that could mix heads (reductions over more than one head, matmuls, norms over the whole
projection as in OLMo2's q_norm) keeps q dense (o is still rewritten; correctness never depends on q being
zeroed).
"""
from __future__ import annotations

from torch import fx

from ._graph import (arg, is_elementwise, is_linear, is_meta_use, is_per_head, is_reshape, is_sdpa, linear_parts,
                     match_group_mask, meta, proj_source, reduces_last_dim_only, tensor_args)
from .base import AttnMatch, Pass, PassContext, log


def _ancestor_linears(start: fx.Node) -> set[fx.Node]:
    """Linear nodes reachable backwards from `start` without passing through another linear."""
    seen, out, stack = set(), set(), [start]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if is_linear(n):
            out.add(n)
            continue
        stack.extend(tensor_args(n))
    return out


def _q_path_ok(q: fx.Node, sdpa: fx.Node) -> tuple[bool, str]:
    """Every use of q's output is a per-head op that ends in sdpa's query argument (only). A reduction over the
    last dimension is per head when that dimension is one head (sdpa's query [..., T, head_dim])."""
    query = arg(sdpa, 0, "query")
    qv = meta(query)
    head_dim = int(qv.shape[-1]) if qv is not None and isinstance(qv.shape[-1], int) else None
    seen, stack = set(), [q]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        for u in n.users:
            if u is sdpa:
                others = [arg(sdpa, 1, "key"), arg(sdpa, 2, "value"), arg(sdpa, 3, "attn_mask")]
                if n is not query or any(o is n for o in others):
                    return False, f"q reaches sdpa outside the query argument via %{n.name}"
                continue
            if is_meta_use(u):
                continue
            if not (is_per_head(u) or is_elementwise(u)):
                reduced = reduces_last_dim_only(u)
                if reduced is None:
                    return False, f"op %{u.name} ({u.target}) on the q path may mix heads"
                if reduced != head_dim:
                    return False, (f"%{u.name} ({u.target}) reduces over {reduced} q columns, more than one head "
                                   f"of {head_dim} (a norm over the whole q projection: zeroing a head would "
                                   "change the others)")
            stack.append(u)
    return True, ""


def _q_and_kv(q_lin: fx.Node, query: fx.Node):
    """(q, [k, v, ...]): q_lin itself and the linears sharing its input, or, for a fused qkv linear, the column
    range of it that reaches sdpa's query and its other column ranges. (None, []) when neither fits."""
    x = linear_parts(q_lin)[0]
    slices = [u for u in q_lin.users if proj_source(u) is not None and proj_source(u)[1] is not None]
    if slices and len(slices) == len(q_lin.users):  # fused: every use is a column range
        reach = _ancestors_until(query, q_lin)
        q = [s for s in slices if s in reach]
        if len(q) != 1:
            return None, []
        return q[0], [s for s in slices if s is not q[0]]
    return q_lin, [u for u in x.users if is_linear(u) and u is not q_lin and linear_parts(u)[0] is x]


def _ancestors_until(start: fx.Node, stop: fx.Node) -> set:
    """Nodes reachable backwards from start, not passing through stop."""
    seen, stack = set(), [start]
    while stack:
        n = stack.pop()
        if n in seen or n is stop:
            continue
        seen.add(n)
        stack.extend(tensor_args(n))
    return seen


def _o_after(sdpa: fx.Node):
    """Follow sdpa's output through shape plumbing to a linear: (o, o_in, mask, G, gs, expand) or None."""
    cur = sdpa
    for _ in range(16):
        users = [u for u in cur.users if not is_meta_use(u)]
        if len(users) != 1:
            return None
        u = users[0]
        if is_linear(u) and linear_parts(u)[0] is cur:
            return u, cur, None, None, None, []
        if u.op == "call_method" and u.target == "unflatten":  # maybe the traced group-mask multiply
            chain_end = [w for w in u.users]
            if len(chain_end) == 1 and len(chain_end[0].users) == 1:
                flat = next(iter(chain_end[0].users))
                em = match_group_mask(flat)
                if em is not None and em[0] is cur:
                    outs = [w for w in flat.users if not is_meta_use(w)]
                    if len(outs) == 1 and is_linear(outs[0]) and linear_parts(outs[0])[0] is flat:
                        _, mask, G, gs, expand = em
                        return outs[0], cur, mask, G, gs, expand
            return None
        if not is_reshape(u):
            return None
        cur = u
    return None


class DetectAttention(Pass):
    name = "detect_attention"

    def __call__(self, ctx: PassContext) -> None:
        for n in ctx.gm.graph.nodes:
            if not is_sdpa(n):
                continue
            query = arg(n, 0, "query")
            qs = _ancestor_linears(query) if isinstance(query, fx.Node) else set()
            if len(qs) != 1:
                ctx.unmatched("attention", n, f"the query of sdpa comes from {len(qs)} linear projections, "
                              "expected 1")
                continue
            q_lin = next(iter(qs))
            x = linear_parts(q_lin)[0]
            q, kv = _q_and_kv(q_lin, query)
            if q is None or len(kv) < 2:
                ctx.unmatched("attention", n, "the q projection shares its input with no k/v projections (separate "
                              "linears, or column ranges of one fused qkv linear)")
                continue
            after = _o_after(n)
            if after is None:
                ctx.unmatched("attention", n, "the sdpa output does not reach an output projection through "
                              "reshapes")
                continue
            o, o_in, mask, G, gs, expand = after
            m = AttnMatch(x=x, q=q, kv=kv, sdpa=n, o=o, o_in=o_in, mask=mask, groups=G, group_size=gs,
                          expand_nodes=expand, q_src=proj_source(q))
            m.q_ok, m.q_reason = _q_path_ok(q, n)
            m.layer = len(ctx.attns)
            ctx.attns.append(m)
        ctx.count("detect_attention.matched", len(ctx.attns))
        ctx.count("detect_attention.masked", sum(a.form == "masked" for a in ctx.attns))
        for a in ctx.attns:
            log.debug("layer %d: attention q=%s kv=%s o=%s (%s)", a.layer, a.q.name, [k.name for k in a.kv],
                      a.o.name, a.form)
