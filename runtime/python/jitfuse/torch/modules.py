# nn.Modules for jitfuse ops (one class per op of the sequence vocabulary) and Sequential, which runs
# its ops as one jitfuse sequence through the jitfuse::forward / jitfuse::backward custom ops.
"""PyTorch modules over jitfuse sequences.

>>> import torch, jitfuse.torch as jt
>>> mlp = jt.Sequential(jt.LayerNorm(1024), jt.Linear(1024, 4096), jt.Bias(4096), jt.GELU(),
...                     jt.Linear(4096, 1024), jt.Bias(1024), jt.AddExtraInput(),
...                     device="cuda", dtype=torch.bfloat16)
>>> y = mlp(x, residual)              # forward and backward are jitfuse programs
>>> torch.compile(mlp, fullgraph=True)(x, residual)
"""

import itertools
import math
import weakref
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

import torch
from torch import Tensor, nn
from torch.nn.modules import module as _nn_module

from .._channels import ChannelError, Wiring, count_error, wire
from ..lib import Explanation
from ._calls import DIRECT, check_arguments, needs_grad, route
from ._dtypes import FP8_RECIPES, RECIPE_OF_DTYPE
from ._ext import EXT as _EXT
from ._ops import eager_call
from ._registry import (DeviceProgram, _programs, context, define, device_program, existing_programs, forget,
                        program_of)
from .float8 import Float8Tensor

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# What Sequential.__call__'s fast path reads (see there). The global hook registries of nn.Module are
# module-level dicts that register_module_*_hook mutate in place; a PyTorch whose layout differs from
# this one (a name missing) always takes Module.__call__.
_module_call = nn.Module.__call__
_is_compiling = torch.compiler.is_compiling
_tracing_state = getattr(torch._C, "_get_tracing_state", None)
_HOOK_NAMES = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
               "_global_backward_hooks")
_GLOBAL_HOOKS = tuple(getattr(_nn_module, n, None) for n in _HOOK_NAMES)
_FAST_CALL = (_tracing_state is not None and all(isinstance(h, dict) for h in _GLOBAL_HOOKS)
              and hasattr(nn.Module, "_compiled_call_impl"))
_gfp, _gf, _gbp, _gb = _GLOBAL_HOOKS

_fp8_salt = itertools.count()

# Sequential's eager call through the C++ extension (jitfuse.torch._ext): one call from Python into the op
# (dispatcher, C++ autograd, C ABI), or None: the pure-Python path. A module attribute, so that a benchmark can
# time both paths in one process (set it to None and back).
ext_forward = _EXT.module_forward if _EXT is not None else None
# The extension's Sequential.__call__ (runtime/torch/python.cpp, module_call): the whole eager call in C++ when
# nothing unusual is about; None where Python decides. Set up below the class (it compares Sequential.forward).
# ext_forward = None (tests, the bench's pure-Python rows) turns both off.
ext_call = getattr(_EXT, "module_call", None) if _EXT is not None and _FAST_CALL else None

try:  # PyTorch >= 2.4 takes the device type; older ones answer for CUDA without an argument
    torch.is_autocast_enabled("cuda")
    _autocast_on = lambda: torch.is_autocast_enabled("cuda")  # noqa: E731
    _autocast_dtype = lambda: torch.get_autocast_dtype("cuda")  # noqa: E731
except TypeError:  # pragma: no cover - older PyTorch
    _autocast_on = torch.is_autocast_enabled
    _autocast_dtype = torch.get_autocast_gpu_dtype


def _autocast(x: Tensor, extras: Tuple[Tensor, ...], params: List[Tensor]):
    """Under ``torch.autocast("cuda", dtype)``: the input, extra inputs and parameters in the autocast dtype,
    as ``nn.Linear`` computes under autocast. Floating tensors of another dtype are cast per call (the cast is
    an autograd op: gradients flow back to the float32 master parameters); the rest pass unchanged."""
    dt = _autocast_dtype()
    cast = lambda t: t.to(dt) if t.is_floating_point() and t.dtype != dt else t  # noqa: E731
    return cast(x), tuple(cast(e) for e in extras), [cast(p) for p in params]


_int64 = torch.int64
# The extra inputs' kinds (jf_sequence_wiring) whose dtype is their op's, not the input's.
_TYPED_EXTRAS = ("labels", "indices", "probs")
_randint = torch.randint
_compiler_disable = getattr(torch.compiler, "disable", lambda f: f)


def _draw_rng(x: Tensor) -> Tensor:
    """The Philox state {seed, offset} of one forward's dropout masks, drawn from PyTorch's CUDA generator of
    the input's device (a kernel on the current stream): ``torch.manual_seed`` reproduces it, a recompute
    under ``torch.utils.checkpoint`` (which restores the generator) draws the same mask, and a CUDA-graph
    replay draws a new one (the generator's graph-safe offsets)."""
    return _randint(0, 1 << 62, (2,), dtype=_int64, device=x.device)


def _check_dtype_change(module: nn.Module, fn: Any, current: torch.dtype, recipe: Optional[str]) -> None:
    """Raises before nn.Module._apply converts parameters to a dtype jitfuse cannot run."""
    try:
        new = fn(torch.empty(0, dtype=current)).dtype
    except Exception:  # a device move that cannot be probed here: the real _apply reports it
        return
    if new == current:
        return
    if recipe in FP8_RECIPES:
        if new == torch.bfloat16:  # e.g. Sequential(Linear(...), recipe="fp8_delayed", dtype=torch.bfloat16)
            return
        raise TypeError(f"{type(module).__name__}: recipe {recipe} keeps bf16 parameters; cannot convert to {new}")
    if new not in SUPPORTED_DTYPES:
        raise TypeError(f"{type(module).__name__}: jitfuse runs float32, float16 and bfloat16 (recipes fp32, fp16, "
                        f"bf16); cannot convert its parameters to {new}")


class BasicOp(nn.Module):
    """One op of a jitfuse sequence. Run ops by putting them in :class:`Sequential`.

    Subclasses set ``op`` (the sequence-format name) and override :meth:`attrs` and :meth:`jf_params`.
    """

    op: str = ""
    n_extra_inputs: int = 0
    n_extra_outputs: int = 0

    def attrs(self, training: bool) -> Dict[str, Any]:
        """The op's attributes in the sequence format (``training``: the module's train/eval mode)."""
        return {}

    def jf_params(self) -> List[Tuple[str, nn.Parameter]]:
        """(ABI name, parameter) of each parameter, in a fixed order."""
        return []

    def accumulates_grad(self, name: str) -> bool:
        """True where the library adds the gradient to the buffer instead of overwriting it."""
        return False

    def spec(self, training: bool = True) -> Dict[str, Any]:
        return {"op": self.op, **self.attrs(training)}

    def n_ops(self) -> int:
        """How many ops of the library's sequence this module is (a parallel Linear: 2)."""
        return 1

    def param_op(self) -> int:
        """Which of its n_ops() ops owns its parameters."""
        return 0

    def forward(self, *args: Any) -> Any:
        raise RuntimeError(f"jitfuse.torch.{type(self).__name__} runs inside jitfuse.torch.Sequential: "
                           f"use Sequential({type(self).__name__}(...)) (a one-op sequence is fine)")

    def _apply(self, fn, recurse=True):  # noqa: D401 - nn.Module hook
        ps = [p for _, p in self.jf_params()]
        if ps:
            _check_dtype_change(self, fn, ps[0].dtype, None)
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.attrs(True).items() if k != "training")


def _factory(device: Any, dtype: Optional[torch.dtype]) -> Dict[str, Any]:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = dtype or torch.get_default_dtype()
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"jitfuse parameters are float32, float16 or bfloat16, not {dtype}")
    return {"device": device, "dtype": dtype}


class Linear(BasicOp):
    """``y = x W^T`` (no bias: add :class:`Bias`, as in the sequence format). ``weight``:
    ``[out_features, in_features]``, initialised like ``nn.Linear`` (Kaiming uniform, a = sqrt(5)).
    ``accumulate_grad``: the library adds the weight gradient to the gradient buffer (which this
    package then zero-fills); autograd still accumulates into ``.grad`` as usual. ``bias``: accepted as
    ``False`` only, so that ``nn.Linear``'s spelling ``Linear(h, f, bias=False)`` works; a bias is the op
    :class:`Bias`. ``weight_layout="in_out"``: ``weight`` is ``[in_features, out_features]`` (GPT-2's Conv1D;
    ``y = x W``), read by the GEMMs as it lies (plain recipes, no tensor parallelism)."""

    op = "linear"

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, accumulate_grad: bool = False,
                 tensor_parallel: str = "none", sequence_parallel: bool = False, group: str = "tp",
                 world_size: Optional[int] = None, device: Any = None, dtype: Optional[torch.dtype] = None,
                 weight_layout: str = "out_in"):
        if weight_layout not in ("out_in", "in_out"):
            raise ValueError(f"weight_layout must be 'out_in' ([out, in], nn.Linear's) or 'in_out' ([in, out]), not "
                             f"{weight_layout!r}")
        if weight_layout == "in_out" and tensor_parallel != "none":
            raise ValueError("weight_layout='in_out' takes no tensor parallelism: a shard is cut from an [out, in] "
                             "weight")
        if bias:
            raise ValueError(f"jitfuse's Linear has no bias: add the op Bias({int(out_features)}) after it "
                             f"(Linear(...), Bias(...)), as in the sequence format")
        if tensor_parallel not in ("none", "column", "row"):
            raise ValueError(f"tensor_parallel must be 'none', 'column' or 'row', not {tensor_parallel!r}")
        if sequence_parallel and tensor_parallel == "none":
            raise ValueError("sequence_parallel=True needs tensor_parallel='column' or 'row'")
        super().__init__()
        self.in_features, self.out_features, self.accumulate_grad = int(in_features), int(out_features), accumulate_grad
        # Tensor parallel (docs/parallel.md): the weight is this rank's shard of the full [out, in] weight.
        self.tensor_parallel, self.sequence_parallel, self.group = tensor_parallel, bool(sequence_parallel), group
        w = 1
        if tensor_parallel != "none":
            from . import distributed
            w = int(world_size) if world_size is not None else distributed.world_size(group)
        self.tp_world_size = w  # the group size its shard was cut for: what explain() plans by default
        out_local = self.out_features // w if tensor_parallel == "column" else self.out_features
        in_local = self.in_features // w if tensor_parallel == "row" else self.in_features
        if (tensor_parallel == "column" and self.out_features % w) or (tensor_parallel == "row" and self.in_features % w):
            raise ValueError(f"a {tensor_parallel}-parallel Linear({self.in_features}, {self.out_features}) does not "
                             f"split into {w} equal shards")
        self.weight_layout = weight_layout
        shape = (in_local, out_local) if weight_layout == "in_out" else (out_local, in_local)
        self.weight = nn.Parameter(torch.empty(*shape, **_factory(device, dtype)))
        self.reset_parameters()

    def n_ops(self) -> int:
        """Ops this module is in the library's sequence: a parallel linear and its inserted collective."""
        return 1 if self.tensor_parallel == "none" else 2

    def param_op(self) -> int:
        """The library op (within n_ops) that owns the weight: a column-parallel linear follows its collective."""
        return 1 if self.tensor_parallel == "column" else 0

    def reset_parameters(self) -> None:
        if getattr(self, "weight_layout", "out_in") == "in_out":  # nn.Linear's init, on the [out, in] view
            nn.init.kaiming_uniform_(self.weight.t(), a=math.sqrt(5))
        else:
            nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def attrs(self, training: bool) -> Dict[str, Any]:
        a: Dict[str, Any] = {"in_features": self.in_features, "out_features": self.out_features}
        if getattr(self, "weight_layout", "out_in") == "in_out":
            a["weight_layout"] = "in_out"
        if self.accumulate_grad:
            a["accumulate_grad"] = True
        if self.tensor_parallel != "none":
            a.update(tensor_parallel=self.tensor_parallel, sequence_parallel=self.sequence_parallel, group=self.group)
        return a

    def jf_params(self) -> List[Tuple[str, nn.Parameter]]:
        return [("weight", self.weight)]

    def accumulates_grad(self, name: str) -> bool:
        return self.accumulate_grad

    @classmethod
    def from_pair(cls, first: Union[nn.Module, Tensor], second: Union[nn.Module, Tensor], *,
                  accumulate_grad: bool = False) -> "Linear":
        """One Linear for two linears of the same shape, e.g. Hugging Face's ``gate_proj`` and ``up_proj``
        before a :class:`SwiGLU`: ``weight`` is one ``[2n, k]`` Parameter holding ``[first; second]``, so the
        output's FIRST half is ``first``'s (the half a gated op gates: ``SwiGLU`` computes
        ``silu(y[..., :n]) * y[..., n:]``, so pass ``(gate_proj, up_proj)``).

        ``first``, ``second``: two bias-free ``nn.Linear`` (or jitfuse ``Linear``) modules, or two weight
        tensors ``[n, k]``, of one shape, dtype (float32, float16, bfloat16) and device. Linears with a bias are
        refused (jitfuse's Linear has none): pass their weights, ``Linear.from_pair(a.weight, b.weight)``, and
        take the biases with :meth:`Bias.from_pair` ``(a, b)`` as the next op.

        The two halves are copied into the new weight once, here; then the two source weights are re-pointed
        (``.data``) to views of it, so storage is shared: the source modules and Parameters stay the same
        objects, and reading or writing them (``state_dict``/``load_state_dict`` of the Hugging Face MLP you
        swapped out, its forward) reads or writes the new weight. The new weight is a new Parameter:
        optimizers built before the swap hold the old Parameters, which never get a gradient (the new weight
        gets it), so they do not train it — build the optimizer after the swap. A later dtype or device
        conversion (``.to()``, ``.half()``) gives the converted module new storage and ends the sharing: swap
        after moving and casting the model. ``requires_grad``: the new weight's is true if either source's is.
        """
        w1, w2 = _pair("Linear.from_pair", first, second, "weight", 2)
        n, k = w1.shape
        lin = cls(k, 2 * n, accumulate_grad=accumulate_grad, device="meta", dtype=w1.dtype)  # nothing allocated
        lin.weight = _fused_parameter(w1, w2)
        return lin


def _pair(what: str, first: Any, second: Any, attr: str, dim: int) -> Tuple[Tensor, Tensor]:
    """The two source tensors of a from_pair (a module's ``attr``, or the tensors themselves), checked."""
    ts = []
    for label, src in (("first", first), ("second", second)):
        if isinstance(src, Tensor):
            t = src
        elif isinstance(src, (nn.Linear, Linear, Bias)):
            if attr == "weight" and getattr(src, "bias", None) is not None:
                raise ValueError(f"{what}: {label} ({type(src).__name__}) has a bias and jitfuse's Linear has none: "
                                 f"pass the weights, Linear.from_pair(first.weight, second.weight), and take the "
                                 f"biases with Bias.from_pair(first, second) as the next op")
            t = getattr(src, attr, None)
            if t is None:
                raise ValueError(f"{what}: {label} ({type(src).__name__}) has no {attr}")
        else:
            raise TypeError(f"{what}: {label} must be an nn.Linear, a jitfuse Linear or Bias, or a tensor, not "
                            f"{type(src).__name__} (for another layout, e.g. GPT-2's Conv1D [in, out], build the "
                            f"op and copy the weights)")
        if t.dim() != dim:
            raise ValueError(f"{what}: {label}'s {attr} has shape {list(t.shape)}; expected {dim} dims")
        if t.grad_fn is not None:
            raise ValueError(f"{what}: {label}'s {attr} is the result of an autograd op; pass a leaf tensor (a "
                             f"Parameter or a plain tensor)")
        ts.append(t)
    a, b = ts
    if a is b or (a.device == b.device and a.device.type != "meta" and a.numel() > 0
                  and a.data_ptr() == b.data_ptr()):
        raise ValueError(f"{what}: first and second are the same tensor")
    if a.shape != b.shape:
        raise ValueError(f"{what}: the two {attr}s differ in shape: {list(a.shape)} and {list(b.shape)}")
    if a.dtype != b.dtype or a.device != b.device:
        raise TypeError(f"{what}: the two {attr}s differ: {a.dtype} on {a.device} and {b.dtype} on {b.device}")
    if a.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{what}: jitfuse parameters are float32, float16 or bfloat16, not {a.dtype}")
    return a, b


def _fused_parameter(a: Tensor, b: Tensor) -> nn.Parameter:
    """A new Parameter [a; b] (along dim 0); ``a`` and ``b`` re-pointed to views of its two halves."""
    n = a.shape[0]
    fused = nn.Parameter(torch.cat([a.detach(), b.detach()]), requires_grad=a.requires_grad or b.requires_grad)
    with torch.no_grad():
        a.data = fused.detach()[:n]
        b.data = fused.detach()[n:]
    return fused


class Bias(BasicOp):
    """``y = x + b``; ``bias`` ``[features]``, zero-initialised (as TransformerEngine does)."""

    op = "bias"

    def __init__(self, features: int, *, device: Any = None, dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.features = int(features)
        self.bias = nn.Parameter(torch.zeros(self.features, **_factory(device, dtype)))

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.bias)

    def jf_params(self) -> List[Tuple[str, nn.Parameter]]:
        return [("bias", self.bias)]

    @classmethod
    def from_pair(cls, first: Union[nn.Module, Tensor], second: Union[nn.Module, Tensor]) -> "Bias":
        """The bias of :meth:`Linear.from_pair`'s pair: ``bias`` is one ``[2n]`` Parameter holding ``[first;
        second]``, for the op after ``Linear.from_pair(first.weight, second.weight)``. ``first``, ``second``:
        two ``nn.Linear`` with biases, or two bias tensors ``[n]``. As with the weights, the sources are
        re-pointed to views of the new Parameter (shared storage; build optimizers after the swap)."""
        b1, b2 = _pair("Bias.from_pair", first, second, "bias", 1)
        op = cls(b1.shape[0] * 2, device="meta", dtype=b1.dtype)
        op.bias = _fused_parameter(b1, b2)
        return op

    def extra_repr(self) -> str:
        return f"features={self.features}"


class _Norm(BasicOp):
    def __init__(self, hidden: int, eps: float, zero_centered_gamma: bool, has_bias: bool, device: Any,
                 dtype: Optional[torch.dtype]):
        super().__init__()
        self.hidden, self.eps, self.zero_centered_gamma = int(hidden), float(eps), bool(zero_centered_gamma)
        f = _factory(device, dtype)
        self.weight = nn.Parameter(torch.empty(self.hidden, **f))
        self.bias = nn.Parameter(torch.empty(self.hidden, **f)) if has_bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        (nn.init.zeros_ if self.zero_centered_gamma else nn.init.ones_)(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def attrs(self, training: bool) -> Dict[str, Any]:
        a: Dict[str, Any] = {"eps": self.eps}
        if self.zero_centered_gamma:
            a["zero_centered_gamma"] = True
        return a

    def jf_params(self) -> List[Tuple[str, nn.Parameter]]:
        return [("weight", self.weight)] + ([("bias", self.bias)] if self.bias is not None else [])

    def extra_repr(self) -> str:
        return f"{self.hidden}, " + super().extra_repr()


class LayerNorm(_Norm):
    """``y = (x - mean) rstd g + beta`` over the last dim; ``weight`` ones (zeros with
    ``zero_centered_gamma``, where ``g = 1 + weight``), ``bias`` zeros."""

    op = "layernorm"

    def __init__(self, hidden: int, eps: float = 1e-5, *, zero_centered_gamma: bool = False, device: Any = None,
                 dtype: Optional[torch.dtype] = None):
        super().__init__(hidden, eps, zero_centered_gamma, True, device, dtype)


class RMSNorm(_Norm):
    """``y = x rstd g`` over the last dim; ``weight`` ones (zeros with ``zero_centered_gamma``)."""

    op = "rmsnorm"

    def __init__(self, hidden: int, eps: float = 1e-5, *, zero_centered_gamma: bool = False, device: Any = None,
                 dtype: Optional[torch.dtype] = None):
        super().__init__(hidden, eps, zero_centered_gamma, False, device, dtype)


class GELU(BasicOp):
    """``y = x Phi(x)``; ``approximate`` "tanh" (the default, as jitfuse's) or "none" (erf)."""

    op = "gelu"

    def __init__(self, approximate: str = "tanh"):
        super().__init__()
        if approximate not in ("tanh", "none"):
            raise ValueError(f"GELU approximate must be 'tanh' or 'none', not {approximate!r}")
        self.approximate = approximate

    def attrs(self, training: bool) -> Dict[str, Any]:
        return {"approximate": self.approximate}


class _Simple(BasicOp):
    pass


class ReLU(_Simple):
    """``y = max(x, 0)``."""
    op = "relu"


class SiLU(_Simple):
    """``y = x sigmoid(x)``."""
    op = "silu"


class QGELU(_Simple):
    """``y = x sigmoid(1.702 x)``."""
    op = "qgelu"


class SReLU(_Simple):
    """``y = max(x, 0)^2``."""
    op = "srelu"


class SwiGLU(_Simple):
    """``[a, b] -> silu(a) * b`` (halves of the last dim)."""
    op = "swiglu"


class GEGLU(_Simple):
    """``[a, b] -> gelu_tanh(a) * b``."""
    op = "geglu"


class ReGLU(_Simple):
    """``[a, b] -> relu(a) * b``."""
    op = "reglu"


class Identity(_Simple):
    """``y = x``."""
    op = "identity"


class Quantize(_Simple):
    """The identity under fp32/fp16/bf16; the E4M3 cast under the FP8 recipes (must be the last op)."""
    op = "quantize"


class AddExtraInput(BasicOp):
    """``y = x + e``. Without ``channel``, ``e`` is the next extra input of ``Sequential.forward(x,
    *extra_inputs)`` (its gradient the next extra input's gradient). With ``channel``, ``e`` is that named
    channel: written by an earlier :class:`MakeExtraOutput` / :class:`Fork` of the same name, or provided by
    the caller when the Sequential declares it in ``input_channels`` (then the channel's FIRST reader takes
    the next extra input; later readers add the same tensor). A channel may have several readers; the
    backward sums their gradients into the channel's source (inside jitfuse). See :class:`AddChannel`."""

    op = "add_extra_input"

    def __init__(self, channel: Optional[str] = None):
        super().__init__()
        self.channel = channel  # its name is checked by the library when a Sequential wires it

    @property
    def n_extra_inputs(self) -> int:  # type: ignore[override]
        """1 for the caller's own extra input; 0 with a channel (an input channel's slot is counted by the
        Sequential, at its first reader: :attr:`Sequential.n_extra_inputs`)."""
        return 1 if self.channel is None else 0

    def attrs(self, training: bool) -> Dict[str, Any]:
        return {} if self.channel is None else {"channel": self.channel}


class MakeExtraOutput(BasicOp):
    """``y = x`` (a fork). Without ``channel``, ``x`` is also the caller's next extra output (its gradient
    the next extra output's gradient). With ``channel``, ``x`` is written into that named channel for later
    :class:`AddExtraInput` / :class:`AddChannel` ops of the sequence to read, hidden from the caller unless
    ``returned=True`` (then it is also the caller's next extra output). See :class:`Fork`."""

    op = "make_extra_output"

    def __init__(self, channel: Optional[str] = None, returned: bool = False):
        super().__init__()
        self.channel = channel  # its name is checked by the library when a Sequential wires it
        if not isinstance(returned, bool):
            raise TypeError(f"{type(self).__name__}: returned must be True or False, not {returned!r}")
        if returned and self.channel is None:
            raise ValueError(f"{type(self).__name__}: returned=True needs a channel (a MakeExtraOutput without one "
                             f"is always the caller's extra output)")
        self.returned = returned

    @property
    def n_extra_outputs(self) -> int:  # type: ignore[override]
        """1 when the caller gets this fork's tensor (no channel, or a returned channel), else 0."""
        return 1 if self.channel is None or self.returned else 0

    def attrs(self, training: bool) -> Dict[str, Any]:
        a: Dict[str, Any] = {}
        if self.channel is not None:
            a["channel"] = self.channel
            if self.returned:
                a["returned"] = True
        return a


class Fork(MakeExtraOutput):
    """``MakeExtraOutput(channel, returned)``: writes the stream into the named channel, e.g. the residual of
    a pre-norm block, ``Sequential(Fork("residual"), RMSNorm(h), ..., AddChannel("residual"))``. Hidden from
    the caller unless ``returned=True``."""

    def __init__(self, channel: str, returned: bool = False):
        if channel is None:
            raise TypeError("Fork needs a channel name (MakeExtraOutput() is the caller's extra output)")
        super().__init__(channel, returned)


class AddChannel(AddExtraInput):
    """``AddExtraInput(channel)``: adds the named channel to the stream (the residual add of a pre-norm
    block). The channel comes from an earlier :class:`Fork` or from the caller (``Sequential(...,
    input_channels=[channel])``)."""

    def __init__(self, channel: str):
        if channel is None:
            raise TypeError("AddChannel needs a channel name (AddExtraInput() adds the caller's extra input)")
        super().__init__(channel)


class Dropout(BasicOp):
    """``y = x keep / (1 - p)`` with a Philox mask. Active in train mode; the identity in eval mode.
    ``seed``: the op's Philox key (XORed with the module's rng seed); default: its index in the
    sequence, so every dropout of a sequence draws its own mask."""

    op = "dropout"

    def __init__(self, p: float, seed: Optional[int] = None):
        super().__init__()
        if not 0.0 <= float(p) < 1.0:
            raise ValueError(f"Dropout p must be in [0, 1), not {p}")
        self.p = float(p)
        self.seed = seed
        self._index = 0

    def attrs(self, training: bool) -> Dict[str, Any]:
        return {"p": self.p, "seed": self.seed if self.seed is not None else self._index, "training": bool(training)}

    def active(self, training: bool) -> bool:
        return training and self.p > 0


class Scale(BasicOp):
    """``y = value * x``."""

    op = "scale"

    def __init__(self, value: float):
        super().__init__()
        self.value = float(value)

    def attrs(self, training: bool) -> Dict[str, Any]:
        return {"value": self.value}


class Reshape(BasicOp):
    """``y = x`` viewed as ``shape`` (at most one -1)."""

    op = "reshape"

    def __init__(self, shape: Iterable[int]):
        super().__init__()
        self.shape = [int(s) for s in shape]

    def attrs(self, training: bool) -> Dict[str, Any]:
        return {"shape": list(self.shape)}


class CrossEntropy(BasicOp):
    """The loss of a language-model head, as ``torch.nn.functional.cross_entropy`` over the last dim:
    ``Sequential(Linear(h, vocab), CrossEntropy())(x, labels)`` returns the loss of the logits ``x W^T``
    against ``labels`` (one class index per row: the input's shape without its last dim; ``torch.int64``, or
    ``torch.int32`` with ``label_dtype=torch.int32``). The labels are the Sequential's last extra input and
    take no gradient; the op must be the last one.

    - ``reduction``: ``"mean"`` (over the rows whose label is not ``ignore_index``), ``"sum"`` (a ``[1]``
      tensor) or ``"none"`` (one loss per row);
    - ``ignore_index``: rows with this label contribute no loss and no gradient (default -100, as PyTorch
      and Hugging Face's shifted causal-LM labels);
    - ``label_smoothing`` in [0, 1), as PyTorch's; ``z_loss``: adds ``z_loss * logsumexp^2`` per row (PaLM);
      ``softcap``: logits become ``softcap * tanh(logits / softcap)`` first (Gemma-2; 0: off).

    After a :class:`Linear` (and :class:`Bias`), with ``"mean"`` or ``"sum"``, training runs the head in
    chunks of rows and computes the gradients in the forward (the logits are never whole in memory;
    docs/rules.md); ``chunk_mib`` bounds one chunk's logits (default None: 256 MiB, but at least 2048
    rows). Its backward scales
    those gradients in place (no allocation), so one forward serves one backward (no ``retain_graph``).

    ``vocab_parallel=True`` after a ``Linear(..., tensor_parallel="column")`` head: each rank holds its shard of the
    vocabulary (rows of the weight), the labels index the whole vocabulary, and the rows' max, sum of exponentials
    and label logit are gathered over the group, as Megatron's vocab-parallel cross-entropy; every rank returns
    the same loss (docs/parallel.md).
    Runs eagerly: ``torch.compile`` breaks the graph around the Sequential."""

    op = "cross_entropy"
    n_extra_inputs = 1

    def __init__(self, reduction: str = "mean", ignore_index: int = -100, label_smoothing: float = 0.0,
                 z_loss: float = 0.0, softcap: float = 0.0, label_dtype: torch.dtype = torch.int64,
                 chunk_mib: Optional[int] = None, vocab_parallel: bool = False):
        super().__init__()
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(f"CrossEntropy reduction must be 'mean', 'sum' or 'none', not {reduction!r}")
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
            raise TypeError(f"CrossEntropy ignore_index must be an int, not {ignore_index!r}")
        if not 0.0 <= float(label_smoothing) < 1.0:
            raise ValueError(f"CrossEntropy label_smoothing must be in [0, 1), not {label_smoothing!r}")
        for name, v in (("z_loss", z_loss), ("softcap", softcap)):
            if not float(v) >= 0.0 or not math.isfinite(float(v)):
                raise ValueError(f"CrossEntropy {name} must be a finite number >= 0, not {v!r}")
        if label_dtype not in (torch.int64, torch.int32):
            raise TypeError(f"CrossEntropy label_dtype must be torch.int64 or torch.int32, not {label_dtype}")
        self.reduction, self.ignore_index = reduction, ignore_index
        self.label_smoothing, self.z_loss, self.softcap = float(label_smoothing), float(z_loss), float(softcap)
        self.label_dtype = label_dtype
        if chunk_mib is not None and (isinstance(chunk_mib, bool) or not isinstance(chunk_mib, int)
                                      or not 1 <= chunk_mib <= 65536):
            raise ValueError(f"CrossEntropy chunk_mib must be None (automatic) or an int in [1, 65536], "
                             f"not {chunk_mib!r}")
        self.chunk_mib = chunk_mib
        if not isinstance(vocab_parallel, bool):
            raise TypeError(f"CrossEntropy vocab_parallel must be a bool, not {vocab_parallel!r}")
        self.vocab_parallel = vocab_parallel

    def extra_dtype(self) -> torch.dtype:
        return self.label_dtype

    def attrs(self, training: bool) -> Dict[str, Any]:
        return {"reduction": self.reduction, "ignore_index": self.ignore_index,
                "label_smoothing": self.label_smoothing, "z_loss": self.z_loss, "softcap": self.softcap,
                "label_dtype": "int32" if self.label_dtype == torch.int32 else "int64",
                **({"chunk_mib": self.chunk_mib} if self.chunk_mib is not None else {}),
                **({"vocab_parallel": True} if self.vocab_parallel else {})}


class MoEPermute(BasicOp):
    """Dispatches token rows to their experts (issue 43; docs/ops.md#mixture-of-experts): each token's row goes to
    the rows of its ``top_k`` experts, grouped by expert (stable: expert, then token, then slot). The top-k expert
    ids ``[tokens, top_k]`` (``torch.topk``'s indices: ``torch.int64``, or ``torch.int32`` with
    ``index_dtype=torch.int32``) are the Sequential's next extra input, with no gradient. The routing happens on
    the device (no host synchronisation of its own).

    - ``layout="packed"`` (dropless, the default): ``tokens * top_k`` rows; a :class:`GroupedLinear` after it
      runs each expert's own rows (their counts are read on the host once per pass: no CUDA-graph capture);
    - ``layout="padded"`` with a ``capacity``: every expert ``capacity`` rows (tokens past it dropped, GShard's
      capacity), fixed shapes: a CUDA graph replays it with new routing.

    ``capacity`` (None: keep every row) may also cap the packed layout. Pairs with the :class:`MoEUnpermute`
    after it, which combines the rows back."""

    op = "moe_permute"
    n_extra_inputs = 1

    def __init__(self, num_experts: int, top_k: int, *, capacity: Optional[int] = None, layout: str = "packed",
                 index_dtype: torch.dtype = torch.int64):
        super().__init__()
        for name, v in (("num_experts", num_experts), ("top_k", top_k)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"MoEPermute {name} must be an int >= 1, not {v!r}")
        if layout not in ("packed", "padded"):
            raise ValueError(f"MoEPermute layout must be 'packed' or 'padded', not {layout!r}")
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1):
            raise ValueError(f"MoEPermute capacity must be None (dropless) or an int >= 1, not {capacity!r}")
        if layout == "padded" and capacity is None:
            raise ValueError("MoEPermute(layout='padded') gives each expert `capacity` rows: pass capacity= (e.g. "
                             "1.25 x tokens x top_k / num_experts, GShard's capacity factor)")
        if index_dtype not in (torch.int64, torch.int32):
            raise TypeError(f"MoEPermute index_dtype must be torch.int64 or torch.int32, not {index_dtype}")
        self.num_experts, self.top_k, self.capacity, self.layout = num_experts, top_k, capacity, layout
        self.index_dtype = index_dtype

    def extra_dtype(self) -> torch.dtype:
        return self.index_dtype

    def attrs(self, training: bool) -> Dict[str, Any]:
        a: Dict[str, Any] = {"num_experts": self.num_experts, "top_k": self.top_k, "layout": self.layout,
                             "index_dtype": "int32" if self.index_dtype == torch.int32 else "int64"}
        if self.capacity is not None:
            a["capacity"] = self.capacity
        return a


class MoEUnpermute(BasicOp):
    """Combines the experts' rows back per token, weighted by the routing probabilities: ``y[t] = sum_j
    probs[t, j] x[row(t, j)]`` with the routing of the :class:`MoEPermute` before it. ``probs`` ``[tokens,
    top_k]``, float32, is the Sequential's next extra input and **takes a gradient** (the router learns through
    it); a dropped slot adds nothing (and gets a zero gradient)."""

    op = "moe_unpermute"
    n_extra_inputs = 1

    def extra_dtype(self) -> torch.dtype:
        return torch.float32


class GroupedLinear(BasicOp):
    """``y_g = x_g W_g^T`` per group of rows: one weight ``[num_groups, out_features, in_features]`` (the experts'
    weights stacked, as Hugging Face's fused experts store ``gate_up_proj`` and ``down_proj``): after a dropless
    MoEPermute one GEMM per expert over its rows (or one cuBLAS grouped call), with equal groups one strided-batched
    GEMM per pass. Between a :class:`MoEPermute` and its :class:`MoEUnpermute` the groups are the experts'
    rows (``num_groups`` = ``num_experts``); alone, the rows are ``num_groups`` equal groups. ``weight=``: use an
    existing parameter (shared, no copy) instead of a new one."""

    op = "grouped_linear"

    def __init__(self, num_groups: int, in_features: int, out_features: int, *, weight: Optional[nn.Parameter] = None,
                 device: Any = None, dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.num_groups, self.in_features, self.out_features = int(num_groups), int(in_features), int(out_features)
        want = (self.num_groups, self.out_features, self.in_features)
        if weight is not None:
            if tuple(weight.shape) != want:
                raise ValueError(f"GroupedLinear weight has shape {list(weight.shape)}; [num_groups, out_features, "
                                 f"in_features] is {list(want)}")
            self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight)
            return
        self.weight = nn.Parameter(torch.empty(*want, **_factory(device, dtype)))
        for g in range(self.num_groups):
            nn.init.kaiming_uniform_(self.weight.data[g], a=math.sqrt(5))

    def attrs(self, training: bool) -> Dict[str, Any]:
        return {"num_groups": self.num_groups, "in_features": self.in_features, "out_features": self.out_features}

    def jf_params(self) -> List[Tuple[str, nn.Parameter]]:
        return [("weight", self.weight)]


class _Collective(BasicOp):
    def __init__(self, group: str = "tp"):
        super().__init__()
        self.group = group

    def attrs(self, training: bool) -> Dict[str, Any]:
        return {"group": self.group}


class AllGather(_Collective):
    """Concatenates every rank's input along dim 0 (backward: reduce-scatter); docs/parallel.md."""

    op = "all_gather"


class ReduceScatter(_Collective):
    """This rank's dim-0 shard of the sum over ranks (backward: all-gather); docs/parallel.md."""

    op = "reduce_scatter"


class AllReduce(_Collective):
    """``direction="forward"``: the sum over ranks (backward: identity); ``"backward"``: the identity whose
    backward sums the gradient over ranks; docs/parallel.md."""

    op = "all_reduce"

    def __init__(self, group: str = "tp", direction: str = "forward"):
        super().__init__(group)
        if direction not in ("forward", "backward"):
            raise ValueError(f"AllReduce direction must be 'forward' or 'backward', not {direction!r}")
        self.direction = direction

    def attrs(self, training: bool) -> Dict[str, Any]:
        return {"group": self.group, "direction": self.direction}


class MoEDispatch(_Collective):
    """Expert parallelism (docs/parallel.md#expert-parallelism): after a dropless :class:`MoEPermute` over all
    ``num_experts`` experts, sends each expert's rows to the rank of group ``group`` that owns it (rank ``r``:
    experts ``[r E/W, (r+1) E/W)``) and returns the rows this rank's experts got from every rank, expert by
    expert (the :class:`GroupedLinear` after it has ``num_groups = E/W``); its backward sends the gradients back.
    ``max_rows`` bounds the rows received (None: world size x the permuted rows, which no routing exceeds; a call
    whose routing exceeds a smaller bound fails on every rank). NCCL send/recv; the counts are read on the host
    once per call (no CUDA-graph capture). Pairs with the :class:`MoECombine` after the experts' ops."""

    op = "moe_dispatch"

    def __init__(self, group: str = "ep", max_rows: Optional[int] = None):
        super().__init__(group)
        if max_rows is not None and (isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1):
            raise ValueError(f"MoEDispatch max_rows must be None or an int >= 1, not {max_rows!r}")
        self.max_rows = max_rows

    def attrs(self, training: bool) -> Dict[str, Any]:
        return {"group": self.group, **({"max_rows": self.max_rows} if self.max_rows is not None else {})}


class MoECombine(_Collective):
    """Sends the experts' rows back to the ranks and rows the :class:`MoEDispatch` before it took them from (the
    permuted rows of this rank, for the :class:`MoEUnpermute` after it); backward: dispatches the gradients."""

    op = "moe_combine"

    def __init__(self, group: str = "ep"):
        super().__init__(group)


class Op(BasicOp):
    """Any op by name, e.g. a pointwise op declared in a rules file: ``Op("softplus", beta=2.0)``.
    ``params``: {ABI name: shape or tensor} for ops that declare parameters (zero-initialised from a
    shape). The rules declaring a user op must be loaded into the contexts (``JITFUSE_RULE_PATH``)."""

    def __init__(self, kind: str, *, params: Optional[Dict[str, Union[Tuple[int, ...], Tensor]]] = None,
                 device: Any = None, dtype: Optional[torch.dtype] = None, **attrs: Any):
        super().__init__()
        self.op = str(kind)
        self._attrs = dict(attrs)
        self._param_names: List[str] = []
        for name, v in (params or {}).items():
            t = v.detach().clone() if isinstance(v, Tensor) else torch.zeros(*v, **_factory(device, dtype))
            self.register_parameter(name.replace(".", "_"), nn.Parameter(t))
            self._param_names.append(name)

    def attrs(self, training: bool) -> Dict[str, Any]:
        return dict(self._attrs)

    def jf_params(self) -> List[Tuple[str, nn.Parameter]]:
        return [(n, getattr(self, n.replace(".", "_"))) for n in self._param_names]

    def extra_repr(self) -> str:
        return ", ".join([repr(self.op)] + [f"{k}={v!r}" for k, v in self._attrs.items()])


class Sequential(nn.Module):
    """Runs ``ops`` as one jitfuse sequence: ``forward(input, *extra_inputs)`` returns the output, or
    ``(output, *extra_outputs)`` when the ops make extra outputs (as TransformerEngine's
    ``te.ops.Sequential``).

    - The recipe follows the input dtype (float32 -> fp32, float16 -> fp16, bfloat16 -> bf16);
      parameters must have the input's dtype, except under ``torch.autocast("cuda", dtype)``, where the
      input, extra inputs and floating parameters are cast to the autocast dtype per call (as ``nn.Linear``
      under autocast: the output has the autocast dtype, gradients flow back to float32 master weights).
    - Parameters are checked at every call (shape, dtype, device, layout); a non-contiguous one (e.g.
      ``nn.Parameter(conv1d.weight.t())``) is copied row-major per call, its gradient flowing back to it
      (a Conv1D's ``[in, out]`` weight needs no copy: ``Linear(..., weight_layout="in_out")``).
    - ``recipe="fp8_current"`` / ``"fp8_delayed"``: training and inference under FP8 (the module is an
      :class:`Fp8Sequential`). Parameters, activations, outputs and gradients stay bf16; every Linear runs
      on FP8 GEMMs (E4M3 input and weight, E5M2 output gradient, per-tensor scales from this tensor's amax
      or from an amax history), and a trailing :class:`Quantize` returns a :class:`Float8Tensor` (E4M3
      codes + the scale_inv that decodes them, dtype bfloat16 for autograd: its backward is straight
      through, the gradient never rounded to E4M3). The recipe state (amax histories, scales) and the
      weights' FP8 copies belong to this module, are saved in its ``state_dict`` and freed with it.
    - FP8 weight casts: every forward casts the weights to FP8 again, whatever wrote them (fused or
      foreach optimizers, NCCL, ``.data``): no version counter or pointer is trusted. Inside
      :class:`jitfuse.torch.fp8_weights_unchanged` the caller promises they did not change (the next
      microbatches of a step, a decode loop) and the copies are reused, except inside a CUDA-graph capture.
    - Forward and backward are the ``jitfuse::forward`` / ``jitfuse::backward`` custom ops, so
      ``torch.compile(fullgraph=True)`` traces them and CUDA graphs capture them (after one eager call
      or :meth:`prepare` per shape). An eager call (not traced, no dispatch mode or profiler active, plain
      tensors) runs the same program without the dispatcher's hops.
    - Dropout masks follow PyTorch's CUDA generator: each training forward draws its Philox {seed, offset}
      with ``torch.randint`` on the input's device, so ``torch.manual_seed`` reproduces a run, a recompute
      under ``torch.utils.checkpoint`` draws the same masks, and each CUDA-graph replay draws new ones.
    - Channels: :class:`Fork` (``MakeExtraOutput(channel)``) writes the stream into a named channel and
      :class:`AddChannel` (``AddExtraInput(channel)``) adds it later in the sequence, so a pre-norm block's
      residual stays inside: ``Sequential(Fork("residual"), RMSNorm(h), Linear(h, 2 * f), SwiGLU(),
      Linear(f, h), AddChannel("residual"))`` takes ``x`` and returns one tensor. A channel may have several
      readers (their gradients are summed into its source inside jitfuse), may also be returned
      (``Fork(name, returned=True)``) or may come from the caller (``input_channels=["skip"]``: one extra
      input, numbered at its first reader). Extra inputs are numbered in op order over AddExtraInput ops
      without a channel and first readers of input channels; extra outputs over MakeExtraOutput ops without
      a channel or returned (``wiring`` lists both, as the library numbered them; :attr:`n_extra_inputs`,
      :attr:`n_extra_outputs`). A wiring the library refuses raises :class:`jitfuse.torch.ChannelError` (a
      ``ValueError``) here, with the library's message naming the op.
    - ``device``/``dtype``: moved/cast onto every op's parameters when given.
    """

    def __init__(self, *ops: BasicOp, input_channels: Iterable[str] = (), recipe: Optional[str] = None,
                 name: str = "sequential", device: Any = None, dtype: Optional[torch.dtype] = None):
        super().__init__()
        if not ops:
            raise ValueError("jitfuse.torch.Sequential needs at least one op")
        for i, op in enumerate(ops):
            if not isinstance(op, BasicOp):
                raise TypeError(f"op {i}: jitfuse.torch.Sequential takes jitfuse.torch ops (Linear, Bias, GELU, ..., "
                                f"Op('name')), not {type(op).__name__}")
            if isinstance(op, Dropout):
                op._index = i
            self.add_module(str(i), op)
        if recipe is not None and recipe not in FP8_RECIPES and recipe not in RECIPE_OF_DTYPE.values():
            raise ValueError(f"unknown recipe {recipe!r}: use None (follow the input dtype), fp8_current or fp8_delayed")
        if recipe in RECIPE_OF_DTYPE.values():
            recipe = None  # a plain recipe is the input dtype
        self.recipe = recipe
        self.name = name
        self._ops: Tuple[BasicOp, ...] = tuple(ops)
        # Channels: the library's parser checks the ops under the recipe and numbers the caller's extra tensors,
        # so a bad wiring (or an op out of place: CrossEntropy before the end or under FP8, Quantize before the
        # end under FP8) fails when the module is built, with the library's message naming the op
        # (docs/python.md#channels).
        specs = [op.spec(True) for op in ops]
        try:
            self.wiring: Wiring = wire(specs, input_channels, ctx=context(-1), recipe=recipe or "bf16", name=name)
        except ChannelError as e:
            raise ChannelError(f"{name}: {e.message}", e.status) from None
        self.input_channels: Tuple[str, ...] = self.wiring.input_channels
        self._n_extra_inputs = self.wiring.n_extra_inputs
        self._n_extra_outputs = self.wiring.n_extra_outputs
        self._jf_specs = specs  # for the library's message on a wrong count of extra inputs (_check_count)
        # Extra inputs of their own dtype (see _labels_forward): CrossEntropy's labels and MoEPermute's indices
        # (integers, no gradient), MoEUnpermute's probabilities (float32, with a gradient): slot -> dtype.
        self._jf_labels: Dict[int, torch.dtype] = {k: ops[s.op].extra_dtype()
                                                   for k, s in enumerate(self.wiring.extra_inputs)
                                                   if s.kind in _TYPED_EXTRAS}
        self._jf_extra_kinds = [s.kind for s in self.wiring.extra_inputs]
        # (library op index, name) of each parameter: a parallel Linear is two ops of the library's sequence
        # (its inserted collective, docs/parallel.md), so indices count n_ops().
        starts = [sum(o.n_ops() for o in ops[:i]) for i in range(len(ops))]
        self._param_index = [(starts[i] + op.param_op(), n) for i, op in enumerate(ops) for n, _ in op.jf_params()]
        self._jf_param_refs: Optional[List[Tuple[BasicOp, str]]] = None  # set after .to() below
        if device is not None or dtype is not None:
            self.to(device=device, dtype=dtype)
        self._jf_fp8_output = recipe in FP8_RECIPES and isinstance(ops[-1], Quantize)
        self._jf_uses_rng = {t: any(isinstance(o, Dropout) and o.active(t) for o in ops) for t in (True, False)}
        self._jf_param_refs = self._param_refs()
        if self.recipe in FP8_RECIPES:
            self.__class__ = Fp8Sequential  # FP8 recipe state in state_dict, freed with the module
        self._jf_define()

    # -- definitions -------------------------------------------------------------------------------

    def _param_refs(self) -> Optional[List[Tuple[BasicOp, str]]]:
        """(op, attribute name in op._parameters) of each parameter, so that a call reads them with dict
        lookups instead of calling every op's jf_params(); None when an op's parameters are not all
        registered attributes (a subclass computing them): then jf_params() is called per call."""
        refs = []
        for op in self._ops:
            for _, p in op.jf_params():
                name = next((n for n, q in op._parameters.items() if q is p), None)
                if name is None:
                    return None
                refs.append((op, name))
        return refs

    def _param_device(self) -> Any:
        for op in self._ops:
            for _, p in op.jf_params():
                return p.device
        return "cuda" if torch.cuda.is_available() else "cpu"

    def _jf_define(self) -> None:
        """Registers the sequence of each (train/eval mode, dtype) under its content key."""
        salt = f"fp8:{next(_fp8_salt)}" if self.recipe in FP8_RECIPES else ""
        shapes = [tuple(p.shape) for op in self._ops for _, p in op.jf_params()]
        acc = [op.accumulates_grad(n) for op in self._ops for n, _ in op.jf_params()]
        self._jf_keys: Dict[bool, Dict[torch.dtype, int]] = {}
        for training in (True, False):
            specs = [op.spec(training) for op in self._ops]
            dtypes = {torch.bfloat16: self.recipe} if self.recipe else RECIPE_OF_DTYPE
            self._jf_keys[training] = {
                dt: define(self.name, specs, recipe, self._param_index, shapes, acc, self._n_extra_inputs,
                              self._n_extra_outputs, self._jf_uses_rng[training], salt, self.input_channels)
                for dt, recipe in dtypes.items()}

    # -- running -----------------------------------------------------------------------------------

    def _params(self, row_major: bool = True) -> List[Tensor]:
        """Every op's parameters in the sequence's order, read live (an op's parameter may be replaced).
        ``row_major=False``: as they are (the C++ entry makes the copies itself)."""
        refs = self._jf_param_refs
        ps = None
        if refs is not None:
            try:
                ps = [op._parameters[n] for op, n in refs]
            except KeyError:
                pass
        if ps is None:
            ps = [p for op in self._ops for _, p in op.jf_params()]
        if not row_major:
            return ps
        for i, p in enumerate(ps):
            if not p.is_contiguous():  # e.g. nn.Parameter(w.t()): a row-major copy, its gradient flows back to p
                ps[i] = p.contiguous()
        return ps

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # nn.Module.__call__ without its two Python frames (_wrapped_call_impl, _call_impl) when they would
        # only call forward: no hook of this module or global one, no Module.compile(), no TorchScript
        # trace, not traced by Dynamo (which inlines Module.__call__ itself), and forward is this class's.
        # ~1 us of host time per call (docs/benchmarks.md, session 24); otherwise Module.__call__ runs. With
        # the extension all of that, and _eager_forward's common case, is one C++ call (ext_call).
        if ext_call is not None and ext_forward is not None and not kwargs and not _is_compiling():
            out = ext_call(self, args)
            if out is not None:
                return out
        if (kwargs or _is_compiling() or not _FAST_CALL or self._forward_pre_hooks or self._forward_hooks
                or self._backward_pre_hooks or self._backward_hooks or self._compiled_call_impl is not None
                or _gfp or _gf or _gbp or _gb or _tracing_state() or type(self).forward is not Sequential.forward):
            return _module_call(self, *args, **kwargs)
        return self._eager_forward(*args)

    def forward(self, input: Tensor, *extra_inputs: Tensor) -> Union[Tensor, Tuple[Tensor, ...]]:
        if self._jf_labels:
            return self._labels_forward(input, extra_inputs)
        if _is_compiling():
            return self._forward_op(input, extra_inputs)
        return self._eager_forward(input, *extra_inputs)

    def _eager_forward(self, input: Tensor, *extra_inputs: Tensor) -> Union[Tensor, Tuple[Tensor, ...]]:
        """forward when not traced by Dynamo. With the C++ extension, every recipe (FP8 included) takes the
        extension's module_forward (its C++ Autograd kernel decides the rest; an E4M3 output comes back with
        its scale_inv and is wrapped here), except a trailing Quantize under autograd, which takes
        :meth:`_forward_op` (see there). Without the extension, on the route :func:`jitfuse.torch._calls.route`
        chooses: DIRECT calls the program here (no dispatcher hop; under autograd, one autograd node around
        it), through the module's :class:`~jitfuse.torch._ops.EagerCall`. Anything unusual (a wrong dtype or
        device, a tensor subclass, a dispatch mode, the profiler) takes the custom op, which also raises the
        errors."""
        if self._jf_labels:
            return self._labels_forward(input, extra_inputs)
        training = self.training
        ext = ext_forward is not None
        params = self._params(not ext)
        if _autocast_on():
            input, extra_inputs, params = _autocast(input, extra_inputs, params)
        key = self._jf_keys[training].get(input.dtype)
        if ext:
            # The C++ op does the rest (contiguity, grad, autograd, checks); None: a call the checked path
            # must answer (an input off CUDA, tensors of another dtype or device).
            if (key is not None and len(extra_inputs) == self._n_extra_inputs
                    and not (self._jf_fp8_output and needs_grad(input, extra_inputs, params))):
                out = ext_forward(key, input, extra_inputs, params,
                                  _draw_rng(input) if self._jf_uses_rng[training] and input.is_cuda else None,
                                  training, self._n_extra_outputs)
                if out is not None:
                    self.__dict__["_jf_last_shape"] = input.shape  # what explain() shows (a plain dict store)
                    return self._fp8_output(out, input.dtype) if self._jf_fp8_output else out
            return self._forward_op(input, extra_inputs, [p if p.is_contiguous() else p.contiguous() for p in params])
        r = route(input, extra_inputs, params)
        if key is None or len(extra_inputs) != self._n_extra_inputs or not r & DIRECT:
            return self._forward_op(input, extra_inputs, params)
        x = input if input.is_contiguous() else input.contiguous()
        extras = [e if e.is_contiguous() else e.contiguous() for e in extra_inputs] if extra_inputs else []
        rng = _draw_rng(x) if self._jf_uses_rng[training] else None
        di = x.get_device()
        prog = _programs.get((key, di)) or device_program(key, di)
        outs = (prog.eager_call or eager_call(prog)).module_forward(r, x, extras, params, rng, training)
        if self._n_extra_outputs:
            return tuple(outs)
        return outs[0]

    def _check_count(self, extra_inputs: Tuple[Tensor, ...]) -> None:
        """A wrong number of extra inputs raises TypeError with the library's message (the one count check of
        both torch layers: jf_sequence_check_counts, which the C++ ops ask too)."""
        if len(extra_inputs) != self._n_extra_inputs:
            raise TypeError(count_error(self._jf_specs, self.input_channels, context(-1), self.recipe or "bf16",
                                        self.name, self.name, len(extra_inputs)))

    def _logits_rows(self, input: Tensor) -> Tuple[int, ...]:
        """The leading shape of the rows reaching the loss: the input's, with dim 0 gathered (x world size) by a
        sequence-parallel column Linear or an AllGather and scattered (/ world size) by a sequence-parallel row
        Linear or a ReduceScatter on the way."""
        rows = list(input.shape[:-1]) or [1]
        for op in self._ops:
            if isinstance(op, Linear) and op.sequence_parallel:
                gather, w = op.tensor_parallel == "column", int(op.tp_world_size)
            elif isinstance(op, (AllGather, ReduceScatter)):
                from . import distributed
                gather, w = isinstance(op, AllGather), distributed.world_size(op.group)
            else:
                continue
            rows[0] = rows[0] * w if gather else rows[0] // w
        return tuple(rows)

    @_compiler_disable
    def _labels_forward(self, input: Tensor, extra_inputs: Tuple[Tensor, ...]) -> Union[Tensor, Tuple[Tensor, ...]]:
        """forward of a Sequential with extra inputs of their own dtype: CrossEntropy's labels and MoEPermute's
        expert indices (integers without a gradient) and MoEUnpermute's routing probabilities (float32 with a
        gradient), which the custom ops (and the C++ extension) do not take, so the program runs here directly
        (one autograd node when a gradient is needed), after the checks the op would make. torch.compile
        breaks the graph around it (``torch.compiler.disable``)."""
        name = self.name
        self._check_count(extra_inputs)
        params = self._params()
        if _autocast_on():  # floating tensors only; the typed extra inputs keep their dtypes
            input, _, params = _autocast(input, (), params)
            extra_inputs = tuple(e if k in self._jf_labels else _autocast(e, (), [])[0]
                                 for k, e in enumerate(extra_inputs))
        training = self.training
        key = self._jf_keys[training].get(input.dtype)
        check_arguments(name, self.recipe, key, input, params)
        rows = self._logits_rows(input)
        extra_inputs = tuple(self._typed_extra(k, e, input, rows) for k, e in enumerate(extra_inputs))
        x = input if input.is_contiguous() else input.contiguous()
        extras = [e if e.is_contiguous() else e.contiguous() for e in extra_inputs]
        rng = _draw_rng(x) if self._jf_uses_rng[training] else None
        di = x.get_device()
        prog = _programs.get((key, di)) or device_program(key, di)
        call = prog.eager_call or eager_call(prog)
        if needs_grad(x, extras, params):
            outs = call.node(True, True, x, extras, params, rng)
        else:
            outs = call.module_forward(DIRECT, x, extras, params, rng, training)
        if self._n_extra_outputs:
            return tuple(outs)
        return outs[0]

    _EXTRA_NOUN = {"labels": "the labels", "indices": "the expert indices", "probs": "the routing probabilities"}

    def _typed_extra(self, k: int, e: Any, input: Tensor, rows: Tuple[int, ...]) -> Tensor:
        """Extra input ``k`` checked against what its op takes (the library checks its shape against the plan
        too, naming the op): an untyped one matches the input; routing probabilities of another floating dtype
        are cast to float32 (autograd takes the gradient back through the cast, as Qwen3-MoE's bf16 scores)."""
        name, want = self.name, self._jf_labels.get(k)
        if not isinstance(e, Tensor):
            raise TypeError(f"{name}: extra input {k} must be a tensor, got {type(e).__name__}")
        if want is None:
            if e.dtype != input.dtype or e.device != input.device:
                raise TypeError(f"{name}: extra inputs must match the input ({input.dtype} on {input.device})")
            return e
        kind = self._jf_extra_kinds[k]
        what = f"{self._EXTRA_NOUN[kind]} (extra input {k})"
        if kind == "probs" and e.is_floating_point() and e.dtype != want:
            e = e.float()
        if e.dtype != want:
            hint = {"labels": "CrossEntropy's label_dtype", "indices": "MoEPermute's index_dtype",
                    "probs": "float32"}[kind]
            raise TypeError(f"{name}: {what} must be a {want} tensor ({hint}), got {e.dtype}")
        if e.device != input.device:
            raise ValueError(f"{name}: {what} are on {e.device}, the input on {input.device}: pass them on the "
                             f"input's device")
        if kind == "labels" and tuple(e.shape) != rows:
            raise ValueError(f"{name}: {what} have shape {list(e.shape)}; one label per row of the logits is shape "
                             f"{list(rows)}")
        return e

    def _forward_op(self, input: Tensor, extra_inputs: Tuple[Tensor, ...],
                    params: Optional[List[Tensor]] = None) -> Union[Tensor, Tuple[Tensor, ...]]:
        """The forward through the ``jitfuse::forward`` op: what torch.compile traces, and the eager fallback
        (with every argument check). ``params``: already read (and cast under autocast) by the caller."""
        if params is None:
            params = self._params()
            if _autocast_on():
                input, extra_inputs, params = _autocast(input, extra_inputs, params)
        training = self.training
        key = self._jf_keys[training].get(input.dtype)
        self._check_count(extra_inputs)
        check_arguments(self.name, self.recipe, key, input, params, extra_inputs)
        grad = needs_grad(input, extra_inputs, params)
        rng = _draw_rng(input) if self._jf_uses_rng[training] else None
        x, extras = input.contiguous(), [e.contiguous() for e in extra_inputs]
        if self._jf_fp8_output and grad and _EXT is not None and not _is_compiling():
            # The extension's autograd node would return the E4M3 codes as its differentiable output, and
            # autograd would round the gradient reaching them to E4M3. The Float8Tensor (dtype bfloat16) must
            # be the node's output: a Python node around the C++ op below autograd, as the pure-Python
            # Autograd kernel builds it (jitfuse::forward and jitfuse::backward still run in C++).
            self.__dict__["_jf_last_shape"] = input.shape
            outs = eager_call(program_of(key, x)).node(False, True, x, extras, params, rng)
        else:
            # Train mode runs the training program with or without grad (see EagerCall.module_forward).
            outs = torch.ops.jitfuse.forward.default(key, x, extras, params, rng, grad or training)
        out = outs[0]
        if self._jf_fp8_output and not isinstance(out, Float8Tensor):
            # An E4M3 output (trailing quantize): the op's list has its scale_inv after the extra outputs.
            if grad and _is_compiling():
                raise NotImplementedError(
                    f"{self.name}: a trailing Quantize under torch.compile with autograd is not supported: the "
                    f"gradient reaching its E4M3 output would be rounded to E4M3; run this module eagerly (or "
                    f"end the sequence before Quantize)")
            out = Float8Tensor(out, outs[1 + self._n_extra_outputs], input.dtype)
        if self._n_extra_outputs:
            return (out, *outs[1:1 + self._n_extra_outputs])  # then (scale_inv,) (saved block,)
        return out

    def _fp8_output(self, out: Any, nominal: torch.dtype) -> Union[Tensor, Tuple[Tensor, ...]]:
        """The extension's answer for a trailing Quantize, (codes, *extra_outputs, scale_inv), as the module
        returns it: a :class:`Float8Tensor` (and the extra outputs)."""
        f8 = Float8Tensor(out[0], out[-1], nominal)
        return (f8, *out[1:-1]) if self._n_extra_outputs else f8

    def recast_fp8_weights(self) -> None:
        """Kept for compatibility: every forward casts the FP8 weights unless inside
        :class:`jitfuse.torch.fp8_weights_unchanged`, so there is nothing to force."""

    def prepare(self, shape: Iterable[int], training: bool = True, dtype: Optional[torch.dtype] = None,
                device: Any = None) -> None:
        """Plans and compiles (or loads from the kernel cache) the programs of an input shape, so that a
        CUDA-graph capture that follows does no preparation. ``training``: prepare the training program
        (forward that saves, and backward); the inference program is prepared with False."""
        ps = self._params()
        dtype = dtype or (torch.bfloat16 if self.recipe else (ps[0].dtype if ps else torch.get_default_dtype()))
        dev = torch.device(device) if device is not None else torch.device(self._param_device())
        if dev.type != "cuda":
            raise ValueError(f"{self.name}: prepare needs a CUDA device, not {dev}")
        key = self._jf_keys[self.training].get(dtype)
        if key is None:
            raise TypeError(f"{self.name}: no program for dtype {dtype}")
        device_program(key, dev.index if dev.index is not None else torch.cuda.current_device()).info(
            tuple(int(d) for d in shape), bool(training))

    def explain(self, shape: Optional[Iterable[int]] = None, training: Optional[bool] = None,
                dtype: Optional[torch.dtype] = None, arch: Optional[int] = None,
                world_size: Optional[int] = None, rank: Optional[int] = None) -> Explanation:
        """The fusion decisions and program for an input shape (default: the last shape run), without a
        GPU. ``arch`` defaults to the current GPU's (90 without one). A tensor-parallel module is planned as
        one rank of ``world_size`` (default: the size its parallel linears were built for) and ``rank``
        (default: this process's rank in their registered group, else 0): the shard widths, collectives and
        buffers of that rank, whose input ``shape`` is (a sequence-parallel input: this rank's rows)."""
        training = self.training if training is None else training
        dtype = dtype or (self._params()[0].dtype if self._params() else torch.bfloat16)
        if self.recipe:
            dtype = torch.bfloat16
        key = self._jf_keys[self.training][dtype]
        if shape is None:
            shape = self.__dict__.get("_jf_last_shape")  # set by the C++ extension's eager call
        if shape is None:
            shape = next((p.last_shape for p in existing_programs(key) if p.last_shape), None)
            if shape is None:
                raise ValueError(f"{self.name}: no shape run yet; pass explain(shape=...)")
        if arch is None:
            arch = 90
            if torch.cuda.is_available():
                major, minor = torch.cuda.get_device_capability()
                arch = major * 10 + minor
        if world_size is None or rank is None:
            w, r = self._tp_rank()
            world_size = w if world_size is None else world_size
            rank = r if rank is None else rank
        seq = device_program(key, -1).sequence
        if world_size <= 1 and not self._tp_ops():
            return seq.explain(tuple(shape), training, arch)
        return seq.explain(tuple(shape), training, arch, world_size=int(world_size), rank=int(rank))

    def _tp_ops(self) -> List[BasicOp]:
        return [op for op in self._ops if getattr(op, "tensor_parallel", "none") != "none"
                or isinstance(op, (MoEDispatch, MoECombine))]

    def _tp_rank(self) -> Tuple[int, int]:
        """(world size, rank) a parallel module runs as: the size its parallel linears were cut for (an
        expert-parallel one: its group's size) and this process's rank in their group (0 when the group is not
        registered); (1, 0) without parallel ops."""
        ops = self._tp_ops()
        if not ops:
            return 1, 0
        from . import distributed
        world = max(int(getattr(op, "tp_world_size", 0) or distributed.world_size(op.group)) for op in ops)
        return world, distributed.rank(ops[0].group) if world > 1 else 0

    @property
    def n_extra_inputs(self) -> int:
        """How many extra inputs ``forward(x, *extra_inputs)`` takes: one per AddExtraInput without a channel
        and one per input channel (numbered at its first reader), in op order (``wiring.extra_inputs``)."""
        return self._n_extra_inputs

    @property
    def n_extra_outputs(self) -> int:
        """How many extra outputs ``forward`` returns after the output: one per MakeExtraOutput without a
        channel or with ``returned=True``, in op order (``wiring.extra_outputs``)."""
        return self._n_extra_outputs

    def __getitem__(self, index: int) -> BasicOp:
        return self._ops[index]

    def __len__(self) -> int:
        return len(self._ops)

    # -- nn.Module hooks ---------------------------------------------------------------------------

    def _apply(self, fn, recurse=True):
        ps = self._params()
        if ps:
            _check_dtype_change(self, fn, ps[0].dtype, self.recipe)
        return super()._apply(fn, recurse)

    def __repr__(self) -> str:
        text = super().__repr__()
        try:
            e = self.explain()
        except Exception:
            return text
        groups = "\n".join(f"    {g}" for g in e.forward)
        bwd = "\n".join(f"    {g}" for g in e.backward) if e.training else ""
        dims = "x".join(map(str, e.shape))
        tail = f"\n  jitfuse plan for input {dims} ({'training' if e.training else 'inference'}):\n  forward:\n{groups}"
        if bwd:
            tail += f"\n  backward:\n{bwd}"
        return text[:-1] + tail + "\n)" if text.endswith(")") else text + tail

    def extra_repr(self) -> str:
        text = f"recipe={self.recipe or 'input dtype'}, name={self.name!r}"
        if self.input_channels:
            text += f", input_channels={list(self.input_channels)!r}"
        return text


if ext_call is not None:
    _EXT.init_module_call(Sequential.forward, _GLOBAL_HOOKS, _draw_rng)


FP8_STATE_FORMAT = "jitfuse.fp8_state/1"


class Fp8Sequential(Sequential):
    """A :class:`Sequential` under an FP8 recipe (``Sequential(..., recipe="fp8_delayed")`` returns one): its
    sequences are its own (keyed per module), so it also owns their recipe state and FP8 weight copies.

    - ``state_dict()`` holds the recipe state as ``_extra_state``: for every FP8 tensor ("<op>.input",
      "<op>.weight", "<op>.grad_output" of each Linear, "<op>.output" of a trailing Quantize) the float32
      block [scale, scale_inv, amax_history...]; ``load_state_dict`` writes it back, so a resumed
      fp8_delayed run continues from the saved scales and histories.
    - The library's sequences (prepared programs, recipe state, weight copies) are freed when the module is.
    - ``copy.deepcopy`` (and pickling) gives an independent module: new sequences, a copy of the state.
    """

    def _jf_define(self) -> None:
        super()._jf_define()
        keys = sorted({k for by_dtype in self._jf_keys.values() for k in by_dtype.values()})
        self._jf_finalizer = weakref.finalize(self, forget, keys)

    def _jf_state_programs(self, create: bool) -> List[DeviceProgram]:
        """The programs holding this module's recipe state on its parameters' device (train mode first)."""
        dev = torch.device(self._param_device())
        if dev.type != "cuda":
            return []
        di = dev.index if dev.index is not None else torch.cuda.current_device()
        out = []
        for training in (True, False):
            key = self._jf_keys[training][torch.bfloat16]
            p = _programs.get((key, di))
            if p is None and create:
                p = device_program(key, di)
            if p is not None and p not in out:
                out.append(p)
        return out

    def get_extra_state(self) -> Any:
        progs = self._jf_state_programs(create=False)
        if not progs:
            return getattr(self, "_jf_pending_state", None)
        blocks = {k: v.detach().cpu().clone() for k, v in progs[0].fp8_state_views().items()}
        return {"format": FP8_STATE_FORMAT, "recipe": self.recipe, "blocks": blocks}

    def set_extra_state(self, state: Any) -> None:
        if state is None:
            return
        if not isinstance(state, dict) or state.get("format") != FP8_STATE_FORMAT:
            raise ValueError(f"{self.name}: the checkpoint's _extra_state is not jitfuse FP8 recipe state "
                             f"(format {FP8_STATE_FORMAT!r}); got {type(state).__name__}")
        if state.get("recipe") != self.recipe:
            raise ValueError(f"{self.name}: the checkpoint's FP8 state is of recipe {state.get('recipe')!r}, "
                             f"this module runs {self.recipe!r}")
        progs = self._jf_state_programs(create=True)
        if not progs:  # parameters not on a GPU yet: applied when the module moves to one (_apply)
            self._jf_pending_state = state
            return
        blocks = state.get("blocks")
        blocks = blocks if isinstance(blocks, dict) else {}
        views = [p.fp8_state_views() for p in progs]
        for vs in views:  # everything checked before anything is written: a bad checkpoint changes nothing
            if set(vs) != set(blocks):
                raise ValueError(f"{self.name}: the checkpoint's FP8 state has tensors {sorted(blocks)}, this "
                                 f"module has {sorted(vs)} (a different sequence?)")
            for k, v in vs.items():
                t = blocks[k]
                if not isinstance(t, Tensor) or tuple(t.shape) != tuple(v.shape) or not t.is_floating_point():
                    raise ValueError(f"{self.name}: FP8 state {k!r}: expected a float32 tensor of shape "
                                     f"{list(v.shape)} ([scale, scale_inv, amax_history]), got "
                                     f"{list(t.shape) if isinstance(t, Tensor) else type(t).__name__}")
        for vs in views:
            for k, v in vs.items():
                v.copy_(blocks[k].to(device=v.device, dtype=torch.float32))  # stream-ordered, current stream
        self._jf_pending_state = None

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        pending = getattr(self, "_jf_pending_state", None)
        if pending is not None and torch.device(self._param_device()).type == "cuda":
            self.set_extra_state(pending)
        return out

    def __getstate__(self) -> Dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_jf_finalizer", None)
        state["_jf_pending_state"] = self.get_extra_state()
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        pending = state.pop("_jf_pending_state", None)
        super().__setstate__(state)
        self._jf_define()  # a fresh salt: own sequences, own recipe state
        self._jf_pending_state = None
        if pending is not None:
            self.set_extra_state(pending)


def export_definitions(model: nn.Module, path: Any) -> int:
    """Writes the sequence definitions of every :class:`Sequential` in ``model`` (both modes, every dtype) to
    ``path``, for a host that runs an exported model without this package: the C++ ops read the file named in
    ``$JITFUSE_TORCH_SEQUENCES`` (or ``jitfuse_torch::load_definitions(path)``) to know what each key of the
    graph's ``jitfuse::forward`` calls means. Returns how many definitions it wrote (docs/deploy.md).

    Warns (:class:`jitfuse.StaticLibstdcxxWarning`) when the compiler Inductor builds packages with links part of
    libstdc++ statically: the package beside these definitions would crash when loaded (docs/deploy.md)."""
    from .. import _toolchain
    from ._registry import write_definitions
    _toolchain.warn_if_static("export_definitions")
    keys = [k for m in model.modules() if isinstance(m, Sequential)
            for by_dtype in m._jf_keys.values() for k in by_dtype.values()]
    return write_definitions(str(path), keys)
