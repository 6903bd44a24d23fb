# Tensor parallelism through a torch.distributed process group of one rank (docs/parallel.md): the group's
# communicator made from the group (unique id broadcast through it), column-/row-parallel Linears with and
# without sequence parallelism equal to the plain Sequential (the collectives of one rank copy), a training
# step with AdamW, the sequence-parallel parameters listed, and the comm ops as modules.
# Run: JITFUSE_LIBRARY=build/runtime/libjitfuse.so PYTHONPATH=runtime/python python3 -m pytest -m gpu -v \
#      runtime/python/tests/test_parallel_gpu.py
import os

import pytest

from conftest import need_torch

torch = need_torch()  # or a skip of this module: no torch, or one jitfuse.torch refuses
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

import torch.distributed as dist  # noqa: E402

import jitfuse  # noqa: E402
import jitfuse.torch as jt  # noqa: E402

pytestmark = pytest.mark.gpu
DEV = "cuda"
H, F, ROWS = 256, 512, 96


@pytest.fixture(scope="module", autouse=True)
def one_rank_group(tmp_path_factory):
    if not dist.is_initialized():
        store = dist.FileStore(str(tmp_path_factory.mktemp("tp") / "store"), 1)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1,
                                device_id=torch.device("cuda", torch.cuda.current_device()))
    jt.distributed.set_process_group(None, name="tp")
    yield


def llama(tp: bool, sp: bool, dtype=torch.bfloat16):
    kw = lambda mode: dict(tensor_parallel=mode, sequence_parallel=sp) if tp else {}  # noqa: E731
    return jt.Sequential(jt.Fork("residual"), jt.RMSNorm(H), jt.Linear(H, 2 * F, **kw("column")), jt.SwiGLU(),
                         jt.Linear(F, H, **kw("row")), jt.AddChannel("residual"), device=DEV, dtype=dtype)


def gpt2(tp: bool, sp: bool, dtype=torch.bfloat16):
    kw = lambda mode: dict(tensor_parallel=mode, sequence_parallel=sp) if tp else {}  # noqa: E731
    return jt.Sequential(jt.Fork("residual"), jt.LayerNorm(H), jt.Linear(H, F, **kw("column")), jt.Bias(F),
                         jt.GELU(), jt.Linear(F, H, **kw("row")), jt.Bias(H), jt.AddChannel("residual"),
                         device=DEV, dtype=dtype)


def _run(model, x):
    x = x.clone().requires_grad_(True)
    y = model(x)
    y.backward(torch.ones_like(y) * 0.01 + torch.linspace(-1, 1, y.numel(), device=DEV).view_as(y).to(y.dtype))
    return [y, x.grad] + [p.grad for p in model.parameters()]


def test_nccl_loads_and_the_group_makes_a_communicator():
    assert jitfuse.nccl_version() >= 21900
    c = jt.distributed.communicator("tp")
    assert (c.world_size, c.rank, c.device) == (1, 0, torch.cuda.current_device())
    assert jt.distributed.communicator("tp") is c  # once per (group, device)


@pytest.mark.parametrize("build", [llama, gpt2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("sp", [True, False], ids=["sp", "tp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_parallel_linears_on_one_rank_equal_the_plain_sequential(build, sp, dtype):
    torch.manual_seed(3)
    plain, par = build(False, False, dtype), build(True, sp, dtype)
    par.load_state_dict(plain.state_dict())  # one rank: the shards are the whole weights
    x = torch.randn(ROWS, H, device=DEV, dtype=dtype)
    a, b = _run(plain, x), _run(par, x)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    for i, (u, v) in enumerate(zip(a, b)):
        torch.testing.assert_close(v, u, **tol, msg=lambda m: f"tensor {i}: {m}")


def test_a_training_step_with_adamw_and_the_sequence_parallel_params():
    torch.manual_seed(5)
    model = gpt2(True, True, torch.float32)  # fp32: AdamW's 1e-3 steps are below bf16's resolution near 1
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(ROWS, H, device=DEV, dtype=torch.float32)
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(3):
        opt.zero_grad()
        model(x).float().square().mean().backward()
        jt.distributed.allreduce_sequence_parallel_grads(model)  # one rank: nothing to sum
        opt.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    names = {id(p) for p in jt.distributed.sequence_parallel_params(model)}
    # LayerNorm (on the shard before the gather) and the bias after the reduce-scatter.
    norm, bias2 = model._ops[1], model._ops[6]
    assert {id(p) for _, p in norm.jf_params()} <= names
    assert {id(p) for _, p in bias2.jf_params()} <= names
    assert id(model._ops[3].bias) not in names  # the column-parallel bias is this rank's shard


def test_comm_ops_as_modules():
    x = torch.randn(64, H, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    for op in (jt.AllGather(), jt.ReduceScatter(), jt.AllReduce(), jt.AllReduce(direction="backward")):
        m = jt.Sequential(jt.GELU(), op, jt.SiLU())
        y = m(x)
        ref = torch.nn.functional.silu(torch.nn.functional.gelu(x.float(), approximate="tanh"))
        torch.testing.assert_close(y.float(), ref, atol=2e-2, rtol=2e-2)
        y.sum().backward()
        assert x.grad is not None and torch.isfinite(x.grad).all()
        x.grad = None


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_explain_plans_this_ranks_program(sp):
    """explain() of a module built for 2 ranks plans rank 1 of 2 by default (issue 45): the column-parallel
    GEMM writes this rank's 2F / 2 columns, not the whole layer's 2F, and the collectives are in the plan;
    world_size=1 still gives the one-rank plan, and an explicit rank is taken."""
    kw = lambda mode: dict(tensor_parallel=mode, sequence_parallel=sp, world_size=2)  # noqa: E731
    m = jt.Sequential(jt.RMSNorm(H), jt.Linear(H, 2 * F, **kw("column")), jt.SwiGLU(), jt.Linear(F, H, **kw("row")),
                      device=DEV, dtype=torch.bfloat16)
    assert m[1].weight.shape == (F, H)  # the shard: 2F / 2 rows
    rows = ROWS // 2 if sp else ROWS      # a sequence-parallel input is this rank's rows
    e = m.explain(shape=(rows, H), training=True, rank=1)
    # Sequence parallel: row blocks beside the copy engines, and NCCL's way beside them (explain's "way": one of the
    # two runs; count each row once, on the copy way's steps and the steps both ways share).
    gemms = [s for s in e.program.forward if s["kind"] == "gemm" and s.get("way") != "nccl"]
    ns = [s["n"] for s in gemms]
    assert ns[0] == F and set(ns) == {F, H}, ns
    assert sum(s["m"] for s in gemms if s["n"] == F) == ROWS  # every row of the layer, gathered or not
    comms = [s["collective"] for s in e.program.forward if s["kind"] == "comm"]
    assert comms if sp else comms == ["all_reduce"], comms
    assert e.raw["program"]["parallel"]["world_size"] == 2 and e.raw["program"]["parallel"]["rank"] == 1
    # The default rank: this process's in the registered group (one rank here: 0).
    assert m.explain(shape=(rows, H), training=True).raw["program"]["parallel"]["rank"] == 0
    one = m.explain(shape=(ROWS, H), training=True, world_size=1)
    assert [s["n"] for s in one.program.forward if s["kind"] == "gemm"][0] == 2 * F
