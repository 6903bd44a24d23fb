# GPU tests of torch.compile(model, backend="jitfuse"): unmodified Hugging Face models (from a config, random
# init) and small hand-written graphs, against float64 eager references (logits and gradients), the fusion
# report (which chains, which ops left and why), training under autocast against Inductor's, and graphs whose
# intermediates have other consumers (left to Inductor, the model still right).
import copy

import pytest

from conftest import need_torch

torch = need_torch()  # or a skip of this module: no torch, or one jitfuse.torch refuses
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
transformers = pytest.importorskip("transformers")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import jitfuse.torch as jt  # noqa: E402
from jitfuse.torch import _dynamo_backend as jb  # noqa: E402
from test_hf_apply_gpu import build, ids, rel_err, train  # noqa: E402
from test_torch_gpu import DEV  # noqa: E402

pytestmark = pytest.mark.gpu


def fresh():
    torch._dynamo.reset()
    jb._REPORTS.clear()


def kinds(reports):
    return [c.kinds for r in reports for c in r.chains if c.swapped]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma", "gpt2", "mistral", "qwen3", "gemma2", "phi3"])
def test_unmodified_models_match_float64(arch):
    fresh()
    model = build(arch)
    ref = copy.deepcopy(model).double()
    compiled = torch.compile(model, backend="jitfuse")
    x = ids()
    out = compiled(x, labels=x)
    r = ref(x, labels=x)
    assert rel_err(out.logits, r.logits) < 2e-3, jt.explain()
    out.loss.backward()
    r.loss.backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if p.grad is not None and ("mlp" in n or "norm" in n or "ln_" in n):
            assert rel_err(p.grad, q.grad) < 5e-3, f"{arch}: grad of {n}\n{jt.explain()}"
    ks = kinds(jb.reports())
    # Every layer's MLP half is one chain: norm -> MLP -> residual add (a channel: the chain's own input).
    mlp_chains = [k for k in ks if "residual (channel)" in k]
    assert len(mlp_chains) >= 2, jt.explain()
    if arch != "gpt2":
        assert all(any(s.startswith("gated") for s in k) for k in mlp_chains), jt.explain()
    # The weights are read as the model stores them: no torch.cat of gate/up, no transposed Conv1D copy.
    linears = [o for r in jb.reports() for c in r.chains if c.swapped for o in c.ops if o.get("op") == "linear"]
    if arch in ("gpt2",):
        assert sum(1 for o in linears if o.get("weight_layout") == "in_out") >= 2 * 2, jt.explain()
    elif arch != "phi3":  # Phi-3's gate_up_proj is one weight already
        assert sum(1 for o in linears if o.get("split_weight")) >= 2, jt.explain()
    assert "swapped" in jt.explain()


def test_training_under_autocast_tracks_inductor():
    def run(backend, steps=12):
        fresh()
        model = build("llama", seed=3)
        return train(model, torch.compile(model, backend=backend), steps, seed=9, autocast=True), jb.reports()
    a, rep = run("jitfuse")
    b, _ = run("inductor")
    assert any(c.swapped for r in rep for c in r.chains), "\n".join(map(str, rep))
    assert abs(a[0] - b[0]) / b[0] < 0.01 and a[-1] < 0.8 * a[0]
    assert abs(sum(a[-3:]) - sum(b[-3:])) / sum(b[-3:]) < 0.05, (a, b)


def test_inference_and_a_second_row_count():
    fresh()
    model = build("qwen2").eval()
    ref = copy.deepcopy(model).double()
    compiled = torch.compile(model, backend="jitfuse")
    with torch.no_grad():
        for seq in (24, 40):
            x = ids(seq=seq)
            assert rel_err(compiled(x).logits, ref(x).logits) < 2e-3


class Forked(nn.Module):
    """linear -> gelu -> linear, where the first linear's output is read a second time (a consumer outside the
    chain), then a chain that is fused: linear -> silu -> linear + residual."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(96, 64) / 8)
        self.w2 = nn.Parameter(torch.randn(64, 96) / 10)
        self.w3 = nn.Parameter(torch.randn(128, 64) / 8)
        self.w4 = nn.Parameter(torch.randn(64, 128) / 11)

    def forward(self, x):
        y = F.linear(x, self.w1)
        z = F.linear(F.gelu(y), self.w2) + y.mean(-1, keepdim=True)  # y: two consumers
        return z + F.linear(F.silu(F.linear(z, self.w3)), self.w4)


def test_a_second_consumer_is_left_to_inductor_and_the_result_is_right():
    fresh()
    m = Forked().to(DEV)
    ref = copy.deepcopy(m).double()
    x = torch.randn(4, 8, 64, device=DEV, requires_grad=True)
    xr = x.detach().double().requires_grad_()
    y = torch.compile(m, backend="jitfuse")(x)
    yr = ref(xr)
    assert rel_err(y, yr) < 1e-3
    y.square().mean().backward()
    yr.square().mean().backward()
    assert rel_err(x.grad, xr.grad) < 2e-3
    for p, q in zip(m.parameters(), ref.parameters()):
        assert rel_err(p.grad, q.grad) < 2e-3
    rep = jb.reports()
    swapped = [c for r in rep for c in r.chains if c.swapped]
    assert len(swapped) == 1 and swapped[0].kinds == ["linear", "silu", "linear", "residual (channel)"], jt.explain()
    assert any("not in a chain" in why for r in rep for _, why in r.left), jt.explain()


class Transposed(nn.Module):
    """A linear whose weight is a transpose (non-contiguous), then a chain that is fused."""

    def __init__(self):
        super().__init__()
        self.wt = nn.Parameter(torch.randn(64, 96) / 8)   # used as wt.t(): [96, 64]
        self.w2 = nn.Parameter(torch.randn(64, 96) / 10)
        self.b2 = nn.Parameter(torch.randn(64) / 10)

    def forward(self, x):
        h = F.linear(x, self.wt.t())
        return F.linear(F.gelu(h, approximate="tanh"), self.w2, self.b2)


def test_a_non_contiguous_weight_is_left_and_the_model_right():
    fresh()
    m = Transposed().to(DEV)
    ref = copy.deepcopy(m).double()
    x = torch.randn(6, 64, device=DEV, requires_grad=True)
    xr = x.detach().double().requires_grad_()
    y = torch.compile(m, backend="jitfuse")(x)
    yr = ref(xr)
    assert rel_err(y, yr) < 1e-3
    y.sum().backward()
    yr.sum().backward()
    for p, q in zip(m.parameters(), ref.parameters()):
        assert rel_err(p.grad, q.grad) < 2e-3
    rep = jb.reports()
    assert not any(c.swapped and c.kinds[0] == "linear" and len(c.kinds) > 2 for r in rep for c in r.chains), \
        jt.explain()


def test_reduce_overhead_mode_replays_cuda_graphs():
    fresh()
    m = Forked().to(DEV).eval()
    ref = copy.deepcopy(m).double()
    f = torch.compile(m, backend=jt.backend(mode="reduce-overhead"))
    with torch.no_grad():
        for i in range(4):  # warm-up, record, replays: each with new values in the same input shape
            x = torch.randn(4, 8, 64, device=DEV)
            y = f(x).clone()
            assert rel_err(y, ref(x.double())) < 1e-3, i
    assert any(c.swapped for r in jb.reports() for c in r.chains)
    with pytest.raises(ValueError, match="unknown mode"):
        jt.backend(mode="fastest")


def test_fp8_recipe_through_the_backend_trains():
    def run(backend, steps=10):
        fresh()
        model = build("llama", dtype=torch.bfloat16, seed=4)
        return train(model, torch.compile(model, backend=backend), steps, seed=2), jb.reports()
    a, rep = run(jt.backend(recipe="fp8_current"))
    b, _ = run("inductor")
    swapped = [c for r in rep for c in r.chains if c.swapped]
    assert swapped and all(any(o.get("op") == "linear" for o in c.ops) for c in swapped), jt.explain()
    assert abs(a[0] - b[0]) / b[0] < 0.03, (a, b)   # FP8 GEMMs: within FP8's rounding of bf16
    assert a[-1] < 0.85 * a[0], a
    with pytest.raises(ValueError, match="unknown recipe"):
        jt.backend(recipe="fp4")


def test_dynamic_row_counts_compile_once_and_stay_right():
    """torch.compile(dynamic=True): the chains keep the symbolic row count (the saved block's size is
    data-dependent), so new sequence lengths reuse the graph; logits and gradients stay right at each."""
    fresh()
    model = build("llama")
    ref = copy.deepcopy(model).double()
    compiled = torch.compile(model, backend="jitfuse", dynamic=True)
    graphs = None
    for seq in (24, 40, 56):
        x = ids(seq=seq, seed=seq)
        out = compiled(x, labels=x)
        r = ref(x, labels=x)
        assert rel_err(out.logits, r.logits) < 2e-3, (seq, jt.explain())
        out.loss.backward()
        r.loss.backward()
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            if "mlp" in n:
                assert rel_err(p.grad, q.grad) < 5e-3, f"seq {seq}: grad of {n}"
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        n_graphs = len(jb.reports())
        if graphs is None:
            graphs = n_graphs
        assert n_graphs == graphs, f"a new row count recompiled: {n_graphs} graphs after {graphs}\n{jt.explain()}"
    assert any(c.swapped and "residual (channel)" in c.kinds for r in jb.reports() for c in r.chains), jt.explain()


def test_decode_with_reduce_overhead_gives_the_eager_models_tokens():
    """A greedy decode (static KV cache, one token per step) through backend=jitfuse with CUDA graphs
    (mode="reduce-overhead"): the same tokens as the unmodified model's eager decode (fp32)."""
    from jitfuse.bench_hf import decode
    fresh()
    model = build("llama").eval()
    prompt = ids(batch=2, seq=16, seed=5)
    eager, _ = decode(model, model.forward, prompt, 24)
    step = torch.compile(model.forward, backend=jt.backend(mode="reduce-overhead"))
    decode(model, step, prompt, 6)  # compile, record the graphs
    toks, ms = decode(model, step, prompt, 24, timed=True)
    assert torch.equal(toks, eager), (toks, eager)
    assert any(c.swapped for r in jb.reports() for c in r.chains), jt.explain()
    assert len(ms) == 23 and all(t > 0 for t in ms)
