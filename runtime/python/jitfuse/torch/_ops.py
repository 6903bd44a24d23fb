# The custom ops jitfuse::forward / jitfuse::backward (schemas, CUDA and fake kernels, the Autograd kernel)
# and EagerCall, the one eager call that Sequential and the Autograd kernel run a forward through.
"""Custom ops ``jitfuse::forward`` / ``jitfuse::backward`` and the eager call behind them.

One op pair for every sequence, not one registration per sequence: the sequence is the op's first
argument, an int ``key`` (see :mod:`jitfuse.torch._registry`). So

- the op set is fixed (opcheck, export and the FX graph cache see two stable ops, not one per module),
- the key is the same in every process for the same sequence, so Inductor's on-disk FX graph cache
  never binds a cached graph to another sequence.

On the pure-Python path (no C++ extension) how an eager forward runs is decided once, by
:func:`jitfuse.torch._calls.route`, for ``Sequential`` and for the op's Autograd kernel alike; a forward that
needs a gradient is one :class:`_Forward` node around either the direct program call (``Sequential``) or
the op below autograd (the Autograd kernel), both built and run by :class:`EagerCall`. With the extension,
the one Python node left is that of an FP8 ``Sequential`` ending in ``Quantize`` under autograd: its
:class:`Float8Tensor` output must be the node's (so the gradient reaching it stays bfloat16), around the C++
op below autograd (``Sequential._forward_op``).
"""

from typing import Any, List, Optional, Tuple
from typing import Sequence as Sequence_

import torch
from torch import Tensor

from . import _ext
from ._calls import DIRECT, GRAD, _functorch_active, direct_call_ok, route, traced_device_index, wrote_in_place
from ._dtypes import LABEL_DTYPES, torch_dtype
from ._registry import DeviceProgram, device_program, program_of
from .float8 import Float8Tensor

# ----------------------------------------------------------------------------------------------------
# The ops. No `from __future__ import annotations` in this file: torch.library reads these hints.

# The two ops are defined with torch.library.Library (define + impl) rather than torch.library.custom_op:
# both give the same schema, fake kernels and autograd registration, but custom_op's Python wrapper cost
# about 175 us per call on an H100 host (cProfile of a bias+gelu step, 2026-11-23), more than the rest of
# the call together.
#
# With the C++ extension (runtime/torch, see _ext) the ops, their CUDA kernels and their autograd are C++;
# their Meta kernels too (fake tensors), and the Python kernels below serve the pure-Python path.
if _ext.EXT is not None:
    _LIB = torch.library.Library("jitfuse", "FRAGMENT")
else:
    _LIB = torch.library.Library("jitfuse", "DEF")
    # The lists are optional (None = []) for AOTInductor: its proxy executor passes None for an empty
    # `Tensor[]` argument, which a `Tensor[]` schema refuses (runtime/torch/ops.cpp, OptTensors).
    _LIB.define("forward(int key, Tensor input, Tensor[]? extra_inputs, Tensor[]? params, Tensor? rng_state, "
                "bool training) -> Tensor[]")  # [output, *extra_outputs] + [saved] when training
    _LIB.define("backward(int key, Tensor input, Tensor[] extra_inputs, Tensor output, Tensor[] extra_outputs, "
                "Tensor[] params, Tensor saved, Tensor grad_output, Tensor[] grad_extra_outputs) -> Tensor[]")


def _concrete(shape: Any) -> Tuple[int, ...]:
    # A symbolic dim is specialised (int() guards on it): programs are prepared per concrete shape.
    return tuple(int(d) for d in shape)


def _hint(d: Any) -> Optional[int]:
    """A dim's value without a guard: an int as it is, a symbolic dim's hint (the example's value); None if it
    has none (an unbacked size)."""
    if isinstance(d, int):
        return d
    node = getattr(d, "node", None)
    h = getattr(node, "hint", None) if node is not None else None
    return int(h) if h is not None else None


def _symbolic_outputs(prog: Any, input: Tensor, training: bool) -> Optional[List[Tensor]]:
    """The fake outputs for an input whose leading (row) dims are symbolic (``torch.compile(dynamic=True)``,
    or Dynamo's automatic dynamic shapes after a second row count): the program of the example's shape says
    each output's columns, and an output with the input's leading dims keeps them symbolic, so one graph
    serves every row count (the library prepares one program per concrete shape at run time, sharing its
    kernels: they depend on the columns only). The saved block's size is data-dependent (an unbacked size).
    None: not that case (a symbolic column count, or an output whose rows differ): the caller specialises."""
    lead = [_hint(d) for d in input.shape[:-1]]
    if not lead or any(h is None for h in lead) or not isinstance(input.shape[-1], int):
        return None
    hint = tuple(lead) + (int(input.shape[-1]),)
    info = prog.info(hint, bool(training))
    outs = []
    for o in info.outputs:
        if tuple(o.shape[:-1]) != hint[:-1]:
            return None
        outs.append(input.new_empty((*input.shape[:-1], int(o.shape[-1])), dtype=torch_dtype(o.dl_dtype)))
    if prog.fp8_output:
        outs.append(input.new_empty((1,), dtype=torch.float32))
    if training:
        size = _dynamic_size(input)
        if size is None:
            return None
        outs.append(input.new_empty((size,), dtype=torch.uint8))
    return outs


def _dynamic_size(input: Tensor) -> Any:
    """A data-dependent (unbacked) size for the saved block: the fake-impl context's under a Python fake kernel,
    else (the extension's Meta kernel) one from the shape environment of ``input``'s symbolic dims; None if
    there is neither (the caller specialises)."""
    try:
        return torch.library.get_ctx().new_dynamic_size()
    except Exception:  # noqa: BLE001 - not inside a Python fake kernel
        pass
    from torch.fx.experimental.symbolic_shapes import _constrain_range_for_size
    env = next((getattr(d.node, "shape_env", None) for d in input.shape if isinstance(d, torch.SymInt)), None)
    if env is None:
        return None
    size = env.create_unbacked_symint()
    _constrain_range_for_size(size)
    return size


def symbolic_fake_outputs(key: int, device_index: int, input: Tensor, training: bool) -> Optional[List[Tensor]]:
    """The extension's forward Meta kernel on an input with symbolic dims (runtime/torch/ops.cpp calls it):
    what the Python fake kernel returns there (:func:`_symbolic_outputs`), or None to specialise."""
    return _symbolic_outputs(device_program(key, device_index), input, training)


def forward_op(key: int, input: Tensor, extra_inputs: Optional[List[Tensor]], params: Optional[List[Tensor]],
               rng_state: Optional[Tensor], training: bool) -> List[Tensor]:
    """Runs a jitfuse sequence forward. Returns [output, *extra_outputs, saved] when ``training``, where
    ``saved`` is the uint8 saved-for-backward block, and [output, *extra_outputs] otherwise (an inference
    call allocates no saved block: one allocation less per call). An FP8 sequence ending in quantize
    returns the float32 [1] scale_inv of its E4M3 output after the extra outputs. ``rng_state``: int64 CUDA tensor
    {seed, offset} that the dropout ops read (not written)."""
    return program_of(key, input).forward(input, list(extra_inputs or ()), list(params or ()), rng_state, training,
                                          with_saved_block=training)


def _forward_fake(key, input, extra_inputs, params, rng_state, training):
    prog = device_program(key, traced_device_index(input))
    if not all(isinstance(d, int) for d in input.shape):
        outs = _symbolic_outputs(prog, input, training)
        if outs is not None:
            return outs
    info = prog.info(_concrete(input.shape), bool(training))
    outs = [input.new_empty(o.shape, dtype=torch_dtype(o.dl_dtype)) for o in info.outputs]
    if prog.fp8_output:
        outs.append(input.new_empty((1,), dtype=torch.float32))
    return outs + [input.new_empty((info.saved_bytes,), dtype=torch.uint8)] if training else outs


def backward_op(key: int, input: Tensor, extra_inputs: List[Tensor], output: Tensor, extra_outputs: List[Tensor],
                params: List[Tensor], saved: Tensor, grad_output: Tensor,
                grad_extra_outputs: List[Tensor]) -> List[Tensor]:
    """The backward of ``jitfuse::forward`` (``saved``: the schema's name of the saved block): returns
    [grad_input, *grad_extra_inputs, *grad_params]."""
    return program_of(key, input).backward(input, list(extra_inputs), output, list(extra_outputs), list(params),
                                           saved, grad_output, list(grad_extra_outputs))


def _backward_fake(key, input, extra_inputs, output, extra_outputs, params, saved, grad_output, grad_extra_outputs):
    return [torch.empty_like(input), *[torch.empty_like(e) for e in extra_inputs],
            *[torch.empty_like(p) for p in params]]


# ----------------------------------------------------------------------------------------------------
# The eager call


class EagerCall:
    """The eager forward of one sequence on one device, and the backward of its autograd node: what
    ``Sequential``'s eager call and ``jitfuse::forward``'s Autograd kernel both run, on the route
    :func:`~jitfuse.torch._calls.route` chose. One per :class:`DeviceProgram` (:func:`eager_call`); it holds
    no tensor (the node keeps it for its backward; tensors go through ``save_for_backward``).

    A forward that needs a gradient is one :class:`_Forward` node, ``direct`` or not:

    - ``direct`` (``Sequential``, route DIRECT|GRAD): the node calls the program itself (no dispatcher hop)
      and returns (output, *extra_outputs); the saved block is kept for the backward only, whose program
      call is direct too when the incoming gradients allow it;
    - not ``direct`` (the Autograd kernel, route GRAD): the node calls the op below autograd and returns
      the op's list, the saved block (and an FP8 output's scale_inv) non-differentiable.

    An E4M3 output (FP8, trailing quantize) is returned as a :class:`Float8Tensor` of the input's dtype, so
    the gradient reaching it is not rounded to E4M3 by autograd (the quantize's backward is straight through)."""

    __slots__ = ("key", "prog", "fp8_output")

    def __init__(self, prog: DeviceProgram):
        self.key = prog.definition.key
        self.prog = prog
        self.fp8_output = prog.fp8_output

    # -- forward -----------------------------------------------------------------------------------

    def module_forward(self, r: int, x: Tensor, extras: List[Tensor], params: List[Tensor],
                       rng_state: Optional[Tensor], training: bool) -> Sequence_[Tensor]:
        """Sequential's eager call on a DIRECT route: [output, *extra_outputs]. With a gradient the node runs
        the training program (it saves for the backward, whatever the module's mode). Without, train mode
        still runs the training program: its plan (joint rules, epilogues) may round differently from the
        inference program's, and a reentrant checkpoint's recompute (with grad) must compute the bits its
        first forward (without) did. Eval mode: inference."""
        if r & GRAD:
            return self.node(True, True, x, extras, params, rng_state)  # a tuple
        outs = self.prog.forward(x, extras, params, rng_state, training, with_saved_block=training,
                                 cache_workspace=True)
        if training:
            outs.pop()  # the saved block: nobody reads it
        if self.fp8_output:
            outs = [Float8Tensor(outs[0], outs[-1], x.dtype), *outs[1:-1]]
        return outs

    def node(self, direct: bool, training: bool, x: Tensor, extras: List[Tensor], params: List[Tensor],
             rng_state: Optional[Tensor]) -> Tuple[Tensor, ...]:
        """The autograd node of a forward (see the class): ``_Forward.apply``, through the C++ apply where
        nothing needs its Python wrapper."""
        if direct and _apply_c is not None and not _functorch_active():
            return _apply_c(self, True, training, len(extras), len(params), rng_state, x, *extras, *params)
        return _Forward.apply(self, direct, training, len(extras), len(params), rng_state, x, *extras, *params)

    def node_forward(self, ctx: Any, direct: bool, training: bool, ne: int, npar: int, rng_state: Optional[Tensor],
                     x: Tensor, tensors: Tuple[Tensor, ...]) -> Tuple[Tensor, ...]:
        extras, params = list(tensors[:ne]), list(tensors[ne:ne + npar])
        fp8_out = self.fp8_output
        if direct:
            outs = self.prog.forward(x, extras, params, rng_state, training, cache_workspace=True)  # [..., saved_block]
            returned = outs[:-2] if fp8_out else outs[:-1]
        else:
            with torch._C._AutoDispatchBelowAutograd():
                outs = torch.ops.jitfuse.forward.default(self.key, x, extras, params, rng_state, training)
            returned = list(outs)
            if training:
                ctx.mark_non_differentiable(outs[-1])
            if fp8_out:
                ctx.mark_non_differentiable(outs[-2 if training else -1])
        if fp8_out:
            returned[0] = Float8Tensor(outs[0], outs[-2 if training else -1], x.dtype)
        ctx.call, ctx.direct, ctx.training, ctx.ne, ctx.npar = self, direct, bool(training), ne, npar
        if training:
            # The saved block too (an output of the op, an intermediate of the direct call): saved-tensor
            # hooks (offloading, checkpointing) see everything the backward reads.
            ctx.save_for_backward(x, *extras, *params, *outs)
        # No zero-filled gradient for outputs autograd has none for (the saved block, unused extra outputs).
        ctx.set_materialize_grads(False)
        return tuple(returned)

    # -- backward ----------------------------------------------------------------------------------

    def node_backward(self, ctx: Any, grads: Tuple[Optional[Tensor], ...]) -> List[Tensor]:
        """[grad_input, *grad_extra_inputs, *grad_params] of the node's forward."""
        if not ctx.training:
            raise RuntimeError("jitfuse: backward through a forward that ran with training=False (no saved context)")
        if getattr(ctx, "jf_in_place", False):
            raise RuntimeError(
                "jitfuse: a second backward through one forward of a Sequential whose gradients were computed in "
                "its forward (Linear + CrossEntropy: the first backward wrote them over the saved dx and dW); "
                "retain_graph=True is not supported there: run the forward again")
        saved_tensors = ctx.saved_tensors
        ne, npar = ctx.ne, ctx.npar
        x = saved_tensors[0]
        extras = list(saved_tensors[1:1 + ne])
        params = list(saved_tensors[1 + ne:1 + ne + npar])
        outs = saved_tensors[1 + ne + npar:]
        neo = len(outs) - (3 if self.fp8_output else 2)  # outputs, (the FP8 output's scale_inv), the saved block
        output, extra_outputs, saved_block = outs[0], list(outs[1:1 + neo]), outs[-1]
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
        # A forward with CrossEntropy's labels ran direct (the ops take no integer extra input): so does its
        # backward, which returns None for the labels.
        labels = any(e.dtype in LABEL_DTYPES for e in extras)
        if ctx.direct and not torch.compiler.is_compiling() and (labels or direct_call_ok(gl[0], gl[1:], ())):
            # The gradients the program computed in its forward are scaled in place over the saved block (no
            # allocation: the LM head's dW is the size of its weight); the node then serves no second backward.
            res = self.prog.backward(x, extras, output, extra_outputs, params, saved_block, gl[0], gl[1:],
                                     cache_workspace=True, in_place=True)
            ctx.jf_in_place = wrote_in_place(self.prog, x)
            return res
        return torch.ops.jitfuse.backward.default(self.key, x, extras, output, extra_outputs, params, saved_block,
                                                  gl[0], gl[1:])


def eager_call(prog: DeviceProgram) -> EagerCall:
    """The EagerCall of a DeviceProgram (made on first use)."""
    c = prog.eager_call
    if c is None:
        c = prog.eager_call = EagerCall(prog)
    return c


class _Forward(torch.autograd.Function):
    """The autograd node of a jitfuse forward (:class:`EagerCall` runs it). Tensor lists are flattened into
    ``apply``'s arguments (autograd tracks positional tensors only): (call, direct, training, n_extra_inputs,
    n_params, rng_state, input, *extra_inputs, *params)."""

    @staticmethod
    def forward(ctx, call, direct, training, ne, npar, rng_state, x, *tensors):  # type: ignore[override]
        return call.node_forward(ctx, direct, training, ne, npar, rng_state, x, tensors)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        return (None, None, None, None, None, None, *ctx.call.node_backward(ctx, grads))


# Function.apply without its Python wrapper's per-call work (it walks every argument with pytree to unwrap
# dead functorch wrappers, which only exist under functorch transforms): the C++ apply, bound to _Forward.
try:
    _apply_c = torch._C._FunctionBase.__dict__["apply"].__get__(None, _Forward)
except (AttributeError, KeyError, TypeError):  # pragma: no cover - other PyTorch layouts
    _apply_c = None


def _forward_autograd(keyset, key, input, extra_inputs, params, rng_state, training):
    # The Autograd kernel of jitfuse::forward: what torch.library.register_autograd registers, without
    # its generic argument handling (pytree flatten/unflatten, default filling), which took ~280 us of
    # host time per call on an H100 host (torch.profiler, bias + gelu at M = 16, 2026-11-24).
    extra_inputs = [] if extra_inputs is None else extra_inputs  # None: an AOTInductor package's empty list
    params = [] if params is None else params
    r = route(input, extra_inputs, params)
    if r & GRAD:
        return list(eager_call(program_of(key, input)).node(False, training, input, list(extra_inputs),
                                                             list(params), rng_state))
    if r & DIRECT:
        # Below Autograd, plain CUDA tensors with nothing watching reach the CUDA kernel (forward_op) and
        # nothing else: call it here instead of redispatching (one Python hop and one schema conversion
        # less per call; what torch.compile's generated code pays per call without CUDA graphs).
        return forward_op(key, input, extra_inputs, params, rng_state, training)
    with torch._C._AutoDispatchBelowAutograd():
        return torch.ops.jitfuse.forward.default.redispatch(keyset & torch._C._after_autograd_keyset, key, input,
                                                            extra_inputs, params, rng_state, training)


if _ext.EXT is None:
    _LIB.impl("forward", forward_op, "CUDA")
    _LIB.impl("backward", backward_op, "CUDA")
    _LIB.impl("forward", _forward_autograd, "Autograd", with_keyset=True)
# The extension's ops carry C++ Meta kernels (runtime/torch/ops.cpp: the same shapes from the same program),
# and torch refuses a Python fake kernel beside a Meta one; an extension without them gets these.
FAKE_IN_PYTHON = _ext.EXT is None or not torch._C._dispatch_has_kernel_for_dispatch_key("jitfuse::forward", "Meta")
if FAKE_IN_PYTHON:
    torch.library.register_fake("jitfuse::forward", _forward_fake, lib=_LIB)
    torch.library.register_fake("jitfuse::backward", _backward_fake, lib=_LIB)
elif hasattr(_ext.EXT, "set_symbolic_meta"):  # one answer for symbolic rows on both paths
    _ext.EXT.set_symbolic_meta(symbolic_fake_outputs)
