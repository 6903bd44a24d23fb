# CPU tests of cross_entropy from Python: the channel wiring counts its labels as an extra input, the library
# plans it (the joint head for mean/sum, unfused for none) and refuses bad attributes naming them (no GPU, no
# PyTorch); jt.CrossEntropy's attributes, JSON, validation and placement (PyTorch, no GPU; skipped without it).
import json

import pytest

import jitfuse
from jitfuse._channels import Slot, wire


def head_ops(v=50257, h=64, **ce):
    return [{"op": "linear", "in_features": h, "out_features": v}, {"op": "cross_entropy", **ce}]


def test_wiring_counts_the_labels_as_the_last_extra_input():
    w = wire([{"op": "add_extra_input"}, {"op": "linear", "in_features": 8, "out_features": 8},
              {"op": "cross_entropy"}])
    assert w.n_extra_inputs == 2
    assert w.extra_inputs == (Slot(0), Slot(2))
    assert [s.kind for s in w.extra_inputs] == ["add", "labels"]  # the library's: no gradient for the labels


def test_library_plans_the_chunked_head_and_refuses_none(ctx):
    s = jitfuse.Sequence(ctx, json.dumps({"format": "jitfuse.sequence/1", "name": "head", "ops": head_ops()}), "bf16")
    e = s.explain((7, 64), training=True, arch=90)
    assert [g.rule for g in e.forward] == ["linear_cross_entropy_chunked"]
    assert [g.rule for g in e.backward] == ["linear_cross_entropy_chunked"]
    assert e.ops[-1].output == (1,)
    n = jitfuse.Sequence(ctx, json.dumps({"ops": head_ops(reduction="none")}), "bf16")
    en = n.explain((7, 64), training=True, arch=90)
    assert all(g.rule != "linear_cross_entropy_chunked" for g in en.forward)
    assert any(d.rule == "linear_cross_entropy_chunked" and not d.taken and "reduction none" in d.reason
               for d in en.decisions)
    assert en.ops[-1].output == (7,)


@pytest.mark.parametrize("attrs,needle", [
    ({"reduction": "avg"}, "expected one of mean|sum|none"),
    ({"label_smoothing": 1.0}, "expected a value < 1"),
    ({"z_loss": -1}, "expected a value >= 0"),
    ({"label_dtype": "int16"}, "expected one of int64|int32"),
])
def test_library_refuses_bad_attributes(ctx, attrs, needle):
    with pytest.raises(jitfuse.JitfuseError, match="cross_entropy") as err:
        jitfuse.Sequence(ctx, json.dumps({"ops": [{"op": "cross_entropy", **attrs}]}), "bf16")
    assert needle in str(err.value)


def test_library_refuses_cross_entropy_before_the_end_and_under_fp8(ctx):
    with pytest.raises(jitfuse.JitfuseError, match=r"op 0 \(cross_entropy\) must be the sequence's last op"):
        jitfuse.Sequence(ctx, json.dumps({"ops": [{"op": "cross_entropy"}, {"op": "identity"}]}), "bf16")
    with pytest.raises(jitfuse.JitfuseError, match="a loss has no FP8 form"):
        jitfuse.Sequence(ctx, json.dumps({"ops": [{"op": "layernorm"}, {"op": "cross_entropy"}]}), "fp8_delayed")


class TestModule:
    @pytest.fixture(autouse=True)
    def _torch(self):
        self.torch = pytest.importorskip("torch")
        try:
            import jitfuse.torch as jt
        except jitfuse.UnsupportedTorchError as e:  # as conftest.need_torch, for these tests only
            pytest.skip(str(e))
        self.jt = jt

    def test_attrs_json_and_extra_inputs(self):
        jt, torch = self.jt, self.torch
        from jitfuse.torch import _registry
        m = jt.Sequential(jt.Linear(16, 100), jt.CrossEntropy(label_smoothing=0.1, softcap=30.0), device="cpu",
                          dtype=torch.float32, name="ce_head")
        assert m.n_extra_inputs == 1 and m.n_extra_outputs == 0
        doc = _registry._definitions[m._jf_keys[True][torch.float32]].document()
        assert doc["ops"][-1] == {"op": "cross_entropy", "reduction": "mean", "ignore_index": -100,
                                  "label_smoothing": 0.1, "z_loss": 0.0, "softcap": 30.0, "label_dtype": "int64"}
        assert jt.CrossEntropy(label_dtype=torch.int32).attrs(True)["label_dtype"] == "int32"
        e = m.explain(shape=(8, 16), training=True, arch=90)
        assert [g.rule for g in e.forward] == ["linear_cross_entropy_chunked"]

    def test_construction_errors(self):
        jt, torch = self.jt, self.torch
        with pytest.raises(ValueError, match="reduction must be"):
            jt.CrossEntropy(reduction="avg")
        with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 1\)"):
            jt.CrossEntropy(label_smoothing=1.0)
        with pytest.raises(ValueError, match="z_loss must be a finite number >= 0"):
            jt.CrossEntropy(z_loss=float("nan"))
        with pytest.raises(ValueError, match="softcap must be a finite number >= 0"):
            jt.CrossEntropy(softcap=-1)
        with pytest.raises(TypeError, match="ignore_index must be an int"):
            jt.CrossEntropy(ignore_index=1.5)
        with pytest.raises(TypeError, match="label_dtype must be torch.int64 or torch.int32"):
            jt.CrossEntropy(label_dtype=torch.float32)
        # The library's refusals, when the module is built (jt.ChannelError: a ValueError).
        with pytest.raises(jt.ChannelError, match=r"sequential: .*op 0 \(cross_entropy\) must be the sequence's "
                                                  r"last op \(it turns the stream into a loss\); op 1 \(identity\)"):
            jt.Sequential(jt.CrossEntropy(), jt.Identity())
        with pytest.raises(jt.ChannelError, match=r"head: sequence 'head': op 1 \(cross_entropy\) under recipe "
                                                  r"fp8_delayed: a loss has no FP8 form"):
            jt.Sequential(jt.Linear(16, 32), jt.CrossEntropy(), recipe="fp8_delayed", device="cpu",
                          dtype=torch.bfloat16, name="head")

    def test_labels_checked_before_the_library(self):
        jt, torch = self.jt, self.torch
        m = jt.Sequential(jt.CrossEntropy(), name="ce")
        x = torch.zeros(4, 10)
        with pytest.raises(TypeError, match=r"^ce: sequence 'ce' takes 1 extra input\(s\) \(the labels of cross_entropy\); got 0$"):
            m(x)
        with pytest.raises(ValueError, match="jitfuse runs on CUDA tensors"):
            m(x, torch.zeros(4, dtype=torch.int64))
