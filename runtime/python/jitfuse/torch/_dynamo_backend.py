# torch.compile(model, backend="jitfuse"): chains of ops jitfuse knows, found in the FX graph Dynamo captures
# (torch-function level, before autograd), become jitfuse sequences on the graph's own parameters; the rest of
# the graph goes to Inductor unchanged. docs/python.md, "torch.compile: backend=\"jitfuse\"".
"""The ``jitfuse`` backend of ``torch.compile``.

``torch.compile(model, backend="jitfuse")`` (registered when ``jitfuse.torch`` is imported) or
``torch.compile(model, backend=jitfuse.torch.backend(...))``. In each graph Dynamo captures, a *chain* is a
run of ops where each op's only consumer is the next one: norms (``F.layer_norm``, ``F.rms_norm``, Hugging
Face's hand-written RMSNorm, Gemma's ``1 + weight`` form), ``F.linear`` (with or without bias), GPT-2's
Conv1D (``addmm`` on a ``[in, out]`` weight), activations (``F.silu``, ``F.gelu``, ``F.relu`` and the GELU
tanh formula written out, as HF's ``NewGELUActivation``), gated products ``act(x W_g^T) * (x W_u^T)``,
dropout, and a residual add at the end (the chain's own input: a channel; another tensor: an extra input).
A chain with at least one linear becomes one call of the ``jitfuse::forward`` op (so autograd, the
backward op and CUDA graphs work as for ``jitfuse.torch.Sequential``); jitfuse's rules decide its fusion.
Everything else, and every chain left out, is compiled by Inductor (``compile_fx``). :func:`reports` and
:func:`explain` list what each compile found and what it left, with the reason; ``JITFUSE_LOG=info`` logs
one line per compile.
"""

import logging
import operator
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

from . import modules as _m

log = logging.getLogger("jitfuse.torch.backend")

_LINEAR = {torch._C._nn.linear, F.linear}
_ADDMM = {torch.addmm}
_LAYER_NORM = {F.layer_norm, torch.layer_norm}
_RMS_NORM = {f for f in (getattr(F, "rms_norm", None), getattr(torch, "rms_norm", None)) if f is not None}
_DROPOUT = {F.dropout}
_ACTS: Dict[Any, str] = {F.silu: "silu", torch.nn.functional.relu: "relu", torch.relu: "relu"}
_GELU = {F.gelu, torch._C._nn.gelu}
_GATED = {"silu": _m.SwiGLU, "gelu_tanh": _m.GEGLU, "relu": _m.ReGLU}
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _val(n: Any) -> Optional[Tensor]:
    if not isinstance(n, fx.Node):
        return None
    v = n.meta.get("example_value", n.meta.get("val"))
    return v if isinstance(v, Tensor) else None


def _is_fn(n: Any, fns: Any) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target in fns


def _is_method(n: Any, name: str) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_method" and n.target == name


def _num(v: Any) -> Optional[float]:
    """A number: a constant, or a node holding a symbolic one (under ``dynamic=True`` Dynamo passes float
    attributes such as a norm's eps as 0-d tensor inputs read with ``.item()``; reading its value guards on it,
    so a new value recompiles)."""
    if isinstance(v, fx.Node):
        v = v.meta.get("example_value", v.meta.get("val"))
        if isinstance(v, torch.SymFloat):  # (a SymInt is a size: read as a constant it would specialise it)
            return float(v)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _scalar_read(n: Any) -> List[fx.Node]:
    """``[n]`` when ``n`` is a ``.item()`` read of a scalar input that only the chain uses (replaced with it)."""
    return [n] if _is_method(n, "item") and len(n.users) == 1 else []


def _other(n: fx.Node, x: Any) -> Any:
    """The operand of a binary node that is not ``x`` (None if neither or both are)."""
    a, b = n.args[0], n.args[1]
    if a is x and b is not x:
        return b
    if b is x and a is not x:
        return a
    return None


def _param(n: Any, dims: int) -> bool:
    """A placeholder or attribute (a parameter of the graph) with ``dims`` dims of a float dtype."""
    v = _val(n)
    return (isinstance(n, fx.Node) and n.op in ("placeholder", "get_attr") and v is not None and v.dim() == dims
            and v.dtype in _FLOATS)


_SIZE_FNS = {f for f in (getattr(torch.ops.aten.sym_size, "int", None), getattr(torch.ops.aten.sym_size, "default", None),
                          getattr(torch.ops.aten.sym_numel, "default", None)) if f is not None}


def _size_query(u: fx.Node) -> bool:
    """A node that reads only a tensor's metadata (its size, dim count): under dynamic shapes Dynamo's graph
    has these, and they are not consumers of the data."""
    return ((u.op == "call_method" and u.target in ("size", "dim", "numel")) or
            (u.op == "call_function" and (u.target in _SIZE_FNS or
                                          (u.target is getattr and len(u.args) > 1 and u.args[1] in ("shape", "ndim")))))


def _users(n: fx.Node) -> List[fx.Node]:
    """The consumers of ``n``'s data (size queries left out)."""
    return [u for u in n.users if not _size_query(u)]


def _only_user(n: fx.Node) -> Optional[fx.Node]:
    us = _users(n)
    return us[0] if len(us) == 1 else None


# ---- one step of a chain -------------------------------------------------------------------------------


@dataclass
class _Param:
    """A parameter of the chain's sequence: graph nodes and how the call gets it (``as_is``, ``cat`` of two,
    ``t``: a transpose made row-major)."""

    nodes: Tuple[fx.Node, ...]
    how: str
    shape: Tuple[int, ...]


@dataclass
class _Step:
    ops: List[Tuple[str, Dict[str, Any], List[Tuple[str, _Param]]]]  # (op, attrs, [(abi name, param)])
    covered: List[fx.Node]
    out: fx.Node
    extra: Optional[fx.Node] = None       # an add's other operand (extra input)
    channel: bool = False                 # the add's other operand is the chain's input
    kind: str = ""


def _norm_step(s: fx.Node) -> Optional[_Step]:
    """A norm reading ``s``: F.layer_norm / F.rms_norm, or HF's RMSNorm written out (Llama's, Gemma's)."""
    h = _val(s).shape[-1] if _val(s) is not None else None
    for u in _users(s):
        if _is_fn(u, _LAYER_NORM) and u.args[0] is s and len(u.args) >= 3:
            shape, w = u.args[1], u.args[2]
            b = u.args[3] if len(u.args) > 3 else u.kwargs.get("bias")
            eps = _num(u.args[4] if len(u.args) > 4 else u.kwargs.get("eps", 1e-5))
            if tuple(shape) == (h,) and _param(w, 1) and _param(b, 1) and eps:
                return _Step([("layernorm", {"eps": eps}, [("weight", _Param((w,), "as_is", (h,))),
                                                           ("bias", _Param((b,), "as_is", (h,)))])], [u], u,
                             kind="layernorm")
        if _is_fn(u, _RMS_NORM) and u.args[0] is s:
            w = u.args[2] if len(u.args) > 2 else u.kwargs.get("weight")
            eps = _num(u.args[3] if len(u.args) > 3 else u.kwargs.get("eps"))
            if tuple(u.args[1]) == (h,) and _param(w, 1) and eps:
                return _Step([("rmsnorm", {"eps": eps}, [("weight", _Param((w,), "as_is", (h,)))])], [u], u,
                             kind="rmsnorm")
        # HF: x32 = s.to(float32) / s.float(); var = x32.pow(2).mean(-1, keepdim=True); y = x32 * rsqrt(var + eps)
        if (_is_method(u, "to") and (torch.float32 in u.args[1:] or u.kwargs.get("dtype") == torch.float32)) or \
                _is_method(u, "float"):
            st = _hf_rms(s, u, h)
            if st is not None:
                return st
    return None


def _hf_rms(s: fx.Node, x32: fx.Node, h: Optional[int]) -> Optional[_Step]:
    users = _users(x32)
    pw = next((v for v in users if _is_method(v, "pow") and v.args[1] == 2), None)
    mul = next((v for v in users if _is_fn(v, {operator.mul}) and _other(v, x32) is not None), None)
    if pw is None or mul is None or len(users) != 2:
        return None
    mean = _only_user(pw)
    if not _is_method(mean, "mean") or mean.args[1:] not in ((-1,), (-1, True)) or \
            not (mean.kwargs.get("keepdim") or mean.args[2:] == (True,)):
        return None
    add = _only_user(mean)
    eps_node = _other(add, mean) if _is_fn(add, {operator.add}) else None
    eps = _num(eps_node)
    rs = _only_user(add) if eps else None
    if not _is_fn(rs, {torch.rsqrt}) or _other(mul, x32) is not rs or _only_user(rs) is not mul:
        return None
    covered = [x32, pw, mean] + _scalar_read(eps_node) + [add, rs, mul]
    nxt = _only_user(mul)
    # Llama: weight * y.to(input_dtype) (the cast may be absent); Gemma: y * (1.0 + weight.float()), type_as(s)
    if _is_method(nxt, "to") or _is_method(nxt, "type_as"):
        covered.append(nxt)
        nxt = _only_user(nxt)
    if _is_fn(nxt, {operator.mul}):
        w = _other(nxt, covered[-1])
        if _param(w, 1):
            return _Step([("rmsnorm", {"eps": eps}, [("weight", _Param((w,), "as_is", (h,)))])], covered + [nxt], nxt,
                         kind="rmsnorm (HF)")
        if _is_fn(w, {operator.add}) and _num(_other(w, w.args[0] if isinstance(w.args[0], fx.Node) else w.args[1])) == 1.0:
            wf = w.args[1] if isinstance(w.args[1], fx.Node) else w.args[0]
            src = wf.args[0] if _is_method(wf, "float") else wf
            if _param(src, 1) and len(_users(w)) == 1 and (wf is src or len(_users(wf)) == 1):
                out = _only_user(nxt)
                extra = [w] + ([wf] if wf is not src else [])
                if _is_method(out, "type_as") and out.args[1] is s:
                    return _Step([("rmsnorm", {"eps": eps, "zero_centered_gamma": True},
                                   [("weight", _Param((src,), "as_is", (h,)))])], covered + extra + [nxt, out], out,
                                 kind="rmsnorm (HF, 1 + weight)")
    return None


def _linear_of(u: fx.Node, s: fx.Node) -> Optional[Tuple[fx.Node, Optional[fx.Node]]]:
    if _is_fn(u, _LINEAR) and u.args[0] is s and _param(u.args[1], 2):
        b = u.args[2] if len(u.args) > 2 else u.kwargs.get("bias")
        if b is None or _param(b, 1):
            return u.args[1], b
    return None


def _linear_step(s: fx.Node, first: bool = False) -> Optional[_Step]:
    """A linear reading ``s`` (its only consumer; the chain's first op may share its input with others)."""
    if first:
        cands = [u for u in _users(s) if _linear_of(u, s) is not None or
                 (_is_method(u, "view") and _is_fn(_only_user(u), _ADDMM))]
        u = cands[0] if len(cands) == 1 else None
    else:
        u = _only_user(s)
    if u is None:
        return None
    wb = _linear_of(u, s)
    if wb is not None:
        w, b = wb
        out_f, in_f = _val(w).shape
        ops = [("linear", {"in_features": in_f, "out_features": out_f}, [("weight", _Param((w,), "as_is", (out_f, in_f)))])]
        if b is not None:
            ops.append(("bias", {}, [("bias", _Param((b,), "as_is", (out_f,)))]))
        return _Step(ops, [u], u, kind="linear")
    # GPT-2's Conv1D: view(s, -1, k) -> addmm(bias, ., W[k, n]) -> view(..., [..., n])
    if _is_method(u, "view") and _is_fn(_only_user(u), _ADDMM):
        mm = _only_user(u)
        b, a, w = mm.args[0], mm.args[1], mm.args[2]
        back = _only_user(mm)
        if a is u and _param(w, 2) and _param(b, 1) and _is_method(back, "view") and not mm.kwargs:
            in_f, out_f = _val(w).shape
            return _Step([("linear", {"in_features": in_f, "out_features": out_f, "weight_layout": "in_out"},
                           [("weight", _Param((w,), "as_is", (in_f, out_f)))]),
                          ("bias", {}, [("bias", _Param((b,), "as_is", (out_f,)))])], [u, mm, back], back,
                         kind="linear (Conv1D)")
    return None


def _act_of(u: fx.Node, s: fx.Node) -> Optional[str]:
    if not isinstance(u, fx.Node) or not u.args or u.args[0] is not s:
        return None
    if _is_fn(u, _ACTS):
        return _ACTS[u.target]
    if _is_fn(u, _GELU):
        approx = u.kwargs.get("approximate", u.args[1] if len(u.args) > 1 else "none")
        return "gelu_tanh" if approx == "tanh" else "gelu_erf"
    return None


def _gelu_formula(s: fx.Node) -> Optional[Tuple[List[fx.Node], fx.Node]]:
    """0.5 * s * (1 + tanh(sqrt(2/pi) * (s + 0.044715 * s**3))) as HF's NewGELUActivation writes it."""
    us = _users(s)
    if len(us) != 3:
        return None
    half = next((u for u in us if _is_fn(u, {operator.mul}) and _num(_other(u, s)) == 0.5), None)
    cube = next((u for u in us if (_is_fn(u, {torch.pow}) or _is_method(u, "pow")) and u.args[0] is s
                 and _num(u.args[1]) == 3.0), None)
    inner = next((u for u in us if _is_fn(u, {operator.add}) and _other(u, s) is not None), None)
    if not (half and cube and inner):
        return None
    c = _only_user(cube)
    if not (_is_fn(c, {operator.mul}) and abs((_num(_other(c, cube)) or 0) - 0.044715) < 1e-9 and _other(inner, s) is c):
        return None
    k = _only_user(inner)
    if not (_is_fn(k, {operator.mul}) and abs((_num(_other(k, inner)) or 0) - 0.7978845608028654) < 1e-6):
        return None
    t = _only_user(k)
    if not _is_fn(t, {torch.tanh}) and not _is_method(t, "tanh"):
        return None
    one = _only_user(t)
    if not (_is_fn(one, {operator.add}) and _num(_other(one, t)) == 1.0):
        return None
    out = _only_user(one)
    if not (_is_fn(out, {operator.mul}) and _other(out, one) is half and _only_user(half) is out):
        return None
    return [half, cube, c, inner, k, t, one, out], out


def _act_step(s: fx.Node) -> Optional[_Step]:
    u = _only_user(s)
    name = _act_of(u, s) if u is not None else None
    if name is not None:
        op = {"silu": ("silu", {}), "relu": ("relu", {}), "gelu_tanh": ("gelu", {"approximate": "tanh"}),
              "gelu_erf": ("gelu", {"approximate": "none"})}[name]
        return _Step([(op[0], op[1], [])], [u], u, kind=name)
    g = _gelu_formula(s)
    if g is not None:
        return _Step([("gelu", {"approximate": "tanh"}, [])], g[0], g[1], kind="gelu_tanh (written out)")
    return None


def _gated_step(s: fx.Node, first: bool = False) -> Optional[_Step]:
    """act(linear(s, Wg)) * linear(s, Wu) with two weights of one shape, as HF's gated MLPs write it (the
    chain's first op may share its input with others). One linear with ``split_weight``: the two weights as
    they are, no copy (FP8 recipes join them per step: :func:`_for_recipe`)."""
    us = [u for u in _users(s) if _linear_of(u, s) is not None] if first else _users(s)
    if len(us) != 2:
        return None
    lins = [(u, _linear_of(u, s)) for u in us]
    if any(wb is None or wb[1] is not None for _, wb in lins):
        return None
    for (g, (wg, _)), (u, (wu, _)) in (lins, lins[::-1]):
        act = _only_user(g)
        name = _act_of(act, g) if act is not None else None
        mul = _only_user(act) if name else None
        if name in _GATED and _is_fn(mul, {operator.mul}) and _other(mul, act) is u and _only_user(u) is mul:
            if _val(wg).shape != _val(wu).shape:
                return None
            n, k = _val(wg).shape
            ops = [("linear", {"in_features": k, "out_features": 2 * n, "split_weight": True},
                    [("weight", _Param((wg,), "as_is", (n, k))), ("weight2", _Param((wu,), "as_is", (n, k)))]),
                   (_GATED[name].op, {}, [])]
            return _Step(ops, [g, u, act, mul], mul, kind=f"gated ({name})")
    return None


def _chunk_gated_step(s: fx.Node) -> Optional[_Step]:
    """``gate, up = s.chunk(2, dim=-1); up * act(gate)`` as Phi-3's MLP writes it after its ``gate_up_proj``:
    the gated op on ``s``'s two halves (the first half gated, as jitfuse's gated ops take them)."""
    c = _only_user(s)
    if not ((_is_method(c, "chunk") or _is_fn(c, {torch.chunk})) and c.args[0] is s):
        return None
    n_chunks = c.args[1] if len(c.args) > 1 else c.kwargs.get("chunks")
    dim = c.args[2] if len(c.args) > 2 else c.kwargs.get("dim", 0)
    vs = _val(s)
    if n_chunks != 2 or vs is None or dim not in (-1, vs.dim() - 1) or vs.shape[-1] % 2:
        return None
    items = {u.args[1]: u for u in _users(c) if _is_fn(u, {operator.getitem})}
    if len(items) != 2 or len(_users(c)) != 2 or set(items) != {0, 1}:
        return None
    gate, up = items[0], items[1]
    act = _only_user(gate)
    name = _act_of(act, gate) if act is not None else None
    mul = _only_user(act) if name else None
    if name not in _GATED or not _is_fn(mul, {operator.mul}) or _other(mul, act) is not up or _only_user(up) is not mul:
        return None
    return _Step([(_GATED[name].op, {}, [])], [c, gate, up, act, mul], mul, kind=f"gated halves ({name})")


def _dropout_step(s: fx.Node) -> Optional[_Step]:
    u = _only_user(s)
    if not _is_fn(u, _DROPOUT) or u.args[0] is not s:
        return None
    p = _num(u.args[1] if len(u.args) > 1 else u.kwargs.get("p", 0.5))
    training = u.args[2] if len(u.args) > 2 else u.kwargs.get("training", True)
    inplace = u.args[3] if len(u.args) > 3 else u.kwargs.get("inplace", False)
    if p is None or not isinstance(training, bool) or inplace or not 0 <= p < 1:
        return None
    return _Step([("dropout", {"p": p, "training": training}, [])] if training and p > 0 else [], [u], u,
                 kind="dropout")


def _add_step(s: fx.Node, start: fx.Node, dtype: torch.dtype) -> Optional[_Step]:
    u = _only_user(s)
    if not _is_fn(u, {operator.add}) or u.kwargs:
        return None
    e = _other(u, s)
    ve, vs = _val(e), _val(s)
    if ve is None or vs is None or tuple(ve.shape) != tuple(vs.shape) or ve.dtype != dtype:
        return None
    if e is start:
        return _Step([], [u], u, channel=True, kind="residual (channel)")
    return _Step([], [u], u, extra=e, kind="add")


def _scale_step(s: fx.Node) -> Optional[_Step]:
    u = _only_user(s)
    if _is_fn(u, {operator.mul}) and _num(_other(u, s)) is not None:
        return _Step([("scale", {"value": _num(_other(u, s))}, [])], [u], u, kind="scale")
    return None


# ---- chains ----------------------------------------------------------------------------------------------


@dataclass
class Chain:
    """One chain found in a graph: ``ops`` (the sequence's op dicts), the graph nodes it replaced, and its
    kinds (what each step matched)."""

    input: str
    output: str
    ops: List[Dict[str, Any]]
    kinds: List[str]
    replaced: List[str]
    swapped: bool = True
    reason: str = ""


@dataclass
class GraphReport:
    """What one compile of the backend did with one graph: the chains swapped, the chains and ops left to
    Inductor (with the reason)."""

    graph: int
    chains: List[Chain] = field(default_factory=list)
    left: List[Tuple[str, str]] = field(default_factory=list)   # (node, reason)

    def __str__(self) -> str:
        sw = [c for c in self.chains if c.swapped]
        lines = [f"jitfuse backend, graph {self.graph}: {len(sw)} chain(s) swapped, {len(self.left)} op(s) left to "
                 f"Inductor"]
        for c in self.chains:
            tag = "swapped" if c.swapped else "left   "
            lines.append(f"  {tag} {c.input} -> {c.output}: " + " -> ".join(o["op"] for o in c.ops)
                         + (f" -- {c.reason}" if c.reason else ""))
        for n, why in self.left:
            lines.append(f"  left    {n}: {why}")
        return "\n".join(lines)


_REPORTS: List[GraphReport] = []
_MAX_REPORTS = 1000


def reports() -> List[GraphReport]:
    """The graphs the backend compiled in this process, in order (a copy; the newest 1000)."""
    return list(_REPORTS)


def explain(model: Any = None) -> str:
    """The fusion report of every graph the backend compiled in this process (``model``: accepted for the
    ``jitfuse.torch.explain(compiled_model)`` spelling; Dynamo does not tell a backend which module a graph
    came from, so all are listed)."""
    return "\n".join(str(r) for r in _REPORTS) or "jitfuse backend: nothing compiled yet"


def _extend(start: fx.Node, taken: set, dtype: torch.dtype) -> Tuple[List[_Step], str]:
    """The longest chain from ``start``, and why it stopped."""
    steps: List[_Step] = []
    s = start
    why = "end of the graph"
    first = True
    while True:
        if not first and any(u in taken for u in _users(s)):
            why = "a consumer already in a chain"
            break
        st = None
        if first:
            st = _norm_step(s) or _gated_step(s, True) or _linear_step(s, True)
        else:
            for f in (_gated_step, _linear_step, _chunk_gated_step, _act_step, _dropout_step, _scale_step, _norm_step):
                st = f(s)
                if st is not None:
                    break
        if st is None and not first:
            st = _add_step(s, start, dtype)
        if st is None:
            users = _users(s)
            why = (f"{s.name} has {len(users)} consumers" if len(users) != 1 else
                   f"{users[0].name} ({getattr(users[0].target, '__name__', users[0].target)}) is not an op the "
                   f"backend matches")
            break
        if not first and len(_users(s)) != len(set(_users(s)) & set(st.covered)):
            why = f"{s.name} has a consumer outside the chain"
            break
        if st.channel and any(x.channel for x in steps):
            break
        steps.append(st)
        s = st.out
        first = False
        if st.channel or st.extra is not None:
            why = "the residual add ends it"
            break
    return steps, why


def _dtype_ok(steps: List[_Step], start: fx.Node, dtype: torch.dtype, autocast: bool) -> str:
    """Why the chain cannot run as one sequence of ``dtype`` ('' if it can)."""
    v = _val(start)
    if v is None or v.dtype not in _FLOATS or v.device.type != "cuda":
        return "its input is not a float tensor on CUDA"
    if autocast:
        return ""
    for st in steps:
        for _, _, ps in st.ops:
            for _, p in ps:
                if any(_val(n).dtype != dtype for n in p.nodes):
                    return f"a parameter's dtype is not the input's {dtype} (outside autocast)"
    return ""


class _Chain(nn.Module):
    """The graph's call of one chain: ``forward(x, *extras, *params)`` runs its Sequential through the
    ``jitfuse::forward`` op (autocast casts first, as Sequential does)."""

    def __init__(self, seq: "_m.Sequential", n_extras: int, out_dtype: Optional[torch.dtype]):
        super().__init__()
        self.__dict__["seq"] = seq
        self.n_extras = n_extras
        self.out_dtype = out_dtype

    def forward(self, x: Tensor, *rest: Tensor) -> Tensor:
        seq = self.__dict__["seq"]
        extras = tuple(rest[:self.n_extras])
        params = list(rest[self.n_extras:])
        if _m._autocast_on():
            x, extras, params = _m._autocast(x, extras, params)
        params = [p if p.is_contiguous() else p.contiguous() for p in params]
        y = seq._forward_op(x, extras, params)
        return y.to(self.out_dtype) if self.out_dtype is not None and y.dtype != self.out_dtype else y


class _Given(_m.BasicOp):
    """An op whose parameters the graph passes per call (shapes known here, for the sequence's definition)."""

    def __init__(self, op: str, attrs: Dict[str, Any], params: List[Tuple[str, Tuple[int, ...]]], dtype: torch.dtype):
        super().__init__()
        self.op = op
        self._jf_attrs = dict(attrs)
        self._jf_given = list(params)
        self._jf_dtype = dtype

    def attrs(self, training: bool) -> Dict[str, Any]:
        return dict(self._jf_attrs)

    def jf_params(self) -> List[Tuple[str, Any]]:
        return [(n, torch.empty(s, device="meta", dtype=self._jf_dtype)) for n, s in self._jf_given]


def _for_recipe(op: str, attrs: Dict[str, Any], ps: List[Tuple[str, _Param]],
                recipe: Optional[str]) -> Tuple[Dict[str, Any], List[Tuple[str, _Param]]]:
    """A linear's attributes and parameters as a recipe runs them: FP8 GEMMs read one ``[out, in]`` weight,
    so under an FP8 recipe a split gated weight is joined (``torch.cat``) and an ``[in, out]`` (Conv1D) weight
    transposed, once per step; plain recipes read them as they are."""
    if op != "linear" or not recipe:
        return attrs, ps
    a = dict(attrs)
    if a.pop("split_weight", False):
        (_, p1), (_, p2) = ps
        return a, [("weight", _Param(p1.nodes + p2.nodes, "cat", (2 * p1.shape[0], p1.shape[1])))]
    if a.pop("weight_layout", "out_in") == "in_out":
        (_, p1), = ps
        return a, [("weight", _Param(p1.nodes, "t", (p1.shape[1], p1.shape[0])))]
    return attrs, ps


def _dims(n: fx.Node) -> Optional[List[str]]:
    v = _val(n)
    return [str(d) for d in v.shape] if v is not None else None


def _size_sources(steps: List[_Step], start: fx.Node) -> Dict[fx.Node, fx.Node]:
    """Where each size query of a replaced intermediate node reads from instead: the chain's input when the
    shapes are equal, or when it asks for a leading (row) dim, which every op of a chain keeps. Raises
    ValueError (the chain is left) for a query jitfuse cannot answer from a node that stays."""
    out = steps[-1].out
    ds = _dims(start)
    moved: Dict[fx.Node, fx.Node] = {}
    for n in (n for st in steps for n in st.covered if n is not out):
        queries = [u for u in n.users if _size_query(u)]
        dn = _dims(n) if queries else None
        for u in queries:
            dim = u.args[1] if len(u.args) > 1 else u.kwargs.get("dim")
            nd = len(dn or [])
            leading = isinstance(dim, int) and not isinstance(dim, bool) and -nd <= dim < nd - 1 and dim != -1
            if dn is not None and (dn == ds or (leading and dn[:-1] == ds[:-1])):
                moved[u] = n
            else:
                raise ValueError(f"{u.name} reads the size of {n.name}, an intermediate of the chain with a shape "
                                 f"its input does not have")
    return moved


def _rewrite(gm: fx.GraphModule, steps: List[_Step], start: fx.Node, index: int, training: bool,
             dtype: torch.dtype, recipe: Optional[str]) -> Tuple[Chain, fx.Node]:
    g = gm.graph
    out = steps[-1].out
    size_queries = _size_sources(steps, start)
    channel = any(st.channel for st in steps)
    extras = [st.extra for st in steps if st.extra is not None]
    vx = _val(start)
    ops: List[_m.BasicOp] = []
    pnodes: List[Tuple[str, Tuple[fx.Node, ...]]] = []
    if channel:
        ops.append(_m.Fork("residual"))
    for st in steps:
        for op, attrs, ps in st.ops:
            if op == "dropout":
                d = _m.Dropout(attrs["p"])
                ops.append(d)
                continue
            attrs, ps = _for_recipe(op, attrs, ps, recipe)
            # A parameter's shape is static (a column count read from an activation specialises it, as
            # the weights it must match are static).
            ops.append(_Given(op, attrs, [(n, tuple(int(d) for d in p.shape)) for n, p in ps], dtype))
            pnodes += [(p.how, p.nodes) for _, p in ps]
        if st.channel:
            ops.append(_m.AddChannel("residual"))
        elif st.extra is not None:
            ops.append(_m.AddExtraInput())
    seq = _m.Sequential(*ops, name=f"compiled.chain{index}", recipe=recipe)
    seq.train(training)
    # The library plans the chain for the example's shape now (no GPU): a sequence it refuses (a shape, an
    # FP8 constraint) stays with Inductor, named, instead of failing inside the compiled step.
    # Symbolic dims (dynamic shapes) are not read (int() would guard on them and specialise the graph): such a
    # chain is planned at its first call instead.
    shape = [int(d) for d in vx.shape] if all(isinstance(d, int) for d in vx.shape) else None
    if shape:
        seq.explain(shape, training=training, dtype=dtype)
    vo = _val(out)
    mod = _Chain(seq, len(extras), vo.dtype if vo is not None else None)
    name = f"jitfuse_chain_{index}"
    gm.add_submodule(name, mod)
    with g.inserting_before(out):
        args: List[fx.Node] = []
        for how, nodes in pnodes:
            if how == "cat":
                args.append(g.call_function(torch.cat, ((nodes[0], nodes[1]),)))
            elif how == "t":
                args.append(g.call_method("t", (nodes[0],)))
            else:
                args.append(nodes[0])
        call = g.call_module(name, (start, *extras, *args))
    call.meta.update(out.meta)  # the same shape and dtype (_Chain casts back): a later chain may start here
    out.replace_all_uses_with(call)
    for u, n in size_queries.items():
        u.replace_input_with(n, start)
    covered = [n for st in steps for n in st.covered]
    for n in reversed(covered):
        if not n.users:
            g.erase_node(n)
    kinds = [st.kind for st in steps]
    return Chain(start.name, out.name, [o.spec(training) for o in ops], kinds, [n.name for n in covered]), call


@dataclass
class Options:
    """``jitfuse.torch.backend(...)``'s options."""

    inductor: bool = True          # the rest of the graph through Inductor (False: run it as captured)
    min_linears: int = 1           # a chain needs this many linears to be swapped
    mode: Optional[str] = None     # Inductor's mode: "reduce-overhead" (CUDA graphs), "max-autotune", ...
    recipe: Optional[str] = None   # "fp8_current" / "fp8_delayed" / "fp8_block": the chains' linears on FP8 GEMMs

    def __post_init__(self) -> None:
        if self.recipe not in (None, "fp8_current", "fp8_delayed", "fp8_block"):
            raise ValueError(f"jitfuse.torch.backend: unknown recipe {self.recipe!r} (None: the input's dtype, "
                             f"'fp8_current', 'fp8_delayed', 'fp8_block')")
        if self.mode not in (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"):
            raise ValueError(f"jitfuse.torch.backend: unknown mode {self.mode!r} (None, 'default', "
                             f"'reduce-overhead', 'max-autotune', 'max-autotune-no-cudagraphs')")
        if not isinstance(self.min_linears, int) or self.min_linears < 1:
            raise ValueError(f"jitfuse.torch.backend: min_linears must be an int >= 1, not {self.min_linears!r}")


def _announce(report: "GraphReport") -> None:
    """One report per compile on stderr at JITFUSE_LOG_LEVEL info or finer (as TORCH_LOGS prints its own)."""
    log.info("%s", report)
    if os.environ.get("JITFUSE_LOG_LEVEL", "").strip().lower() in ("trace", "debug", "info"):
        print(f"[jitfuse info] {report}", file=sys.stderr)


def _compile(gm: fx.GraphModule, example_inputs: Sequence[Any], opts: Options) -> Callable[..., Any]:
    autocast = bool(_m._autocast_on())
    adtype = _m._autocast_dtype() if autocast else None
    training = torch.is_grad_enabled()
    report = GraphReport(len(_REPORTS))
    taken: set = set()
    index = sum(len(r.chains) for r in _REPORTS)
    replaced: Dict[fx.Node, fx.Node] = {}  # a chain's last node -> its call (where the next chain may start)
    for node in list(gm.graph.nodes):
        node = replaced.get(node, node)
        if node in taken or _val(node) is None:
            continue
        v = _val(node)
        if v.dtype not in _FLOATS or v.dim() < 1:
            continue
        dtype = adtype or v.dtype
        steps, why = _extend(node, taken, dtype)
        if not steps:
            continue
        n_lin = sum(1 for st in steps for op, _, _ in st.ops if op == "linear")
        covered = [n for st in steps for n in st.covered]
        if n_lin < opts.min_linears or len(steps) < 2:  # a lone linear (+ bias): Inductor's GEMM is the same
            continue
        bad = _dtype_ok(steps, node, dtype, autocast)
        if not bad and opts.recipe and dtype != torch.bfloat16:
            bad = f"{opts.recipe} computes in bfloat16; this chain computes in {dtype}"
        if bad:
            report.chains.append(Chain(node.name, steps[-1].out.name, [{"op": k} for k in (st.kind for st in steps)],
                                       [st.kind for st in steps], [], swapped=False, reason=bad))
            continue
        try:
            chain, call = _rewrite(gm, steps, node, index, training or any(
                o[0] == "dropout" and o[1].get("training") for st in steps for o in st.ops), dtype, opts.recipe)
            report.chains.append(chain)
            taken.update(covered)
            replaced[steps[-1].out] = call
            index += 1
        except Exception as e:  # noqa: BLE001 - a chain jitfuse refuses stays with Inductor, named
            report.chains.append(Chain(node.name, steps[-1].out.name, [], [st.kind for st in steps], [],
                                       swapped=False, reason=f"{type(e).__name__}: {e}"))
    for node in gm.graph.nodes:
        if _is_fn(node, _LINEAR | _ADDMM | _LAYER_NORM | _RMS_NORM):
            report.left.append((node.name, "not in a chain: its input or output has other consumers, or a "
                                           "parameter is not a graph input"))
    gm.graph.lint()
    gm.recompile()
    _REPORTS.append(report)
    del _REPORTS[:-_MAX_REPORTS]  # a process that recompiles for ever keeps the newest only
    _announce(report)
    if not opts.inductor:
        return gm.forward
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx
    patches = list_mode_options(opts.mode) if opts.mode not in (None, "default") else None
    return compile_fx(gm, example_inputs, config_patches=patches)


def backend(**options: Any) -> Callable[..., Any]:
    """A ``torch.compile`` backend with options: ``torch.compile(m, backend=jitfuse.torch.backend(inductor=False))``.
    ``inductor``: compile the rest of the graph with Inductor (default True); ``mode``: Inductor's mode
    (``"reduce-overhead"``: CUDA graphs, as ``torch.compile(mode=...)`` gives the inductor backend);
    ``recipe``: ``"fp8_current"`` / ``"fp8_delayed"`` / ``"fp8_block"`` runs the chains' linears on FP8 GEMMs
    (bfloat16 chains: a bf16 model or bf16 autocast; each chain keeps its own recipe state; ``"fp8_block"``
    scales per 1x128 / 128x128 block and needs whole 128-wide blocks); ``min_linears``: the linears a chain
    needs to be swapped (default 1)."""
    opts = Options(**options)

    def jitfuse_backend(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        return _compile(gm, example_inputs, opts)
    return jitfuse_backend


def register() -> None:
    """Registers ``backend="jitfuse"`` with Dynamo (once; importing jitfuse.torch does it)."""
    try:
        from torch._dynamo import list_backends, register_backend
        if "jitfuse" not in list_backends(exclude_tags=()):
            register_backend(name="jitfuse")(backend())
    except Exception as e:  # noqa: BLE001 - a torch without Dynamo: the backend is simply absent
        log.debug("jitfuse: torch.compile backend not registered: %s", e)
