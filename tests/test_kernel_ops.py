"""torch.ops.wide.* registration: opcheck, public wrappers (leading dims), torch.compile tracing,
reference semantics (inactive groups contribute exactly 0).  Runs on CPU (reference impl)."""
import pytest
import torch
import torch.nn.functional as F

import wide_compile.kernels  # noqa: F401  (registers torch.ops.wide.*)
from wide_compile.kernels import mask_reorder, reference as R, wide_mlp, wide_o_proj, wide_q_proj


def _inputs(T=5, D=16, G=4, gs=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    F = G * gs
    x = torch.randn(T, D, generator=g, dtype=dtype)
    w1 = torch.randn(F, D, generator=g, dtype=dtype)
    w2 = torch.randn(F, D, generator=g, dtype=dtype)
    w3 = torch.randn(F, D, generator=g, dtype=dtype)
    m = torch.rand(T, G, generator=g) < 0.5
    return x, w1, w2, w3, m


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_all(dtype):
    x, w1, w2, w3, m = _inputs(dtype=dtype)
    a = torch.randn(5, 32, dtype=dtype)
    b_q = torch.randn(32, dtype=dtype)
    b_o = torch.randn(16, dtype=dtype)
    cases = [
        (torch.ops.wide.mlp.default, (x, w1, w2, w3, m, 8)),
        (torch.ops.wide.q_proj.default, (x, w1, b_q, m, 8)),
        (torch.ops.wide.q_proj.default, (x, w1, None, m, 8)),
        (torch.ops.wide.o_proj.default, (a, w3, b_o, m, 8)),
        (torch.ops.wide.o_proj.default, (a, w3, None, m, 8)),
        (torch.ops.wide.mask_reorder.default, (m, 4)),
        (torch.ops.wide.mask_reorder.default, (m, 1)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)


def _mixed_mask(T, G, seed=0):
    """[T, G] bool with every case the ops must get right: random rows, one all-off row, one all-on row,
    and group 1 off for every token (a group no token uses)."""
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(T, G, generator=g) < 0.5
    m[0] = False
    m[1] = True
    m[:, 1] = False
    return m


def _oracle_f64(x, w_gate, w_up, w_down_t, w_q, b_q, a, w_o_t, b_o, m, gs):
    """Independent float64 oracle, per token, with the inactive groups removed from the WEIGHTS (the DESIGN
    oracle: down_proj / o_proj columns and q rows of inactive groups zeroed), not from the activations as
    reference.py does."""
    d = torch.float64
    x, w_gate, w_up, w_down_t, w_q, b_q, a, w_o_t, b_o = (t.to(d) for t in (x, w_gate, w_up, w_down_t, w_q, b_q,
                                                                             a, w_o_t, b_o))
    keep = m.repeat_interleave(gs, dim=-1).to(d)  # [T, G*gs]
    mlp = torch.stack([F.silu(x[t] @ w_gate.T) * (x[t] @ w_up.T) @ (w_down_t * keep[t, :, None])
                       for t in range(x.shape[0])])
    q = torch.stack([x[t] @ (w_q * keep[t, :, None]).T + b_q * keep[t] for t in range(x.shape[0])])
    o = torch.stack([a[t] @ (w_o_t * keep[t, :, None]) + b_o for t in range(x.shape[0])])
    return mlp, q, o


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
def test_wrappers_against_float64_oracle(dtype, tol):
    """wide_mlp / wide_q_proj / wide_o_proj (leading dims [2, 3]) against the float64 oracle above."""
    x, w1, w2, w3, _ = _inputs(T=6, dtype=dtype)
    m = _mixed_mask(6, 4)
    g = torch.Generator().manual_seed(5)
    b_q, a, b_o = (torch.randn(*s, generator=g, dtype=dtype) for s in ((32,), (6, 32), (16,)))
    exp_mlp, exp_q, exp_o = _oracle_f64(x, w1, w2, w3, w1, b_q, a, w3, b_o, m, 8)
    x3, m3, a3 = x.view(2, 3, 16), m.view(2, 3, 4), a.view(2, 3, 32)
    out = wide_mlp(x3, w1, w2, w3, m3, 8)
    q = wide_q_proj(x3, w1, b_q, m3, 8)
    o = wide_o_proj(a3, w3, b_o, m3, 8)
    assert out.shape == (2, 3, 16) and q.shape == (2, 3, 32) and o.shape == (2, 3, 16)
    for got, exp in ((out, exp_mlp), (q, exp_q), (o, exp_o)):
        torch.testing.assert_close(got.reshape(exp.shape).double(), exp, atol=tol, rtol=tol)
    assert (q.view(6, 32)[R.expand_mask(~m, 8)] == 0).all()  # inactive q columns exactly 0, bias included
    assert torch.equal(o[0, 0], b_o)  # the all-off token: bias only


def test_unused_groups_do_not_matter():
    """Weights of a group no token uses (and inactive columns of o_proj's input) may hold anything: garbage
    there changes nothing."""
    x, w1, w2, w3, _ = _inputs(T=6)
    m = _mixed_mask(6, 4)
    off = ~m.any(0)
    assert off.any()  # the check below runs (group 1 is off for every token)
    x3, m3 = x.view(2, 3, 16), m.view(2, 3, 4)
    out = wide_mlp(x3, w1, w2, w3, m3, 8)
    rows = R.expand_mask(off[None], 8)[0]
    w1z, w2z, w3z = w1.clone(), w2.clone(), w3.clone()
    w1z[rows], w2z[rows], w3z[rows] = 1e4, 1e4, -1e4
    torch.testing.assert_close(wide_mlp(x3, w1z, w2z, w3z, m3, 8), out, atol=0, rtol=0)
    q = wide_q_proj(x3, w1, None, m3, 8)
    torch.testing.assert_close(wide_q_proj(x3, w1z, None, m3, 8), q, atol=0, rtol=0)
    a = torch.randn(2, 3, 32)
    o = wide_o_proj(a, w3, torch.ones(16), m3, 8)
    a2 = a.clone().view(6, 32)
    a2[R.expand_mask(~m, 8)] = 1e6  # inactive columns must not matter
    torch.testing.assert_close(wide_o_proj(a2.view(2, 3, 32), w3, torch.ones(16), m3, 8), o, atol=0, rtol=0)
    # all-inactive -> bias only
    o0 = wide_o_proj(a, w3, torch.ones(16), torch.zeros_like(m3), 8)
    assert torch.equal(o0, torch.ones(2, 3, 16))


def test_mask_reorder_structure():
    g = torch.Generator().manual_seed(1)
    T, G, bm = 37, 9, 8
    m = torch.rand(T, G, generator=g) < 0.4
    tg, tc, sid, bg, ntpp = mask_reorder(m, bm)
    n_tiles = (T + bm - 1) // bm
    assert tg.shape == (n_tiles, G) and tc.shape == (n_tiles,)
    assert sid.shape == (G * n_tiles * bm,) and bg.shape == (G * n_tiles,) and ntpp.shape == (1,)
    for t in range(n_tiles):
        act = m[t * bm:(t + 1) * bm].any(0)
        assert tc[t] == act.sum()
        assert tg[t, :tc[t]].tolist() == act.nonzero().flatten().tolist()
        assert sorted(tg[t].tolist()) == list(range(G))
    total = int(ntpp)
    assert total % bm == 0 and total == sum(-(-int(c) // bm) * bm for c in m.sum(0))
    for b in range(total // bm):
        grp = int(bg[b])
        toks = sid[b * bm:(b + 1) * bm]
        real = toks[toks < T]
        assert m[real.long(), grp].all()
    assert (bg[total // bm:] == -1).all() and (sid[total:] == T).all()
    # every active pair appears exactly once
    pairs = {(int(t), int(bg[i // bm])) for i, t in enumerate(sid[:total].tolist()) if t < T}
    assert pairs == {(int(t), int(gg)) for t, gg in m.nonzero().tolist()}
    assert len([t for t in sid[:total].tolist() if t < T]) == int(m.sum())


def test_torch_compile_traces_without_graph_breaks():
    x, w1, w2, w3, m = _inputs(T=7)

    def f(x, m):
        h = wide_mlp(x, w1, w2, w3, m, 8)
        q = wide_q_proj(x, w1, None, m, 8)
        o = wide_o_proj(q, w3, None, m, 8)
        return h + o, mask_reorder(m, 4)[0]

    cf = torch.compile(f, fullgraph=True, dynamic=True)
    got = cf(x, m)
    exp = f(x, m)
    torch.testing.assert_close(got[0], exp[0])
    assert torch.equal(got[1], exp[1])
    x2, *_ , m2 = _inputs(T=11, seed=3)  # other T, same compiled graph (dynamic)
    torch.testing.assert_close(cf(x2, m2)[0], f(x2, m2)[0])
