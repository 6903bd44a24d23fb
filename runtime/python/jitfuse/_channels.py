# Named channels of the sequence format (jitfuse.sequence/1, docs/ops.md#channels): the wiring of a list of op
# dicts as the library's parser checks and numbers it (jf_sequence_wiring), so that jitfuse.torch refuses a bad
# wiring when a module is built, with the library's message. No PyTorch; needs libjitfuse (no GPU).
"""Named channels: a sequence's extra input and extra output slots and its channels, as the library numbers them.

An op ``make_extra_output`` may write the stream into a channel (``"channel": "residual"``), hidden from
the caller unless ``"returned": true``; an ``add_extra_input`` with a channel adds the channel (written by an
earlier ``make_extra_output``, or provided by the caller when the document declares it in
``"input_channels"``). :func:`wire` hands the ops to the library's parser (``jf_sequence_create`` on a
planning context, then ``jf_sequence_wiring``) and returns what it numbered:

- extra inputs, in op order: every ``add_extra_input`` without a channel (kind ``"add"``), the FIRST reader of
  each input channel (``"channel"``: one slot per input channel, however many ops read it), and the labels of
  a ``cross_entropy`` (``"labels"``: integers, no gradient);
- extra outputs, in op order: every ``make_extra_output`` without a channel (``"output"``) or with
  ``"returned": true`` (``"returned"``).

A document the parser refuses raises :class:`ChannelError` with the library's message (naming the op).

>>> w = wire([{"op": "make_extra_output", "channel": "residual"}, {"op": "gelu"},
...           {"op": "add_extra_input", "channel": "residual"}])
>>> (w.n_extra_inputs, w.n_extra_outputs)
(0, 0)
"""

import json
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Mapping, Optional, Sequence, Tuple

from .errors import JitfuseError


class ChannelError(JitfuseError, ValueError):
    """The library's parser refused the document :func:`wire` handed it: a channel wiring (read before it is
    written, written twice, never read, a bad name, ...) or anything else it refuses in a sequence (an op out
    of place, a bad attribute). ``message`` is the library's (jf_last_error), ``status`` its jf_status."""


@dataclass(frozen=True)
class Slot:
    """One of the caller's extra tensors: the op that owns it (its index in the ops given to :func:`wire`: a
    plain add_extra_input or make_extra_output, the first reader of an input channel, a returned channel's
    make_extra_output, a cross_entropy's labels), its channel and its kind (see the module)."""

    op: int
    channel: Optional[str] = None
    kind: str = field(default="", compare=False)

    def __str__(self) -> str:
        return f"op {self.op}" + (f" (channel {self.channel!r})" if self.channel is not None else "")


@dataclass(frozen=True)
class Channel:
    """A channel: its source (the make_extra_output's op index, or -1 for an input channel), its readers' op
    indices and whether the caller also gets it (returned)."""

    name: str
    source: int
    readers: Tuple[int, ...]
    returned: bool = False


@dataclass(frozen=True)
class Wiring:
    """The caller's view of a sequence: its extra input and extra output slots, in slot order, and its
    channels by name (in the order their sources appear: input channels first)."""

    extra_inputs: Tuple[Slot, ...]
    extra_outputs: Tuple[Slot, ...]
    channels: Tuple[Channel, ...]
    input_channels: Tuple[str, ...] = ()

    @property
    def n_extra_inputs(self) -> int:
        return len(self.extra_inputs)

    @property
    def n_extra_outputs(self) -> int:
        return len(self.extra_outputs)

    def channel(self, name: str) -> Channel:
        for c in self.channels:
            if c.name == name:
                return c
        raise KeyError(name)

    @classmethod
    def from_json(cls, j: Mapping[str, Any]) -> "Wiring":
        """The Wiring of jf_sequence_wiring's JSON."""
        def slots(key: str) -> Tuple[Slot, ...]:
            return tuple(Slot(int(s["op"]), s.get("channel"), str(s["kind"])) for s in j[key])
        channels = tuple(Channel(str(c["name"]), int(c["source"]), tuple(int(r) for r in c["readers"]),
                                 bool(c["returned"])) for c in j["channels"])
        return cls(slots("extra_inputs"), slots("extra_outputs"), channels, tuple(j["input_channels"]))


_planning_lock = threading.Lock()
_planning: Optional[Any] = None


def _planning_context() -> Any:
    """The context :func:`wire` parses in when given none (built-in rules and ``JITFUSE_RULE_PATH``)."""
    global _planning
    with _planning_lock:
        if _planning is None:
            from .lib import Context
            _planning = Context()
        return _planning


def document(ops: Sequence[Mapping[str, Any]], input_channels: Any = (), name: str = "wiring") -> str:
    """The sequence document (JSON text) of ``ops`` and ``input_channels`` that :func:`wire` parses. A string
    ``input_channels`` is passed as it is (the library refuses it); any other iterable becomes a list."""
    doc: Dict[str, Any] = {"format": "jitfuse.sequence/1", "name": name}
    if isinstance(input_channels, str) or input_channels:
        doc["input_channels"] = input_channels if isinstance(input_channels, str) else list(input_channels)
    doc["ops"] = list(ops)
    try:
        return json.dumps(doc, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ChannelError(f"the ops are not a JSON sequence document: {e}") from None


def wire(ops: Sequence[Mapping[str, Any]], input_channels: Iterable[str] = (), ctx: Optional[Any] = None,
         recipe: str = "bf16", name: str = "wiring") -> Wiring:
    """The wiring of ``ops`` (op dicts of the sequence format) with ``input_channels`` (the document's
    ``"input_channels"``), as the library's parser checks and numbers it: ``ctx`` (a :class:`jitfuse.Context`,
    default: one planning context of this process) creates the sequence ``name`` under ``recipe`` (the wiring
    does not depend on it; what the recipe refuses, e.g. a loss under FP8, is refused here too) and reports
    it with ``jf_sequence_wiring``. Needs no GPU. Raises :class:`ChannelError` with the library's message for
    any document the library refuses."""
    if not isinstance(input_channels, str):
        input_channels = list(input_channels)
    text = document(ops, input_channels, name)
    from .lib import Sequence
    try:
        seq = Sequence(ctx if ctx is not None else _planning_context(), text, recipe)
    except JitfuseError as e:  # the message names the op; the function (jf_sequence_create) would be noise
        raise ChannelError(e.message, e.status) from None
    try:
        return seq.wiring()
    finally:
        seq.close()


def count_error(ops: Sequence[Mapping[str, Any]], input_channels: Iterable[str], ctx: Optional[Any], recipe: str,
                name: str, caller: str, n_extra_inputs: int) -> str:
    """The library's message for a call of the sequence :func:`wire` numbered with ``n_extra_inputs`` extra
    inputs (``jf_sequence_check_counts``: the one count check of both torch layers). Needs no GPU."""
    from .lib import Sequence as LibSequence
    seq = LibSequence(ctx if ctx is not None else _planning_context(), document(ops, list(input_channels), name),
                      recipe)
    try:
        seq.check_counts(caller, n_extra_inputs)
    except JitfuseError as e:
        return e.message
    finally:
        seq.close()
    return f"{caller}: {n_extra_inputs} extra input(s) is the count the library expects, yet not the module's"
