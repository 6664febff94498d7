"""torch.ops.wide.* registration: opcheck, public wrappers (leading dims), torch.compile tracing,
reference semantics (inactive groups contribute exactly 0).  Runs on CPU (reference impl)."""
import pytest
import torch

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


def test_wrappers_leading_dims_and_semantics():
    x, w1, w2, w3, m = _inputs(T=6)
    x3, m3 = x.view(2, 3, 16), m.view(2, 3, 4)
    out = wide_mlp(x3, w1, w2, w3, m3, 8)
    assert out.shape == (2, 3, 16)
    torch.testing.assert_close(out.view(6, 16), R.mlp_ref(x, w1, w2, w3, m, 8))
    # inactive groups contribute exactly 0: garbage in weights of groups no token uses changes nothing
    off = ~m.any(0)
    if off.any():
        rows = R.expand_mask(off[None], 8)[0]
        w1z, w3z = w1.clone(), w3.clone()
        w1z[rows] = 1e4
        w3z[rows] = -1e4
        torch.testing.assert_close(wide_mlp(x3, w1z, w2, w3z, m3, 8), out)
    q = wide_q_proj(x3, w1, None, m3, 8)
    assert q.shape == (2, 3, 32)
    assert (q.view(6, 32)[R.expand_mask(~m, 8)] == 0).all()
    a = torch.randn(2, 3, 32)
    o = wide_o_proj(a, w3, torch.ones(16), m3, 8)
    assert o.shape == (2, 3, 16)
    a2 = a.clone().view(6, 32)
    a2[R.expand_mask(~m, 8)] = 1e6  # inactive columns must not matter
    torch.testing.assert_close(wide_o_proj(a2.view(2, 3, 32), w3, torch.ones(16), m3, 8), o)
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
