# GPU tests in the users' models: Hugging Face GPT-2 and Llama (built from a config, random init) with
# their MLPs swapped for jitfuse.torch.Sequential, in the training loops people write (AdamW, gradient
# checkpointing with and without dropout, autocast over fp32 master weights, FP8 with fused AdamW).
# Skipped where transformers is not installed.
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
transformers = pytest.importorskip("transformers")

from torch import nn  # noqa: E402

import jitfuse.torch as jt  # noqa: E402
from test_torch_gpu import DEV  # noqa: E402

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16


class JfGPT2MLP(nn.Module):
    """GPT-2's MLP (Conv1D c_fc -> gelu_new -> Conv1D c_proj -> dropout) as one jitfuse sequence. The
    Conv1D weights are [in, out]: the Linear weights are their transposes, kept as non-contiguous views."""

    def __init__(self, mlp, p, recipe=None):
        super().__init__()
        h, f = mlp.c_fc.weight.shape
        dt = mlp.c_fc.weight.dtype
        self.seq = jt.Sequential(jt.Linear(h, f), jt.Bias(f), jt.GELU("tanh"), jt.Linear(f, h), jt.Bias(h),
                                 jt.Dropout(p), device=DEV, dtype=dt, recipe=recipe, name="gpt2_mlp")
        self.seq[0].weight = nn.Parameter(mlp.c_fc.weight.detach().t())
        self.seq[1].bias = nn.Parameter(mlp.c_fc.bias.detach().clone())
        self.seq[3].weight = nn.Parameter(mlp.c_proj.weight.detach().t())
        self.seq[4].bias = nn.Parameter(mlp.c_proj.bias.detach().clone())

    def forward(self, hs):
        return self.seq(hs.reshape(-1, hs.shape[-1])).reshape(hs.shape)


class JfLlamaMLP(nn.Module):
    """Llama's MLP down(silu(gate(x)) * up(x)) as Linear([gate; up]) -> SwiGLU -> Linear."""

    def __init__(self, mlp, recipe=None):
        super().__init__()
        f, h = mlp.gate_proj.weight.shape
        dt = mlp.gate_proj.weight.dtype
        self.seq = jt.Sequential(jt.Linear(h, 2 * f), jt.SwiGLU(), jt.Linear(f, h), device=DEV, dtype=dt,
                                 recipe=recipe, name="llama_mlp")
        with torch.no_grad():
            self.seq[0].weight.copy_(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
            self.seq[2].weight.copy_(mlp.down_proj.weight)

    def forward(self, hs):
        return self.seq(hs.reshape(-1, hs.shape[-1])).reshape(hs.shape)


def gpt2(dtype=BF16, pdrop=0.1, recipe=None, jit=True):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=256, n_head=4, n_positions=128, vocab_size=512,
                                  resid_pdrop=pdrop, embd_pdrop=pdrop, attn_pdrop=pdrop)
    m = transformers.GPT2LMHeadModel(cfg).to(DEV, dtype)
    if jit:
        for blk in m.transformer.h:
            blk.mlp = JfGPT2MLP(blk.mlp, pdrop, recipe)
    return m


def llama(dtype=BF16, jit=True, recipe=None):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, vocab_size=512,
                                   max_position_embeddings=128)
    m = transformers.LlamaForCausalLM(cfg).to(DEV, dtype)
    if jit:
        for layer in m.model.layers:
            layer.mlp = JfLlamaMLP(layer.mlp, recipe)
    return m


def batch(seed, n=4, t=64, vocab=512):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randint(0, vocab, (n, t), device=DEV, generator=g)


def grads_of(model, ids, seed):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def loss_curve(model, opt, ids, steps):
    """The losses of `steps` optimizer steps on one batch, learnt by heart (so the loss must fall: random
    tokens have nothing else to learn)."""
    curve = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        curve.append(loss.item())
    return curve


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_gradient_checkpointing_is_bit_exact(arch, reentrant):
    """HF's gradient_checkpointing_enable() (dropout in GPT-2; none in Llama): the same loss and gradients as
    without checkpointing, bit for bit, as PyTorch's own modules give."""
    model = gpt2() if arch == "gpt2" else llama()
    model.train()
    ids = batch(1)
    loss, g = grads_of(model, ids, 7)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    loss_ck, g_ck = grads_of(model, ids, 7)
    assert torch.equal(loss, loss_ck)
    assert g.keys() == g_ck.keys()
    worst = max(((g[n] - g_ck[n]).abs().max().item(), n) for n in g)
    assert worst[0] == 0, f"checkpointing changed gradient {worst[1]} by {worst[0]}"


def test_gpt2_swapped_trains_like_pytorch():
    """GPT-2 bf16, fused AdamW, 20 steps on one batch: the jitfuse-swapped model's loss curve follows the
    original's (same init; dropout off so the two draw nothing different)."""
    curves = {}
    for jit in (False, True):
        model = gpt2(pdrop=0.0, jit=jit)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        curves[jit] = loss_curve(model, opt, batch(100), 20)
    diff = max(abs(a - b) for a, b in zip(curves[True], curves[False]))
    assert diff < 0.05, (diff, curves)
    assert curves[True][-1] < curves[True][0] - 0.3


def test_llama_autocast_over_fp32_master_weights():
    """HF Trainer's bf16=True: fp32 parameters, torch.autocast(bf16). The jitfuse MLPs compute in bf16 and
    the gradients reach the fp32 parameters; loss and gradients match PyTorch's original model under the
    same autocast within bf16 noise."""
    res = {}
    for jit in (False, True):
        model = llama(dtype=torch.float32, jit=jit)
        ids = batch(3)
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=BF16):
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        grads = {}
        for n, p in model.named_parameters():
            assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32, n
            grads[n] = p.grad
        res[jit] = (out.loss.item(), grads)
    assert abs(res[True][0] - res[False][0]) < 0.02 * abs(res[False][0])
    # Compare the attention weights' gradients (same names in both models): within bf16 noise.
    for n, gref in res[False][1].items():
        if "self_attn" in n:
            gj = res[True][1][n]
            assert ((gj - gref).norm() / gref.norm()).item() < 0.05, n


def test_llama_fp8_fused_adamw_trains():
    """FP8 (delayed) Llama MLPs with fused AdamW: the loss falls as with foreach AdamW (no stale weights)."""
    curves = {}
    for fused in (True, False):
        model = llama(recipe="fp8_delayed")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused, foreach=not fused)
        curves[fused] = loss_curve(model, opt, batch(200), 15)
    diff = max(abs(a - b) for a, b in zip(curves[True], curves[False]))
    assert diff < 0.05, (diff, curves)
    assert curves[True][-1] < curves[True][0] - 0.3, curves
