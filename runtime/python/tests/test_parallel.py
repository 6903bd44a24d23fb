# Tensor parallelism from Python without a GPU (docs/parallel.md): one rank of a group planned with
# Sequence.explain(world_size=, rank=), the comm steps in its program, and the errors named.
import json

import pytest

import jitfuse


def _tp_mlp(repo):
    return json.loads((repo / "tools/examples/tp_mlp.json").read_text())


def test_explain_plans_one_rank_of_a_group(ctx, repo, monkeypatch):
    seq = jitfuse.Sequence(ctx, _tp_mlp(repo), "bf16")
    # From 2 ranks (docs/parallel.md, "copy"): every collective by copy engines, NCCL's way ("local") beside it. The
    # all-gather: this rank's shard pushed to every other rank on the side stream, copied into the gathered buffer,
    # the other ranks' rows taken as they arrive, each with its GEMM; the reduce-scatter: the row GEMM in one block
    # per rank, the other ranks' first, each pushed to its owner, then the sum of the staged blocks.
    for world, rank in ((2, 1), (4, 3)):
        e = seq.explain((1024, 1024), training=True, arch=90, world_size=world, rank=rank)
        comms = [(c["collective"], c["stream"], c.get("way", "-")) for c in e.program.forward if c["kind"] == "comm"]
        pushes = [("peer_push", "side", "peers")] * (world - 1)
        takes = [("peer_take", "side", "peers")] * world
        assert comms == (pushes + takes + [("all_gather", "side", "nccl")] + pushes +
                         [("peer_wait", "caller", "peers"), ("peer_ack", "caller", "peers"),
                          ("reduce_scatter", "caller", "nccl")])
        steps = e.program.forward
        roots = [s["root"] for s in steps if s["kind"] == "comm" and s["collective"] == "peer_push"]
        assert roots == [(rank + j) % world for j in range(1, world)] * 2
        gemms = [s["m"] for s in steps if s["kind"] == "gemm"]
        # The gathered rows' GEMMs (a block per rank), NCCL's way's two, the row GEMM's blocks, NCCL's whole one.
        assert gemms == [1024] * world + [1024, (world - 1) * 1024] + [1024] * world + [world * 1024]
        back = [(s["collective"], s.get("way", "-")) for s in e.program.backward if s["kind"] == "comm"]
        assert back.count(("peer_push", "peers")) == 2 * (world - 1)
        assert back.count(("all_gather", "nccl")) == 1 and back.count(("reduce_scatter", "nccl")) == 1
    # JITFUSE_OVERLAP=local: NCCL's collectives alone, beside the GEMMs that do not need them.
    monkeypatch.setenv("JITFUSE_OVERLAP", "local")
    e = jitfuse.Sequence(ctx, _tp_mlp(repo), "bf16").explain((1024, 1024), training=True, arch=90, world_size=4,
                                                              rank=3)
    comms = [(c["collective"], c["stream"]) for c in e.program.forward if c["kind"] == "comm"]
    assert comms == [("all_gather", "side"), ("reduce_scatter", "caller")]
    assert [g["m"] for g in e.program.forward if g["kind"] == "gemm"] == [1024, 3 * 1024, 4 * 1024]
    back = [(s["collective"], s["stream"]) for s in e.program.backward if s["kind"] == "comm"]
    assert back == [("all_gather", "side"), ("reduce_scatter", "side")]
    monkeypatch.delenv("JITFUSE_OVERLAP")
    # JITFUSE_OVERLAP=chunks (the way one rank takes): the gather pipelined with the column GEMM (a broadcast of
    # each chunk's rows, root = the owner), the reduce-scatter with the row GEMM (a reduce of each chunk's rows to
    # it), all on the side stream: 4 chunks.
    monkeypatch.setenv("JITFUSE_OVERLAP", "chunks")
    e = jitfuse.Sequence(ctx, _tp_mlp(repo), "bf16").explain((1024, 1024), training=True, arch=90, world_size=2,
                                                              rank=1)
    comms = [s for s in e.program.forward if s["kind"] == "comm"]
    assert [c["collective"] for c in comms] == ["broadcast"] * 4 + ["reduce"] * 4
    assert [c["root"] for c in comms] == [0, 0, 1, 1] * 2
    assert all(c["stream"] == "side" for c in comms)
    assert all(c["count"] == 512 * 1024 for c in comms)
    back = [s["collective"] for s in e.program.backward if s["kind"] == "comm"]
    assert back == ["broadcast"] * 4 + ["reduce"] * 4
    # The GEMMs see the whole sequence, 2 shards of 1024 tokens, in chunks of half a shard.
    gemms = [s for s in e.program.forward if s["kind"] == "gemm"]
    assert len(gemms) == 8 and sum(g["m"] for g in gemms) == 2 * 2048
    monkeypatch.delenv("JITFUSE_OVERLAP")
    # Under per-tensor FP8 each operand is cast once: the all-gather half is NCCL's on the caller's stream, both ways
    # (each rank sends its 1024x1024 bf16 shard to 3 others), the gathered input cast and its GEMM whole; the
    # reduce-scatter half runs FP8 GEMMs over row blocks of the codes, each block pushed to its owner.
    f8 = jitfuse.Sequence(ctx, _tp_mlp(repo), "fp8_delayed").explain((1024, 1024), world_size=4, rank=3)
    comms = [s for s in f8.program.forward if s["kind"] == "comm"]
    ag = comms[0]
    assert ag["collective"] == "all_gather" and ag["wire_bytes"] == 1024 * 1024 * 2 * 3
    assert (ag["stream"], ag.get("way", "-")) == ("caller", "-")
    assert [c["collective"] for c in comms[1:]] == ["peer_push"] * 3 + ["peer_wait", "peer_ack", "reduce_scatter"]
    assert [g["m"] for g in f8.program.forward if g["kind"] == "gemm"] == [4096] + [1024] * 4 + [4096]
    # One rank (the default without a communicator): NCCL copies, nothing crosses a link.
    one = seq.explain((1024, 1024), training=True, arch=90)
    assert all(s["wire_bytes"] == 0 for s in one.program.forward if s["kind"] == "comm")


def test_parallel_errors_are_named(ctx, repo):
    seq = jitfuse.Sequence(ctx, _tp_mlp(repo), "bf16")
    with pytest.raises(jitfuse.InvalidArgumentError, match="rank 4 of world size 4"):
        seq.explain((1024, 1024), world_size=4, rank=4)
    with pytest.raises(jitfuse.InvalidArgumentError, match="not divisible by the world size 3"):
        seq.explain((1023, 1024), world_size=3, rank=0)
    ops = [{"op": "all_gather", "group": "tp"},
           {"op": "linear", "in_features": 8, "out_features": 8, "tensor_parallel": "row", "group": "other"}]
    with pytest.raises(jitfuse.InvalidArgumentError, match="one sequence runs on one communicator"):
        jitfuse.Sequence(ctx, ops, "bf16")
    with pytest.raises(jitfuse.InvalidArgumentError, match="a unique id has 128 bytes"):
        jitfuse.Communicator(b"short", 1, 0)


def _distributed_with_a_standin_torch(monkeypatch):
    """jitfuse/torch/distributed.py loaded against a stand-in `torch` (is_initialized, group.WORLD): the group
    registry is plain Python, testable without PyTorch."""
    import importlib.util
    import sys
    import types

    from conftest import PY_ROOT
    fake = types.ModuleType("torch")
    fake.distributed = types.ModuleType("torch.distributed")
    fake.distributed.is_initialized = lambda: True
    fake.distributed.group = types.SimpleNamespace(WORLD=object())
    fake.nn = types.SimpleNamespace(Module=object, Parameter=object)  # annotations only
    monkeypatch.setitem(sys.modules, "torch", fake)
    monkeypatch.setitem(sys.modules, "torch.distributed", fake.distributed)
    pkg = types.ModuleType("jitfuse.torch")
    pkg.__path__ = [str(PY_ROOT / "jitfuse" / "torch")]
    monkeypatch.setitem(sys.modules, "jitfuse.torch", pkg)
    spec = importlib.util.spec_from_file_location("jitfuse.torch.distributed",
                                                  PY_ROOT / "jitfuse" / "torch" / "distributed.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod, fake.distributed


def test_registering_the_default_group_again_is_a_no_op(monkeypatch):
    # Two test modules' fixtures (or two libraries of one process) each register the default group as "tp"
    # after a communicator was made: None and group.WORLD are one group, not "another process group".
    mod, dist = _distributed_with_a_standin_torch(monkeypatch)
    mod.set_process_group(None, name="tp")
    assert mod.process_group("tp") is dist.group.WORLD
    mod._comms[("tp", 0)] = object()  # a communicator made: the group now runs sequences
    mod.set_process_group(None, name="tp")
    mod.set_process_group(dist.group.WORLD, name="tp")
    with pytest.raises(RuntimeError, match="group 'tp' already runs sequences on another process group"):
        mod.set_process_group(object(), name="tp")
    other = object()
    mod.set_process_group(other, name="dp")  # another name: fine
    assert mod.process_group("dp") is other and mod.process_group("tp") is dist.group.WORLD
