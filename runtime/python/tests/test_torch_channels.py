# Tests of jitfuse.torch that need PyTorch but no GPU (nothing here runs a program; a Sequential's wiring comes from
# the library's parser, jf_sequence_wiring): the sequence JSON the modules emit with channels, the extra
# input/output counts of Sequential, the construction errors (the library's messages) naming the op, Linear.from_pair / Bias.from_pair (storage sharing, the half order, refusals), and
# export_definitions' warning about a compiler that links libstdc++ statically in part (docs/deploy.md).
# Skipped where PyTorch is not installed or is older than jitfuse.torch supports (conftest.need_torch); not marked
# gpu: `python3 -m pytest runtime/python/tests` runs them on any machine with PyTorch (CUDA or not).
import copy
import hashlib
import json
import sys

import pytest

import jitfuse

from conftest import need_torch

torch = need_torch()  # or a skip of this module: no torch, or one jitfuse.torch refuses

from torch import nn  # noqa: E402

import jitfuse.torch as jt  # noqa: E402
from jitfuse.torch import _registry  # noqa: E402

CPU = dict(device="cpu", dtype=torch.float32)
H, I = 64, 96


def document(model, training=True, dtype=torch.float32):
    return _registry._definitions[model._jf_keys[training][dtype]].document()


def llama_half(h=H, i=I):
    return jt.Sequential(jt.Fork("residual"), jt.RMSNorm(h, eps=1e-6), jt.Linear(h, 2 * i), jt.SwiGLU(),
                         jt.Linear(i, h), jt.AddChannel("residual"), name="llama_half", **CPU)


def test_hidden_channel_block_json_and_counts():
    m = llama_half()
    assert (m.n_extra_inputs, m.n_extra_outputs) == (0, 0)
    assert (m._n_extra_inputs, m._n_extra_outputs) == (0, 0)
    doc = document(m)
    assert "input_channels" not in doc
    assert doc["ops"][0] == {"op": "make_extra_output", "channel": "residual"}
    assert doc["ops"][-1] == {"op": "add_extra_input", "channel": "residual"}
    assert [o["op"] for o in doc["ops"]] == ["make_extra_output", "rmsnorm", "linear", "swiglu", "linear",
                                             "add_extra_input"]
    assert document(m, training=False) == doc
    assert isinstance(m[0], jt.MakeExtraOutput) and isinstance(m[5], jt.AddExtraInput)
    assert repr(m[0]) == "Fork(channel='residual')" and repr(m[5]) == "AddChannel(channel='residual')"


def test_sequences_without_channels_emit_what_they_did():
    """No channel, no 'returned', no 'input_channels': the JSON and the key are those of before channels."""
    m = jt.Sequential(jt.MakeExtraOutput(), jt.LayerNorm(H), jt.Linear(H, H), jt.AddExtraInput(), name="plain", **CPU)
    doc = document(m)
    assert json.dumps(doc) == json.dumps({"format": "jitfuse.sequence/1", "name": "plain", "ops": [
        {"op": "make_extra_output"}, {"eps": 1e-05, "op": "layernorm"},
        {"in_features": H, "op": "linear", "out_features": H}, {"op": "add_extra_input"}]})
    canon = [json.dumps(o, sort_keys=True) for o in doc["ops"]]
    d = _registry._definitions[m._jf_keys[True][torch.float32]]
    blob = json.dumps([canon, "fp32", [list(p) for p in d.params], [list(s) for s in d.param_shapes],
                       list(d.accumulate), ""])
    assert m._jf_keys[True][torch.float32] == int(hashlib.sha256(blob.encode()).hexdigest()[:15], 16)
    assert (m.n_extra_inputs, m.n_extra_outputs) == (1, 1)
    assert d.input_channels == ()


def test_returned_and_input_channels_json_and_slots():
    m = jt.Sequential(jt.MakeExtraOutput(), jt.AddExtraInput(), jt.Fork("r", returned=True), jt.AddChannel("b"),
                      jt.Linear(H, H), jt.AddChannel("a"), jt.AddChannel("b"), jt.MakeExtraOutput(),
                      jt.AddExtraInput(), jt.AddChannel("r"), jt.Fork("hid"), jt.GELU(), jt.AddChannel("hid"),
                      jt.AddChannel("a"), input_channels=["a", "b"], name="mixed", **CPU)
    assert (m.n_extra_inputs, m.n_extra_outputs) == (4, 3)
    assert [(s.op, s.channel) for s in m.wiring.extra_inputs] == [(1, None), (3, "b"), (5, "a"), (8, None)]
    assert [(s.op, s.channel) for s in m.wiring.extra_outputs] == [(0, None), (2, "r"), (7, None)]
    doc = document(m)
    assert list(doc) == ["format", "name", "input_channels", "ops"] and doc["input_channels"] == ["a", "b"]
    assert doc["ops"][2] == {"op": "make_extra_output", "channel": "r", "returned": True}
    assert doc["ops"][10] == {"op": "make_extra_output", "channel": "hid"}
    assert m.input_channels == ("a", "b") and "input_channels=['a', 'b']" in m.extra_repr()
    # The declared order is part of the definition (the library's document), so another order is another key.
    m2 = jt.Sequential(*[copy.deepcopy(o) for o in m._ops], input_channels=("b", "a"), name="mixed", **CPU)
    assert m2.n_extra_inputs == 4 and m2._jf_keys[True][torch.float32] != m._jf_keys[True][torch.float32]


def test_fan_out_and_op_by_name():
    m = jt.Sequential(jt.Fork("h"), jt.Linear(H, H), jt.AddChannel("h"), jt.GELU(), jt.AddChannel("h"), **CPU)
    assert (m.n_extra_inputs, m.n_extra_outputs) == (0, 0) and m.wiring.channel("h").readers == (2, 4)
    # Op("...") with channel attributes counts like the classes (the counts come from the op dicts).
    g = jt.Sequential(jt.Op("make_extra_output", channel="h"), jt.GELU(), jt.Op("add_extra_input", channel="h"),
                      jt.Op("add_extra_input"), **CPU)
    assert (g.n_extra_inputs, g.n_extra_outputs) == (1, 0)


def test_op_arguments():
    assert jt.MakeExtraOutput().n_extra_outputs == 1 and jt.MakeExtraOutput().attrs(True) == {}
    assert jt.MakeExtraOutput("r").n_extra_outputs == 0
    assert jt.MakeExtraOutput("r", returned=True).n_extra_outputs == 1
    assert jt.AddExtraInput().n_extra_inputs == 1 and jt.AddExtraInput("r").n_extra_inputs == 0
    assert jt.Fork("r", returned=True).attrs(True) == {"channel": "r", "returned": True}
    assert jt.MakeExtraOutput("r", returned=False).spec() == {"op": "make_extra_output", "channel": "r"}
    with pytest.raises(ValueError, match="returned=True needs a channel"):
        jt.MakeExtraOutput(returned=True)
    with pytest.raises(TypeError, match="returned must be True or False"):
        jt.Fork("r", returned="yes")
    # Channel names are the library's to check, when a Sequential wires them (naming the op).
    with pytest.raises(jt.ChannelError, match=r"blk: .*op 0 \(make_extra_output\): a channel name is a string of "
                                              r"1 to 64 characters"):
        jt.Sequential(jt.Fork("a b"), jt.AddChannel("a b"), name="blk", **CPU)
    with pytest.raises(jt.ChannelError, match=r"blk: .*op 1 \(add_extra_input\): a channel name"):
        jt.Sequential(jt.GELU(), jt.AddChannel("x" * 65), name="blk", **CPU)
    with pytest.raises(jt.ChannelError, match=r"blk: .*op 0 \(make_extra_output\): a channel name"):
        jt.Sequential(jt.MakeExtraOutput(""), jt.GELU(), name="blk", **CPU)
    with pytest.raises(TypeError, match="Fork needs a channel name"):
        jt.Fork(None)
    with pytest.raises(TypeError, match="AddChannel needs a channel name"):
        jt.AddChannel(None)


@pytest.mark.parametrize("ops, kwargs, msg", [
    (lambda: [jt.Linear(H, H), jt.AddChannel("r")], {},
     r"blk: .*op 1 \(add_extra_input\): channel 'r' is read before anything writes it"),
    (lambda: [jt.AddChannel("r"), jt.Fork("r", returned=True)], {},
     r"blk: .*op 0 \(add_extra_input\): channel 'r' is read before anything writes it: its make_extra_output is op 1"),
    (lambda: [jt.Fork("r"), jt.AddChannel("r"), jt.Fork("r"), jt.AddChannel("r")], {},
     r"blk: .*op 2 \(make_extra_output\): channel 'r' already has a source \(op 0\)"),
    (lambda: [jt.Linear(H, H), jt.Fork("r"), jt.GELU()], {},
     r"blk: .*op 1 \(make_extra_output\): channel 'r' is never read: read it with add_extra_input "
     r"\{\"channel\": \"r\"\}"),
    (lambda: [jt.AddChannel("a")], {"input_channels": ["a", "b"]},
     r"blk: .*input_channels\[1\]: input channel 'b' is never read"),
    (lambda: [jt.AddChannel("a")], {"input_channels": ["a", "a"]},
     r"blk: .*input_channels\[1\]: channel 'a' is declared twice"),
    (lambda: [jt.AddChannel("a")], {"input_channels": "a"}, r'blk: .*"input_channels" must be an array'),
    (lambda: [jt.AddChannel("a"), jt.Fork("a", returned=True)], {"input_channels": ["a"]},
     r'blk: .*op 1 \(make_extra_output\): channel \'a\' already has a source \("input_channels"\)'),
    (lambda: [jt.GELU(), jt.Op("make_extra_output", channel="a b"), jt.AddChannel("a")], {},
     r"blk: .*op 1 \(make_extra_output\): a channel name"),
    (lambda: [jt.GELU(), jt.Op("make_extra_output", returned=True)], {},
     r'blk: .*op 1 \(make_extra_output\): "returned" needs a "channel"'),
    (lambda: [jt.Fork("r"), jt.Op("gelu", channel="r"), jt.AddChannel("r")], {},
     r'blk: .*op 1 \(gelu\): "channel" belongs to make_extra_output'),
], ids=["unknown", "read_before_write", "duplicate_writer", "never_read", "input_never_read", "input_twice",
        "input_string", "writer_of_input", "invalid_name", "returned_without_channel", "channel_on_gelu"])
def test_sequential_refuses_bad_wiring_naming_the_op(ops, kwargs, msg):
    with pytest.raises(jt.ChannelError, match=msg) as e:
        jt.Sequential(*ops(), name="blk", **kwargs, **CPU)
    assert isinstance(e.value, ValueError)


def test_deepcopy_keeps_the_wiring():
    m = jt.Sequential(jt.Fork("r", returned=True), jt.Linear(H, H), jt.AddChannel("r"), jt.AddChannel("s"),
                      input_channels=["s"], **CPU)
    c = copy.deepcopy(m)
    assert c.wiring == m.wiring and (c.n_extra_inputs, c.n_extra_outputs) == (1, 1)
    assert c._jf_keys == m._jf_keys  # the same definition: one key


# ---- Linear.from_pair / Bias.from_pair -----------------------------------------------------------------------

def pair(n=I, k=H, bias=False, dtype=torch.float32):
    torch.manual_seed(0)
    return (nn.Linear(k, n, bias=bias, dtype=dtype), nn.Linear(k, n, bias=bias, dtype=dtype))


def test_from_pair_concatenates_first_then_second_and_shares_storage():
    gate, up = pair()
    g0, u0 = gate.weight.detach().clone(), up.weight.detach().clone()
    gate_param, up_param = gate.weight, up.weight
    lin = jt.Linear.from_pair(gate, up)
    assert isinstance(lin, jt.Linear) and (lin.in_features, lin.out_features) == (H, 2 * I)
    assert lin.weight.shape == (2 * I, H) and lin.weight.dtype == torch.float32 and lin.weight.requires_grad
    assert torch.equal(lin.weight[:I], g0) and torch.equal(lin.weight[I:], u0)  # FIRST half: first (gated)
    # The sources are the same Parameter objects, now views of the new weight's halves.
    assert gate.weight is gate_param and up.weight is up_param
    assert gate.weight.data_ptr() == lin.weight.data_ptr()
    assert up.weight.data_ptr() == lin.weight.data_ptr() + I * H * lin.weight.element_size()
    assert torch.equal(gate.weight, g0) and torch.equal(up.weight, u0)
    with torch.no_grad():  # an optimizer's in-place update of the new weight ...
        lin.weight.mul_(2).add_(1)
    assert torch.equal(gate.weight, 2 * g0 + 1) and torch.equal(up.weight, 2 * u0 + 1)  # ... is the sources'
    x = torch.randn(5, H)
    assert torch.equal(torch.cat([gate(x), up(x)], -1), x @ lin.weight.detach().T)
    # The swapped-out module's state_dict reads, and load_state_dict writes, the shared storage.
    sd = gate.state_dict()
    assert set(sd) == {"weight"} and torch.equal(sd["weight"], lin.weight[:I])
    up.load_state_dict({"weight": torch.zeros(I, H)})
    assert torch.equal(lin.weight[I:], torch.zeros(I, H)) and torch.equal(lin.weight[:I], 2 * g0 + 1)
    # The gradient goes to the new weight only (the sources are other leaves).
    (x @ lin.weight.T).sum().backward()
    assert lin.weight.grad is not None and gate.weight.grad is None and up.weight.grad is None


def test_from_pair_in_a_sequential_keeps_sharing():
    gate, up = pair(dtype=torch.bfloat16)
    lin = jt.Linear.from_pair(gate, up)
    m = jt.Sequential(jt.RMSNorm(H), lin, jt.SwiGLU(), jt.Linear(I, H), device="cpu", dtype=torch.bfloat16)
    assert m[1].weight is lin.weight and gate.weight.data_ptr() == m[1].weight.data_ptr()
    assert document(m, dtype=torch.bfloat16)["ops"][1] == {"op": "linear", "in_features": H, "out_features": 2 * I}
    assert set(m.state_dict()) == {"0.weight", "1.weight", "3.weight"}


def test_from_pair_of_tensors_and_biases():
    gate, up = pair(bias=True)
    gb, ub = gate.bias.detach().clone(), up.bias.detach().clone()
    with pytest.raises(ValueError, match=r"first \(Linear\) has a bias and jitfuse's Linear has none: pass the "
                                         r"weights, Linear.from_pair\(first.weight, second.weight\), and take the "
                                         r"biases with Bias.from_pair"):
        jt.Linear.from_pair(gate, up)
    lin = jt.Linear.from_pair(gate.weight, up.weight, accumulate_grad=True)
    bias = jt.Bias.from_pair(gate, up)
    assert lin.accumulate_grad and lin.attrs(True)["accumulate_grad"] is True
    assert bias.features == 2 * I and torch.equal(bias.bias, torch.cat([gb, ub]))
    assert gate.bias.data_ptr() == bias.bias.data_ptr() and gate.weight.data_ptr() == lin.weight.data_ptr()
    x = torch.randn(3, H)
    assert torch.allclose(torch.cat([gate(x), up(x)], -1), x @ lin.weight.detach().T + bias.bias.detach())
    b1, b2 = torch.randn(I), torch.randn(I)
    b = jt.Bias.from_pair(b1, b2)
    assert b1.data_ptr() == b.bias.data_ptr() and not b.bias.requires_grad  # plain tensors: no grad asked
    with pytest.raises(ValueError, match=r"Bias.from_pair: first \(Linear\) has no bias"):
        jt.Bias.from_pair(*pair())


@pytest.mark.parametrize("args, err, msg", [
    (lambda: (nn.Linear(H, I, bias=False), nn.Linear(H, I + 1, bias=False)), ValueError, r"differ in shape: \[96, 64\] "
     r"and \[97, 64\]"),
    (lambda: (nn.Linear(H, I, bias=False), nn.Linear(H, I, bias=False, dtype=torch.bfloat16)), TypeError,
     r"the two weights differ: torch.float32 on cpu and torch.bfloat16 on cpu"),
    (lambda: (torch.zeros(I, H, dtype=torch.float64), torch.zeros(I, H, dtype=torch.float64)), TypeError,
     r"float32, float16 or bfloat16, not torch.float64"),
    (lambda: (torch.zeros(I), torch.zeros(I)), ValueError, r"first's weight has shape \[96\]; expected 2 dims"),
    (lambda: (nn.Conv1d(H, I, 1), nn.Conv1d(H, I, 1)), TypeError, r"first must be an nn.Linear"),
    (lambda: (nn.Linear(H, I, bias=False), nn.Linear(H, I, bias=True)), ValueError, r"second \(Linear\) has a bias"),
], ids=["shape", "dtype", "float64", "dims", "conv", "one_bias"])
def test_from_pair_refusals(args, err, msg):
    with pytest.raises(err, match=msg):
        jt.Linear.from_pair(*args())


def test_from_pair_refuses_same_or_non_leaf_tensors():
    w = nn.Parameter(torch.randn(2 * I, H))
    with pytest.raises(ValueError, match="first and second are the same tensor"):
        jt.Linear.from_pair(w, w)
    with pytest.raises(ValueError, match="first's weight is the result of an autograd op"):
        jt.Linear.from_pair(w[:I], w[I:])
    a, b = w.detach()[:I], w.detach()[I:]  # two views of one tensor are fine: copied into a new weight
    lin = jt.Linear.from_pair(a, b)
    assert torch.equal(lin.weight, w) and a.data_ptr() == lin.weight.data_ptr()


def test_linear_bias_keyword_as_nn_linear():
    assert jt.Linear(H, I, bias=False).weight.shape == (I, H)
    assert jt.Linear(H, I, False, device="cpu").out_features == I
    with pytest.raises(ValueError, match=r"jitfuse's Linear has no bias: add the op Bias\(96\) after it"):
        jt.Linear(H, I, bias=True)


def test_from_pair_requires_grad_follows_the_sources():
    gate, up = pair()
    gate.weight.requires_grad_(False)
    up.weight.requires_grad_(False)
    assert not jt.Linear.from_pair(gate, up).weight.requires_grad
    gate, up = pair()
    gate.weight.requires_grad_(False)
    assert jt.Linear.from_pair(gate, up).weight.requires_grad


def test_export_definitions_warns_about_a_compiler_that_links_libstdcxx_statically(tmp_path, monkeypatch):
    # The devtoolset-style GCC of docs/deploy.md as $CXX (what Inductor would build the package with): the
    # definitions are written, with a warning naming the compiler, its linker script and the fix.
    from jitfuse import _toolchain
    script = tmp_path / "libstdc++.so"
    script.write_text("/* GNU ld script */\nINPUT ( /usr/lib64/libstdc++.so.6 -lstdc++_nonshared )\n")
    cxx = tmp_path / "g++"
    cxx.write_text(f"#!/bin/sh\necho {script}\n")
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.delitem(sys.modules, "torch._inductor.config", raising=False)
    monkeypatch.setattr(_toolchain, "_warned", set())
    m = llama_half()
    with pytest.warns(jitfuse.StaticLibstdcxxWarning) as rec:
        assert jt.export_definitions(m, tmp_path / "model.jfseq") >= 1
    ours = [w for w in rec if issubclass(w.category, jitfuse.StaticLibstdcxxWarning)]
    assert len(ours) == 1
    msg = str(ours[0].message)
    assert msg.startswith(f"jitfuse (export_definitions): the C++ compiler that Inductor builds AOTInductor packages "
                          f"with, {cxx} (from $CXX)")
    assert str(script) in msg and "-lstdc++_nonshared" in msg and "CXX=" in msg
    assert ours[0].filename == __file__  # points at the caller's line
