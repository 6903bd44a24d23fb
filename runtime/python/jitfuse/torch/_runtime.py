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
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple
from typing import Sequence as Sequence_

import torch
from torch import Tensor

from .. import _abi
from ..errors import JitfuseError
from ..lib import Context, ProgramInfo, Sequence
from .float8 import Float8Tensor

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
    name: str = field(compare=False)                # a label only: equal sequences under two names are one
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
    # The name is not hashed: identical sequences share one key (and one prepared program) under any name.
    d = Definition(key, name, canon, recipe, tuple((int(i), str(n)) for i, n in params),
                   tuple(tuple(int(x) for x in s) for s in param_shapes), tuple(bool(a) for a in accumulate),
                   n_extra_inputs, n_extra_outputs, uses_rng)
    with _registry_lock:
        old = _definitions.get(key)
        if old is not None and old != d:
            raise JitfuseError(f"jitfuse.torch: sequence key collision: {name!r} and {old.name!r} hash to the same "
                               f"key but differ (a 60-bit sha256 prefix collided: please report it)")
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


def forget(keys: Sequence_[int]) -> None:
    """Drops the definitions of ``keys`` and closes their programs (the library's sequences: prepared
    programs, FP8 recipe state and weight copies). For a module whose keys are its own (FP8, salted per
    module): called when it is garbage-collected. The library's free waits for work still using the memory."""
    with _registry_lock:
        for k in keys:
            _definitions.pop(k, None)
        progs = [_programs.pop(kd) for kd in [kd for kd in _programs if kd[0] in keys]]
    for p in progs:
        try:
            p.close()
        except Exception:  # interpreter shutdown: the library may be gone already
            pass


class _Fp8Promise(threading.local):
    active = False


_fp8_promise = _Fp8Promise()


class fp8_weights_unchanged:
    """Context manager: the caller promises that no weight of an FP8 :class:`Sequential` changed since its
    last forward (TransformerEngine's ``is_first_microbatch=False``): forwards in this scope, on this thread,
    reuse the FP8 weight copies instead of casting the weights again. Outside it every forward casts, whatever
    wrote the weights (an optimizer, fused or not, NCCL, ``.data``, DLPack). jitfuse still casts when it never
    cast a weight or a weight's pointer changed, and always inside a CUDA-graph capture (a replay re-casts).

    >>> for i, micro in enumerate(microbatches):
    ...     with jt.fp8_weights_unchanged() if i else contextlib.nullcontext():
    ...         loss = model(micro).sum()
    """

    def __enter__(self) -> "fp8_weights_unchanged":
        self._was = _fp8_promise.active
        _fp8_promise.active = True
        return self

    def __exit__(self, *exc: Any) -> None:
        _fp8_promise.active = self._was


def existing_programs(key: int) -> List["Program"]:
    with _registry_lock:
        return [p for (k, _), p in _programs.items() if k == key]


# ----------------------------------------------------------------------------------------------------
# Per-call helpers. Host time per call is the point of this file (issue 12): each of these was measured
# (tools/torch_baselines/host_overhead.py, docs/benchmarks.md) and replaces a slower equivalent.

_cuda_get_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
_get_raw_stream = (getattr(torch._C, "_cuda_getCurrentRawStream", None)
                   or (lambda device_index: torch.cuda.current_stream(device_index).cuda_stream))
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or torch.cuda.is_current_stream_capturing
_dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", None) or (lambda: 0)
_profiling = (getattr(torch.autograd, "_profiler_enabled", None)
              or getattr(getattr(torch._C, "_autograd", None), "_profiler_enabled", None) or (lambda: False))
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", None) or (lambda: False)
_empty = torch.empty
_empty_like = torch.empty_like
_uint8 = torch.uint8
_Parameter = torch.nn.Parameter


def _raw_stream(device_index: int) -> int:
    """The current CUDA stream of a device as an integer handle (what ``torch.cuda.current_stream(dev).cuda_stream``
    returns, without building a Stream object: ~0.3 us instead of ~6 us per call on an H100 host)."""
    return _get_raw_stream(device_index)


def _device_index(t: Tensor) -> int:
    """The CUDA device of a real tensor (get_device(): an int, no torch.device object)."""
    i = t.get_device()
    return i if i >= 0 else _cuda_get_device()


def _traced_device_index(t: Tensor) -> int:
    """The device of a fake or traced tensor (its .device; get_device() would read the meta device)."""
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


# Per-call workspaces (cuBLASLt's 32 MiB for any sequence with a GEMM, the arena of temporaries) up to
# this size are kept, one buffer per (device, stream) grown to the largest asked for, instead of a
# torch.empty per call: the calls of one stream run one after the other on the GPU, so they can share
# it (and a buffer replaced by a larger one is freed stream-ordered, on the stream that used it). Larger
# workspaces (large inputs, where one allocation is nothing beside the GPU work) and calls captured
# into a CUDA graph (whose memory must come from the graph's pool) allocate per call.
WORKSPACE_CACHE_MAX_BYTES = 64 << 20
_workspaces: Dict[Tuple[int, int], Tensor] = {}


def _workspace(nbytes: int, device_index: int, stream: int, device: torch.device) -> Tensor:
    if nbytes <= WORKSPACE_CACHE_MAX_BYTES and not _capturing():
        ws = _workspaces.get((device_index, stream))
        if ws is None or ws.numel() < nbytes:
            ws = _workspaces[(device_index, stream)] = _empty((nbytes,), dtype=_uint8, device=device)
        return ws
    return _empty((nbytes,), dtype=_uint8, device=device)


def direct_call_ok(x: Tensor, extras: Sequence_[Tensor], params: Sequence_[Tensor]) -> bool:
    """Whether a call may skip the dispatcher and run the program directly: nothing that must see the op
    is active (no TorchDispatchMode such as FakeTensorMode or make_fx, no profiler, no functorch transform),
    every tensor is a plain torch.Tensor (or Parameter), ``x`` is on a CUDA device, and every other tensor
    has its dtype and device (the checks the op makes on its arguments, folded into the same pass). The
    caller checks torch.compiler.is_compiling() first (under Dynamo this function is never traced)."""
    if _dispatch_modes() or _profiling() or _functorch_active():
        return False
    tt = type(x)
    if tt is not Tensor and tt is not _Parameter:
        return False
    dt, di = x.dtype, x.get_device()
    if di < 0:
        return False
    for ts in (extras, params):
        for t in ts:
            tt = type(t)
            if (tt is not Tensor and tt is not _Parameter) or t.dtype is not dt or t.get_device() != di:
                return False
    return True


def _dl_block(specs: List[Tuple[Tuple[int, ...], Tuple[int, int]]], device_index: int) -> Tuple[Any, List[Any], Any]:
    """DLTensors of fixed shapes and dtypes, contiguous in one ctypes array: (array, [DLTensor views], keep).
    Their data pointers are set per call."""
    arr = (_abi.DLTensor * max(len(specs), 1))()
    keep = []
    dls = []
    for i, (shape, dt) in enumerate(specs):
        dims = (ctypes.c_int64 * len(shape))(*shape)
        keep.append(dims)
        d = arr[i]
        d.device = _abi.DLDevice(_abi.kDLCUDA, device_index)
        d.ndim = len(shape)
        d.dtype = _abi.DLDataType(dt[0], dt[1], 1)
        d.shape = ctypes.cast(dims, ctypes.POINTER(ctypes.c_int64))
        d.byte_offset = 0
        dls.append(d)
    return arr, dls[:len(specs)], keep


def _ptrs(arr: Any, first: int, n: int) -> Any:
    """A DLTensor* array pointing at arr[first:first + n]."""
    out = (ctypes.POINTER(_abi.DLTensor) * max(n, 1))()
    for i in range(n):
        out[i] = ctypes.pointer(arr[first + i])
    return out


def _params(names: List[Tuple[int, bytes]], arr: Any, first: int) -> Any:
    out = (_abi.jf_param * max(len(names), 1))()
    for i, (op, name) in enumerate(names):
        out[i].op_index = op
        out[i].name = name
        out[i].tensor = ctypes.pointer(arr[first + i])
    return out


class _ForwardCall:
    """Everything a forward of one (input shape, training) needs that does not change per call: the
    jf_forward_args with one DLTensor per tensor (only data pointers are set per call), and what to
    allocate (shape, dtype) for the outputs, the saved buffer and the workspace."""

    def __init__(self, prog: "Program", info: ProgramInfo, x: Tensor, extras: List[Tensor], params: List[Tensor],
                 training: bool):
        dev = prog.device_index
        self.device = torch.device("cuda", dev)
        self.out_shape = tuple(info.outputs[0].shape)
        self.out_dtype = torch_dtype(info.outputs[0].dl_dtype)
        self.out_like_input = self.out_shape == tuple(x.shape) and self.out_dtype == x.dtype
        self.extra_specs = [(tuple(o.shape), torch_dtype(o.dl_dtype)) for o in info.outputs[1:]]
        self.saved_bytes = info.saved_bytes if training else 0
        self.saved_shape = (self.saved_bytes,)
        self.ws_bytes = info.forward_workspace_bytes
        self.ws_shape = (self.ws_bytes,)
        self.returns_handle = training and not self.saved_bytes  # jf_forward hands back an empty jf_saved
        ne, neo, npar = len(extras), len(info.outputs) - 1, len(params)
        specs = ([(tuple(x.shape), _TORCH_TO_DL[x.dtype])] + [(tuple(e.shape), _TORCH_TO_DL[e.dtype]) for e in extras]
                 + [(o.shape, o.dl_dtype[:2]) for o in info.outputs]
                 + [(tuple(p.shape), _TORCH_TO_DL[p.dtype]) for p in params])
        arr, self.dls, self._keep = _dl_block(specs, dev)
        # What each tensor must look like per call (None: an output this package allocates itself).
        self.shapes = ([x.shape] + [e.shape for e in extras] + [None] * (1 + neo)
                       + [torch.Size(s) for s in prog.definition.param_shapes])
        self.dtype = x.dtype
        self._keep += [arr, _ptrs(arr, 1, ne), _ptrs(arr, 2 + ne, neo), _params(prog.names, arr, 2 + ne + neo)]
        a = self.args = _abi.jf_forward_args()
        a.input = ctypes.pointer(arr[0])
        a.extra_inputs = ctypes.cast(self._keep[-3], ctypes.POINTER(ctypes.POINTER(_abi.DLTensor)))
        a.n_extra_inputs = ne
        a.output = ctypes.pointer(arr[1 + ne])
        a.extra_outputs = ctypes.cast(self._keep[-2], ctypes.POINTER(ctypes.POINTER(_abi.DLTensor)))
        a.n_extra_outputs = neo
        a.params = ctypes.cast(self._keep[-1], ctypes.POINTER(_abi.jf_param))
        a.n_params = npar
        a.training = int(training)
        a.saved_bytes = self.saved_bytes
        a.workspace_bytes = self.ws_bytes
        self.args_ref = ctypes.byref(a)
        self.handle = _abi.jf_saved()
        self.handle_ref = ctypes.byref(self.handle)


class _BackwardCall:
    """jf_backward_args for one input shape, one DLTensor per tensor, and the gradients to allocate."""

    def __init__(self, prog: "Program", info: ProgramInfo, x: Tensor, extras: List[Tensor], params: List[Tensor]):
        dev = prog.device_index
        self.device = torch.device("cuda", dev)
        self.saved_bytes = info.saved_bytes
        self.ws_bytes = info.backward_workspace_bytes
        self.ws_shape = (self.ws_bytes,)
        self.accumulate = prog.definition.accumulate
        self.any_accumulate = any(self.accumulate)
        dt = _TORCH_TO_DL[x.dtype]
        ne, neo, npar = len(extras), len(info.outputs) - 1, len(params)
        xs, es = tuple(x.shape), [tuple(e.shape) for e in extras]
        ps = [(tuple(p.shape), _TORCH_TO_DL[p.dtype]) for p in params]
        # Order: input, extras, output, extra outputs, params, grad_output, grad extra outputs, grad_input,
        # grad extras, grads (the order Program.backward lists its tensors in).
        specs = ([(xs, dt)] + [(s, dt) for s in es] + [(o.shape, o.dl_dtype[:2]) for o in info.outputs] + ps
                 + [(o.shape, dt) for o in info.outputs] + [(xs, dt)] + [(s, dt) for s in es] + ps)
        arr, self.dls, self._keep = _dl_block(specs, dev)
        at_out = 1 + ne
        at_par = at_out + 1 + neo
        at_go = at_par + npar
        at_gi = at_go + 1 + neo
        at_grads = at_gi + 1 + ne
        pp = ctypes.POINTER(ctypes.POINTER(_abi.DLTensor))
        arrays = [_ptrs(arr, 1, ne), _ptrs(arr, at_out + 1, neo), _params(prog.names, arr, at_par),
                  _ptrs(arr, at_go + 1, neo), _ptrs(arr, at_gi + 1, ne), _params(prog.names, arr, at_grads)]
        self._keep += [arr, arrays]
        a = self.args = _abi.jf_backward_args()
        a.input = ctypes.pointer(arr[0])
        a.extra_inputs = ctypes.cast(arrays[0], pp)
        a.n_extra_inputs = ne
        a.output = ctypes.pointer(arr[at_out])
        a.extra_outputs = ctypes.cast(arrays[1], pp)
        a.n_extra_outputs = neo
        a.params = ctypes.cast(arrays[2], ctypes.POINTER(_abi.jf_param))
        a.n_params = npar
        a.saved_bytes = info.saved_bytes
        a.grad_output = ctypes.pointer(arr[at_go])
        a.grad_extra_outputs = ctypes.cast(arrays[3], pp)
        a.n_grad_extra_outputs = neo
        a.grad_input = ctypes.pointer(arr[at_gi])
        a.grad_extra_inputs = ctypes.cast(arrays[4], pp)
        a.n_grad_extra_inputs = ne
        a.grads = ctypes.cast(arrays[5], ctypes.POINTER(_abi.jf_param))
        a.n_grads = npar
        a.workspace_bytes = self.ws_bytes
        self.args_ref = ctypes.byref(a)


class _Calls(threading.local):
    def __init__(self) -> None:
        self.calls: Dict[Any, Any] = {}


class Program:
    """A Definition's jf_sequence in the jitfuse context of one device, with its prepared shapes.

    FP8 recipes: the sequence keeps FP8 copies of the linear weights. Every forward casts them again
    (``jf_forward_args.fp8_weights_unchanged`` = 0) unless the caller promised, with
    :func:`jitfuse.torch.fp8_weights_unchanged`, that the weights did not change since the last forward:
    no version counter or pointer is trusted, since fused optimizers, NCCL and raw writes bypass both."""

    def __init__(self, d: Definition, device_index: int):
        self.definition = d
        self.device_index = device_index
        self.sequence = Sequence(context(device_index), d.document(), d.recipe)
        self.names = [(i, n.encode()) for i, n in d.params]
        self.last_shape: Optional[Tuple[int, ...]] = None
        self._tls = _Calls()
        self._lib = self.sequence.lib
        self._cdll = self._lib.cdll
        self._handle = self.sequence.handle
        self._jf_forward = self._cdll.jf_forward
        self._jf_backward = self._cdll.jf_backward
        self.fp8 = d.recipe in FP8_RECIPES
        self._fp8_views: Optional[Dict[str, Tensor]] = None
        # FP8 with a trailing quantize: the output is a Float8Tensor whose scale_inv is copied, per call, from
        # the quantize's state (jf_fp8_state.scale_inv: what decodes the codes this forward wrote).
        self.fp8_output = self.fp8 and bool(d.ops) and json.loads(d.ops[-1]).get("op") == "quantize"

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
        return self._tls.calls

    # -- FP8 recipe state --------------------------------------------------------------------------

    def fp8_state_views(self) -> Dict[str, Tensor]:
        """FP8: every recipe-state block of this sequence on its device, as float32 tensors aliasing the
        library's memory ([scale, scale_inv, amax_history...]), keyed "<op>.<tensor>" ("3.weight", "5.output"
        for a quantize op). Allocates the state if no prepare did yet. The views live as long as this Program."""
        views = self._fp8_views
        if views is None:
            views = {}
            with torch.cuda.device(self.device_index):
                for i, op in enumerate(self.definition.ops):
                    kind = json.loads(op).get("op")
                    if kind == "linear":
                        for t in ("input", "weight", "grad_output"):
                            views[f"{i}.{t}"] = self._state_view(self.sequence.fp8_operand_state(i, t))
                    elif kind == "quantize":
                        views[f"{i}.output"] = self._state_view(self.sequence.fp8_state(i))
            self._fp8_views = views
        return views

    def _state_view(self, st: Any) -> Tensor:
        n = 2 + int(st.history_len)  # one block: [scale, scale_inv, history...] (jitfuse.h, jf_fp8_state)
        iface = {"shape": (n,), "typestr": "<f4", "data": (int(st.scale), False), "version": 2, "strides": None}
        holder = type("_StateBlock", (), {"__cuda_array_interface__": iface})()
        return torch.as_tensor(holder, device=torch.device("cuda", self.device_index))

    def close(self) -> None:
        """Frees the library's sequence (its prepared programs, FP8 state and weight copies)."""
        self._fp8_views = None
        self._tls = _Calls()
        self.sequence.close()

    # -- the kernels of the custom ops ----------------------------------------------------------

    def _forward_call(self, x: Tensor, extras: List[Tensor], params: List[Tensor], training: bool) -> _ForwardCall:
        shape = tuple(int(d) for d in x.shape)
        c = _ForwardCall(self, self.info(shape, training), x, extras, params, training)
        c.shape = shape
        self._tls.calls[(x.shape, training)] = c
        return c

    def forward(self, x: Tensor, extras: List[Tensor], params: List[Tensor], rng_state: Optional[Tensor],
                training: bool, with_saved: bool = True, cache_workspace: bool = False) -> List[Tensor]:
        """[output, *extra_outputs, saved]; without ``with_saved`` (every inference call, and the eager direct
        call, which keeps the saved buffer for its own backward) the trailing saved buffer is left out.
        ``cache_workspace``: the eager direct call may take the workspace from the per-stream cache
        (:func:`_workspace`); the op's kernel never does (CUDA-graph trees run it with the allocator routed
        to a graph pool, where a kept tensor is an error)."""
        dev_i = x.get_device()
        if dev_i != self.device_index or dev_i != _cuda_get_device():
            if dev_i != self.device_index:
                raise JitfuseError(f"jitfuse: a tensor on device {dev_i} passed to the program of device "
                                   f"{self.device_index}")
            with torch.cuda.device(dev_i):  # jitfuse works in the current CUDA context
                return self.forward(x, extras, params, rng_state, training, with_saved, cache_workspace)
        c = self._tls.calls.get((x.shape, training))
        if c is None:
            c = self._forward_call(x, extras, params, training)
        dev = c.device
        # empty_like / new_empty: 1.6 / 2.4 us against 3.1 us for torch.empty(shape, dtype=, device=) (H100
        # host, tools/torch_baselines/host_overhead.py).
        out = _empty_like(x) if c.out_like_input else x.new_empty(c.out_shape, dtype=c.out_dtype)
        extra_outs = [x.new_empty(s, dtype=t) for s, t in c.extra_specs] if c.extra_specs else []
        saved = x.new_empty(c.saved_shape, dtype=_uint8) if with_saved else None
        a = c.args
        stream = _get_raw_stream(dev_i)
        if c.ws_bytes:
            ws = (_workspace(c.ws_bytes, dev_i, stream, dev) if cache_workspace
                  else x.new_empty(c.ws_shape, dtype=_uint8))
            a.workspace = ws.data_ptr()
        # Every tensor the call reads is checked against what its DLTensor says (the blocks are built once per
        # input shape): a parameter replaced by one of another shape, dtype or layout after a call ran, or a
        # non-contiguous one, is an error here, never a kernel reading the wrong memory.
        for d, t, s in zip(c.dls, (x, *extras, out, *extra_outs, *params), c.shapes):
            if s is not None and (t.shape != s or t.dtype is not c.dtype or not t.is_contiguous()):
                raise JitfuseError(self._mismatch(c, x, extras, params))
            d.data = t.data_ptr()
        a.rng_state = rng_state.data_ptr() if rng_state is not None else None
        if c.saved_bytes:
            a.saved = saved.data_ptr()
        if self.fp8:
            a.fp8_weights_unchanged = int(_fp8_promise.active and not _capturing())
        status = self._jf_forward(self._handle, c.args_ref, c.handle_ref, stream)
        if status:
            self._lib.check(status, "jf_forward")
        if c.returns_handle and c.handle.value:  # training with nothing to save: nothing is in it
            self._cdll.jf_saved_release(c.handle, stream)
            c.handle.value = None
        self.last_shape = c.shape
        if self.fp8_output:  # the scale_inv that decodes this call's codes, copied before the next call moves it
            extra_outs.append(self._fp8_output_view()[1:2].clone())
        if with_saved:
            return [out, *extra_outs, saved]
        return [out, *extra_outs]

    def _fp8_output_view(self) -> Tensor:
        return self.fp8_state_views()[f"{len(self.definition.ops) - 1}.output"]

    def _mismatch(self, c: _ForwardCall, x: Tensor, extras: List[Tensor], params: List[Tensor]) -> str:
        """The error for a tensor that does not match the program (shape, dtype, contiguity), naming it."""
        names = ["input"] + [f"extra input {i}" for i in range(len(extras))]
        tensors = [x, *extras]
        names += [f"op {op} {n.decode()}" for op, n in self.names]
        tensors += list(params)
        shapes = [s for s in c.shapes if s is not None]
        for name, t, s in zip(names, tensors, shapes):
            if t.shape != s:
                return (f"jitfuse: sequence {self.definition.name!r}: {name} has shape {list(t.shape)}, the program "
                        f"expects {list(s)} (a parameter replaced by one of another shape?)")
            if t.dtype is not c.dtype:
                return f"jitfuse: sequence {self.definition.name!r}: {name} is {t.dtype}, the program runs {c.dtype}"
            if not t.is_contiguous():
                return (f"jitfuse: sequence {self.definition.name!r}: {name} is not contiguous (strides "
                        f"{list(t.stride())}): jitfuse reads row-major tensors; pass .contiguous()")
        return f"jitfuse: sequence {self.definition.name!r}: a tensor does not match the program"

    def _backward_call(self, x: Tensor, extras: List[Tensor], params: List[Tensor]) -> _BackwardCall:
        shape = tuple(int(d) for d in x.shape)
        c = _BackwardCall(self, self.info(shape, True), x, extras, params)
        c.shape = shape
        self._tls.calls[("b", x.shape)] = c
        return c

    def backward(self, x: Tensor, extras: List[Tensor], output: Tensor, extra_outputs: List[Tensor],
                 params: List[Tensor], saved: Tensor, grad_output: Tensor, grad_extra_outputs: List[Tensor],
                 cache_workspace: bool = False) -> List[Tensor]:
        """[grad_input, *grad_extra_inputs, *grads]; ``cache_workspace`` as in :meth:`forward`."""
        dev_i = x.get_device()
        if dev_i != self.device_index or dev_i != _cuda_get_device():
            if dev_i != self.device_index:
                raise JitfuseError(f"jitfuse: a tensor on device {dev_i} passed to the program of device "
                                   f"{self.device_index}")
            with torch.cuda.device(dev_i):
                return self.backward(x, extras, output, extra_outputs, params, saved, grad_output,
                                     grad_extra_outputs, cache_workspace)
        c = self._tls.calls.get(("b", x.shape))
        if c is None:
            c = self._backward_call(x, extras, params)
        if saved.numel() != c.saved_bytes:
            raise JitfuseError(f"jitfuse: the saved buffer has {saved.numel()} bytes, the program of input "
                               f"{list(c.shape)} saves {c.saved_bytes}: was the forward run with training=True?")
        grad_input = _empty_like(x)
        grad_extras = [_empty_like(e) for e in extras] if extras else []
        if c.any_accumulate:
            grads = [torch.zeros_like(p) if acc else _empty_like(p) for p, acc in zip(params, c.accumulate)]
        else:
            grads = [_empty_like(p) for p in params]
        a = c.args
        stream = _get_raw_stream(dev_i)
        if c.ws_bytes:
            ws = (_workspace(c.ws_bytes, dev_i, stream, c.device) if cache_workspace
                  else x.new_empty(c.ws_shape, dtype=_uint8))
            a.workspace = ws.data_ptr()
        for d, t in zip(c.dls, (x, *extras, output, *extra_outputs, *params, grad_output, *grad_extra_outputs,
                                grad_input, *grad_extras, *grads)):
            d.data = t.data_ptr()
        if c.saved_bytes:
            a.saved = saved.data_ptr()
        status = self._jf_backward(self._handle, c.args_ref, stream)
        if status:
            self._lib.check(status, "jf_backward")
        return [grad_input, *grad_extras, *grads]


def _program_of(key: int, t: Tensor) -> Program:
    return _programs.get((key, _device_index(t))) or program(key, _device_index(t))


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
            "bool training) -> Tensor[]")  # [output, *extra_outputs] + [saved] when training
_LIB.define("backward(int key, Tensor input, Tensor[] extra_inputs, Tensor output, Tensor[] extra_outputs, "
            "Tensor[] params, Tensor saved, Tensor grad_output, Tensor[] grad_extra_outputs) -> Tensor[]")


def forward_op(key: int, input: Tensor, extra_inputs: List[Tensor], params: List[Tensor],
               rng_state: Optional[Tensor], training: bool) -> List[Tensor]:
    """Runs a jitfuse sequence forward. Returns [output, *extra_outputs, saved] when ``training``, where
    ``saved`` is the uint8 saved-for-backward buffer, and [output, *extra_outputs] otherwise (an inference
    call allocates no saved buffer: one allocation less per call). An FP8 sequence ending in quantize
    returns the float32 [1] scale_inv of its E4M3 output after the extra outputs. ``rng_state``: int64 CUDA tensor
    {seed, offset} that the dropout ops read (not written)."""
    return _program_of(key, input).forward(input, list(extra_inputs), list(params), rng_state, training,
                                           with_saved=training)


def _forward_fake(key, input, extra_inputs, params, rng_state, training):
    prog = program(key, _traced_device_index(input))
    info = prog.info(_concrete(input.shape), bool(training))
    outs = [input.new_empty(o.shape, dtype=torch_dtype(o.dl_dtype)) for o in info.outputs]
    if prog.fp8_output:
        outs.append(input.new_empty((1,), dtype=torch.float32))
    return outs + [input.new_empty((info.saved_bytes,), dtype=torch.uint8)] if training else outs


def backward_op(key: int, input: Tensor, extra_inputs: List[Tensor], output: Tensor, extra_outputs: List[Tensor],
                params: List[Tensor], saved: Tensor, grad_output: Tensor,
                grad_extra_outputs: List[Tensor]) -> List[Tensor]:
    """The backward of ``jitfuse::forward``: returns [grad_input, *grad_extra_inputs, *grad_params]."""
    return _program_of(key, input).backward(input, list(extra_inputs), output, list(extra_outputs), list(params),
                                            saved, grad_output, list(grad_extra_outputs))


def _backward_fake(key, input, extra_inputs, output, extra_outputs, params, saved, grad_output, grad_extra_outputs):
    return [torch.empty_like(input), *[torch.empty_like(e) for e in extra_inputs],
            *[torch.empty_like(p) for p in params]]


class _Forward(torch.autograd.Function):
    """The autograd node of a jitfuse forward. Tensor lists are flattened into ``apply``'s arguments
    (autograd tracks positional tensors only): (key, training, n_extra_inputs, n_params, rng_state, prog,
    input, *extra_inputs, *params).

    ``prog`` None: the Autograd kernel of ``jitfuse::forward`` (below it, the op's CUDA kernel runs through
    the dispatcher; returns the op's list, the saved buffer non-differentiable). ``prog`` a :class:`Program`:
    the eager direct call of ``Sequential`` (no dispatcher hop; returns (output, *extra_outputs); the saved
    buffer is kept for the backward only). An E4M3 output (FP8, trailing quantize) is returned as a
    :class:`Float8Tensor` of dtype bfloat16, so the gradient reaching it is not rounded to E4M3 by autograd
    (the quantize's backward is straight through)."""

    @staticmethod
    def forward(ctx, key, training, ne, npar, rng_state, prog, x, *tensors):  # type: ignore[override]
        extras, params = list(tensors[:ne]), list(tensors[ne:ne + npar])
        if prog is not None:
            outs = prog.forward(x, extras, params, rng_state, training, cache_workspace=True)  # [..., saved]
            fp8_out = prog.fp8_output
            returned = outs[:-2] if fp8_out else outs[:-1]
        else:
            with torch._C._AutoDispatchBelowAutograd():
                outs = torch.ops.jitfuse.forward.default(key, x, extras, params, rng_state, training)
            fp8_out = _program_of(key, x).fp8_output
            returned = list(outs)
            if training:
                ctx.mark_non_differentiable(outs[-1])
            if fp8_out:
                ctx.mark_non_differentiable(outs[-2 if training else -1])
        if fp8_out:
            returned[0] = Float8Tensor(outs[0], outs[-2 if training else -1], x.dtype)
        ctx.key, ctx.training, ctx.ne, ctx.npar, ctx.prog, ctx.fp8_out = key, bool(training), ne, npar, prog, fp8_out
        if training:
            # The saved buffer too (an output of the op, an intermediate of the direct call): saved-tensor
            # hooks (offloading, checkpointing) see everything the backward reads.
            ctx.save_for_backward(x, *extras, *params, *outs)
        # No zero-filled gradient for outputs autograd has none for (the saved buffer, unused extra outputs).
        ctx.set_materialize_grads(False)
        return tuple(returned)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        if not ctx.training:
            raise RuntimeError("jitfuse: backward through a forward that ran with training=False (no saved context)")
        saved_tensors = ctx.saved_tensors
        ne, npar = ctx.ne, ctx.npar
        x = saved_tensors[0]
        extras = list(saved_tensors[1:1 + ne])
        params = list(saved_tensors[1 + ne:1 + ne + npar])
        outs = saved_tensors[1 + ne + npar:]
        neo = len(outs) - (3 if ctx.fp8_out else 2)  # outputs, (the FP8 output's scale_inv), the saved buffer
        output, extra_outputs, saved = outs[0], list(outs[1:1 + neo]), outs[-1]
        # Autograd may hand in None (unused output) or expanded / non-contiguous gradients.
        dt = x.dtype
        gl = []
        for g, o in zip(grads[:1 + neo], (output, *extra_outputs)):
            if g is None:
                g = torch.zeros(o.shape, dtype=dt, device=o.device)
            else:
                if isinstance(g, Float8Tensor):
                    g = g.dequantize()
                if g.dtype != dt:
                    g = g.to(dt)
                if not g.is_contiguous():
                    g = g.contiguous()
            gl.append(g)
        prog = ctx.prog
        if prog is not None and not torch.compiler.is_compiling() and direct_call_ok(gl[0], gl[1:], ()):
            res = prog.backward(x, extras, output, extra_outputs, params, saved, gl[0], gl[1:], cache_workspace=True)
        else:
            res = torch.ops.jitfuse.backward.default(ctx.key, x, extras, output, extra_outputs, params, saved, gl[0],
                                                     gl[1:])
        return (None, None, None, None, None, None, *res)


# Function.apply without its Python wrapper's per-call work (it walks every argument with pytree to unwrap
# dead functorch wrappers, which only exist under functorch transforms): the C++ apply, bound to _Forward.
try:
    _apply_c = torch._C._FunctionBase.__dict__["apply"].__get__(None, _Forward)
except (AttributeError, KeyError, TypeError):  # pragma: no cover - other PyTorch layouts
    _apply_c = None


def autograd_forward(prog: Program, key: int, x: Tensor, extras: List[Tensor], params: List[Tensor],
                     rng_state: Optional[Tensor]) -> Tuple[Tensor, ...]:
    """The eager training forward of Sequential: the autograd node around a direct program call (the caller
    checked :func:`direct_call_ok`). Returns (output, *extra_outputs)."""
    if _apply_c is not None and not _functorch_active():
        return _apply_c(key, True, len(extras), len(params), rng_state, prog, x, *extras, *params)
    return _Forward.apply(key, True, len(extras), len(params), rng_state, prog, x, *extras, *params)


def _forward_autograd(keyset, key, input, extra_inputs, params, rng_state, training):
    # The Autograd kernel of jitfuse::forward: what torch.library.register_autograd registers, without
    # its generic argument handling (pytree flatten/unflatten, default filling), which took ~280 us of
    # host time per call on an H100 host (torch.profiler, bias + gelu at M = 16, 2026-11-24).
    if torch.is_grad_enabled() and (input.requires_grad or any(t.requires_grad for t in extra_inputs)
                                    or any(p.requires_grad for p in params)):
        return list(_Forward.apply(key, training, len(extra_inputs), len(params), rng_state, None, input,
                                   *extra_inputs, *params))
    if direct_call_ok(input, extra_inputs, params):
        # Below Autograd, plain CUDA tensors with nothing watching reach the CUDA kernel (forward_op) and
        # nothing else: call it here instead of redispatching (one Python hop and one schema conversion
        # less per call; what torch.compile's generated code pays per call without CUDA graphs).
        return forward_op(key, input, extra_inputs, params, rng_state, training)
    with torch._C._AutoDispatchBelowAutograd():
        return torch.ops.jitfuse.forward.default.redispatch(keyset & torch._C._after_autograd_keyset, key, input,
                                                            extra_inputs, params, rng_state, training)


_LIB.impl("forward", forward_op, "CUDA")
_LIB.impl("backward", backward_op, "CUDA")
torch.library.register_fake("jitfuse::forward", _forward_fake, lib=_LIB)
torch.library.register_fake("jitfuse::backward", _backward_fake, lib=_LIB)
_LIB.impl("forward", _forward_autograd, "Autograd", with_keyset=True)
