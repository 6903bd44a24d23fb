# jitfuse.torch.hf: a one-line swap of a Hugging Face model's norms and MLPs for jitfuse sequences on the model's
# own parameters (no copies; state_dict, save_pretrained, generate, checkpointing unchanged). docs/python.md,
# "Hugging Face models".
"""``jitfuse.torch.hf.apply(model)``: every norm and MLP module of a Hugging Face model that jitfuse can run is
swapped, in place, for a jitfuse sequence built on that module's own parameters.

- **What is swapped**: RMSNorm (Llama, Mistral, Qwen2/3, Phi-3; Gemma's ``1 + weight``), ``nn.LayerNorm``
  (GPT-2), and the MLPs: gated with two Linears (``gate_proj``/``up_proj``/``down_proj``: Llama, Mistral,
  Qwen2/3, Gemma, Gemma2), gated with one (``gate_up_proj``/``down_proj``: Phi-3), and GPT-2's Conv1D MLP
  (``c_fc``/``c_proj``, bias, GELU, dropout). Each is recognised by what it *computes*: its own forward is run
  once on a random probe input (its weights untouched) and compared with the formula of the jitfuse sequence
  that would replace it; a module that does something else is left as it is, with the reason in the report.
- **How**: only the module's ``forward`` is replaced (an instance attribute). The module, its Parameters
  (the same objects: optimizers built before or after keep working), ``state_dict`` keys and values,
  hooks, ``save_pretrained``/``from_pretrained`` and PEFT adapters on other layers are untouched. The
  jitfuse ``Sequential`` reads the parameters live at every call. A gated MLP's ``gate_proj`` and
  ``up_proj`` weights are moved once, here, into one buffer (their ``.data`` re-pointed to its two
  halves, as :meth:`jitfuse.torch.Linear.from_pair` does), so the ``[2n, k]`` weight of the fused GEMM is a
  view of memory they already own, and its gradient's halves flow back to each: no per-step copy.
- **When the original forward runs instead**: an input off CUDA, or of another dtype than the weights
  outside autocast (e.g. HF's float32 norm on a bfloat16 input), or of the wrong width; also once the gate
  and up weights no longer share a buffer (after a ``.to()`` that copied them: a one-time warning; call
  ``apply`` again).
- GPT-2's Conv1D weights are ``[in, out]``: the sequence's linears read them as they lie (``weight_layout``
  ``"in_out"``: the GEMMs take the transposed operand), no copy per call.

With ``loss=True`` a causal LM's head and loss are swapped too (Liger Kernel's fused linear cross-entropy, for
HF's own loss): when the model's forward gets ``labels``, it runs the decoder, then ``lm_head`` and HF's shifted
cross-entropy (``ignore_index=-100``, ``num_items_in_batch``, Gemma-2's ``final_logit_softcapping``) as one
jitfuse ``Sequential(Linear, CrossEntropy)`` on ``lm_head``'s own weight, in chunks of rows with the gradients
computed in the forward, and returns ``logits=None`` (the logits are never whole in memory). Without labels
(generation, evaluation of logits) the original forward runs. The swap is checked like the others: the
model's own loss on a probe batch must equal the fused one.

The residual adds stay in Hugging Face's decoder-layer code (which writes them): every swapped module
computes exactly what it replaced, so the model is right whatever its layer's forward does with it.

>>> report = jitfuse.torch.hf.apply(model)     # model: LlamaForCausalLM, GPT2LMHeadModel, ...
>>> print(report)                               # every module swapped or left, with the reason
>>> jitfuse.torch.hf.revert(model)              # the original forwards again
"""

import inspect
import math
import types
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import modules as _m
from .modules import SUPPORTED_DTYPES

_ATTR = "_jf_hf"  # a swapped module's _Swap (in its __dict__)


# ---- parameters read live ----------------------------------------------------------------------------


class _JoinHalves(torch.autograd.Function):
    """``[a; b]`` for two tensors that lie back to back in one storage: a tensor over that memory (no copy);
    the gradient's two halves (views) go back to ``a`` and ``b``."""

    @staticmethod
    def forward(ctx: Any, a: Tensor, b: Tensor) -> Tensor:  # type: ignore[override]
        ctx.n = a.shape[0]
        shape = (a.shape[0] + b.shape[0],) + tuple(a.shape[1:])
        return a.new_empty(0).set_(a.untyped_storage(), a.storage_offset(), shape, a.stride())

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tuple[Tensor, Tensor]:  # type: ignore[override]
        return g[:ctx.n], g[ctx.n:]


def _adjacent(a: Tensor, b: Tensor) -> bool:
    """``b`` starts where ``a`` ends, in one storage, both row-major of one dtype and row shape."""
    return (a.is_contiguous() and b.is_contiguous() and a.dtype == b.dtype and a.device == b.device
            and a.shape[1:] == b.shape[1:] and a.device.type != "meta"
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and b.storage_offset() == a.storage_offset() + a.numel())


def _join_storage(a: nn.Parameter, b: nn.Parameter) -> None:
    """Moves ``a`` and ``b`` into one buffer ``[a; b]`` (their ``.data`` re-pointed; the Parameters stay the
    same objects), unless they are there already."""
    if _adjacent(a, b) or a.device.type == "meta":
        return
    with torch.no_grad():
        buf = torch.cat([a.detach(), b.detach()])
        n = a.shape[0]
        a.data = buf[:n]
        b.data = buf[n:]


_warned_split = False


class _Source:
    """One parameter of a swapped module, read at every call: ``module.attr``, or the joined
    ``[m1.attr; m2.attr]`` of a gated MLP's two Linears. Holds the modules themselves (not closures), so
    ``copy.deepcopy`` of the model points the copy at the copy's modules."""

    def __init__(self, module: nn.Module, attr: str, second: Optional[nn.Module] = None):
        self.module, self.attr, self.second = module, attr, second

    def get(self, quiet: bool = False) -> Tensor:
        t = getattr(self.module, self.attr)
        if self.second is None:
            return t
        u = getattr(self.second, self.attr)
        if _adjacent(t, u):
            return _JoinHalves.apply(t, u)
        global _warned_split
        if not _warned_split and not quiet:
            _warned_split = True
            warnings.warn("jitfuse.torch.hf: a gated MLP's two weights no longer share one buffer (moved or cast "
                          "after apply()?): they are concatenated per call; call jitfuse.torch.hf.apply(model) "
                          "again to join them", stacklevel=3)
        return torch.cat([t, u])


class _Borrowed(_m.BasicOp):
    """An op whose parameters belong to a Hugging Face module (read live, never registered here)."""

    def __init__(self, op: str, attrs: Dict[str, Any], params: List[Tuple[str, _Source]]):
        super().__init__()
        self.op = op
        self._jf_attrs = dict(attrs)
        self.__dict__["_jf_sources"] = list(params)

    def attrs(self, training: bool) -> Dict[str, Any]:
        return dict(self._jf_attrs)

    def jf_params(self) -> List[Tuple[str, Any]]:
        return [(n, s.get()) for n, s in self.__dict__["_jf_sources"]]


# ---- what a module computes ------------------------------------------------------------------------------


def _tolerance(dtype: torch.dtype) -> float:
    return {torch.float32: 1e-4, torch.float16: 4e-3}.get(dtype, 3e-2)


def _close(got: Tensor, want: Tensor, dtype: torch.dtype) -> bool:
    got, want = got.double(), want.double()
    scale = max(float(want.abs().max()), 1e-6)
    return bool(torch.isfinite(got).all()) and float((got - want).abs().max()) <= _tolerance(dtype) * scale


def _activation(act: Any) -> Optional[str]:
    """What ``act`` computes on float32 (silu, gelu_tanh, gelu_erf, relu), or None."""
    if not callable(act):
        return None
    x = torch.linspace(-6, 6, 2001, dtype=torch.float64)
    cands = {"silu": x * torch.sigmoid(x), "gelu_erf": 0.5 * x * (1 + torch.erf(x / 2 ** 0.5)), "relu": x.clamp(min=0),
             "gelu_tanh": 0.5 * x * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (x + 0.044715 * x ** 3)))}
    try:
        with torch.no_grad():
            y = act(x.float()).double()
    except Exception:
        return None
    for name, want in cands.items():
        if y.shape == want.shape and float((y - want).abs().max()) < 2e-5:
            return name
    return None


def _original_forward(module: nn.Module) -> Callable[..., Any]:
    swap = module.__dict__.get(_ATTR)
    if swap is not None and swap.instance_forward is not None:
        return swap.instance_forward
    inst = module.__dict__.get("forward")
    if inst is not None and swap is None:
        return inst
    return types.MethodType(type(module).forward, module)


def _probe(module: nn.Module, x: Tensor, randomize: List[Tensor],
           reference: Optional[Callable[[], Tensor]] = None,
           args: Optional[Tuple[Any, ...]] = None) -> Tuple[Tensor, Dict[int, Tensor], Optional[Tensor]]:
    """The module's own (original) forward on ``x`` (or ``args``), in eval mode, with the tensors ``randomize``
    given random values for the probe (restored after, bit for bit); the float64 values they had; and
    ``reference()`` evaluated while they have them."""
    saved = [t.detach().clone() for t in randomize]
    was = [m.training for m in module.modules()]
    vals: Dict[int, Tensor] = {}
    try:
        with torch.no_grad():
            g = torch.Generator(device="cpu").manual_seed(1234)
            for t in randomize:
                r = torch.rand(t.shape, generator=g, dtype=torch.float32) * 1.5 - 0.5
                t.detach().copy_(r.to(t.dtype) / (t.shape[-1] ** 0.5 if t.dim() >= 2 else 1.0))
                vals[id(t)] = t.detach().double().cpu()
            module.eval()
            y = _original_forward(module)(*(args if args is not None else (x,)))
            want = reference() if reference is not None else None
    finally:
        with torch.no_grad():
            for t, s in zip(randomize, saved):
                t.detach().copy_(s)
        for m, w in zip(module.modules(), was):
            m.training = w
    return y.detach().double().cpu(), vals, want


def _probe_input(width: int, like: Tensor) -> Tensor:
    g = torch.Generator(device="cpu").manual_seed(4321)
    return torch.randn(3, width, generator=g).to(device=like.device, dtype=like.dtype)


# ---- the swaps -----------------------------------------------------------------------------------------


@dataclass
class Entry:
    """One module of the model: ``path`` (its name in ``named_modules``), ``kind`` (norm, mlp), ``swapped``,
    ``what`` (the jitfuse ops, or the module's class) and ``reason`` (why it was left)."""

    path: str
    kind: str
    swapped: bool
    what: str
    reason: str = ""


@dataclass
class Report:
    """What :func:`apply` did: one :class:`Entry` per norm and MLP module found."""

    entries: List[Entry] = field(default_factory=list)

    @property
    def swapped(self) -> List[Entry]:
        return [e for e in self.entries if e.swapped]

    @property
    def left(self) -> List[Entry]:
        return [e for e in self.entries if not e.swapped]

    def __str__(self) -> str:
        lines = [f"jitfuse.torch.hf: {len(self.swapped)} module(s) swapped, {len(self.left)} left"]
        for e in self.entries:
            lines.append(f"  {'swapped' if e.swapped else 'left   '} {e.path or '<model>'} ({e.kind}): {e.what}"
                         + (f" -- {e.reason}" if e.reason else ""))
        return "\n".join(lines)


@dataclass
class _Swap:
    seq: "_m.Sequential"
    kind: str
    weight: _Source                      # a parameter whose dtype the input must have (outside autocast)
    width: int                           # the input's last dim
    instance_forward: Optional[Callable[..., Any]] = None  # a forward the module had as an instance attribute
    # The submodules whose parameters the sequence reads, by name: one replaced since apply() (PEFT wrapping
    # a projection in a LoRA layer, say) makes the module run its own forward again, which calls the new one.
    children: Dict[str, nn.Module] = field(default_factory=dict)


_warned_replaced = False


def _children_unchanged(module: nn.Module, swap: _Swap) -> bool:
    """Whether the submodules ``swap``'s sequence reads are still ``module``'s (warns once when one is not)."""
    global _warned_replaced
    for name, child in swap.children.items():
        if module._modules.get(name) is not child:
            if not _warned_replaced:
                _warned_replaced = True
                warnings.warn(f"jitfuse.torch.hf: {type(module).__name__}.{name} was replaced after apply() (by a "
                              f"PEFT/LoRA wrapper?): the module runs its own forward again, which calls the new "
                              f"one; call jitfuse.torch.hf.apply(model) after wrapping to swap what still can be",
                              stacklevel=4)
            return False
    return True


def _usable(x: Any, swap: Any, module: Optional[nn.Module] = None) -> bool:
    if not isinstance(x, Tensor) or not x.is_cuda or x.dtype not in SUPPORTED_DTYPES or x.dim() < 1:
        return False
    if x.shape[-1] != swap.width or x.numel() == 0 or (module is not None and not _children_unchanged(module, swap)):
        return False
    w = getattr(swap.weight.module, swap.weight.attr)
    if not isinstance(w, Tensor) or not w.is_cuda or w.device != x.device:
        return False
    return x.dtype == w.dtype or bool(_m._autocast_on())


def _swapped_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    swap: _Swap = self.__dict__[_ATTR]
    if len(args) == 1 and not kwargs and _usable(args[0], swap, self):
        seq = swap.seq
        if seq.training != self.training:
            seq.train(self.training)
        return seq(args[0])
    return _original_forward(self)(*args, **kwargs)


def _install(module: nn.Module, seq: "_m.Sequential", kind: str, weight: _Source, width: int) -> None:
    inst = module.__dict__.get("forward")
    children = {n: c for n, c in module._modules.items() if c is not None and next(c.parameters(), None) is not None}
    module.__dict__[_ATTR] = _Swap(seq, kind, weight, width, inst, children)
    module.forward = types.MethodType(_swapped_forward, module)


def _norm_ops(module: nn.Module) -> Tuple[Optional[_m.BasicOp], str, str]:
    """The jitfuse op computing what the norm ``module`` computes, its description, or (None, '', reason)."""
    w = getattr(module, "weight", None)
    if not isinstance(w, Tensor) or w.dim() != 1:
        return None, "", "no 1-D weight"
    if w.dtype not in SUPPORTED_DTYPES:
        return None, "", f"weight dtype {w.dtype}"
    b = getattr(module, "bias", None)
    b = b if isinstance(b, Tensor) else None
    eps = None
    for a in ("variance_epsilon", "eps", "epsilon"):
        v = getattr(module, a, None)
        if isinstance(v, (float, int)) and not isinstance(v, bool) and v > 0:
            eps = float(v)
            break
    if eps is None:
        return None, "", "no eps attribute (variance_epsilon / eps)"
    h = w.shape[0]
    x = _probe_input(h, w)
    try:
        y, vals, _ = _probe(module, x, [w] + ([b] if b is not None else []))
    except Exception as e:  # noqa: BLE001 - any failure means: not a norm we know
        return None, "", f"its forward failed on a probe input ({type(e).__name__}: {e})"
    xd, wd = x.double().cpu(), vals[id(w)]
    rms = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
    cands: List[Tuple[str, Tensor, Callable[[], _m.BasicOp]]] = []
    if b is None:
        cands.append(("rmsnorm", rms * wd, lambda: _Borrowed("rmsnorm", {"eps": eps}, [("weight", _Source(module, "weight"))])))
        cands.append(("rmsnorm (1 + weight)", rms * (1 + wd),
                      lambda: _Borrowed("rmsnorm", {"eps": eps, "zero_centered_gamma": True},
                                        [("weight", _Source(module, "weight"))])))
    else:
        mu = xd.mean(-1, keepdim=True)
        ln = (xd - mu) * torch.rsqrt((xd - mu).pow(2).mean(-1, keepdim=True) + eps)
        cands.append(("layernorm", ln * wd + vals[id(b)],
                      lambda: _Borrowed("layernorm", {"eps": eps}, [("weight", _Source(module, "weight")),
                                                                    ("bias", _Source(module, "bias"))])))
    for name, want, make in cands:
        if y.shape == want.shape and _close(y, want, w.dtype):
            return make(), f"{name}(eps={eps:g})", ""
    return None, "", "computes neither RMSNorm nor LayerNorm of its weight on a probe input"


def _linears(mlp: nn.Module) -> Optional[Dict[str, Any]]:
    """The MLP's layout: gated with two Linears, gated with one, or GPT-2's Conv1D pair; None if none."""
    def lin(name: str) -> Optional[nn.Linear]:
        m = getattr(mlp, name, None)
        return m if isinstance(m, nn.Linear) else None
    act = getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None) or getattr(mlp, "act", None)
    if lin("gate_proj") is not None and lin("up_proj") is not None and lin("down_proj") is not None:
        return {"layout": "gated2", "act": act}
    if lin("gate_up_proj") is not None and lin("down_proj") is not None:
        return {"layout": "gated1", "act": act}
    fc, proj = getattr(mlp, "c_fc", None), getattr(mlp, "c_proj", None)
    if fc is not None and proj is not None and type(fc).__name__ == "Conv1D" and type(proj).__name__ == "Conv1D":
        return {"layout": "conv1d", "act": act}
    return None


_GATED = {"silu": "swiglu", "gelu_tanh": "geglu", "relu": "reglu"}


def _mlp_ops(mlp: nn.Module, lay: Dict[str, Any]) -> Tuple[Optional[List[_m.BasicOp]], str, str, Optional[_Source]]:
    """The jitfuse ops computing what ``mlp`` computes, their description and the weight the input must match;
    or (None, '', reason, None)."""
    act = _activation(lay["act"])
    layout = lay["layout"]
    ops: List[_m.BasicOp] = []
    if layout in ("gated2", "gated1"):
        if act not in _GATED:
            return None, "", (f"gated activation {type(lay['act']).__name__} is not one jitfuse has (swiglu: silu, "
                              f"geglu: gelu tanh, reglu: relu)"), None
        down = mlp.down_proj
        if layout == "gated2":
            g, u = mlp.gate_proj, mlp.up_proj
            if g.weight.shape != u.weight.shape or (g.bias is None) != (u.bias is None):
                return None, "", "gate_proj and up_proj differ in shape or bias", None
            first = _Source(g, "weight", u)
            k, n = g.in_features, g.out_features
            ops.append(_Borrowed("linear", {"in_features": k, "out_features": 2 * n}, [("weight", first)]))
            if g.bias is not None:
                ops.append(_Borrowed("bias", {}, [("bias", _Source(g, "bias", u))]))
        else:
            gu = mlp.gate_up_proj
            if gu.out_features % 2:
                return None, "", "gate_up_proj has an odd width", None
            first = _Source(gu, "weight")
            k, n = gu.in_features, gu.out_features // 2
            ops.append(_Borrowed("linear", {"in_features": k, "out_features": 2 * n}, [("weight", first)]))
            if gu.bias is not None:
                ops.append(_Borrowed("bias", {}, [("bias", _Source(gu, "bias"))]))
        ops.append({"swiglu": _m.SwiGLU, "geglu": _m.GEGLU, "reglu": _m.ReGLU}[_GATED[act]]())
        if down.in_features != n or down.out_features != k:
            return None, "", f"down_proj is {down.in_features}->{down.out_features}, not {n}->{k}", None
        ops.append(_Borrowed("linear", {"in_features": n, "out_features": k}, [("weight", _Source(down, "weight"))]))
        if down.bias is not None:
            ops.append(_Borrowed("bias", {}, [("bias", _Source(down, "bias"))]))
        desc = f"linear({k}->{2 * n}) -> {_GATED[act]} -> linear({n}->{k})"
        return ops, desc, "", first
    # GPT-2: Conv1D weights [in, out], always a bias.
    fc, proj = mlp.c_fc, mlp.c_proj
    if act not in ("gelu_tanh", "gelu_erf", "relu", "silu"):
        return None, "", f"activation {type(lay['act']).__name__} is not one jitfuse has", None
    k, n = fc.weight.shape
    if tuple(proj.weight.shape) != (n, k) or fc.bias is None or proj.bias is None:
        return None, "", "c_fc and c_proj do not chain (shapes or biases)", None
    # The [in, out] weights read as they lie (weight_layout in_out): no transposed copy per call.
    first = _Source(fc, "weight")
    ops += [_Borrowed("linear", {"in_features": k, "out_features": n, "weight_layout": "in_out"}, [("weight", first)]),
            _Borrowed("bias", {}, [("bias", _Source(fc, "bias"))])]
    ops.append({"gelu_tanh": lambda: _m.GELU("tanh"), "gelu_erf": lambda: _m.GELU("none"), "relu": _m.ReLU,
                "silu": _m.SiLU}[act]())
    ops += [_Borrowed("linear", {"in_features": n, "out_features": k, "weight_layout": "in_out"},
                      [("weight", _Source(proj, "weight"))]),
            _Borrowed("bias", {}, [("bias", _Source(proj, "bias"))])]
    drop = getattr(mlp, "dropout", None)
    p = float(drop.p) if isinstance(drop, nn.Dropout) else 0.0
    if p > 0:
        ops.append(_m.Dropout(p))
    return ops, f"linear({k}->{n}) -> bias -> {act} -> linear({n}->{k}) -> bias" + (f" -> dropout({p:g})" if p else ""), "", first


def _mlp_reference(ops: List[_m.BasicOp], x: Tensor) -> Tensor:
    """What the ops compute (eval mode), in float64 on the CPU, with the parameters as they are now."""
    y = x.double().cpu()
    for op in ops:
        if isinstance(op, _Borrowed):
            p = [s.get(quiet=True).detach().double().cpu() for _, s in op.__dict__["_jf_sources"]]
            in_out = op.op == "linear" and op._jf_attrs.get("weight_layout") == "in_out"
            y = (y @ (p[0] if in_out else p[0].t())) if op.op == "linear" else (y + p[0] if op.op == "bias" else y)
        elif isinstance(op, (_m.SwiGLU, _m.GEGLU, _m.ReGLU)):
            n = y.shape[-1] // 2
            a, b = y[..., :n], y[..., n:]
            if isinstance(op, _m.SwiGLU):
                a = a * torch.sigmoid(a)
            elif isinstance(op, _m.GEGLU):
                a = F.gelu(a, approximate="tanh")
            else:
                a = a.clamp(min=0)
            y = a * b
        elif isinstance(op, _m.GELU):
            y = F.gelu(y, approximate=op.approximate)
        elif isinstance(op, _m.ReLU):
            y = y.clamp(min=0)
        elif isinstance(op, _m.SiLU):
            y = y * torch.sigmoid(y)
    return y


def _mlp_params(mlp: nn.Module, lay: Dict[str, Any]) -> List[Tensor]:
    names = {"gated2": [("gate_proj", "weight"), ("gate_proj", "bias"), ("up_proj", "weight"), ("up_proj", "bias"),
                        ("down_proj", "weight"), ("down_proj", "bias")],
             "gated1": [("gate_up_proj", "weight"), ("gate_up_proj", "bias"), ("down_proj", "weight"),
                        ("down_proj", "bias")],
             "conv1d": [("c_fc", "weight"), ("c_fc", "bias"), ("c_proj", "weight"), ("c_proj", "bias")]}[lay["layout"]]
    out = []
    for m, a in names:
        t = getattr(getattr(mlp, m), a, None)
        if isinstance(t, Tensor):
            out.append(t)
    return out


def _swap_mlp(path: str, mlp: nn.Module, lay: Dict[str, Any], report: Report) -> None:
    cls = type(mlp).__name__
    ops, desc, why, first = _mlp_ops(mlp, lay)
    params = _mlp_params(mlp, lay)
    if ops is not None and any(p.dtype not in SUPPORTED_DTYPES or p.dtype != params[0].dtype for p in params):
        ops, why = None, "its parameters are not all of one float32/float16/bfloat16 dtype"
    if ops is not None:
        width = ops[0]._jf_attrs["in_features"]
        x = _probe_input(width, params[0])
        try:
            y, _, want = _probe(mlp, x, params, lambda: _mlp_reference(ops, x))
        except Exception as e:  # noqa: BLE001
            ops, why = None, f"its forward failed on a probe input ({type(e).__name__}: {e})"
    if ops is not None:
        if y.shape != want.shape or not _close(y, want, params[0].dtype):
            ops, why = None, f"its forward does not compute {desc} (a probe input differs)"
    if ops is None:
        report.entries.append(Entry(path, "mlp", False, cls, why))
        return
    if lay["layout"] == "gated2":
        _join_storage(mlp.gate_proj.weight, mlp.up_proj.weight)
        if mlp.gate_proj.bias is not None:
            _join_storage(mlp.gate_proj.bias, mlp.up_proj.bias)
    seq = _m.Sequential(*ops, name=_seq_name(path, "mlp"))
    seq.train(mlp.training)
    _install(mlp, seq, "mlp", first, width)
    report.entries.append(Entry(path, "mlp", True, desc))


# ---- mixture-of-experts experts ----------------------------------------------------------------------------


def _experts_layout(mod: nn.Module) -> Optional[Tuple[int, int, int]]:
    """(E, H, I) of a fused experts module (transformers 5: ``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I],
    called as ``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])``: Mixtral, Qwen3-MoE, OLMoE,
    ...), or None for any other module."""
    gu, dn = getattr(mod, "gate_up_proj", None), getattr(mod, "down_proj", None)
    if not isinstance(gu, nn.Parameter) or not isinstance(dn, nn.Parameter) or gu.dim() != 3 or dn.dim() != 3:
        return None
    e, two_i, h = gu.shape
    if two_i % 2 or tuple(dn.shape) != (e, h, two_i // 2):
        return None
    return int(e), int(h), int(two_i // 2)


def _experts_reference(gate_up: Tensor, down: Tensor, gated: str, x: Tensor, idx: Tensor, w: Tensor) -> Tensor:
    """What the jitfuse expert block computes, in float64: y[t] = sum_j w[t, j] down_e (act(gate_e x) * up_e x)."""
    act = {"swiglu": F.silu, "geglu": lambda a: F.gelu(a, approximate="tanh"), "reglu": F.relu}[gated]
    x, gu, dn = x.double(), gate_up.double(), down.double()
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            a, b = (gu[e] @ x[t]).chunk(2)
            y[t] += float(w[t, j]) * (dn[e] @ (act(a) * b))
    return y.cpu()


def _experts_ops(mod: nn.Module, lay: Tuple[int, int, int], gated: str, top_k: int,
                 index_dtype: torch.dtype, capacity: Optional[int] = None,
                 ep: Optional[Tuple[str, int]] = None) -> List[_m.BasicOp]:
    """The expert block's ops; ``ep`` (group, world size): expert-parallel, this rank's E / W experts between a
    MoEDispatch and a MoECombine (the module's parameters hold only those)."""
    e, h, i = lay
    local = e // ep[1] if ep else e
    permute = (_m.MoEPermute(e, top_k, index_dtype=index_dtype) if capacity is None else
               _m.MoEPermute(e, top_k, index_dtype=index_dtype, layout="padded", capacity=capacity))
    return [permute, *([_m.MoEDispatch(ep[0])] if ep else []),
            _Borrowed("grouped_linear", {"num_groups": local, "in_features": h, "out_features": 2 * i},
                      [("weight", _Source(mod, "gate_up_proj"))]),
            _Borrowed(gated, {}, []),
            _Borrowed("grouped_linear", {"num_groups": local, "in_features": i, "out_features": h},
                      [("weight", _Source(mod, "down_proj"))]),
            *([_m.MoECombine(ep[0])] if ep else []),
            _m.MoEUnpermute()]


@dataclass
class _ExpertsSwap:
    mod: nn.Module
    lay: Tuple[int, int, int]
    gated: str
    path: str
    instance_forward: Optional[Callable[..., Any]] = None
    kind: str = "experts"
    capacity_factor: Optional[float] = None
    ep: Optional[Tuple[str, int]] = None  # expert parallelism: (group, world size); the parameters hold this rank's
    seqs: Dict[Tuple[int, torch.dtype, Optional[int]], "_m.Sequential"] = field(default_factory=dict)

    @property
    def weight(self) -> _Source:  # what _usable reads: the input must have its dtype (outside autocast)
        return _Source(self.mod, "gate_up_proj")

    @property
    def width(self) -> int:  # the input's last dim: the hidden size
        return self.lay[1]

    def seq(self, tokens: int, top_k: int, index_dtype: torch.dtype) -> "_m.Sequential":
        cap = None
        if self.capacity_factor is not None:  # GShard's capacity, in rows of 8, at most every token
            cap = min(tokens, max(8, math.ceil(self.capacity_factor * tokens * top_k / self.lay[0] / 8) * 8))
        s = self.seqs.get((top_k, index_dtype, cap))
        if s is None:
            s = _m.Sequential(*_experts_ops(self.mod, self.lay, self.gated, top_k, index_dtype, cap, self.ep),
                              name=_seq_name(self.path, "experts"))
            self.seqs[(top_k, index_dtype, cap)] = s
        return s


def _experts_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    swap: _ExpertsSwap = self.__dict__[_ATTR]
    if len(args) == 3 and not kwargs and _usable(args[0], swap) and args[0].dim() == 2:
        x, idx, w = args
        if (isinstance(idx, Tensor) and isinstance(w, Tensor) and idx.dim() == 2 and idx.dtype in (torch.int64, torch.int32)
                and w.shape == idx.shape and w.is_floating_point() and idx.device == x.device == w.device
                and idx.shape[0] == x.shape[0] and 1 <= idx.shape[1] <= swap.lay[0]):
            seq = swap.seq(int(x.shape[0]), int(idx.shape[1]), idx.dtype)
            if seq.training != self.training:
                seq.train(self.training)
            return seq(x, idx, w)
    return _original_forward(self)(*args, **kwargs)


def _swap_experts(path: str, mod: nn.Module, lay: Tuple[int, int, int], report: Report,
                  capacity_factor: Optional[float] = None, ep: Optional[Tuple[str, int, int]] = None) -> None:
    """Swaps a fused experts module for the dropless jitfuse expert block (permute, grouped gate/up GEMMs, the
    gated op, grouped down GEMMs, the weighted combine) on its own two parameters, after a probe. ``ep`` (group,
    world size, rank): expert-parallel; after the probe the two parameters keep only this rank's experts."""
    cls = type(mod).__name__
    params = [mod.gate_up_proj, mod.down_proj]
    gated = _GATED.get(_activation(getattr(mod, "act_fn", None)) or "")
    why = ""
    if gated is None:
        why = "its activation is not silu, gelu (tanh) or relu"
    elif getattr(mod, "has_bias", False) or getattr(mod, "is_transposed", False):
        why = "biased or transposed expert weights"
    elif any(p.dtype not in SUPPORTED_DTYPES or p.dtype != params[0].dtype for p in params):
        why = "its parameters are not all of one float32/float16/bfloat16 dtype"
    elif lay[1] % 8 or lay[2] % 8:
        why = f"hidden {lay[1]} or expert width {lay[2]} is not a multiple of 8 (the routing kernels' rows)"
    elif ep and lay[0] % ep[1]:
        why = f"its {lay[0]} experts do not split over the {ep[1]} ranks of group '{ep[0]}'"
    if not why:
        e, h, _ = lay
        k = min(2, e)
        g = torch.Generator(device="cpu").manual_seed(99)
        x = torch.randn(12, h, generator=g).to(device=params[0].device, dtype=params[0].dtype)
        idx = torch.rand(12, e, generator=g).argsort(-1)[:, :k].to(params[0].device)
        wts = torch.rand(12, k, generator=g).to(params[0].device)
        try:
            y, _, want = _probe(mod, x, params, lambda: _experts_reference(params[0], params[1], gated, x, idx, wts),
                                args=(x, idx, wts))
            if y.shape != want.shape or not _close(y, want, params[0].dtype):
                why = f"its forward does not compute the top-k weighted {gated} experts (a probe input differs)"
        except Exception as ex:  # noqa: BLE001
            why = f"its forward failed on a probe input ({type(ex).__name__}: {ex})"
    if why:
        report.entries.append(Entry(path, "experts", False, cls, why))
        return
    inst = mod.__dict__.get("forward")
    if ep:  # this rank's experts only (the same Parameter objects: optimizers built before still hold them)
        local = lay[0] // ep[1]
        with torch.no_grad():
            for p in params:
                p.data = p.data[ep[2] * local:(ep[2] + 1) * local].clone()
    mod.__dict__[_ATTR] = _ExpertsSwap(mod, lay, gated, path, inst, capacity_factor=capacity_factor,
                                       ep=(ep[0], ep[1]) if ep else None)
    mod.forward = types.MethodType(_experts_forward, mod)
    how = "dropless" if capacity_factor is None else f"padded, capacity factor {capacity_factor:g}"
    if ep:
        local = lay[0] // ep[1]
        how += (f", expert-parallel over group '{ep[0]}': experts {ep[2] * local}-{(ep[2] + 1) * local - 1} of "
                f"{lay[0]} on this rank")
    report.entries.append(Entry(path, "experts", True, f"moe_permute, grouped_linear {lay[1]}->{2 * lay[2]}, {gated}, "
                                f"grouped_linear {lay[2]}->{lay[1]}, moe_unpermute ({lay[0]} experts, {how})"))


# ---- the causal-LM head and its loss ---------------------------------------------------------------------


@dataclass
class _LossSwap:
    mean: "_m.Sequential"                # reduction mean: HF's loss
    total: "_m.Sequential"               # reduction sum: HF's loss over num_items_in_batch (gradient accumulation)
    base: str                            # the decoder's attribute (base_model_prefix)
    weight: _Source
    width: int
    instance_forward: Optional[Callable[..., Any]] = None
    kind: str = "loss"


def _loss_outputs(model: nn.Module, swap: _LossSwap, bound: Dict[str, Any]) -> Optional[Tuple[Tensor, Any]]:
    """The fused loss of the forward whose (bound) arguments are ``bound``, and the decoder's outputs; None where
    the original forward must run (no labels, logits asked for, a tuple return, an input jitfuse cannot take)."""
    extra = dict(bound.pop("kwargs", {}) or {})
    labels = bound.pop("labels", None)
    keep = bound.pop("logits_to_keep", 0)
    shift = extra.pop("shift_labels", None)
    items = extra.pop("num_items_in_batch", None)
    if (labels is None and shift is None) or keep not in (0, None) or bound.get("return_dict") is False:
        return None
    out = getattr(model, swap.base)(**bound, **extra)
    hidden = out[0]
    if not _usable(hidden, swap):  # type: ignore[arg-type]
        return None
    if shift is None:  # HF's ForCausalLMLoss: labels shifted left, -100 after the last
        shift = F.pad(labels, (0, 1), value=-100)[..., 1:]
    x = hidden.reshape(-1, swap.width)
    y = shift.reshape(-1).to(device=hidden.device, dtype=torch.int64)
    for seq in (swap.mean, swap.total):
        if seq.training != model.training:
            seq.train(model.training)
    if items is None:
        loss = swap.mean(x, y)
    else:
        loss = swap.total(x, y) / (items.to(hidden.device) if isinstance(items, Tensor) else items)
    return loss.float().reshape(()), out


def _loss_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    swap: _LossSwap = self.__dict__[_ATTR]
    original = _original_forward(self)
    try:
        bound = inspect.signature(original).bind(*args, **kwargs)
    except TypeError:
        return original(*args, **kwargs)
    got = _loss_outputs(self, swap, dict(bound.arguments))
    if got is None:
        return original(*args, **kwargs)
    loss, out = got
    from transformers.modeling_outputs import CausalLMOutputWithPast
    return CausalLMOutputWithPast(loss=loss, logits=None, past_key_values=getattr(out, "past_key_values", None),
                                  hidden_states=getattr(out, "hidden_states", None),
                                  attentions=getattr(out, "attentions", None))


def _swap_loss(model: nn.Module, report: Report) -> None:
    """Swaps a causal LM's head + loss (``loss=True``), or reports why not."""
    cls = type(model).__name__
    head, cfg = getattr(model, "lm_head", None), getattr(model, "config", None)
    base = getattr(model, "base_model_prefix", "") or ""
    why = ""
    if not isinstance(head, nn.Linear):
        why = "no nn.Linear lm_head"
    elif not isinstance(getattr(model, base, None), nn.Module):
        why = f"no decoder at base_model_prefix {base!r}"
    elif head.weight.dtype not in SUPPORTED_DTYPES or (head.bias is not None and head.bias.dtype != head.weight.dtype):
        why = f"lm_head weight dtype {head.weight.dtype}"
    elif head.weight.shape[0] < 2:
        why = "a vocabulary of one"
    if why:
        report.entries.append(Entry("", "loss", False, cls, why))
        return
    h, v = int(head.in_features), int(head.out_features)
    cap = float(getattr(cfg, "final_logit_softcapping", None) or 0.0)

    def seq(reduction: str) -> "_m.Sequential":
        ops: List[_m.BasicOp] = [_Borrowed("linear", {"in_features": h, "out_features": v},
                                           [("weight", _Source(head, "weight"))])]
        if head.bias is not None:
            ops.append(_Borrowed("bias", {}, [("bias", _Source(head, "bias"))]))
        ops.append(_m.CrossEntropy(reduction=reduction, softcap=cap))
        return _m.Sequential(*ops, name=_seq_name("lm_head_" + reduction, "loss"))

    swap = _LossSwap(seq("mean"), seq("sum"), base, _Source(head, "weight"), h, model.__dict__.get("forward"))
    desc = f"linear({h} -> {v}){' + bias' if head.bias is not None else ''} + cross_entropy" + \
        (f" (softcap {cap:g})" if cap else "") + ", chunked, logits=None with labels"
    # The probe: the model's own loss on 2 x 9 random tokens against the fused one, both in eval mode.
    was = [m.training for m in model.modules()]
    try:
        g = torch.Generator(device="cpu").manual_seed(4321)
        ids = torch.randint(0, v, (2, 9), generator=g).to(head.weight.device)
        labels = ids.clone()
        labels[0, :3] = -100
        model.eval()
        with torch.no_grad():
            want = _original_forward(model)(input_ids=ids, labels=labels).loss
            got = _loss_outputs(model, swap, {"input_ids": ids, "labels": labels})
    except Exception as e:  # noqa: BLE001 - any failure means: not a head and loss we know
        want, got, why = None, None, f"its forward failed on a probe batch ({type(e).__name__}: {e})"
    finally:
        for m, w in zip(model.modules(), was):
            m.training = w
    if not why and (got is None or want is None):
        why = "the decoder's output is not a hidden state jitfuse can take (device, dtype, width)"
    if not why and not _close(got[0].reshape(1), want.reshape(1), head.weight.dtype):  # type: ignore[index]
        why = f"its loss is not HF's shifted cross-entropy of lm_head (probe: {float(want):.6g}, fused " \
              f"{float(got[0]):.6g})"  # type: ignore[index]
    if why:
        report.entries.append(Entry("", "loss", False, cls, why))
        return
    model.__dict__[_ATTR] = swap
    model.forward = types.MethodType(_loss_forward, model)
    report.entries.append(Entry("", "loss", True, desc))


def _seq_name(path: str, kind: str) -> str:
    name = "".join(c if c.isalnum() or c in "._-" else "_" for c in (path or kind))
    return f"hf.{name}"[:200]


def _is_norm(m: nn.Module) -> bool:
    n = type(m).__name__
    return isinstance(m, nn.LayerNorm) or n.endswith("RMSNorm") or n.endswith("LayerNorm")


def apply(model: nn.Module, *, norms: bool = True, mlps: bool = True, loss: bool = False,
          experts: bool = True, expert_capacity: Optional[float] = None,
          expert_parallel: Optional[str] = None) -> Report:
    """Swaps, in place, every norm (``norms``) and MLP (``mlps``) module of ``model`` that jitfuse can run for
    a jitfuse sequence on the module's own parameters, and returns the :class:`Report` (every module found,
    swapped or left with the reason). ``loss=True``: a causal LM's ``lm_head`` and HF's loss too, as the fused
    chunked head whenever the forward gets ``labels`` (which then returns ``logits=None``). Modules swapped
    before are left as they are (``apply`` twice is harmless; it re-joins gate/up weights that a ``.to()``
    split). ``experts``: the fused experts of mixture-of-experts layers (Mixtral, Qwen3-MoE, OLMoE: ``gate_up_proj``
    and ``down_proj`` stacked per expert) as the dropless jitfuse expert block; the router stays the model's
    (its logits, the auxiliary loss and their hooks unchanged). ``expert_capacity``: None (dropless, as the
    model computes; each expert's row count is read on the host once per pass, so no CUDA-graph capture) or a
    capacity factor (GShard's: each expert keeps at most ``factor x tokens x top_k / experts`` rows, the rest of
    its tokens dropped; fixed shapes and routing on the device, so the model's forward captures in a CUDA graph).
    ``expert_parallel``: the name of a group registered with ``jitfuse.torch.distributed.set_process_group``:
    rank r of its W ranks keeps experts ``[r E/W, (r+1) E/W)`` of every experts module (their two parameters are
    cut to those, in place) and each call sends every expert's rows to the rank owning it and back
    (docs/parallel.md#expert-parallelism); every rank calls the model on its own tokens, the same number of times.
    With ``expert_capacity`` too, every rank sends each expert ``capacity`` rows: fixed shapes, so the model's
    forward (decode) captures in a CUDA graph.
    :func:`revert` undoes it (but for expert-parallel experts, which keep only this rank's weights)."""
    if expert_capacity is not None and (isinstance(expert_capacity, bool) or not isinstance(expert_capacity, (int, float))
                                        or not 0 < float(expert_capacity) <= 1024):
        raise ValueError(f"expert_capacity must be None (dropless) or a capacity factor in (0, 1024], "
                         f"not {expert_capacity!r}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"jitfuse.torch.hf.apply takes an nn.Module, not {type(model).__name__}")
    ep = None
    if expert_parallel is not None:
        from . import distributed
        if not isinstance(expert_parallel, str) or expert_parallel not in distributed._groups:
            raise ValueError(f"expert_parallel={expert_parallel!r}: register the group first with "
                             f"jitfuse.torch.distributed.set_process_group(group, {expert_parallel!r})")
        ep = (expert_parallel, distributed.world_size(expert_parallel), distributed.rank(expert_parallel))
    report = Report()
    if loss and _ATTR not in model.__dict__:
        _swap_loss(model, report)
    for path, mod in list(model.named_modules()):
        if path == "" and isinstance(mod.__dict__.get(_ATTR), _LossSwap):
            continue
        swap = mod.__dict__.get(_ATTR)
        if swap is not None:
            if swap.kind == "mlp" and isinstance(getattr(mod, "gate_proj", None), nn.Linear):
                _join_storage(mod.gate_proj.weight, mod.up_proj.weight)
            report.entries.append(Entry(path, swap.kind, True, "swapped before"))
            continue
        if experts:
            elay = _experts_layout(mod)
            if elay is not None:
                _swap_experts(path, mod, elay, report,
                              None if expert_capacity is None else float(expert_capacity), ep)
                continue
        if mlps:
            lay = _linears(mod)
            if lay is not None:
                _swap_mlp(path, mod, lay, report)
                continue
        if norms and _is_norm(mod):
            op, desc, why = _norm_ops(mod)
            if op is None:
                report.entries.append(Entry(path, "norm", False, type(mod).__name__, why))
                continue
            seq = _m.Sequential(op, name=_seq_name(path, "norm"))
            _install(mod, seq, "norm", _Source(mod, "weight"), int(mod.weight.shape[0]))
            report.entries.append(Entry(path, "norm", True, desc))
    return report


def revert(model: nn.Module) -> int:
    """Gives every module :func:`apply` swapped its own forward back; returns how many. (The gate/up weights
    stay in their shared buffer: the values are the same.)"""
    n = 0
    for path, mod in model.named_modules():
        swap = mod.__dict__.get(_ATTR)
        if isinstance(swap, _ExpertsSwap) and swap.ep:
            warnings.warn(f"jitfuse.torch.hf.revert: {path} holds this rank's experts only (expert_parallel): "
                          f"left swapped", stacklevel=2)
            continue
        swap = mod.__dict__.pop(_ATTR, None)
        if swap is None:
            continue
        mod.__dict__.pop("forward", None)
        if swap.instance_forward is not None:
            mod.__dict__["forward"] = swap.instance_forward
        n += 1
    return n


def swapped(model: nn.Module) -> Dict[str, "_m.Sequential"]:
    """The jitfuse ``Sequential`` of each swapped module, by path (``explain()``, ``print`` show its plan); the
    swapped head and loss as ``"lm_head+loss"``."""
    out: Dict[str, "_m.Sequential"] = {}
    for p, m in model.named_modules():
        swap = m.__dict__.get(_ATTR)
        if isinstance(swap, _LossSwap):
            out["lm_head+loss"] = swap.mean
        elif isinstance(swap, _ExpertsSwap):
            for (k, dt, cap), seq in swap.seqs.items():  # one per top-k, index dtype and capacity
                tag = (f"top_k={k}" + (", int32" if dt == torch.int32 else "")
                       + (f", capacity={cap}" if cap is not None else ""))
                out[p if len(swap.seqs) == 1 else f"{p}[{tag}]"] = seq
        elif swap is not None:
            out[p] = swap.seq
    return out
