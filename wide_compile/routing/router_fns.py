"""The router maths, once: plain functions of (h, *tensors) that a router module's forward calls and that
the form-B pass (passes/insert_routers) inserts into a dense graph as they are.

`*_logits` return float32 logits [..., G] (execute iff > 0); `*_mask` return the hard bool mask [..., G].
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def linear_logits(h, w, b):
    # h: [..., D], w: [G, D], b: [G]
    return F.linear(h.to(w.dtype), w, b)


def linear_router_mask(h, w, b):
    return linear_logits(h, w, b) > 0


def summed_linear_logits(h, w, b):
    """linear_logits as a multiply-and-sum over the width (the same fp32 products, summed in another order):
    compiled at a few tokens, Inductor makes it one reduction kernel with the bias and the threshold in it, where
    an fp32 GEMM of one row runs as cuBLAS's dot and reduce kernels and the threshold as a third launch."""
    # h: [..., D], w: [G, D], b: [G] -> [..., G]
    z = (h.to(w.dtype).unsqueeze(-2) * w).sum(-1)
    return z if b is None else z + b


def summed_linear_router_mask(h, w, b):
    return summed_linear_logits(h, w, b) > 0


def split_logits(h: torch.Tensor, w2: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """Logits of a linear router held as a bf16 pair (routers.split_bf16), for bf16 inputs: one tensor-core
    GEMM h @ [hi; lo]^T with fp32 accumulation and fp32 output (aten::mm.dtype on CUDA), then hi + lo in
    fp32. A product of two bf16 values is exact in fp32, so this is the fp32 router up to summation order and
    the 2^-16 weight split, at bf16 GEMM speed (fp32 routers run without tensor cores). w2 may hold each half
    padded with zero rows to Gp >= G rows (split_bf16(pad_to=)): then G is the bias's length."""
    Gp = w2.shape[0] // 2
    G = b.shape[0] if b is not None else Gp
    x = h.reshape(-1, h.shape[-1])
    if x.is_cuda:
        y = torch.mm(x, w2.t(), out_dtype=torch.float32)
    else:  # the same arithmetic where mm.dtype has no kernel (CPU)
        y = x.float() @ w2.float().t()
    out = y.narrow(1, 0, G) + y.narrow(1, Gp, G)
    if b is not None:
        out = out + b.float()
    return out.reshape(*h.shape[:-1], G)


def split_router_mask(h, w2, b):
    return split_logits(h, w2, b) > 0


def normed_margin(z, c, r):
    """A linear router's margin on the residual h, W h + c, scaled by r > 0, from what the block's RMSNorm and the
    projection after it already computed: n = g * (h r) is the norm's output (r = rsqrt(mean(h^2) + eps) [..., 1],
    float32), and z = n @ (W / g)^T [..., G] = r (W h) are extra output columns of the GEMM that reads n
    (passes/fuse_router_gemm.py). So z + c r = r (W h + c) is positive exactly when W h + c is: the same decision,
    up to the rounding of n and of the GEMM's output in the model's dtype."""
    m = z.float()
    return m if c is None else m + c * r


def normed_router_mask(z, c, r):
    return normed_margin(z, c, r) > 0


def mlp_logits(h, w1, b1, w2, b2):
    # h: [..., D] -> silu([..., hidden]) -> [..., G]
    return F.linear(F.silu(F.linear(h.to(w1.dtype), w1, b1)), w2, b2)


def mlp_router_mask(h, w1, b1, w2, b2):
    return mlp_logits(h, w1, b1, w2, b2) > 0


def pair_logits(h, w_down, b_down, w_up, b_up):
    """The "wide" recipe's logit pairs: h [..., D] -> [..., r] -> [..., G, 2] with (skip, execute) last."""
    z = F.linear(F.linear(h.to(w_down.dtype), w_down, b_down), w_up, b_up)
    return z.unflatten(-1, (-1, 2))


def pair_margin(h, w_down, b_down, w_up, b_up):
    """logit_exec - logit_skip [..., G]: execute iff > 0 (the argmax of the pair, deterministic)."""
    z = pair_logits(h, w_down, b_down, w_up, b_up)
    return z[..., 1] - z[..., 0]


def pair_router_mask(h, w_down, b_down, w_up, b_up):
    return pair_margin(h, w_down, b_down, w_up, b_up) > 0


def constant_router_mask(h, mask):
    # mask: [G] bool -> [..., G] for every token of h
    return mask.expand(*h.shape[:-1], mask.shape[-1])


def replay_router_mask(h, mask):
    # mask: [..., T, G] recorded for exactly h's token shape
    return mask.view(*h.shape[:-1], mask.shape[-1])


def bucket_logits(bucket, table):
    """The logits row [..., G] of each token's bucket: bucket [...] int (prototype / level id) indexes the table
    [P, G] (a codebook's prototype logits, a nested router's level logits)."""
    return F.embedding(bucket, table)


def bucket_mask(bucket, table):
    """bool [..., G]: each token's row of the table, > 0. Equals (table > 0)[bucket], the form the bucket ops take
    (the pass recognises this function, inserted or traced as embedding(bucket, table) > 0)."""
    return bucket_logits(bucket, table) > 0


def prototype_widths(protos):
    # protos: [P, G] logits -> [P] float32: the fraction of groups each hard prototype (logits > 0) keeps
    return (protos > 0).to(torch.float32).mean(-1)


def codebook_bucket(h, protos, tilt, *scorer):
    """Each token's prototype id [...]: the argmax (first on ties) of the scores [..., P] plus tilt times each
    prototype's width (the calibration's margin: raising it never narrows a token's pick)."""
    s = scorer_scores(h, scorer)
    return (s + tilt * prototype_widths(protos).to(s.dtype)).argmax(-1)


def codebook_logits(h, protos, tilt, *scorer):
    # h: [..., D], protos: [P, G], scorer: (w [P, D], b) or the rank-r pair -> the chosen prototype's logits
    return bucket_logits(codebook_bucket(h, protos, tilt, *scorer), protos)


def codebook_router_mask(h, protos, tilt, *scorer):
    return bucket_mask(codebook_bucket(h, protos, tilt, *scorer), protos)


def lowrank_scores(h, w_down, b_down, w_up, b_up):
    # h: [..., D] -> [..., r] -> [..., P]
    return F.linear(F.linear(h.to(w_down.dtype), w_down, b_down), w_up, b_up)


def scorer_scores(h, scorer):
    # scorer: (w, b) of a linear D -> P scorer, or (w_down, b_down, w_up, b_up) of a rank-r one
    return linear_logits(h, *scorer) if len(scorer) == 2 else lowrank_scores(h, *scorer)


def nested_level(h, tilt, *scorer):
    """Each token's width level [...]: argmax over the level scores [..., P] plus tilt * level (the tilt is the
    calibration's margin: raising it never lowers a token's level)."""
    s = scorer_scores(h, scorer)
    return (s + tilt * torch.arange(s.shape[-1], device=s.device, dtype=s.dtype)).argmax(-1)


def nested_table(pos, widths):
    """+-30 logits [P, G]: row l keeps the groups whose position in the layer's order pos[g] is below widths[l]."""
    return torch.where(pos[None, :] < widths[:, None], 30.0, -30.0).to(torch.float32)


def nested_logits(h, pos, widths, tilt, *scorer):
    """+-30 logits [..., G]: group g executes iff pos[g] is below the width of the token's level (widths [P],
    long)."""
    return bucket_logits(nested_level(h, tilt, *scorer), nested_table(pos, widths))


def nested_router_mask(h, pos, widths, tilt, *scorer):
    return bucket_mask(nested_level(h, tilt, *scorer), nested_table(pos, widths))
