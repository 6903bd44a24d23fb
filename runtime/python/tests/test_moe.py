# CPU tests of the mixture-of-experts ops from Python (no GPU): the wiring names the routing inputs (the expert
# indices, then the probabilities), the library plans the dropless expert block with one GEMM per expert and pass
# whose rows come from the permute's routing (explain shows it), and refuses what cannot run naming the op;
# jt.MoEPermute / jt.GroupedLinear / jt.MoEUnpermute's attributes and errors (PyTorch, skipped without it).
import json

import pytest

import jitfuse
from jitfuse._channels import wire


def block_ops(e=8, k=2, h=64, f=96, **permute):
    return [{"op": "moe_permute", "num_experts": e, "top_k": k, **permute},
            {"op": "grouped_linear", "num_groups": e, "in_features": h, "out_features": 2 * f}, {"op": "swiglu"},
            {"op": "grouped_linear", "num_groups": e, "in_features": f, "out_features": h}, {"op": "moe_unpermute"}]


def test_wiring_names_the_indices_and_the_probabilities():
    w = wire(block_ops())
    assert w.n_extra_inputs == 2
    assert [s.kind for s in w.extra_inputs] == ["indices", "probs"]
    assert [s.op for s in w.extra_inputs] == [0, 4]


def test_library_plans_the_dropless_block_with_routed_gemms(ctx):
    s = jitfuse.Sequence(ctx, json.dumps({"format": "jitfuse.sequence/1", "name": "moe", "ops": block_ops()}), "bf16")
    e = s.explain((301, 64), training=True, arch=90)
    assert e.ops[0].output == (602, 64)  # T k rows, no multiple of the experts needed
    gemms = [st for st in e.program.forward + e.program.backward if st.get("gemm")]
    assert sorted(st["gemm"] for st in gemms) == ["dgrad", "dgrad", "fwd", "fwd", "wgrad", "wgrad"]  # one per kind
    for st in gemms:
        assert st["m"] == 602  # every expert's rows: the T k bound
        rows = st["rows"]
        assert rows["routing"] == gemms[0]["rows"]["routing"] and rows["experts"] == 8
        assert "once per pass" in rows["read"]


def test_library_refuses_groups_that_are_not_the_experts(ctx):
    ops = block_ops()
    ops[1]["num_groups"] = 4
    with pytest.raises(jitfuse.JitfuseError, match=r"num_groups = 4 but op 0 \(moe_permute\) routes to 8 experts"):
        jitfuse.Sequence(ctx, json.dumps({"ops": ops}), "bf16").explain((300, 64))


def test_library_plans_the_expert_parallel_block_for_one_rank(ctx):
    ops = block_ops(e=8)
    ops.insert(1, {"op": "moe_dispatch", "group": "ep"})
    ops.insert(5, {"op": "moe_combine", "group": "ep"})
    for op in ops:
        if op["op"] == "grouped_linear":
            op["num_groups"] = 4
    e = jitfuse.Sequence(ctx, json.dumps({"name": "ep", "ops": ops}), "bf16").explain(
        (300, 64), training=True, arch=90, world_size=2, rank=1)
    assert e.ops[1].output == (1200, 64)  # W T k rows: no routing overflows it
    comms = [s for s in e.program.forward if s["kind"] == "comm"]
    assert [c["collective"] for c in comms] == ["all_to_all", "all_to_all"]
    assert comms[0]["all_to_all"]["all_gathers_counts"] and not comms[1]["all_to_all"]["all_gathers_counts"]
    assert comms[0]["all_to_all"]["direction"] == "to the experts" and comms[0]["all_to_all"]["experts"] == 8
    back = [s["all_to_all"]["direction"] for s in e.program.backward if s["kind"] == "comm"]
    assert back == ["to the experts", "back from the experts"]
    gemms = [st for st in e.program.forward if st.get("gemm")]
    assert all(g["rows"]["experts"] == 4 and g["m"] == 1200 for g in gemms)  # this rank's experts
    with pytest.raises(jitfuse.JitfuseError, match=r"not a multiple of the world size 3"):
        jitfuse.Sequence(ctx, json.dumps({"name": "ep", "ops": ops}), "bf16").explain((300, 64), world_size=3, rank=0)


class TestModule:
    @pytest.fixture(autouse=True)
    def _torch(self):
        self.torch = pytest.importorskip("torch")
        try:
            import jitfuse.torch as jt
        except jitfuse.UnsupportedTorchError as e:
            pytest.skip(str(e))
        self.jt = jt

    def test_attrs_and_extra_inputs(self):
        jt, torch = self.jt, self.torch
        m = jt.Sequential(jt.MoEPermute(8, 2), jt.GroupedLinear(8, 64, 192, device="cpu", dtype=torch.float32),
                          jt.SwiGLU(), jt.GroupedLinear(8, 96, 64, device="cpu", dtype=torch.float32),
                          jt.MoEUnpermute(), name="experts")
        assert m.n_extra_inputs == 2
        assert m._jf_labels == {0: torch.int64, 1: torch.float32}
        assert jt.MoEPermute(8, 2, layout="padded", capacity=40, index_dtype=torch.int32).attrs(True) == {
            "num_experts": 8, "top_k": 2, "layout": "padded", "index_dtype": "int32", "capacity": 40}
        assert m[1].weight.shape == (8, 192, 64)
        w = torch.nn.Parameter(torch.zeros(8, 192, 64))
        assert jt.GroupedLinear(8, 64, 192, weight=w).weight is w  # shared, not copied

    def test_expert_parallel_modules(self):
        jt, torch = self.jt, self.torch
        assert jt.MoEDispatch().attrs(True) == {"group": "ep"}
        assert jt.MoEDispatch("ep2", max_rows=4096).attrs(True) == {"group": "ep2", "max_rows": 4096}
        assert jt.MoECombine().spec() == {"op": "moe_combine", "group": "ep"}
        m = jt.Sequential(jt.MoEPermute(8, 2), jt.MoEDispatch(), jt.GroupedLinear(4, 64, 192, device="cpu"),
                          jt.SwiGLU(), jt.GroupedLinear(4, 96, 64, device="cpu"), jt.MoECombine(), jt.MoEUnpermute(),
                          name="ep_experts")
        assert m.n_extra_inputs == 2
        e = m.explain((300, 64), dtype=torch.float32, world_size=2, rank=0)
        assert e.ops[1].output == (1200, 64)
        with pytest.raises(ValueError, match="max_rows must be None or an int >= 1"):
            jt.MoEDispatch(max_rows=0)

    def test_construction_errors(self):
        jt, torch = self.jt, self.torch
        with pytest.raises(ValueError, match="layout='padded'.*capacity="):
            jt.MoEPermute(8, 2, layout="padded")
        with pytest.raises(ValueError, match="top_k must be an int >= 1"):
            jt.MoEPermute(8, 0)
        with pytest.raises(TypeError, match="index_dtype must be torch.int64 or torch.int32"):
            jt.MoEPermute(8, 2, index_dtype=torch.float32)
        with pytest.raises(ValueError, match=r"GroupedLinear weight has shape \[8, 64, 64\]"):
            jt.GroupedLinear(8, 64, 192, weight=torch.nn.Parameter(torch.zeros(8, 64, 64)))
        with pytest.raises(jt.ChannelError, match="moe_unpermute"):
            jt.Sequential(jt.MoEUnpermute())
