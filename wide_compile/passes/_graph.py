"""FX helpers shared by the passes: op classification on Dynamo (torch-level) graphs, tensor metadata,
weights behind placeholders / get_attr, node insertion with fake-tensor metadata."""
from __future__ import annotations

import operator
from typing import Any, Callable, Iterable

import torch
from torch import fx

# --- op classes (Dynamo graphs hold torch-level calls: functions, methods, operators) -------------------
LINEAR_FNS = {torch._C._nn.linear, torch.nn.functional.linear}
SILU_FNS = {torch.nn.functional.silu, torch._C._nn.silu}
SDPA_FNS = {torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention}
MUL_FNS = {operator.mul, torch.mul, operator.imul}

# Ops that keep every element in its own query head (views, per-element arithmetic, slicing, concatenation
# along the head dimension), used on the q -> sdpa path (RoPE lives here). Reductions, matmuls, softmax,
# norms over the whole projection are NOT here: a zeroed (inactive) head would leak into other heads.
_PER_HEAD_METHODS = {"view", "reshape", "transpose", "permute", "contiguous", "to", "float", "half", "bfloat16",
                     "type_as", "unsqueeze", "squeeze", "unflatten", "flatten", "mul", "add", "sub", "neg",
                     "__getitem__", "expand", "clone", "type", "view_as", "reshape_as", "div", "mul_", "add_",
                     "narrow", "chunk", "split", "unbind"}
_PER_HEAD_FNS = {operator.mul, operator.add, operator.sub, operator.neg, operator.truediv, operator.getitem,
                 torch.mul, torch.add, torch.sub, torch.neg, torch.cat, torch.stack, torch.transpose,
                 torch.reshape, torch.unsqueeze, torch.squeeze, torch.flatten, torch.permute, torch.narrow,
                 torch.chunk, torch.split, torch.unbind, torch.view_as_complex, torch.view_as_real,
                 torch.Tensor.type_as, torch.Tensor.to}
# elementwise maths (each element of q depends on that element only), e.g. inside a per-head RMSNorm
_ELEMENTWISE_METHODS = {"pow", "rsqrt", "sqrt", "square", "reciprocal", "abs", "exp", "tanh", "sigmoid"}
_ELEMENTWISE_FNS = {torch.pow, torch.rsqrt, torch.sqrt, torch.square, torch.reciprocal, operator.pow}
# reductions: per head only when they run over the last dimension and that dimension is one head (head_dim)
_REDUCE_METHODS = {"mean", "sum", "norm", "amax", "var"}
_REDUCE_FNS = {torch.mean, torch.sum, torch.norm, torch.amax, torch.var, torch.linalg.vector_norm}
# pure shape plumbing between sdpa and o_proj
_RESHAPE_METHODS = {"view", "reshape", "transpose", "permute", "contiguous", "to", "flatten", "type_as", "clone"}
_RESHAPE_FNS = {torch.transpose, torch.reshape, torch.permute, torch.flatten}
# consumers that only read metadata
_META_METHODS = {"size", "dim", "numel", "stride"}


def is_call(n: Any, fns: set, methods: Iterable[str] = ()) -> bool:
    if not isinstance(n, fx.Node):
        return False
    if n.op == "call_function":
        return n.target in fns
    if n.op == "call_method":
        return n.target in methods
    return False


def is_linear(n) -> bool:
    return is_call(n, LINEAR_FNS)


def is_sdpa(n) -> bool:
    return is_call(n, SDPA_FNS)


def is_mul(n) -> bool:
    return is_call(n, MUL_FNS, ("mul",))


def is_silu(n) -> bool:
    return is_call(n, SILU_FNS, ("silu",))


def is_meta_use(n: fx.Node) -> bool:
    if n.op == "call_method" and n.target in _META_METHODS:
        return True
    return n.op == "call_function" and n.target is getattr and len(n.args) > 1 and n.args[1] in (
        "shape", "dtype", "device", "ndim")


def is_per_head(n: fx.Node) -> bool:
    return is_call(n, _PER_HEAD_FNS, _PER_HEAD_METHODS)


def is_elementwise(n: fx.Node) -> bool:
    return is_call(n, _ELEMENTWISE_FNS, _ELEMENTWISE_METHODS)


def reduces_last_dim_only(n: fx.Node) -> int | None:
    """For a reduction over the last dimension only (mean(-1), sum(dim=-1, keepdim=True), ...): the size of
    that dimension; None for anything else."""
    if not is_call(n, _REDUCE_FNS, _REDUCE_METHODS):
        return None
    v = meta(n.args[0]) if n.args else None
    dim = arg(n, 1, "dim")
    if n.op == "call_function" and n.target in (torch.norm, torch.linalg.vector_norm):
        dim = arg(n, 2, "dim")
    if isinstance(dim, (tuple, list)) and len(dim) == 1:
        dim = dim[0]
    if v is None or not isinstance(dim, int) or dim not in (-1, v.dim() - 1):
        return None
    return _int(v.shape[-1])


def _rows_of_slice(idx, width: int | None):
    """idx of x[idx] when it slices only the last dimension ((..., a:b) or a:b of a 1-d x): (a, b), else None."""
    if isinstance(idx, tuple) and len(idx) == 2 and idx[0] is Ellipsis:
        idx = idx[1]
    elif not (isinstance(idx, slice) and width is not None):
        return None
    if not isinstance(idx, slice) or idx.step not in (None, 1) or width is None:
        return None
    a, b = _int(idx.start) if idx.start is not None else 0, _int(idx.stop) if idx.stop is not None else width
    return (a, min(b, width)) if a is not None and b is not None and 0 <= a < b else None


_SPLIT_METHODS, _SPLIT_FNS = {"chunk", "split"}, {torch.chunk, torch.split}


def proj_source(n) -> tuple | None:
    """Where a projection's output comes from: (linear, None) for a linear node, (linear, (a, b)) for output
    columns a:b of a fused linear (qkv[..., a:b], or an item of chunk / split along the last dimension, as
    in Phi-3's qkv_proj / gate_up_proj); None otherwise. Rows a:b of the fused weight compute those columns."""
    if is_linear(n):
        return n, None
    if not (isinstance(n, fx.Node) and n.op == "call_function" and n.target is operator.getitem):
        return None
    base, idx = n.args[0], n.args[1]
    if is_linear(base):
        rows = _rows_of_slice(idx, last_dim(base))
        return (base, rows) if rows is not None else None
    if is_call(base, _SPLIT_FNS, _SPLIT_METHODS) and is_linear(base.args[0]) and isinstance(idx, int):
        lin, width = base.args[0], last_dim(base.args[0])
        size, dim = arg(base, 1, "split_size_or_sections" if base.target is torch.split else "chunks"), \
            arg(base, 2, "dim", 0)
        vb = meta(lin)
        if width is None or vb is None or dim not in (-1, vb.dim() - 1):
            return None
        if base.target in ("chunk", torch.chunk):
            if not isinstance(size, int) or size <= 0:
                return None
            step = -(-width // size)
            sizes = [min(step, width - i) for i in range(0, width, step)]
        elif isinstance(size, int):
            sizes = [min(size, width - i) for i in range(0, width, size)]
        elif isinstance(size, (list, tuple)) and all(_int(s) is not None for s in size):
            sizes = list(size)
        else:
            return None
        if not 0 <= idx < len(sizes):
            return None
        a = sum(sizes[:idx])
        return lin, (a, a + sizes[idx])
    return None


def is_reshape(n: fx.Node) -> bool:
    return is_call(n, _RESHAPE_FNS, _RESHAPE_METHODS)


def arg(n: fx.Node, i: int, name: str, default=None):
    if len(n.args) > i:
        return n.args[i]
    return n.kwargs.get(name, default)


def linear_parts(n: fx.Node):
    """(input, weight, bias) of a linear node."""
    return arg(n, 0, "input"), arg(n, 1, "weight"), arg(n, 2, "bias")


def tensor_args(n: fx.Node) -> list[fx.Node]:
    out: list[fx.Node] = []
    fx.node.map_arg((n.args, n.kwargs), lambda a: out.append(a))
    return out


def meta(n) -> torch.Tensor | None:
    """The (fake) example value Dynamo recorded for a node, or None."""
    if not isinstance(n, fx.Node):
        return None
    v = n.meta.get("example_value", n.meta.get("val"))
    return v if isinstance(v, torch.Tensor) else None


def last_dim(n) -> int | None:
    v = meta(n)
    if v is None or v.dim() == 0:
        return None
    d = v.shape[-1]
    return int(d) if isinstance(d, int) else None


def static_rows(n) -> int | None:
    """Rows (tokens) of a node's value [..., D] when every leading size is static, else None. Dynamo
    specializes sizes 0 and 1, so a symbolic size is >= 2 and None means at least two rows."""
    v = meta(n)
    if v is None or v.dim() == 0:
        return None
    rows = 1
    for s in v.shape[:-1]:
        if not isinstance(s, int):
            return None
        rows *= s
    return rows


def dense_masked_at_static_rows(node) -> bool:
    """A rewritten op whose path (meta["wide_path"], a cost_model.Decision) is the dense-masked one at a static token
    count: every column computed, the inactive groups selected away."""
    d = node.meta.get("wide_path")
    return d is not None and d.T is not None and d.path == "dense_masked"


def describe(n: fx.Node | None) -> str:
    if n is None:
        return "?"
    st = n.meta.get("stack_trace") or ""
    line = [s.strip() for s in st.strip().splitlines() if s.strip().strip("^~ ")]
    where = f" ({line[-1][:120]})" if line else ""
    src = n.meta.get("nn_module_stack")
    mod = ""
    if src:
        mod = " in " + list(src.values())[-1][0]
    return f"%{n.name}{mod}{where}"


class Weights:
    """Real tensors behind graph nodes: placeholders (example_inputs: with inlined nn modules, parameters
    arrive as placeholders) and get_attr nodes."""

    def __init__(self, gm: fx.GraphModule, example_inputs):
        self.gm = gm
        self.by_node: dict[fx.Node, torch.Tensor] = {}
        phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for n, v in zip(phs, example_inputs or []):
            if isinstance(v, torch.Tensor):
                self.by_node[n] = v
        self._consts: dict[tuple, fx.Node] = {}
        self.fake_mode = None
        for n in gm.graph.nodes:
            v = meta(n)
            fm = getattr(v, "fake_mode", None)
            if fm is not None:
                self.fake_mode = fm
                break

    def tensor(self, n) -> torch.Tensor | None:
        if not isinstance(n, fx.Node):
            return None
        if n.op == "placeholder":
            return self.by_node.get(n)
        if n.op == "get_attr":
            obj = self.gm
            for a in n.target.split("."):
                obj = getattr(obj, a, None)
            return obj if isinstance(obj, torch.Tensor) else None
        return None

    def is_static_weight(self, n) -> bool:
        """A parameter/buffer of the model (not an activation): what may be baked into constants."""
        t = self.tensor(n)
        if t is None:
            return False
        if n.op == "get_attr" or isinstance(t, torch.nn.Parameter):
            return True
        return bool(getattr(t, "_dynamo_static_input_type", None))

    def constant(self, key: tuple, name: str, make: Callable[[], torch.Tensor], before: fx.Node) -> fx.Node:
        """A get_attr node for a tensor made once now (compile time), cached by key."""
        if key in self._consts:
            return self._consts[key]
        t = make()
        base, i = f"_wide_{name}", 0
        while hasattr(self.gm, f"{base}_{i}"):
            i += 1
        attr = f"{base}_{i}"
        self.gm.register_buffer(attr, t, persistent=False)
        p2s = getattr(self.gm, "_param_name_to_source", None)
        if isinstance(p2s, dict):  # Dynamo metadata that AOT autograd expects for every lifted buffer
            from torch._dynamo.source import ConstantSource

            p2s[attr] = ConstantSource(f"wide_compile_{attr}")
        first = next(n for n in self.gm.graph.nodes if n.op != "placeholder")
        with self.gm.graph.inserting_before(first):
            node = self.gm.graph.get_attr(attr)
        if self.fake_mode is not None:
            node.meta["example_value"] = self.fake_mode.from_tensor(t, static_shapes=True)
        self._consts[key] = node
        return node

    def drop_constant(self, node: fx.Node) -> bool:
        """Erase a constant this object made, once nothing reads it, with its buffer; True if it went."""
        key = next((k for k, v in self._consts.items() if v is node), None)
        if key is None or node.users:
            return False
        del self._consts[key]
        self.gm.graph.erase_node(node)
        delattr(self.gm, node.target)
        p2s = getattr(self.gm, "_param_name_to_source", None)
        if isinstance(p2s, dict):
            p2s.pop(node.target, None)
        return True

    def transposed(self, t: torch.Tensor, name: str, before: fx.Node) -> fx.Node:
        """A constant holding t.T, contiguous (a weight re-laid out once, at compile time)."""
        return self.constant(("t", id(t)), name, lambda: t.detach().t().contiguous(), before=before)

    def call(self, target: Callable, args: tuple, kwargs: dict | None = None) -> fx.Node:
        """Insert call_function(target) at the current insertion point and fill its fake example value."""
        node = self.gm.graph.call_function(target, args, kwargs or {})
        if self.fake_mode is not None:
            try:
                fa, fk = fx.node.map_arg((args, kwargs or {}), _example)
                with self.fake_mode:
                    node.meta["example_value"] = target(*fa, **fk)
            except Exception:  # metadata is advisory; Inductor re-traces with its own fake tensors
                pass
        return node


def _example(n: fx.Node):
    """A node's fake example value for re-running an op on it: a tensor, or the tuple of tensors of an op with
    several outputs (so getitem on it gets its own value); None otherwise."""
    v = n.meta.get("example_value", n.meta.get("val"))
    if isinstance(v, torch.Tensor) or (isinstance(v, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in v)):
        return v
    return None


def erase_unused(gm: fx.GraphModule, nodes: Iterable[fx.Node]) -> int:
    """Erase the given (pure, replaced) nodes once nothing uses them; returns how many were erased."""
    pending = {n for n in nodes if isinstance(n, fx.Node) and n.op in ("call_function", "call_method")}
    erased, changed = 0, True
    while changed:
        changed = False
        for n in list(pending):
            if not n.users:
                gm.graph.erase_node(n)
                pending.discard(n)
                erased += 1
                changed = True
    return erased


def node_index(gm: fx.GraphModule) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(gm.graph.nodes)}


def _int(v) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def match_group_mask(n: Any):
    """Match the eager reference's group-mask multiply (routing/attach.py `_expand`):
        flatten(mul(unflatten(inner, -1, (G, gs)), unsqueeze(to(mask, dtype), -1)), -2)
    (operand order free, any chain of dtype casts / unsqueeze(-1) on the mask). Returns
    (inner, mask, G, gs, [nodes of the multiply]) or None."""
    if not (isinstance(n, fx.Node) and n.op == "call_method" and n.target == "flatten"):
        return None
    start = arg(n, 1, "start_dim", 0)
    end = arg(n, 2, "end_dim", -1)
    m = n.args[0]
    if not is_mul(m) or len(m.args) != 2 or m.kwargs:
        return None
    for a, b in (m.args, m.args[::-1]):
        if not (isinstance(a, fx.Node) and a.op == "call_method" and a.target == "unflatten"):
            continue
        dim = arg(a, 1, "dim")
        sizes = arg(a, 2, "sizes")
        if dim not in (-1,) or not isinstance(sizes, (tuple, list)) or len(sizes) != 2:
            continue
        inner = a.args[0]
        va = meta(a)
        if va is not None and (start not in (-2, va.dim() - 2) or end not in (-1, va.dim() - 1)):
            continue
        chain, cur = [], b
        while isinstance(cur, fx.Node) and cur.op == "call_method" and cur.target in ("to", "unsqueeze", "float",
                                                                                     "half", "bfloat16", "type"):
            if cur.target == "unsqueeze":
                if arg(cur, 1, "dim") != -1:
                    break
                if any(c.target == "unsqueeze" for c in chain):
                    break  # exactly one trailing unsqueeze
            chain.append(cur)
            cur = cur.args[0]
        if not any(c.target == "unsqueeze" for c in chain):
            continue
        mv = meta(cur)
        if mv is None or mv.dtype != torch.bool:
            continue
        G, gs = _int(sizes[0]), _int(sizes[1])
        if G is None and va is not None:
            G = _int(va.shape[-2])
        if gs is None and va is not None:
            gs = _int(va.shape[-1])
        if G is None or gs is None or _int(mv.shape[-1]) != G:
            continue
        return inner, cur, G, gs, [n, m, a, *chain]
    return None
