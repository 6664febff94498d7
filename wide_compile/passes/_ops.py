"""Graph-side wrappers around the WIDE kernel ops (wide_compile.kernels: wide_mlp / wide_q_proj /
wide_o_proj, backed by torch.ops.wide.*). The passes insert calls to these N-d wrappers; AOT autograd
traces through them, so the graph Inductor sees holds reshapes + the torch.ops.wide ops (T = all tokens).
`tuning` is the kernels' tile table as JSON ("" = the device's shipped one; wide_compile.kernels.tuning)."""
from __future__ import annotations

import torch

OPS = ("wide_mlp", "wide_q_proj", "wide_o_proj", "wide_attn_decode", "wide_attn_prefill", "wide_rmsnorm_router",
       "wide_add_rmsnorm_router", "wide_mlp_bucket", "wide_q_proj_bucket", "wide_o_proj_bucket", "wide_routed_select",
       "wide_routed_gated_select")


def kernels():
    import importlib

    return importlib.import_module("wide_compile.kernels")


def missing_ops() -> list[str]:
    try:
        K = kernels()
    except Exception as e:  # pragma: no cover - import error in the kernels package
        return [f"{o} (import failed: {e})" for o in OPS]
    return [o for o in OPS if not callable(getattr(K, o, None))]


def _flat_mask(mask, lead):
    g = mask.shape[-1]
    return mask.expand(*lead, g).reshape(-1, g)


def group_masked_nd(x, mask):
    """The eager reference's group-mask multiply (routing/attach.py _expand): x [..., G*gs] with the columns of
    the groups inactive in mask [..., G] zeroed. What a dense graph given routers runs where a block cannot
    use the WIDE kernels, so its routing is kept."""
    g = mask.shape[-1]
    return (x.unflatten(-1, (g, x.shape[-1] // g)) * mask.to(x.dtype).unsqueeze(-1)).flatten(-2)


def wide_mlp_nd(x, w_gate, w_up, w_down_t, mask, group_size: int, tuning: str = "", activation: str = "silu"):
    lead = x.shape[:-1]
    out = kernels().wide_mlp(x.reshape(-1, x.shape[-1]), w_gate, w_up, w_down_t, _flat_mask(mask, lead),
                             group_size, tuning, activation)
    return out.reshape(*lead, out.shape[-1])


def wide_q_proj_nd(x, w_q, b_q, mask, group_size: int, tuning: str = ""):
    lead = x.shape[:-1]
    out = kernels().wide_q_proj(x.reshape(-1, x.shape[-1]), w_q, b_q, _flat_mask(mask, lead), group_size, tuning)
    return out.reshape(*lead, out.shape[-1])


def wide_o_proj_nd(a, w_o_t, b_o, mask, group_size: int, tuning: str = ""):
    lead = a.shape[:-1]
    out = kernels().wide_o_proj(a.reshape(-1, a.shape[-1]), w_o_t, b_o, _flat_mask(mask, lead), group_size, tuning)
    return out.reshape(*lead, out.shape[-1])


def _flat_bucket(bucket, lead):
    # bucket: [...] prototype ids of the router's tokens -> [T], one per row of the flattened input
    return bucket.expand(*lead).reshape(-1)


def wide_mlp_bucket_nd(x, w_gate, w_up, w_down, bucket, protos, group_size: int, activation: str = "silu"):
    """x [..., D], w_down [D, F] (down_proj's own weight), bucket [...] int, protos [P, G] bool -> [..., D]."""
    lead = x.shape[:-1]
    out = kernels().wide_mlp_bucket(x.reshape(-1, x.shape[-1]), w_gate, w_up, w_down, _flat_bucket(bucket, lead),
                                    protos, group_size, activation)
    return out.reshape(*lead, out.shape[-1])


def wide_q_proj_bucket_nd(x, w_q, b_q, bucket, protos, group_size: int):
    lead = x.shape[:-1]
    out = kernels().wide_q_proj_bucket(x.reshape(-1, x.shape[-1]), w_q, b_q, _flat_bucket(bucket, lead), protos,
                                       group_size)
    return out.reshape(*lead, out.shape[-1])


def wide_o_proj_bucket_nd(a, w_o, b_o, bucket, protos, group_size: int):
    """a [..., Nq], w_o [D, Nq] (o_proj's own weight) -> [..., D]."""
    lead = a.shape[:-1]
    out = kernels().wide_o_proj_bucket(a.reshape(-1, a.shape[-1]), w_o, b_o, _flat_bucket(bucket, lead), protos,
                                       group_size)
    return out.reshape(*lead, out.shape[-1])


def wide_attn_decode_nd(q, k, v, mask, heads_per_group: int, key_mask=None, scale=None):
    """q [B, Hq, 1, d], k / v [B, Hkv, L, d], mask [..., G] (the router's, one token per sequence),
    key_mask [B|1, 1, 1, L] bool or None -> [B, Hq, 1, d]."""
    B, G = q.shape[0], q.shape[1] // heads_per_group
    head_mask = mask.expand(B, 1, G).reshape(B, G)
    km = None if key_mask is None else key_mask.expand(B, 1, 1, key_mask.shape[-1]).reshape(B, -1)
    return kernels().wide_attn_decode(q, k, v, head_mask, heads_per_group, km, scale)


def wide_attn_prefill_nd(q, k, v, mask, heads_per_group: int, scale=None):
    """q [B, Hq, T, d], k / v [B, Hkv, T, d], mask [..., T, G] (the router's) -> [B, Hq, T, d], causal."""
    B, T, G = q.shape[0], q.shape[2], q.shape[1] // heads_per_group
    return kernels().wide_attn_prefill(q, k, v, mask.expand(B, T, G), heads_per_group, None, scale)


def wide_rmsnorm_router_nd(x, w_norm, eps: float, router_input: str, kind: str, w1, b1=None, w2=None, b2=None):
    """x [..., D] -> (RMSNorm(x) [..., D], router mask [..., G] bool) in one launch (kernels/norm_router.py)."""
    return kernels().wide_rmsnorm_router(x, w_norm, eps, router_input, kind, w1, b1, w2, b2)


def wide_add_rmsnorm_router_nd(a, b, w_norm, eps: float, router_input: str, kind: str, w1, b1=None, w2=None,
                               b2=None):
    """a, b [..., D] -> (a + b, RMSNorm(a + b), router mask [..., G] bool) in one launch (kernels/norm_router.py)."""
    return kernels().wide_add_rmsnorm_router(a, b, w_norm, eps, router_input, kind, w1, b1, w2, b2)


def _gate_up(x2, w_gate, w_up=None):
    """(g, u) [T, F] of x2 [T, D]: two GEMMs, or (w_up None: w_gate is [gate; up], [2F, D]) one GEMM's halves."""
    if w_up is not None:
        return x2 @ w_gate.t(), x2 @ w_up.t()
    gu = x2 @ w_gate.t()  # [T, 2F]
    F = w_gate.shape[0] // 2
    return gu[:, :F], gu[:, F:]


def wide_mlp_gate_up_nd(x, w_gate_up, w_down_t, mask, group_size: int, activation: str = "silu"):
    """The dense-masked MLP over gate and up as one weight [2F, D] ([gate; up], rewrite_mlp's fuse_gate_up): one
    GEMM where kernels/dense_masked.mlp_dense_masked runs two; the select (Inductor fuses it) reads both halves of
    its output. x [..., D], mask [..., G] -> [..., D]."""
    return wide_mlp_down_nd(x @ w_gate_up.t(), w_down_t, mask, group_size, activation)


def wide_mlp_down_nd(gu, w_down_t, mask, group_size: int, activation: str = "silu"):
    """The rest of the dense-masked MLP once gate and up are computed: gu [..., 2F] = [g | u] (columns of one GEMM's
    output, possibly a view into a wider one), mask [..., G] -> act(g) * u selected by the mask, @ w_down_t [F, D]."""
    from ..kernels.dense_masked import gated_select_ref

    lead, F = gu.shape[:-1], w_down_t.shape[0]
    g2 = gu.reshape(-1, gu.shape[-1])
    h = gated_select_ref(g2[:, :F], g2[:, F:2 * F], _flat_mask(mask, lead), group_size, activation)
    return (h @ w_down_t).reshape(*lead, w_down_t.shape[1])


def dense_masked_mlp_args(node, mask):
    """(x, w_gate, w_up, w_down_t, group_size, activation) of a graph call of wide_mlp_nd or wide_mlp_gate_up_nd (then
    w_up is None and w_gate is [gate; up]) that reads `mask`; None for any other node. The passes that rebuild the
    dense-masked MLP around its router read its arguments here."""
    if node.target is wide_mlp_nd and node.args[4] is mask:
        x, wg, wu, wdt, _, gs = node.args[:6]
        act = node.args[7] if len(node.args) > 7 else node.kwargs.get("activation", "silu")
        return x, wg, wu, wdt, gs, act
    if node.target is wide_mlp_gate_up_nd and node.args[3] is mask:
        x, wgu, wdt, _, gs, act = node.args[:6]
        return x, wgu, None, wdt, gs, act
    return None


def wide_routed_mlp_nd(x, w_gate, w_up, w_down_t, h, w2, b, group_size: int, activation: str = "silu"):
    """The dense-masked MLP (kernels/dense_masked.mlp_dense_masked) with its split-bf16 router computed in the
    select: x [..., D], h [..., Dh] (the router's input), w2 [2 Gp, Dh], b [G] -> [..., D]; w_up None: w_gate is
    [gate; up] (fuse_gate_up) and one GEMM gives both halves. The GEMMs stay aten mm for Inductor; the middle is one
    wide.routed_gated_select launch (fuse_router_select.py)."""
    lead = x.shape[:-1]
    g, u = _gate_up(x.reshape(-1, x.shape[-1]), w_gate, w_up)
    mid = kernels().wide_routed_gated_select(g, u, h.reshape(-1, h.shape[-1]), w2, b, group_size, activation)
    return (mid @ w_down_t).reshape(*lead, w_down_t.shape[1])


def wide_routed_o_proj_nd(a, w_o_t, b_o, h, w2, b, group_size: int):
    """The dense-masked o_proj (dense_masked.o_proj_dense_masked) with its split-bf16 router computed in the
    select of its input: a [..., Nq], w_o_t [Nq, D], b_o [D] or None, h [..., Dh] -> [..., D]."""
    lead = a.shape[:-1]
    am = kernels().wide_routed_select(a.reshape(-1, a.shape[-1]), h.reshape(-1, h.shape[-1]), w2, b, group_size)
    out = am @ w_o_t if b_o is None else torch.addmm(b_o, am, w_o_t)
    return out.reshape(*lead, w_o_t.shape[1])
