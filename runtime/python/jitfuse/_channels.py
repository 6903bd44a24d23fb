# Named channels of the sequence format (jitfuse.sequence/1, docs/ops.md#add_extra_input): checks a list of op
# dicts and numbers the caller's extra tensors, exactly as the library's parser does (runtime/ops/sequence.cpp),
# so that jitfuse.torch refuses a bad wiring when a module is built. Standard library only (no PyTorch).
"""Named channels: validation and slot numbering of a sequence's extra inputs and outputs.

An op ``make_extra_output`` may write the stream into a channel (``"channel": "residual"``), hidden from
the caller unless ``"returned": true``; an ``add_extra_input`` with a channel adds the channel (written by an
earlier ``make_extra_output``, or provided by the caller when the document declares it in
``"input_channels"``). :func:`wire` checks a sequence's channels and numbers the caller's extra tensors:

- extra inputs, in op order: every ``add_extra_input`` without a channel, the FIRST reader of each input
  channel (one slot per input channel, however many ops read it), and the labels of a ``cross_entropy``
  (integers, no gradient: :data:`LABELS_OPS`);
- extra outputs, in op order: every ``make_extra_output`` without a channel or with ``"returned": true``.

>>> w = wire([{"op": "make_extra_output", "channel": "residual"}, {"op": "gelu"},
...           {"op": "add_extra_input", "channel": "residual"}])
>>> (w.n_extra_inputs, w.n_extra_outputs)
(0, 0)
"""

import re
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

MAX_CHANNEL_NAME = 64
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,%d}\Z" % MAX_CHANNEL_NAME)
FORK = "make_extra_output"
READER = "add_extra_input"
# Ops that read an extra input of their own (integer labels, one per row) beside the stream.
LABELS_OPS = ("cross_entropy",)


class ChannelError(ValueError):
    """A channel wiring the sequence format refuses (the library refuses the same document)."""


def check_channel_name(name: Any, where: str) -> str:
    """``name`` if it is a valid channel name (1 to 64 characters from A-Z a-z 0-9 _ . -), else ChannelError."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ChannelError(f"{where}: a channel name is a string of 1 to {MAX_CHANNEL_NAME} characters from "
                           f"A-Z a-z 0-9 _ . -, not {name!r}")
    return name


@dataclass(frozen=True)
class Slot:
    """One of the caller's extra tensors: the op that owns it (a plain add_extra_input or make_extra_output,
    the first reader of an input channel, or a returned channel's make_extra_output) and its channel."""

    op: int
    channel: Optional[str] = None

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


def wire(ops: Sequence[Mapping[str, Any]], input_channels: Iterable[str] = ()) -> Wiring:
    """Checks the channels of ``ops`` (op dicts of the sequence format) and ``input_channels`` (the document's
    ``"input_channels"``) and numbers the caller's extra tensors. Raises :class:`ChannelError` naming the op
    index for: ``channel``/``returned`` on another op, an invalid name, ``returned`` without a channel or not a
    bool, an input channel declared twice, a second source for a channel, a channel read before anything
    writes it, a hidden channel nobody reads, an input channel nobody reads."""
    if isinstance(input_channels, str):
        raise ChannelError(f"input_channels must be a list of channel names, not the string {input_channels!r}")
    declared: List[str] = []
    for k, n in enumerate(input_channels):
        n = check_channel_name(n, f"input_channels[{k}]")
        if n in declared:
            raise ChannelError(f"input_channels[{k}]: channel {n!r} is declared twice")
        declared.append(n)

    writer: Dict[str, int] = {n: -1 for n in declared}  # op index of the source; -1: the caller's
    returned: Dict[str, bool] = {}
    readers: Dict[str, List[int]] = {n: [] for n in declared}
    ins: List[Slot] = []
    outs: List[Slot] = []
    names: List[Tuple[int, str, bool]] = []  # (op, channel, returned) of each op, for the later passes
    for i, o in enumerate(ops):
        kind = o.get("op")
        where = f"op {i} ({kind})"
        channel, ret = o.get("channel"), o.get("returned")
        if ("channel" in o or "returned" in o) and kind not in (FORK, READER):
            key = "channel" if "channel" in o else "returned"
            raise ChannelError(f"{where}: {key!r} belongs to make_extra_output (writes a channel) and "
                               f"add_extra_input (reads one), not to {kind}")
        if "channel" in o:
            channel = check_channel_name(channel, where)
        if "returned" in o:
            if kind != FORK:
                raise ChannelError(f"{where}: 'returned' belongs to make_extra_output")
            if not isinstance(ret, bool):
                raise ChannelError(f"{where}: 'returned' must be True or False, not {ret!r}")
            if ret and channel is None:
                raise ChannelError(f"{where}: 'returned' needs a channel (a make_extra_output without one is "
                                   f"always the caller's extra output)")
        ret = bool(ret)
        names.append((i, channel, ret))
        if kind in LABELS_OPS:
            ins.append(Slot(i))  # its labels
            continue
        if kind == FORK:
            if channel is None or ret:
                outs.append(Slot(i, channel))
            if channel is None:
                continue
            if channel in writer:
                src = writer[channel]
                raise ChannelError(f"{where}: channel {channel!r} already has a source "
                                   f"({'input_channels' if src < 0 else f'op {src}'}): a channel has one source; "
                                   f"name this one differently")
            writer[channel] = i
            returned[channel] = ret
            readers[channel] = []
        elif kind == READER:
            if channel is None:
                ins.append(Slot(i))
                continue
            if channel not in writer:
                later = next((j for j, o2 in enumerate(ops) if j > i and o2.get("op") == FORK
                              and o2.get("channel") == channel), None)
                hint = (f"its make_extra_output is op {later}, after this reader; a source comes before its readers"
                        if later is not None else
                        "write it with an earlier MakeExtraOutput(channel=...) / Fork(...), or declare it in "
                        "input_channels")
                raise ChannelError(f"{where}: channel {channel!r} is read before anything writes it: {hint}")
            if writer[channel] < 0 and not readers[channel]:
                ins.append(Slot(i, channel))  # the first reader of an input channel owns its extra input
            readers[channel].append(i)
    for i, channel, ret in names:
        if ops[i].get("op") == FORK and channel is not None and not ret and not readers[channel]:
            raise ChannelError(f"op {i} (make_extra_output): channel {channel!r} is never read: read it with "
                               f"add_extra_input (AddChannel({channel!r})) after this op, or set returned=True "
                               f"to hand it to the caller")
    for k, n in enumerate(declared):
        if not readers[n]:
            raise ChannelError(f"input_channels[{k}]: input channel {n!r} is never read: read it with "
                               f"add_extra_input (AddChannel({n!r})) or remove it")
    channels = tuple(Channel(n, writer[n], tuple(readers[n]), returned.get(n, False))
                     for n in sorted(writer, key=lambda n: writer[n]))
    return Wiring(tuple(ins), tuple(outs), channels, tuple(declared))
