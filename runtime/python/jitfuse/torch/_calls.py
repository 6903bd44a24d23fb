# One jitfuse call from PyTorch: the route a forward takes, the argument check, the DLTensor argument blocks
# cached per (shape, training, thread), and the forward / backward kernels that fill and run them.
"""The calls of a :class:`~jitfuse.torch._registry.DeviceProgram`.

Host time per call is the point of this file (issue 12): each per-call helper was measured
(tools/torch_baselines/host_overhead.py, docs/benchmarks.md) and replaces a slower equivalent.

- :func:`route` decides how a forward runs on the pure-Python path, for ``Sequential``'s eager call and
  ``jitfuse::forward``'s Python Autograd kernel alike (with the C++ extension loaded, its ``module_forward``
  and C++ Autograd kernel decide instead, for every Sequential, FP8 recipes included; docs/python.md "Who
  decides how a forward runs"); :func:`check_arguments` raises the module's errors for a call it did not
  send DIRECT.
- :class:`ForwardArgs` / :class:`BackwardArgs`: the ``jf_forward_args`` / ``jf_backward_args`` of one input
  shape; :meth:`ForwardArgs.bind` compares a call's tensors with the block (shape against the module's
  definition, dtype, contiguity) and, when one differs, the call goes to the library with the tensors as
  they are (:meth:`ForwardArgs.call_as_they_are`): the library's checks and messages, as the C++ extension's.
- :func:`run_forward` / :func:`run_backward`: the kernels (``DeviceProgram.forward`` / ``.backward``).
"""

import ctypes
import threading
from typing import Any, Dict, List, Optional, Tuple
from typing import Sequence as Sequence_

import torch
from torch import Tensor

from .. import _abi
from ..errors import JitfuseError, error_for_status
from ..lib import ProgramInfo
from ._dtypes import LABEL_DTYPES, TORCH_TO_DL, torch_dtype

_cuda_get_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
_get_raw_stream = (getattr(torch._C, "_cuda_getCurrentRawStream", None)
                   or (lambda device_index: torch.cuda.current_stream(device_index).cuda_stream))
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or torch.cuda.is_current_stream_capturing
_dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", None) or (lambda: 0)
_profiling = (getattr(torch.autograd, "_profiler_enabled", None)
              or getattr(getattr(torch._C, "_autograd", None), "_profiler_enabled", None) or (lambda: False))
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", None) or (lambda: False)
_grad_enabled = torch.is_grad_enabled
_empty = torch.empty
_empty_like = torch.empty_like
_uint8 = torch.uint8
_Parameter = torch.nn.Parameter


def device_index(t: Tensor) -> int:
    """The CUDA device of a real tensor (get_device(): an int, no torch.device object)."""
    i = t.get_device()
    return i if i >= 0 else _cuda_get_device()


def traced_device_index(t: Tensor) -> int:
    """The device of a fake or traced tensor (its .device; get_device() would read the meta device)."""
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


# ----------------------------------------------------------------------------------------------------
# The route of a forward


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


# route() answers OP or DIRECT, with GRAD added where autograd needs a node. What each caller does with it:
#   Sequential's eager call:        DIRECT: the program;  DIRECT|GRAD: _Forward around the program;
#                                   OP(|GRAD): the jitfuse::forward op (its module checks, then the op).
#   jitfuse::forward's Autograd kernel:  DIRECT: the CUDA kernel, no redispatch;  OP: redispatch below
#                                   autograd;  (DIRECT|OP)|GRAD: _Forward around the op below autograd.
OP = 0
DIRECT = 1
GRAD = 2


def needs_grad(x: Tensor, extras: Sequence_[Tensor], params: Sequence_[Tensor]) -> bool:
    """Grad mode is on and a tensor of the call requires a gradient (also traced by Dynamo)."""
    return _grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)
                                or any(e.requires_grad for e in extras))


def route(x: Tensor, extras: Sequence_[Tensor], params: Sequence_[Tensor]) -> int:
    """How a forward runs (see above): DIRECT when :func:`direct_call_ok`, else OP; plus GRAD when
    :func:`needs_grad`."""
    r = DIRECT if direct_call_ok(x, extras, params) else OP
    if needs_grad(x, extras, params):
        r |= GRAD
    return r


def check_arguments(name: str, recipe: Optional[str], key: Optional[int], x: Tensor, params: Sequence_[Tensor],
                    extras: Sequence_[Tensor] = ()) -> None:
    """The errors of a module call that :func:`route` did not send DIRECT, raised before the op is called
    (also at trace time: the fake kernel checks nothing): an input dtype the module has no program for
    (``key`` None), a tensor off CUDA or of another dtype or device than the input. The count of extra inputs
    is the library's check (``Sequential._check_count``); what the prepared program checks per call (shapes
    against the definition, contiguity) is :meth:`ForwardArgs.bind`'s."""
    if key is None:
        raise TypeError(f"{name}: input dtype {x.dtype} is not supported "
                        f"({'bfloat16 under ' + recipe if recipe else 'float32, float16 or bfloat16'})")
    if x.device.type != "cuda":
        raise ValueError(f"{name}: jitfuse runs on CUDA tensors; the input is on {x.device}")
    for p in params:
        if p.dtype != x.dtype or p.device != x.device:
            raise TypeError(f"{name}: parameters must match the input ({x.dtype} on {x.device}); "
                            f"found one of {p.dtype} on {p.device}")
    for e in extras:
        if e.dtype != x.dtype or e.device != x.device:
            raise TypeError(f"{name}: extra inputs must match the input ({x.dtype} on {x.device})")


# ----------------------------------------------------------------------------------------------------
# FP8 weight casts


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
        ext = _ext_module()
        self._ext_was = ext.set_fp8_promise(True) if ext is not None else None
        return self

    def __exit__(self, *exc: Any) -> None:
        _fp8_promise.active = self._was
        if self._ext_was is not None:
            _ext_module().set_fp8_promise(self._ext_was)


def _ext_module() -> Any:
    """The C++ extension module (its ops read the promise from C++), or None."""
    from . import _ext
    return _ext.EXT


# ----------------------------------------------------------------------------------------------------
# Workspaces

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


# ----------------------------------------------------------------------------------------------------
# DLTensor argument blocks


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


def _param_array(names: List[Tuple[int, bytes]], arr: Any, first: int) -> Any:
    """A jf_param array naming arr[first:first + len(names)] (op index, ABI name)."""
    out = (_abi.jf_param * max(len(names), 1))()
    for i, (op, name) in enumerate(names):
        out[i].op_index = op
        out[i].name = name
        out[i].tensor = ctypes.pointer(arr[first + i])
    return out


class ForwardArgs:
    """Everything a forward of one (input shape, training) needs that does not change per call: the
    jf_forward_args with one DLTensor per tensor (only data pointers are set per call), what each tensor
    the call reads must look like, and what to allocate (shape, dtype) for the outputs, the saved block
    (the saved-for-backward bytes) and the workspace."""

    def __init__(self, prog: Any, info: ProgramInfo, x: Tensor, extras: List[Tensor], params: List[Tensor],
                 training: bool):
        dev = prog.device_index
        self.shape = tuple(int(d) for d in x.shape)
        self.name = prog.definition.name
        self.param_names = prog.names
        self.device = torch.device("cuda", dev)
        self.out_shape = tuple(info.outputs[0].shape)
        self.out_dtype = torch_dtype(info.outputs[0].dl_dtype)
        self.out_like_input = self.out_shape == tuple(x.shape) and self.out_dtype == x.dtype
        self.extra_specs = [(tuple(o.shape), torch_dtype(o.dl_dtype)) for o in info.outputs[1:]]
        self.saved_block_bytes = info.saved_bytes if training else 0
        self.saved_block_shape = (self.saved_block_bytes,)
        self.ws_bytes = info.forward_workspace_bytes
        self.ws_shape = (self.ws_bytes,)
        self.returns_saved_handle = training and not self.saved_block_bytes  # the forward hands back an empty jf_saved
        # The jf_program of (shape, training): prepared above (prog.info), so opening it is a lookup; a call
        # on it is the library's steady-state call (the C++ extension's too).
        self.program = prog.sequence.open(self.shape, training)
        self.handle = self.program.handle
        ne, neo, npar = len(extras), len(info.outputs) - 1, len(params)
        specs = ([(tuple(x.shape), TORCH_TO_DL[x.dtype])] + [(tuple(e.shape), TORCH_TO_DL[e.dtype]) for e in extras]
                 + [(o.shape, o.dl_dtype[:2]) for o in info.outputs]
                 + [(tuple(p.shape), TORCH_TO_DL[p.dtype]) for p in params])
        arr, self.dls, self._keep = _dl_block(specs, dev)
        # What each tensor must look like per call (None: an output this package allocates itself): the
        # parameters' shapes are the module's definition, not the tensors of the first call.
        self.shapes = ([x.shape] + [e.shape for e in extras] + [None] * (1 + neo)
                       + [torch.Size(s) for s in prog.definition.param_shapes])
        self.dtype = x.dtype
        # Each tensor's dtype per call: the input's, but the typed extra inputs' own (labels, indices, probs).
        self.dtypes = [x.dtype] + [e.dtype for e in extras] + [None] * (1 + neo) + [x.dtype] * npar
        self._keep += [arr, _ptrs(arr, 1, ne), _ptrs(arr, 2 + ne, neo), _param_array(prog.names, arr, 2 + ne + neo)]
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
        a.saved_bytes = self.saved_block_bytes
        a.workspace_bytes = self.ws_bytes
        self.args_ref = ctypes.byref(a)
        self.saved_handle = _abi.jf_saved()
        self.saved_handle_ref = ctypes.byref(self.saved_handle)

    def bind(self, x: Tensor, extras: List[Tensor], out: Tensor, extra_outs: List[Tensor], params: List[Tensor]) -> bool:
        """Sets the data pointers of the block's DLTensors, once every tensor the call reads is what its DLTensor
        says (the block is built once per input shape: a parameter replaced by one of another shape, dtype or
        layout, or a non-contiguous one, differs). True when all are; False when one is not: then the caller
        hands the library the tensors as they are (:meth:`call_as_they_are`), whose checks judge them and whose
        error names the tensor, never a kernel reading the wrong memory. The package formats no message."""
        for d, t, s, dt in zip(self.dls, (x, *extras, out, *extra_outs, *params), self.shapes, self.dtypes):
            if s is not None and (t.shape != s or t.dtype is not dt or not t.is_contiguous()):
                return False
            d.data = t.data_ptr()
        return True

    def call_as_they_are(self, prog: Any, x: Tensor, extras: List[Tensor], out: Tensor, extra_outs: List[Tensor],
                         params: List[Tensor], stream: int) -> int:
        """jf_program_forward with DLTensors describing the call's tensors as they are (their own shapes,
        strides and dtypes) and every other field as the call set it in ``args``: the library's per-call
        checks, the same as the C++ extension's calls meet, refuse a tensor naming it, and a call they accept
        runs. Only after :meth:`bind` found a tensor unlike the block, never in the steady state."""
        tensors = [x, *extras, out, *extra_outs, *params]
        arr = (_abi.DLTensor * len(tensors))()
        keep = [arr]
        for d, t in zip(arr, tensors):
            dt = TORCH_TO_DL.get(t.dtype)
            if dt is None:
                raise JitfuseError(f"jitfuse: sequence {self.name!r}: a tensor of {t.dtype} cannot be passed to "
                                   f"jitfuse")
            dims, strides = (ctypes.c_int64 * t.dim())(*t.shape), (ctypes.c_int64 * t.dim())(*t.stride())
            keep += [dims, strides]
            d.data = t.data_ptr()
            d.device = _abi.DLDevice(_abi.kDLCUDA, prog.device_index)
            d.ndim = t.dim()
            d.dtype = _abi.DLDataType(dt[0], dt[1], 1)
            d.shape = ctypes.cast(dims, ctypes.POINTER(ctypes.c_int64))
            d.strides = ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64))
        ne, neo = len(extras), len(extra_outs)
        ins, outs = _ptrs(arr, 1, ne), _ptrs(arr, 2 + ne, neo)
        pars = _param_array(self.param_names, arr, 2 + ne + neo)
        a = _abi.jf_forward_args()
        ctypes.memmove(ctypes.byref(a), self.args_ref, ctypes.sizeof(a))  # counts, buffers, rng, training, FP8
        a.input = ctypes.pointer(arr[0])
        a.extra_inputs = ctypes.cast(ins, ctypes.POINTER(ctypes.POINTER(_abi.DLTensor)))
        a.output = ctypes.pointer(arr[1 + ne])
        a.extra_outputs = ctypes.cast(outs, ctypes.POINTER(ctypes.POINTER(_abi.DLTensor)))
        a.params = ctypes.cast(pars, ctypes.POINTER(_abi.jf_param))
        status = prog._jf_program_forward(self.handle, ctypes.byref(a), self.saved_handle_ref, stream)
        return status


class BackwardArgs:
    """jf_backward_args for one input shape, one DLTensor per tensor, and the gradients to allocate."""

    def __init__(self, prog: Any, info: ProgramInfo, x: Tensor, extras: List[Tensor], params: List[Tensor]):
        dev = prog.device_index
        self.shape = tuple(int(d) for d in x.shape)
        self.device = torch.device("cuda", dev)
        self.saved_block_bytes = info.saved_bytes
        self.ws_bytes = info.backward_workspace_bytes
        self.ws_shape = (self.ws_bytes,)
        self.accumulate = prog.definition.accumulate
        self.any_accumulate = any(self.accumulate)
        dt = TORCH_TO_DL[x.dtype]
        ne, neo, npar = len(extras), len(info.outputs) - 1, len(params)
        xs, es = tuple(x.shape), [tuple(e.shape) for e in extras]
        ps = [(tuple(p.shape), TORCH_TO_DL[p.dtype]) for p in params]
        # Order: input, extras, output, extra outputs, params, grad_output, grad extra outputs, grad_input,
        # grad extras, grads (the order run_backward lists its tensors in).
        # CrossEntropy's labels keep their integer dtype and have no gradient (NULL in grad_extra_inputs).
        eds = [TORCH_TO_DL[e.dtype] for e in extras]
        specs = ([(xs, dt)] + list(zip(es, eds)) + [(o.shape, o.dl_dtype[:2]) for o in info.outputs] + ps
                 + [(o.shape, dt) for o in info.outputs] + [(xs, dt)] + list(zip(es, eds)) + ps)
        arr, self.dls, self._keep = _dl_block(specs, dev)
        at_out = 1 + ne
        at_par = at_out + 1 + neo
        at_go = at_par + npar
        at_gi = at_go + 1 + neo
        at_grads = at_gi + 1 + ne
        pp = ctypes.POINTER(ctypes.POINTER(_abi.DLTensor))
        arrays = [_ptrs(arr, 1, ne), _ptrs(arr, at_out + 1, neo), _param_array(prog.names, arr, at_par),
                  _ptrs(arr, at_go + 1, neo), _ptrs(arr, at_gi + 1, ne), _param_array(prog.names, arr, at_grads)]
        for i, e in enumerate(extras):
            if e.dtype in LABEL_DTYPES:
                arrays[4][i] = None
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
        self.program = prog.sequence.open(self.shape, True)  # as ForwardArgs.program
        self.handle = self.program.handle
        # Gradients the backward may write in place over the saved block (jf_program_grad_aliases): index 0
        # grad_input, 1 + i parameter i's gradient -> (byte offset, bytes, shape, dtype).
        slots = {(op, name.decode()): i for i, (op, name) in enumerate(prog.names)}
        self.aliases: List[Tuple[int, int, int, Tuple[int, ...], torch.dtype]] = []
        for op, name, off, nbytes in self.program.grad_aliases():
            i = 0 if op < 0 else 1 + slots.get((op, name), -2)
            if i >= 0:
                like = x if i == 0 else params[i - 1]
                self.aliases.append((i, off, nbytes, tuple(like.shape), like.dtype))


class CallCache(threading.local):
    """A program's argument blocks of this thread: ForwardArgs by (input shape, training), BackwardArgs by
    ("b", input shape). Per thread: a block's data pointers are written per call."""

    def __init__(self) -> None:
        self.calls: Dict[Any, Any] = {}


# ----------------------------------------------------------------------------------------------------
# The kernels: DeviceProgram.forward / DeviceProgram.backward


def run_forward(prog: Any, x: Tensor, extras: List[Tensor], params: List[Tensor], rng_state: Optional[Tensor],
                training: bool, with_saved_block: bool = True, cache_workspace: bool = False) -> List[Tensor]:
    """[output, *extra_outputs, saved_block]; without ``with_saved_block`` (every inference call, and the eager
    direct call, which keeps the saved block for its own backward) the trailing saved block is left out. An
    FP8 program ending in quantize has the float32 [1] scale_inv of its E4M3 output after the extra outputs.
    ``cache_workspace``: the eager direct call may take the workspace from the per-stream cache
    (:func:`_workspace`); the op's kernel never does (CUDA-graph trees run it with the allocator routed
    to a graph pool, where a kept tensor is an error)."""
    dev_i = x.get_device()
    if dev_i != prog.device_index or dev_i != _cuda_get_device():
        if dev_i != prog.device_index:
            raise JitfuseError(f"jitfuse: a tensor on device {dev_i} passed to the program of device "
                               f"{prog.device_index}")
        with torch.cuda.device(dev_i):  # jitfuse works in the current CUDA context
            return run_forward(prog, x, extras, params, rng_state, training, with_saved_block, cache_workspace)
    c = prog._tls.calls.get((x.shape, training))
    if c is None:
        c = prog._tls.calls[(x.shape, training)] = ForwardArgs(prog, prog.info(tuple(int(d) for d in x.shape),
                                                                               training), x, extras, params, training)
    # empty_like / new_empty: 1.6 / 2.4 us against 3.1 us for torch.empty(shape, dtype=, device=) (H100
    # host, tools/torch_baselines/host_overhead.py).
    out = _empty_like(x) if c.out_like_input else x.new_empty(c.out_shape, dtype=c.out_dtype)
    extra_outs = [x.new_empty(s, dtype=t) for s, t in c.extra_specs] if c.extra_specs else []
    saved_block = x.new_empty(c.saved_block_shape, dtype=_uint8) if with_saved_block else None
    a = c.args
    stream = _get_raw_stream(dev_i)
    if c.ws_bytes:
        ws = (_workspace(c.ws_bytes, dev_i, stream, c.device) if cache_workspace
              else x.new_empty(c.ws_shape, dtype=_uint8))
        a.workspace = ws.data_ptr()
    a.rng_state = rng_state.data_ptr() if rng_state is not None else None
    if c.saved_block_bytes:
        a.saved = saved_block.data_ptr()
    if prog.fp8:
        a.fp8_weights_unchanged = int(_fp8_promise.active and not _capturing())
    if c.bind(x, extras, out, extra_outs, params):
        status = prog._jf_program_forward(c.handle, c.args_ref, c.saved_handle_ref, stream)
    else:  # a tensor unlike the block: the library judges the tensors as they are
        status = c.call_as_they_are(prog, x, extras, out, extra_outs, params, stream)
    if status:
        raise error_for_status(status, f"sequence {c.name!r}: {prog._lib.last_error()}", "jf_program_forward")
    if c.returns_saved_handle and c.saved_handle.value:  # training with nothing to save: nothing is in it
        prog._cdll.jf_saved_release(c.saved_handle, stream)
        c.saved_handle.value = None
    prog.last_shape = c.shape
    if prog.fp8_output:  # the scale_inv that decodes this call's codes, copied before the next call moves it
        extra_outs.append(prog.fp8_output_state()[1:2].clone())
    if with_saved_block:
        return [out, *extra_outs, saved_block]
    return [out, *extra_outs]


def wrote_in_place(prog: Any, x: Tensor) -> bool:
    """Whether run_backward(..., in_place=True) of ``x``'s shape writes gradients over the saved block."""
    c = prog._tls.calls.get(("b", x.shape))
    return c is not None and bool(c.aliases)


def run_backward(prog: Any, x: Tensor, extras: List[Tensor], output: Tensor, extra_outputs: List[Tensor],
                 params: List[Tensor], saved_block: Tensor, grad_output: Tensor, grad_extra_outputs: List[Tensor],
                 cache_workspace: bool = False, in_place: bool = False) -> List[Tensor]:
    """[grad_input, *grad_extra_inputs, *grads]; ``cache_workspace`` as in :func:`run_forward`. ``in_place``:
    the gradients the program allows it (jf_program_grad_aliases: the chunked LM head's dx and dW) are views
    of ``saved_block``, written over what they are computed from, so this backward allocates nothing for
    them; the caller must not pass that saved block to a backward again."""
    dev_i = x.get_device()
    if dev_i != prog.device_index or dev_i != _cuda_get_device():
        if dev_i != prog.device_index:
            raise JitfuseError(f"jitfuse: a tensor on device {dev_i} passed to the program of device "
                               f"{prog.device_index}")
        with torch.cuda.device(dev_i):
            return run_backward(prog, x, extras, output, extra_outputs, params, saved_block, grad_output,
                                grad_extra_outputs, cache_workspace, in_place)
    c = prog._tls.calls.get(("b", x.shape))
    if c is None:
        c = prog._tls.calls[("b", x.shape)] = BackwardArgs(prog, prog.info(tuple(int(d) for d in x.shape), True),
                                                           x, extras, params)
    # None for CrossEntropy's labels: no gradient (their slot of grad_extra_inputs is NULL).
    grad_extras = [None if e.dtype in LABEL_DTYPES else _empty_like(e) for e in extras] if extras else []
    over = {}
    if in_place and c.aliases and saved_block.numel() >= c.saved_block_bytes:
        for i, off, nbytes, shape, dt in c.aliases:
            over[i] = saved_block[off:off + nbytes].view(dt).view(shape)
    grad_input = over[0] if 0 in over else _empty_like(x)
    if c.any_accumulate:  # the library lets no accumulating gradient sit over the saved block
        grads = [torch.zeros_like(p) if acc else over.get(1 + i, None) for i, (p, acc)
                 in enumerate(zip(params, c.accumulate))]
        grads = [g if g is not None else _empty_like(p) for g, p in zip(grads, params)]
    else:
        grads = [over[1 + i] if 1 + i in over else _empty_like(p) for i, p in enumerate(params)]
    a = c.args
    a.saved_bytes = saved_block.numel()  # the library checks it against the program's (its message names both)
    stream = _get_raw_stream(dev_i)
    if c.ws_bytes:
        ws = (_workspace(c.ws_bytes, dev_i, stream, c.device) if cache_workspace
              else x.new_empty(c.ws_shape, dtype=_uint8))
        a.workspace = ws.data_ptr()
    for d, t in zip(c.dls, (x, *extras, output, *extra_outputs, *params, grad_output, *grad_extra_outputs,
                            grad_input, *grad_extras, *grads)):
        if t is not None:
            d.data = t.data_ptr()
    if c.saved_block_bytes:
        a.saved = saved_block.data_ptr()
    status = prog._jf_program_backward(c.handle, c.args_ref, stream)
    if status:
        prog._lib.check(status, "jf_program_backward")
    return [grad_input, *grad_extras, *grads]
