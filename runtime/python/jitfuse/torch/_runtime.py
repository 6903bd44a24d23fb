# The PyTorch side of a jitfuse call: sequence definitions by content key, one prepared program per
# (key, device), DLTensor argument blocks cached per (shape, training, thread), and the two custom ops.
"""Custom ops ``jitfuse::forward`` / ``jitfuse::backward`` and the programs behind them.

One op pair for every sequence, not one registration per sequence: the sequence is the op's first
argument, an int ``key`` (a hash of the sequence's ops, recipe and parameter list). So

- the op set is fixed (opcheck, export and the FX graph cache see two stable ops, not one per module),
- the key is the same in every process for the same sequence, so Inductor's on-disk FX graph cache
  never binds a cached graph to another sequence,
- identical modules share one prepared jf_sequence (ABI 2 takes every tensor per call, and a sequence
  may be run from several threads at once), except under FP8 recipes whose recipe state is per
  sequence (their key is salted per module).
"""

import ctypes
import hashlib
import json
import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from .. import _abi
from ..errors import JitfuseError
from ..lib import Context, ProgramInfo, Sequence

# ----------------------------------------------------------------------------------------------------
# dtypes

_TORCH_TO_DL: Dict[torch.dtype, Tuple[int, int]] = {
    torch.float32: (_abi.kDLFloat, 32), torch.float16: (_abi.kDLFloat, 16), torch.bfloat16: (_abi.kDLBfloat, 16),
    torch.uint8: (_abi.kDLUInt, 8), torch.int64: (_abi.kDLInt, 64),
}
_DL_TO_TORCH: Dict[Tuple[int, int], torch.dtype] = {v: k for k, v in _TORCH_TO_DL.items()}
if hasattr(torch, "float8_e4m3fn"):
    _DL_TO_TORCH[(_abi.kDLFloat8_e4m3fn, 8)] = torch.float8_e4m3fn
    _TORCH_TO_DL[torch.float8_e4m3fn] = (_abi.kDLFloat8_e4m3fn, 8)

RECIPE_OF_DTYPE: Dict[torch.dtype, str] = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
FP8_RECIPES = ("fp8_delayed", "fp8_current")


def torch_dtype(dl: Tuple[int, int, int]) -> torch.dtype:
    try:
        return _DL_TO_TORCH[(dl[0], dl[1])]
    except KeyError:
        raise JitfuseError(f"jitfuse reported a tensor of DLPack dtype {dl} that PyTorch cannot hold") from None


# ----------------------------------------------------------------------------------------------------
# Definitions (what a key means) and programs (a key prepared on a device)


@dataclass(frozen=True)
class Definition:
    key: int
    name: str
    ops: Tuple[str, ...]                            # JSON of each op dict (hashable, canonical)
    recipe: str
    params: Tuple[Tuple[int, str], ...]             # (op index, ABI name) in the order the op receives them
    param_shapes: Tuple[Tuple[int, ...], ...]
    accumulate: Tuple[bool, ...]                    # gradient is added to (linear accumulate_grad)
    n_extra_inputs: int
    n_extra_outputs: int
    uses_rng: bool

    def document(self) -> Dict[str, Any]:
        return {"format": "jitfuse.sequence/1", "name": self.name, "ops": [json.loads(o) for o in self.ops]}


_registry_lock = threading.RLock()
_definitions: Dict[int, Definition] = {}
_programs: Dict[Tuple[int, int], "Program"] = {}
_contexts: Dict[int, Context] = {}


def define(name: str, ops: List[Dict[str, Any]], recipe: str, params: List[Tuple[int, str]],
           param_shapes: List[Tuple[int, ...]], accumulate: List[bool], n_extra_inputs: int, n_extra_outputs: int,
           uses_rng: bool, salt: str = "") -> int:
    """Registers a sequence definition and returns its key (a positive int64)."""
    canon = tuple(json.dumps(o, sort_keys=True) for o in ops)
    blob = json.dumps([list(canon), recipe, params, [list(s) for s in param_shapes], accumulate, salt])
    key = int(hashlib.sha256(blob.encode()).hexdigest()[:15], 16)  # 60 bits: a positive int64
    d = Definition(key, name, canon, recipe, tuple((int(i), str(n)) for i, n in params),
                   tuple(tuple(int(x) for x in s) for s in param_shapes), tuple(bool(a) for a in accumulate),
                   n_extra_inputs, n_extra_outputs, uses_rng)
    with _registry_lock:
        old = _definitions.get(key)
        if old is not None and old != d:
            raise JitfuseError(f"jitfuse.torch: sequence key collision for {name!r}")
        _definitions[key] = d
    return key


def context(device_index: int) -> Context:
    """The jitfuse context of a device (-1: one for planning only, e.g. explain on a CPU machine)."""
    with _registry_lock:
        ctx = _contexts.get(device_index)
        if ctx is None:
            ctx = _contexts[device_index] = Context()
        return ctx


def program(key: int, device_index: int) -> "Program":
    p = _programs.get((key, device_index))
    if p is not None:
        return p
    with _registry_lock:
        p = _programs.get((key, device_index))
        if p is None:
            d = _definitions.get(key)
            if d is None:
                raise JitfuseError(f"jitfuse: unknown sequence key {key}: the module that defined it was not "
                                   f"created in this process")
            p = _programs[(key, device_index)] = Program(d, device_index)
        return p


def existing_programs(key: int) -> List["Program"]:
    with _registry_lock:
        return [p for (k, _), p in _programs.items() if k == key]


def _raw_stream(dev: torch.device) -> int:
    """The current CUDA stream of ``dev`` as an integer handle (what ``torch.cuda.current_stream(dev).cuda_stream``
    returns, without building a Stream object: ~0.3 us instead of ~6 us per call on an H100 host)."""
    get = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if get is not None:
        return get(dev.index if dev.index is not None else torch.cuda.current_device())
    return torch.cuda.current_stream(dev).cuda_stream


def _device_index(t: Tensor) -> int:
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


class _Slot:
    """A DLTensor of a fixed shape and dtype whose data pointer is set per call."""
    __slots__ = ("dl", "shape")

    def __init__(self, shape: Tuple[int, ...], dl_dtype: Tuple[int, int], device_index: int):
        self.shape = (ctypes.c_int64 * len(shape))(*shape)
        self.dl = _abi.DLTensor()
        self.dl.device = _abi.DLDevice(_abi.kDLCUDA, device_index)
        self.dl.ndim = len(shape)
        self.dl.dtype = _abi.DLDataType(dl_dtype[0], dl_dtype[1], 1)
        self.dl.shape = ctypes.cast(self.shape, ctypes.POINTER(ctypes.c_int64))
        self.dl.byte_offset = 0


def _slots(shapes: List[Tuple[int, ...]], dtypes: List[Tuple[int, int]], dev: int) -> List[_Slot]:
    return [_Slot(s, d, dev) for s, d in zip(shapes, dtypes)]


def _ptr_array(slots: List[_Slot]) -> Any:
    arr = (ctypes.POINTER(_abi.DLTensor) * max(len(slots), 1))()
    for i, s in enumerate(slots):
        arr[i] = ctypes.pointer(s.dl)
    return arr


def _param_array(names: List[Tuple[int, bytes]], slots: List[_Slot]) -> Any:
    arr = (_abi.jf_param * max(len(slots), 1))()
    for i, ((op, name), s) in enumerate(zip(names, slots)):
        arr[i].op_index = op
        arr[i].name = name
        arr[i].tensor = ctypes.pointer(s.dl)
    return arr


class _ForwardCall:
    """jf_forward_args for one (input shape, training), with a slot per tensor."""

    def __init__(self, prog: "Program", info: ProgramInfo, x: Tensor, extras: List[Tensor], params: List[Tensor],
                 training: bool):
        dev = prog.device_index
        dt = _TORCH_TO_DL[x.dtype]
        self.input = _Slot(tuple(x.shape), dt, dev)
        self.extras = _slots([tuple(e.shape) for e in extras], [_TORCH_TO_DL[e.dtype] for e in extras], dev)
        self.output = _Slot(info.outputs[0].shape, info.outputs[0].dl_dtype[:2], dev)
        self.extra_outs = _slots([o.shape for o in info.outputs[1:]], [o.dl_dtype[:2] for o in info.outputs[1:]], dev)
        self.params = _slots([tuple(p.shape) for p in params], [_TORCH_TO_DL[p.dtype] for p in params], dev)
        self._arrays = (_ptr_array(self.extras), _ptr_array(self.extra_outs), _param_array(prog.names, self.params))
        a = self.args = _abi.jf_forward_args()
        a.input = ctypes.pointer(self.input.dl)
        a.extra_inputs = ctypes.cast(self._arrays[0], ctypes.POINTER(ctypes.POINTER(_abi.DLTensor)))
        a.n_extra_inputs = len(self.extras)
        a.output = ctypes.pointer(self.output.dl)
        a.extra_outputs = ctypes.cast(self._arrays[1], ctypes.POINTER(ctypes.POINTER(_abi.DLTensor)))
        a.n_extra_outputs = len(self.extra_outs)
        a.params = ctypes.cast(self._arrays[2], ctypes.POINTER(_abi.jf_param))
        a.n_params = len(self.params)
        a.training = int(training)
        a.saved_bytes = info.saved_bytes if training else 0
        a.workspace_bytes = info.forward_workspace_bytes


class _BackwardCall:
    """jf_backward_args for one (input shape), with a slot per tensor."""

    def __init__(self, prog: "Program", info: ProgramInfo, x: Tensor, extras: List[Tensor], params: List[Tensor]):
        dev = prog.device_index
        dt = _TORCH_TO_DL[x.dtype]
        out_dt = [o.dl_dtype[:2] for o in info.outputs]
        self.input = _Slot(tuple(x.shape), dt, dev)
        self.extras = _slots([tuple(e.shape) for e in extras], [dt] * len(extras), dev)
        self.output = _Slot(info.outputs[0].shape, out_dt[0], dev)
        self.extra_outs = _slots([o.shape for o in info.outputs[1:]], out_dt[1:], dev)
        self.params = _slots([tuple(p.shape) for p in params], [_TORCH_TO_DL[p.dtype] for p in params], dev)
        self.grad_output = _Slot(info.outputs[0].shape, dt, dev)
        self.grad_extra_outs = _slots([o.shape for o in info.outputs[1:]], [dt] * (len(info.outputs) - 1), dev)
        self.grad_input = _Slot(tuple(x.shape), dt, dev)
        self.grad_extras = _slots([tuple(e.shape) for e in extras], [dt] * len(extras), dev)
        self.grads = _slots([tuple(p.shape) for p in params], [_TORCH_TO_DL[p.dtype] for p in params], dev)
        self._arrays = (_ptr_array(self.extras), _ptr_array(self.extra_outs), _param_array(prog.names, self.params),
                        _ptr_array(self.grad_extra_outs), _ptr_array(self.grad_extras),
                        _param_array(prog.names, self.grads))
        pp = ctypes.POINTER(ctypes.POINTER(_abi.DLTensor))
        a = self.args = _abi.jf_backward_args()
        a.input = ctypes.pointer(self.input.dl)
        a.extra_inputs = ctypes.cast(self._arrays[0], pp)
        a.n_extra_inputs = len(self.extras)
        a.output = ctypes.pointer(self.output.dl)
        a.extra_outputs = ctypes.cast(self._arrays[1], pp)
        a.n_extra_outputs = len(self.extra_outs)
        a.params = ctypes.cast(self._arrays[2], ctypes.POINTER(_abi.jf_param))
        a.n_params = len(self.params)
        a.saved_bytes = info.saved_bytes
        a.grad_output = ctypes.pointer(self.grad_output.dl)
        a.grad_extra_outputs = ctypes.cast(self._arrays[3], pp)
        a.n_grad_extra_outputs = len(self.grad_extra_outs)
        a.grad_input = ctypes.pointer(self.grad_input.dl)
        a.grad_extra_inputs = ctypes.cast(self._arrays[4], pp)
        a.n_grad_extra_inputs = len(self.grad_extras)
        a.grads = ctypes.cast(self._arrays[5], ctypes.POINTER(_abi.jf_param))
        a.n_grads = len(self.grads)
        a.workspace_bytes = info.backward_workspace_bytes


class Program:
    """A Definition's jf_sequence in the jitfuse context of one device, with its prepared shapes."""

    def __init__(self, d: Definition, device_index: int):
        self.definition = d
        self.device_index = device_index
        self.sequence = Sequence(context(device_index), d.document(), d.recipe)
        self.names = [(i, n.encode()) for i, n in d.params]
        self.last_shape: Optional[Tuple[int, ...]] = None
        self._tls = threading.local()
        self._lib = self.sequence.lib
        self._cdll = self._lib.cdll

    def info(self, shape: Tuple[int, ...], training: bool) -> ProgramInfo:
        """The prepared program of (shape, training); prepares it (plan, compile or load) on first use.
        Preparing cannot happen inside a CUDA-graph capture: run the shape once (or Sequential.prepare)
        before capturing."""
        info = self.sequence.cached_info(shape, training)
        if info is not None:
            return info
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise JitfuseError(
                f"jitfuse: sequence {self.definition.name!r} is not prepared for input {list(shape)} "
                f"({'training' if training else 'inference'}) and a CUDA graph is being captured; run it once "
                f"with this shape, or call Sequential.prepare(shape), before the capture")
        with torch.cuda.device(self.device_index):
            info = self.sequence.info(shape, training)
        self._validate(info)
        return info

    def _validate(self, info: ProgramInfo) -> None:
        d = self.definition
        mine = {(i, n): s for (i, n), s in zip(d.params, d.param_shapes)}
        theirs = {(p.op_index, p.name): p.shape for p in info.params}
        if set(mine) != set(theirs):
            raise JitfuseError(f"jitfuse.torch: sequence {d.name!r}: the module's parameters {sorted(mine)} differ "
                               f"from the library's {sorted(theirs)}")
        for k, s in mine.items():
            if tuple(theirs[k]) != tuple(s):
                raise JitfuseError(f"jitfuse.torch: sequence {d.name!r}: op {k[0]} {k[1]} has shape {list(s)} in the "
                                   f"module but the library expects {list(theirs[k])}")
        if len(info.outputs) != 1 + d.n_extra_outputs:
            raise JitfuseError(f"jitfuse.torch: sequence {d.name!r}: {len(info.outputs) - 1} extra outputs, "
                               f"expected {d.n_extra_outputs}")
        if info.uses_rng and info.rng_offset_advance != 1:
            raise JitfuseError(f"jitfuse.torch: sequence {d.name!r} advances the Philox offset by "
                               f"{info.rng_offset_advance} per call; this package assumes 1")

    def _calls(self) -> Dict[Any, Any]:
        c = getattr(self._tls, "calls", None)
        if c is None:
            c = self._tls.calls = {}
        return c

    # -- the kernels of the custom ops ----------------------------------------------------------

    def forward(self, x: Tensor, extras: List[Tensor], params: List[Tensor], rng_state: Optional[Tensor],
                training: bool, with_saved: bool = True) -> List[Tensor]:
        """[output, *extra_outputs, saved]; without ``with_saved`` (inference called directly, not as the
        op) the trailing saved buffer is left out."""
        if x.device.index is not None and x.device.index != torch.cuda.current_device():
            with torch.cuda.device(x.device):  # jitfuse works in the current CUDA context
                return self.forward(x, extras, params, rng_state, training, with_saved)
        shape = tuple(x.shape)
        info = self.info(shape, training)
        calls = self._calls()
        ck = ("f", shape, training)
        c = calls.get(ck)
        if c is None:
            c = calls[ck] = _ForwardCall(self, info, x, extras, params, training)
        dev = x.device
        out = torch.empty(info.outputs[0].shape, dtype=torch_dtype(info.outputs[0].dl_dtype), device=dev)
        extra_outs = [torch.empty(o.shape, dtype=torch_dtype(o.dl_dtype), device=dev) for o in info.outputs[1:]]
        saved = (torch.empty((info.saved_bytes if training else 0,), dtype=torch.uint8, device=dev)
                 if with_saved else None)
        ws = (torch.empty((info.forward_workspace_bytes,), dtype=torch.uint8, device=dev)
              if info.forward_workspace_bytes else None)
        c.input.dl.data = x.data_ptr()
        for s, t in zip(c.extras, extras):
            s.dl.data = t.data_ptr()
        c.output.dl.data = out.data_ptr()
        for s, t in zip(c.extra_outs, extra_outs):
            s.dl.data = t.data_ptr()
        for s, t in zip(c.params, params):
            s.dl.data = t.data_ptr()
        a = c.args
        a.rng_state = rng_state.data_ptr() if rng_state is not None else None
        a.saved = saved.data_ptr() if training and info.saved_bytes else None
        a.workspace = ws.data_ptr() if ws is not None else None
        stream = _raw_stream(dev)
        handle = _abi.jf_saved()
        status = self._cdll.jf_forward(self.sequence.handle, ctypes.byref(a), ctypes.byref(handle), stream)
        if status:
            self._lib.check(status, "jf_forward")
        if handle.value:  # only when training with nothing to save (saved_bytes == 0): nothing is in it
            self._cdll.jf_saved_release(handle, stream)
        self.last_shape = shape
        return [out, *extra_outs, saved] if with_saved else [out, *extra_outs]

    def backward(self, x: Tensor, extras: List[Tensor], output: Tensor, extra_outputs: List[Tensor],
                 params: List[Tensor], saved: Tensor, grad_output: Tensor,
                 grad_extra_outputs: List[Tensor]) -> List[Tensor]:
        if x.device.index is not None and x.device.index != torch.cuda.current_device():
            with torch.cuda.device(x.device):
                return self.backward(x, extras, output, extra_outputs, params, saved, grad_output,
                                     grad_extra_outputs)
        shape = tuple(x.shape)
        info = self.info(shape, True)
        if saved.numel() != info.saved_bytes:
            raise JitfuseError(f"jitfuse: the saved buffer has {saved.numel()} bytes, the program of input "
                               f"{list(shape)} saves {info.saved_bytes}: was the forward run with training=True?")
        calls = self._calls()
        ck = ("b", shape)
        c = calls.get(ck)
        if c is None:
            c = calls[ck] = _BackwardCall(self, info, x, extras, params)
        dev = x.device
        grad_input = torch.empty_like(x)
        grad_extras = [torch.empty_like(e) for e in extras]
        grads = [torch.zeros_like(p) if acc else torch.empty_like(p)
                 for p, acc in zip(params, self.definition.accumulate)]
        ws = (torch.empty((info.backward_workspace_bytes,), dtype=torch.uint8, device=dev)
              if info.backward_workspace_bytes else None)
        for slots, tensors in ((c.extras, extras), (c.extra_outs, extra_outputs), (c.params, params),
                               (c.grad_extra_outs, grad_extra_outputs), (c.grad_extras, grad_extras),
                               (c.grads, grads)):
            for s, t in zip(slots, tensors):
                s.dl.data = t.data_ptr()
        c.input.dl.data = x.data_ptr()
        c.output.dl.data = output.data_ptr()
        c.grad_output.dl.data = grad_output.data_ptr()
        c.grad_input.dl.data = grad_input.data_ptr()
        a = c.args
        a.saved = saved.data_ptr() if info.saved_bytes else None
        a.workspace = ws.data_ptr() if ws is not None else None
        stream = _raw_stream(dev)
        status = self._cdll.jf_backward(self.sequence.handle, ctypes.byref(a), stream)
        if status:
            self._lib.check(status, "jf_backward")
        return [grad_input, *grad_extras, *grads]


# ----------------------------------------------------------------------------------------------------
# The custom ops. No `from __future__ import annotations` in this file: infer_schema reads these hints.


def _concrete(shape: Any) -> Tuple[int, ...]:
    # A symbolic dim is specialised (int() guards on it): programs are prepared per concrete shape.
    return tuple(int(d) for d in shape)


# The two ops are defined with torch.library.Library (define + impl) rather than torch.library.custom_op:
# both give the same schema, fake kernels and autograd registration, but custom_op's Python wrapper cost
# about 175 us per call on an H100 host (cProfile of a bias+gelu step, 2026-11-23), more than the rest of
# the call together.
_LIB = torch.library.Library("jitfuse", "DEF")
_LIB.define("forward(int key, Tensor input, Tensor[] extra_inputs, Tensor[] params, Tensor? rng_state, "
            "bool training) -> Tensor[]")
_LIB.define("backward(int key, Tensor input, Tensor[] extra_inputs, Tensor output, Tensor[] extra_outputs, "
            "Tensor[] params, Tensor saved, Tensor grad_output, Tensor[] grad_extra_outputs) -> Tensor[]")


def forward_op(key: int, input: Tensor, extra_inputs: List[Tensor], params: List[Tensor],
               rng_state: Optional[Tensor], training: bool) -> List[Tensor]:
    """Runs a jitfuse sequence forward. Returns [output, *extra_outputs, saved] where ``saved`` is the
    uint8 saved-for-backward buffer (empty unless ``training``). ``rng_state``: int64 CUDA tensor
    {seed, offset} that the dropout ops read (not written)."""
    return program(key, _device_index(input)).forward(input, list(extra_inputs), list(params), rng_state, training)


def forward_direct(key: int, input: Tensor, extra_inputs: List[Tensor], params: List[Tensor],
                   rng_state: Optional[Tensor]) -> List[Tensor]:
    """Inference in eager mode without the custom op (no dispatcher, no saved buffer): what
    ``jitfuse::forward(..., training=False)`` computes, returned as [output, *extra_outputs, <unused>]
    so callers index it like the op's result."""
    outs = program(key, _device_index(input)).forward(input, extra_inputs, params, rng_state, False, with_saved=False)
    outs.append(None)
    return outs


def _forward_fake(key, input, extra_inputs, params, rng_state, training):
    info = program(key, _device_index(input)).info(_concrete(input.shape), bool(training))
    outs = [input.new_empty(o.shape, dtype=torch_dtype(o.dl_dtype)) for o in info.outputs]
    return outs + [input.new_empty((info.saved_bytes if training else 0,), dtype=torch.uint8)]


def backward_op(key: int, input: Tensor, extra_inputs: List[Tensor], output: Tensor, extra_outputs: List[Tensor],
                params: List[Tensor], saved: Tensor, grad_output: Tensor,
                grad_extra_outputs: List[Tensor]) -> List[Tensor]:
    """The backward of ``jitfuse::forward``: returns [grad_input, *grad_extra_inputs, *grad_params]."""
    return program(key, _device_index(input)).backward(input, list(extra_inputs), output, list(extra_outputs),
                                                       list(params), saved, grad_output, list(grad_extra_outputs))


def _backward_fake(key, input, extra_inputs, output, extra_outputs, params, saved, grad_output, grad_extra_outputs):
    return [torch.empty_like(input), *[torch.empty_like(e) for e in extra_inputs],
            *[torch.empty_like(p) for p in params]]


class _Forward(torch.autograd.Function):
    """The autograd node of ``jitfuse::forward``. Tensor lists are flattened into ``apply``'s arguments
    (autograd tracks positional tensors only): (key, training, n_extra_inputs, n_params, rng_state,
    input, *extra_inputs, *params)."""

    @staticmethod
    def forward(ctx, key, training, ne, npar, rng_state, x, *tensors):  # type: ignore[override]
        extras, params = list(tensors[:ne]), list(tensors[ne:ne + npar])
        with torch._C._AutoDispatchBelowAutograd():
            outs = torch.ops.jitfuse.forward.default(key, x, extras, params, rng_state, training)
        ctx.key, ctx.training, ctx.ne, ctx.npar, ctx.neo = key, bool(training), ne, npar, len(outs) - 2
        if training:
            ctx.save_for_backward(x, *extras, *params, *outs)
        ctx.mark_non_differentiable(outs[-1])
        # No zero-filled gradient for the saved buffer (autograd would allocate and fill one per step).
        ctx.set_materialize_grads(False)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        if not ctx.training:
            raise RuntimeError("jitfuse: backward through a forward that ran with training=False (no saved context)")
        saved_tensors = ctx.saved_tensors
        ne, npar, neo = ctx.ne, ctx.npar, ctx.neo
        x = saved_tensors[0]
        extras = list(saved_tensors[1:1 + ne])
        params = list(saved_tensors[1 + ne:1 + ne + npar])
        outs = saved_tensors[1 + ne + npar:]
        output, extra_outputs, saved = outs[0], list(outs[1:1 + neo]), outs[1 + neo]
        # Autograd may hand in None (unused output) or expanded / non-contiguous gradients.
        gl = [g.contiguous() if g is not None else torch.zeros_like(o)
              for g, o in zip(grads[:1 + neo], [output, *extra_outputs])]
        res = torch.ops.jitfuse.backward.default(ctx.key, x, extras, output, extra_outputs, params, saved, gl[0], gl[1:])
        return (None, None, None, None, None, *res)


def _forward_autograd(keyset, key, input, extra_inputs, params, rng_state, training):
    # The Autograd kernel of jitfuse::forward: what torch.library.register_autograd registers, without
    # its generic argument handling (pytree flatten/unflatten, default filling), which took ~280 us of
    # host time per call on an H100 host (torch.profiler, bias + gelu at M = 16, 2026-11-24).
    if torch.is_grad_enabled() and (input.requires_grad or any(t.requires_grad for t in extra_inputs)
                                    or any(p.requires_grad for p in params)):
        return list(_Forward.apply(key, training, len(extra_inputs), len(params), rng_state, input,
                                   *extra_inputs, *params))
    with torch._C._AutoDispatchBelowAutograd():
        return torch.ops.jitfuse.forward.default.redispatch(keyset & torch._C._after_autograd_keyset, key, input,
                                                            extra_inputs, params, rng_state, training)


_LIB.impl("forward", forward_op, "CUDA")
_LIB.impl("backward", backward_op, "CUDA")
torch.library.register_fake("jitfuse::forward", _forward_fake, lib=_LIB)
torch.library.register_fake("jitfuse::backward", _backward_fake, lib=_LIB)
_LIB.impl("forward", _forward_autograd, "Autograd", with_keyset=True)
