# What a sequence key means (its Definition) and where it runs: one jitfuse context per device, one
# DeviceProgram per (key, device) holding the library's sequence, its prepared shapes and FP8 recipe state.
"""Sequence definitions by content key and their programs per device.

One op pair serves every sequence: the sequence is the ops' first argument, an int ``key`` (a hash of the
sequence's ops, recipe and parameter list), so the key means the same sequence in every process, and
identical modules share one prepared jf_sequence (ABI 2 takes every tensor per call, and a sequence may be
run from several threads at once), except under FP8 recipes, whose recipe state is per sequence (their key
is salted per module). :func:`forget` drops a module's own keys when it is garbage-collected.
"""

import atexit
import hashlib
import json
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple
from typing import Sequence as Sequence_

import torch
from torch import Tensor

from ..errors import JitfuseError
from ..lib import Context, ProgramInfo, Sequence
from . import _calls, _ext
from ._dtypes import FP8_RECIPES


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
    input_channels: Tuple[str, ...] = ()            # the caller's channels (the document's "input_channels")

    def document(self) -> Dict[str, Any]:
        doc: Dict[str, Any] = {"format": "jitfuse.sequence/1", "name": self.name}
        if self.input_channels:  # only when used: the documents of sequences without them are as before
            doc["input_channels"] = list(self.input_channels)
        doc["ops"] = [json.loads(o) for o in self.ops]
        return doc


_registry_lock = threading.RLock()
_definitions: Dict[int, Definition] = {}
_programs: Dict[Tuple[int, int], "DeviceProgram"] = {}
_contexts: Dict[int, Context] = {}


def define(name: str, ops: List[Dict[str, Any]], recipe: str, params: List[Tuple[int, str]],
           param_shapes: List[Tuple[int, ...]], accumulate: List[bool], n_extra_inputs: int, n_extra_outputs: int,
           uses_rng: bool, salt: str = "", input_channels: Sequence_[str] = ()) -> int:
    """Registers a sequence definition and returns its key (a positive int64). ``input_channels``: the
    channels the caller provides (hashed only when there are some, so other keys are as before)."""
    canon = tuple(json.dumps(o, sort_keys=True) for o in ops)
    fields: List[Any] = [list(canon), recipe, params, [list(s) for s in param_shapes], accumulate, salt]
    if input_channels:
        fields.append({"input_channels": list(input_channels)})
    blob = json.dumps(fields)
    key = int(hashlib.sha256(blob.encode()).hexdigest()[:15], 16)  # 60 bits: a positive int64
    # The name is not hashed: identical sequences share one key (and one prepared program) under any name.
    d = Definition(key, name, canon, recipe, tuple((int(i), str(n)) for i, n in params),
                   tuple(tuple(int(x) for x in s) for s in param_shapes), tuple(bool(a) for a in accumulate),
                   n_extra_inputs, n_extra_outputs, uses_rng, tuple(str(c) for c in input_channels))
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


def device_program(key: int, device_index: int) -> "DeviceProgram":
    """The DeviceProgram of (key, device), made on first use."""
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
            p = _programs[(key, device_index)] = DeviceProgram(d, device_index)
        return p


def program_of(key: int, t: Tensor) -> "DeviceProgram":
    """The DeviceProgram of ``key`` on the device of a real tensor."""
    return _programs.get((key, _calls.device_index(t))) or device_program(key, _calls.device_index(t))


def existing_programs(key: int) -> List["DeviceProgram"]:
    with _registry_lock:
        return [p for (k, _), p in _programs.items() if k == key]


def forget(keys: Sequence_[int]) -> None:
    """Drops the definitions of ``keys`` and closes their programs (the library's sequences: prepared
    programs, FP8 recipe state and weight copies). For a module whose keys are its own (FP8, salted per
    module): called when it is garbage-collected. The library's free waits for work still using the memory."""
    if _ext.EXT is not None:
        try:
            _ext.EXT.forget(list(keys))  # before the sequences are destroyed (the C++ side borrows them)
        except Exception:  # interpreter shutdown
            pass
    with _registry_lock:
        for k in keys:
            _definitions.pop(k, None)
        progs = [_programs.pop(kd) for kd in [kd for kd in _programs if kd[0] in keys]]
    for p in progs:
        try:
            p.close()
        except Exception:  # interpreter shutdown: the library may be gone already
            pass


class DeviceProgram:
    """A Definition's jf_sequence in the jitfuse context of one device, with its prepared shapes (not the
    library's IR ``Program``, nor :class:`jitfuse.ProgramExplain`, the record ``explain`` prints).

    ``forward`` / ``backward`` are the kernels of the custom ops (:func:`jitfuse.torch._calls.run_forward`,
    :func:`~jitfuse.torch._calls.run_backward`), with their argument blocks cached per (shape, thread).

    FP8 recipes: the sequence keeps FP8 copies of the linear weights. Every forward casts them again
    (``jf_forward_args.fp8_weights_unchanged`` = 0) unless the caller promised, with
    :func:`jitfuse.torch.fp8_weights_unchanged`, that the weights did not change since the last forward:
    no version counter or pointer is trusted, since fused optimizers, NCCL and raw writes bypass both."""

    forward = _calls.run_forward
    backward = _calls.run_backward

    def __init__(self, d: Definition, device_index: int):
        self.definition = d
        self.device_index = device_index
        self.sequence = Sequence(context(device_index), d.document(), d.recipe)
        from . import distributed  # tensor parallel: the group's communicator, before the first prepare
        distributed.bind(self.sequence, d.document()["ops"], device_index)
        self.names = [(i, n.encode()) for i, n in d.params]
        self.last_shape: Optional[Tuple[int, ...]] = None
        self._tls = _calls.CallCache()
        self._lib = self.sequence.lib
        self._cdll = self._lib.cdll
        self._handle = self.sequence.handle
        self._jf_program_forward = self._cdll.jf_program_forward
        self._jf_program_backward = self._cdll.jf_program_backward
        self.fp8 = d.recipe in FP8_RECIPES
        self._fp8_views: Optional[Dict[str, Tensor]] = None
        # FP8 with a trailing quantize: the output is a Float8Tensor whose scale_inv is copied, per call, from
        # the quantize's state (jf_fp8_state.scale_inv: what decodes the codes this forward wrote).
        self.fp8_output = self.fp8 and bool(d.ops) and json.loads(d.ops[-1]).get("op") == "quantize"
        # Its jitfuse.torch._ops.EagerCall, made on the first eager call (that module builds on this one).
        self.eager_call: Optional[Any] = None
        if _ext.EXT is not None and device_index >= 0:
            # The C++ ops run this jf_sequence too (one FP8 recipe state, one set of prepared programs).
            dtype = {"fp32": "float32", "fp16": "float16"}.get(d.recipe, "bfloat16")
            _ext.EXT.register_sequence(d.key, device_index, int(self._handle), d.name, dtype, list(d.params),
                                       list(d.accumulate), d.n_extra_inputs, d.n_extra_outputs, self.fp8,
                                       self.fp8_output, self.sequence.num_ops - 1)  # the library's last op

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

    # -- FP8 recipe state --------------------------------------------------------------------------

    def fp8_state_views(self) -> Dict[str, Tensor]:
        """FP8: every recipe-state block of this sequence on its device, as float32 tensors aliasing the
        library's memory ([scale, scale_inv, amax_history...]), keyed "<op>.<tensor>" ("3.weight", "5.output"
        for a quantize op). Allocates the state if no prepare did yet. The views live as long as this
        DeviceProgram."""
        views = self._fp8_views
        if views is None:
            views = {}
            with torch.cuda.device(self.device_index):
                for i, op in enumerate(self.definition.ops):
                    kind = json.loads(op).get("op")
                    if kind == "linear" and self.definition.recipe != "fp8_block":  # block scales: no state
                        for t in ("input", "weight", "grad_output"):
                            views[f"{i}.{t}"] = self._state_view(self.sequence.fp8_operand_state(i, t))
                    elif kind == "quantize":
                        views[f"{i}.output"] = self._state_view(self.sequence.fp8_state(i))
            self._fp8_views = views
        return views

    def fp8_output_state(self) -> Tensor:
        """The recipe-state block of the trailing quantize (its [1] is the scale_inv of the last output)."""
        return self.fp8_state_views()[f"{len(self.definition.ops) - 1}.output"]

    def _state_view(self, st: Any) -> Tensor:
        n = 2 + int(st.history_len)  # one block: [scale, scale_inv, history...] (jitfuse.h, jf_fp8_state)
        iface = {"shape": (n,), "typestr": "<f4", "data": (int(st.scale), False), "version": 2, "strides": None}
        holder = type("_StateBlock", (), {"__cuda_array_interface__": iface})()
        return torch.as_tensor(holder, device=torch.device("cuda", self.device_index))

    def close(self) -> None:
        """Frees the library's sequence (its prepared programs, FP8 state and weight copies)."""
        self._fp8_views = None
        self._tls = _calls.CallCache()
        self.sequence.close()


def _resolve(key: int, device_index: int) -> bool:
    """The C++ ops' resolver: a key they have not seen on a device (a compiled graph's first call there)."""
    if key not in _definitions:
        return False  # the C++ op raises "unknown sequence key"
    device_program(key, device_index)  # registers it with the extension (DeviceProgram.__init__)
    return True


if _ext.EXT is not None:
    _ext.EXT.set_resolver(_resolve)
    _ext.EXT.set_error_class(JitfuseError)


DEFINITIONS_FORMAT = "jitfuse.torch_sequences/1"


def write_definitions(path: str, keys: Sequence_[int]) -> int:
    """Writes the definitions of ``keys`` in the format a C++ host reads (``jitfuse_torch::load_definitions``,
    ``$JITFUSE_TORCH_SEQUENCES``): one line per key, tab-separated: key, recipe, extra inputs, extra outputs,
    FP8 output (0/1), name, parameters (op:name:accumulate, or '-'), the sequence document as one-line JSON.
    Returns how many it wrote."""
    lines = [DEFINITIONS_FORMAT]
    with _registry_lock:
        defs = [_definitions[k] for k in sorted(set(keys)) if k in _definitions]
    for d in defs:
        params = ",".join(f"{i}:{n}:{int(a)}" for (i, n), a in zip(d.params, d.accumulate)) or "-"
        fp8_output = d.recipe in FP8_RECIPES and bool(d.ops) and json.loads(d.ops[-1]).get("op") == "quantize"
        name = " ".join(d.name.split()) or "sequence"
        lines.append("\t".join([str(d.key), d.recipe, str(d.n_extra_inputs), str(d.n_extra_outputs),
                                "1" if fp8_output else "0", name, params,
                                json.dumps(d.document(), separators=(",", ":"))]))
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return len(defs)


def _release_at_exit() -> None:
    """At interpreter exit, before module globals (the contexts among them) are torn down in whatever order:
    every key forgotten, which closes the C++ extension's programs (they borrow this registry's sequences)
    first, then this registry's sequences, while their contexts are still alive. Without it the extension's
    programs were closed by C++ static destructors after their contexts were gone (heap corruption at exit,
    H100 run 1 of session 35)."""
    with _registry_lock:
        keys = sorted(set(_definitions) | {k for k, _ in _programs})
    if keys:
        forget(keys)


atexit.register(_release_at_exit)  # after torch's own (atexit runs last-registered first): ours runs before
