# GPU tests of named channels in jitfuse.torch.Sequential (issue 27): a Llama-style MLP half-block whose residual
# is a hidden channel, a channel with two readers, a returned channel, a channel the caller provides, each
# forward and backward against float64 PyTorch; the half-block under torch.compile(fullgraph=True) and captured
# in a CUDA graph; Linear.from_pair against Hugging Face's LlamaMLP is in test_hf_models_gpu.py.
# Run: JITFUSE_LIBRARY=build/runtime/libjitfuse.so PYTHONPATH=runtime/python python3 -m pytest -m gpu -v \
#      runtime/python/tests/test_channels_gpu.py
import pytest

from conftest import need_torch

torch = need_torch()  # or a skip of this module: no torch, or one jitfuse.torch refuses
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

import torch.nn.functional as F  # noqa: E402

import jitfuse.torch as jt  # noqa: E402
from test_torch_gpu import DEV, _attr_of, check, randomize, ref_op  # noqa: E402

pytestmark = pytest.mark.gpu
DTYPES = [torch.float32, torch.bfloat16]
IDS = lambda d: str(d).split(".")[-1]  # noqa: E731
H, I, ROWS = 256, 704, 77  # Llama-like widths (HF's test config), an odd row count


def llama_half_block(h, i, dtype, eps=1e-6):
    """The post-attention half of a Llama decoder layer: x + down(swiglu(rmsnorm(x) @ [gate; up]^T)), the
    residual a hidden channel: one input, one output."""
    return jt.Sequential(jt.Fork("residual"), jt.RMSNorm(h, eps=eps), jt.Linear(h, 2 * i, bias=False), jt.SwiGLU(),
                         jt.Linear(i, h, bias=False), jt.AddChannel("residual"), device=DEV, dtype=dtype,
                         name="llama_half_block")


# ---- float64 reference of a Sequential with channels --------------------------------------------------------

def ref_forward(model, x, extras, params):
    """Float64 forward of ``model`` (ops as jitfuse.torch defines them, channels as the slot rules number them):
    [output, *extra_outputs]. ``params``: {state_dict name: float64 tensor}."""
    h, k, outs, chan = x, 0, [], {}
    for i, op in enumerate(model._ops):
        if isinstance(op, jt.MakeExtraOutput):
            if op.channel is None or op.returned:
                outs.append(h)
            if op.channel is not None:
                chan[op.channel] = h
        elif isinstance(op, jt.AddExtraInput):
            if op.channel is None:
                h, k = h + extras[k], k + 1
            else:
                if op.channel not in chan:  # an input channel: its first reader takes the next extra input
                    assert op.channel in model.input_channels
                    chan[op.channel], k = extras[k], k + 1
                h = h + chan[op.channel]
        else:
            p = {n: params[f"{i}.{_attr_of(op, n)}"] for n, _ in op.jf_params()}
            h, used, eo = ref_op(op, h, [], p)
            assert used == 0 and not eo
    assert k == len(extras)
    return [h, *outs]


def run_and_check(model, x, extras, dtype, chain=2):
    """Forward and backward of ``model`` against float64 (output, extra outputs, the gradients of the input, the
    extra inputs and every parameter), with random output gradients; returns the outputs."""
    assert len(extras) == model.n_extra_inputs
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    extras = [e.detach().requires_grad_() for e in extras]
    out = model(x, *extras)
    outs = list(out) if isinstance(out, tuple) else [out]
    assert isinstance(out, tuple) == bool(model.n_extra_outputs) and len(outs) == 1 + model.n_extra_outputs
    g = torch.Generator(device=DEV).manual_seed(2)
    dys = [torch.randn(o.shape, device=DEV, dtype=dtype, generator=g) for o in outs]
    torch.autograd.backward(outs, dys)

    x64 = x.detach().double().requires_grad_()
    e64 = [e.detach().double().requires_grad_() for e in extras]
    p64 = {n: p.detach().double().requires_grad_() for n, p in model.named_parameters()}
    r_outs = ref_forward(model, x64, e64, p64)
    torch.autograd.backward(r_outs, [d.double() for d in dys])
    for i, (o, r) in enumerate(zip(outs, r_outs)):
        assert o.dtype == dtype
        check(f"output {i}", o, r, dtype, gemm=True, chain=chain)
    check("grad_input", x.grad, x64.grad, dtype, gemm=True, chain=chain)
    for i, (e, r) in enumerate(zip(extras, e64)):
        check(f"grad_extra_input {i}", e.grad, r.grad, dtype, gemm=True, chain=chain)
    for n, p in model.named_parameters():
        r = p64[n].grad if p64[n].grad is not None else torch.zeros_like(p64[n])
        check(f"grad {n}", p.grad, r, dtype, gemm=True, chain=chain)
    return outs


def inputs(n, h, dtype, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return [torch.randn(ROWS, h, device=DEV, dtype=dtype, generator=g) for _ in range(n)]


# ---- the channel shapes -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_llama_half_block_hidden_residual(dtype):
    """Fork("residual") ... AddChannel("residual"): one input, one output, against the plain PyTorch block
    x + down(silu(g) * u) with [g, u] = rmsnorm(x) @ [gate; up]^T, written out in float64."""
    model = llama_half_block(H, I, dtype)
    assert (model.n_extra_inputs, model.n_extra_outputs) == (0, 0)
    randomize(model)
    (x,) = inputs(1, H, dtype, 11)
    x.requires_grad_()
    y = model(x)
    assert isinstance(y, torch.Tensor) and y.shape == x.shape and y.dtype == dtype
    dy = torch.randn_like(y)
    y.backward(dy)

    x64 = x.detach().double().requires_grad_()
    gamma, w1, w2 = (model[k].weight.detach().double().requires_grad_() for k in (1, 2, 4))
    normed = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * gamma
    gate, up = (normed @ w1.T).chunk(2, dim=-1)  # the FIRST half is gated
    ref = x64 + (F.silu(gate) * up) @ w2.T
    ref.backward(dy.double())
    check("output", y, ref, dtype, gemm=True, chain=2)
    check("grad_input", x.grad, x64.grad, dtype, gemm=True, chain=2)
    for k, r in ((1, gamma), (2, w1), (4, w2)):
        check(f"grad {k}.weight", model[k].weight.grad, r.grad, dtype, gemm=True, chain=2)
    # The generic reference agrees (it is what the other shapes are checked against).
    run_and_check(model, *inputs(1, H, dtype, 12), [], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_fan_out_two_readers(dtype):
    """A channel read twice: x's gradient is the stream's plus both readers'."""
    model = jt.Sequential(jt.Fork("h"), jt.RMSNorm(H, eps=1e-6), jt.Linear(H, H), jt.AddChannel("h"), jt.GELU(),
                          jt.Scale(0.5), jt.AddChannel("h"), device=DEV, dtype=dtype, name="fan_out")
    assert (model.n_extra_inputs, model.n_extra_outputs) == (0, 0)
    assert model.wiring.channel("h").readers == (3, 6)
    randomize(model)
    run_and_check(model, *inputs(1, H, dtype, 21), [], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_returned_channel(dtype):
    """A returned channel is also an extra output (its gradient from the caller adds to its reader's), between
    plain forks in slot order: extra outputs (op 0, op 1 'r', op 5)."""
    model = jt.Sequential(jt.MakeExtraOutput(), jt.Fork("r", returned=True), jt.Linear(H, H), jt.Bias(H), jt.GELU(),
                          jt.MakeExtraOutput(), jt.AddChannel("r"), jt.Fork("hidden"), jt.Scale(-0.75),
                          jt.AddChannel("hidden"), device=DEV, dtype=dtype, name="returned")
    assert (model.n_extra_inputs, model.n_extra_outputs) == (0, 3)
    assert [s.op for s in model.wiring.extra_outputs] == [0, 1, 5]
    randomize(model)
    x, = inputs(1, H, dtype, 31)
    outs = run_and_check(model, x, [], dtype)
    # Slots 0 and 1 hold the input (forks before any op), slot 2 the GELU's output.
    assert torch.equal(outs[1], x) and torch.equal(outs[2], x)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_input_channel(dtype):
    """A channel from the caller, read twice, between plain extra inputs: extra inputs (op 1 'skip', op 3);
    its gradient is the sum of both readers'."""
    model = jt.Sequential(jt.Linear(H, H), jt.AddChannel("skip"), jt.GELU(), jt.AddExtraInput(), jt.Linear(H, H),
                          jt.AddChannel("skip"), input_channels=["skip"], device=DEV, dtype=dtype,
                          name="input_channel")
    assert (model.n_extra_inputs, model.n_extra_outputs) == (2, 0)
    assert [(s.op, s.channel) for s in model.wiring.extra_inputs] == [(1, "skip"), (3, None)]
    randomize(model)
    x, skip, e = inputs(3, H, dtype, 41)
    run_and_check(model, x, [skip, e], dtype)


def test_hidden_channel_without_grad_and_eval():
    """Inference (no grad, and eval mode) gives the training forward's output."""
    model = llama_half_block(H, I, torch.bfloat16)
    randomize(model)
    (x,) = inputs(1, H, torch.bfloat16, 51)
    y_train = model(x.clone().requires_grad_()).detach()
    with torch.no_grad():
        y_nograd = model(x)
        y_eval = model.eval()(x)
    model.train()
    assert torch.equal(y_nograd, y_train)
    check("eval", y_eval, y_train, torch.bfloat16, gemm=True, chain=2)  # another program: may round differently


# ---- torch.compile and CUDA graphs ------------------------------------------------------------------------

def _grads(model, call, x, dy):
    x = x.detach().requires_grad_()
    y = call(x)
    gs = torch.autograd.grad(y, [x, *model.parameters()], dy)
    return y.detach().clone(), [g.clone() for g in gs]


def test_half_block_torch_compile_fullgraph_matches_eager():
    model = llama_half_block(H, I, torch.bfloat16)
    randomize(model)
    x, dy = inputs(2, H, torch.bfloat16, 61)
    y_eager, g_eager = _grads(model, model, x, dy)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model)(x.detach().requires_grad_())
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(model, fullgraph=True)
    for seed in (0, 62):  # the inputs it was traced with, then fresh ones
        if seed:
            x, dy = inputs(2, H, torch.bfloat16, seed)
            y_eager, g_eager = _grads(model, model, x, dy)
        y_c, g_c = _grads(model, compiled, x, dy)
        assert torch.equal(y_c, y_eager)
        for a, b in zip(g_c, g_eager):
            assert torch.equal(a, b)


def test_half_block_cuda_graph_replays_match_eager():
    model = llama_half_block(H, I, torch.bfloat16)
    randomize(model)
    x, dy = inputs(2, H, torch.bfloat16, 71)
    x.requires_grad_()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up (prepares the shape) on a side stream, as torch.cuda.graph asks
        for _ in range(3):
            model(x).backward(dy)
    torch.cuda.current_stream().wait_stream(s)
    x.grad = None
    model.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = model(x)
        static_y.backward(dy)
    for seed in (72, 73, 74):
        new_x, new_dy = inputs(2, H, torch.bfloat16, seed)
        with torch.no_grad():
            x.copy_(new_x)
            dy.copy_(new_dy)
        graph.replay()
        torch.cuda.synchronize()
        y_r = static_y.detach().clone()
        g_r = [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
        y_e, g_e = _grads(model, model, new_x, new_dy)
        assert torch.equal(y_r, y_e), seed
        for a, b in zip(g_r, g_e):
            assert torch.equal(a, b), seed
