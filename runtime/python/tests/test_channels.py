# CPU tests of named channels from Python (jitfuse._channels, no PyTorch, no GPU): the wiring the library's parser
# reports (jf_sequence_wiring: slots, kinds, channels), every refusal with the library's message naming the op, and
# the slots against the buffers of the program the library plans.

import pytest

import jitfuse
from jitfuse._channels import ChannelError, Slot, document, wire

H = 64


def fork(channel=None, returned=None):
    o = {"op": "make_extra_output"}
    if channel is not None:
        o["channel"] = channel
    if returned is not None:
        o["returned"] = returned
    return o


def add(channel=None):
    return {"op": "add_extra_input", **({"channel": channel} if channel is not None else {})}


LIN = {"op": "linear", "in_features": H, "out_features": H}
NORM = {"op": "rmsnorm"}
GELU = {"op": "gelu"}

LLAMA_HALF = [fork("residual"), NORM, {"op": "linear", "in_features": H, "out_features": 2 * 96}, {"op": "swiglu"},
              {"op": "linear", "in_features": 96, "out_features": H}, add("residual")]

# (ops, input_channels, extra input slots, extra output slots)
VALID = {
    "plain": ([fork(), LIN, add(), fork(), GELU, add()], (), [Slot(2), Slot(5)], [Slot(0), Slot(3)]),
    "hidden": (LLAMA_HALF, (), [], []),
    "fan_out": ([fork("h"), NORM, LIN, add("h"), GELU, add("h"), add("h")], (), [], []),
    "returned": ([fork("r", True), LIN, add("r")], (), [], [Slot(0, "r")]),
    "returned_unread": ([LIN, fork("r", True), GELU], (), [], [Slot(1, "r")]),
    "returned_false": ([fork("r", False), LIN, add("r")], (), [], []),
    "input_channel": ([LIN, add("skip"), GELU, add("skip")], ("skip",), [Slot(1, "skip")], []),
    # Slots in op order: plain readers and first readers of input channels interleave; later readers of an
    # input channel own no slot; plain forks and returned channels interleave likewise.
    "mixed": ([fork(), add(), fork("r", True), add("b"), LIN, add("a"), add("b"), fork(), add(), add("r"),
               fork("hid"), GELU, add("hid"), add("a")],
              ("a", "b"), [Slot(1), Slot(3, "b"), Slot(5, "a"), Slot(8)], [Slot(0), Slot(2, "r"), Slot(7)]),
}


@pytest.mark.parametrize("case", sorted(VALID))
def test_slots_follow_the_rules(case):
    ops, inputs, ins, outs = VALID[case]
    w = wire(ops, inputs)
    assert list(w.extra_inputs) == ins and list(w.extra_outputs) == outs
    assert (w.n_extra_inputs, w.n_extra_outputs) == (len(ins), len(outs))
    assert w.input_channels == tuple(inputs)


def test_slot_kinds_are_the_libraries():
    w = wire(VALID["mixed"][0], ("a", "b"))
    assert [s.kind for s in w.extra_inputs] == ["add", "channel", "channel", "add"]
    assert [s.kind for s in w.extra_outputs] == ["output", "returned", "output"]
    w = wire([add(), {"op": "linear", "in_features": 8, "out_features": 8}, {"op": "cross_entropy"}])
    assert [(s.op, s.kind) for s in w.extra_inputs] == [(0, "add"), (2, "labels")]


def test_channels_record_source_and_readers():
    w = wire(VALID["mixed"][0], ("a", "b"))
    assert [c.name for c in w.channels] == ["a", "b", "r", "hid"]  # input channels first, then by source
    assert w.channel("a").source == -1 and w.channel("a").readers == (5, 13)
    assert w.channel("b").readers == (3, 6)
    assert w.channel("r").source == 2 and w.channel("r").returned and w.channel("r").readers == (9,)
    assert w.channel("hid").source == 10 and not w.channel("hid").returned
    with pytest.raises(KeyError):
        w.channel("nope")
    assert str(Slot(3, "b")) == "op 3 (channel 'b')" and str(Slot(1)) == "op 1"


def test_a_sequence_reports_its_wiring(ctx):
    ops, inputs, ins, outs = VALID["mixed"]
    seq = jitfuse.Sequence(ctx, document(ops, inputs), "bf16")
    assert seq.wiring() == wire(ops, inputs)
    assert list(seq.wiring().extra_inputs) == ins
    seq.close()


def test_names():
    for ok in ("a", "residual", "x.y-z_0", "A" * 64):
        assert wire([fork(ok, True)]).extra_outputs == (Slot(0, ok),)
    for bad in ("", "a b", "résidu", "a/b", "A" * 65, 3, None, ["a"]):
        with pytest.raises(ChannelError, match=r"op 0 \(make_extra_output\): a channel name is a string of 1 to "
                                               r"64 characters from A-Z a-z 0-9 _ \. -, not "):
            wire([{"op": "make_extra_output", "channel": bad, "returned": True}])
    assert issubclass(ChannelError, ValueError) and issubclass(ChannelError, jitfuse.JitfuseError)


# (ops, input_channels, message): every refusal is the library's, naming the op index (or the input_channels entry).
INVALID = {
    "read_before_write": ([LIN, add("r")], (), r"op 1 \(add_extra_input\): channel 'r' is read before anything "
                          r"writes it: write it with an earlier make_extra_output"),
    "read_before_later_write": ([add("r"), LIN, fork("r", True)], (),
                                r"op 0 \(add_extra_input\): channel 'r' is read before anything writes it: its "
                                r"make_extra_output is op 2, after this reader"),
    "duplicate_writer": ([fork("r"), add("r"), fork("r"), add("r")], (),
                         r"op 2 \(make_extra_output\): channel 'r' already has a source \(op 0\)"),
    "writer_of_input_channel": ([add("r"), fork("r", True)], ("r",),
                                r"op 1 \(make_extra_output\): channel 'r' already has a source \(\"input_channels\"\)"),
    "never_read": ([LIN, fork("r"), GELU], (), r"op 1 \(make_extra_output\): channel 'r' is never read: read it "
                   r"with add_extra_input"),
    "input_never_read": ([LIN, add("a")], ("a", "b"), r"input_channels\[1\]: input channel 'b' is never read"),
    "input_declared_twice": ([add("a")], ("a", "a"), r"input_channels\[1\]: channel 'a' is declared twice"),
    "input_channels_string": ([add("a")], "a", r'"input_channels" must be an array of channel names'),
    "bad_input_name": ([add("a")], ("a", "b c"), r"input_channels\[1\]: a channel name"),
    "bad_name": ([fork("a b"), add("a b")], (), r"op 0 \(make_extra_output\): a channel name"),
    "null_name": ([LIN, {"op": "add_extra_input", "channel": None}], (), r"op 1 \(add_extra_input\): a channel name"),
    "returned_without_channel": ([LIN, fork(returned=True)], (), r'op 1 \(make_extra_output\): "returned" needs a '
                                r'"channel"'),
    "returned_not_bool": ([fork("r", 1), add("r")], (), r'op 0 \(make_extra_output\): "returned" must be true or '
                          r'false'),
    "returned_on_reader": ([fork("r"), {"op": "add_extra_input", "channel": "r", "returned": True}], (),
                           r'op 1 \(add_extra_input\): "returned" belongs to make_extra_output'),
    "channel_on_other_op": ([fork("r"), {"op": "gelu", "channel": "r"}, add("r")], (),
                            r'op 1 \(gelu\): "channel" belongs to make_extra_output \(writes a channel\) and '
                            r'add_extra_input \(reads one\), not to gelu'),
    "labels_before_the_end": ([{"op": "cross_entropy"}, GELU], (),
                              r"op 0 \(cross_entropy\) must be the sequence's last op"),
    "no_ops": ([], (), r'"ops" must be a non-empty array of ops'),
    "op_not_an_object": ([3], (), r"op 0: each op is an object with a string \"op\""),
}


@pytest.mark.parametrize("case", sorted(INVALID))
def test_refusals_are_the_librarys_naming_the_op(ctx, case):
    ops, inputs, msg = INVALID[case]
    with pytest.raises(ChannelError, match=msg) as ours:
        wire(ops, inputs)
    assert ours.value.status in (jitfuse._abi.JF_ERR_PARSE, jitfuse._abi.JF_ERR_INVALID_ARGUMENT)
    # The same document through jitfuse.Sequence: the same message, word for word.
    with pytest.raises((jitfuse.InvalidArgumentError, jitfuse.ParseError)) as theirs:
        jitfuse.Sequence(ctx, document(ops, inputs), "bf16")
    assert theirs.value.message == ours.value.message and ours.value.status == theirs.value.status


def test_hostile_arguments_are_channel_errors():
    with pytest.raises(ChannelError, match="not a JSON sequence document"):
        wire([{"op": "gelu", "approximate": object()}])
    with pytest.raises(ChannelError, match="not a JSON sequence document"):
        wire([GELU], [float("nan")])  # NaN is not JSON (json.dumps would write NaN; allow_nan is off below)
    with pytest.raises(ChannelError, match=r"a loss has no FP8 form"):
        wire([NORM, {"op": "cross_entropy"}], recipe="fp8_delayed", name="head")
    with pytest.raises(ChannelError, match=r"sequence 'blk': op 0 \(quantize\) under recipe fp8_current must be "
                                           r"the last op"):
        wire([{"op": "quantize"}, GELU], recipe="fp8_current", name="blk")
    assert wire([GELU], recipe="fp8_current").n_extra_inputs == 0


# ---- the library's program agrees -------------------------------------------------------------------------

def _caller_slots(explanation, role):
    return {b["name"] for b in explanation.program.buffers if b["role"] == role}


@pytest.mark.parametrize("case", sorted(VALID))
def test_the_programs_caller_buffers_are_the_slots(ctx, case):
    ops, inputs, ins, outs = VALID[case]
    seq = jitfuse.Sequence(ctx, document(ops, inputs), "bf16")
    e = seq.explain((24, H), training=True)
    assert _caller_slots(e, "extra_in") == {f"extra_input[{k}]" for k in range(len(ins))}
    assert _caller_slots(e, "extra_out") == {f"extra_output[{k}]" for k in range(len(outs))}
    assert _caller_slots(e, "grad_extra_in") == {f"grad_extra_input[{k}]" for k in range(len(ins))}
    assert _caller_slots(e, "grad_extra_out") == {f"grad_extra_output[{k}]" for k in range(len(outs))}
    seq.close()


def test_count_checks_are_the_librarys(ctx):
    # jf_sequence_check_counts: the verdict and message both torch layers show for a wrong count.
    from jitfuse._channels import count_error
    seq = jitfuse.Sequence(ctx, {"name": "blk", "input_channels": ["r"],
                                 "ops": [add("r"), NORM, LIN, add(), fork()]})
    seq.check_counts("blk", 2)
    seq.check_counts("blk", 2, shape=(8, H), n_params=2)
    seq.check_counts("blk", 2, shape=(8, H), n_params=2, n_extra_outputs=1, n_grad_extra_outputs=1)
    with pytest.raises(jitfuse.InvalidArgumentError,
                       match=r": blk: sequence 'blk' takes 2 extra input\(s\) \(add_extra_input ops without a channel "
                             r"and one per input channel\) and 2 parameter\(s\); got 2 and 3$"):
        seq.check_counts("blk", 2, shape=(8, H), n_params=3)
    with pytest.raises(jitfuse.InvalidArgumentError, match=r"1 extra output\(s\) and their gradients; got 2, 1 \(0\)$"):
        seq.check_counts("blk", 2, n_extra_outputs=1, n_grad_extra_outputs=0)
    with pytest.raises(jitfuse.InvalidArgumentError, match=r"expected shape|linear"):
        seq.check_counts("blk", 2, shape=(8, H + 1), n_params=2)
    seq.close()
    msg = count_error([add("r"), GELU, add()], ["r"], ctx, "bf16", "blk", "mod", 0)
    assert msg == ("mod: sequence 'blk' takes 2 extra input(s) (add_extra_input ops without a channel and one per "
                   "input channel); got 0")
