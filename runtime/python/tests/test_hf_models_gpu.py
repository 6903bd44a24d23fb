# GPU tests in the users' models: Hugging Face GPT-2 and Llama (built from a config, random init) with
# their MLPs swapped for jitfuse.torch.Sequential, in the training loops people write (AdamW, gradient
# checkpointing with and without dropout, autocast over fp32 master weights, FP8 with fused AdamW).
# Skipped where transformers is not installed.
import pytest

from conftest import need_torch

torch = need_torch()  # or a skip of this module: no torch, or one jitfuse.torch refuses
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
transformers = pytest.importorskip("transformers")

from torch import nn  # noqa: E402

import jitfuse.torch as jt  # noqa: E402
from test_torch_gpu import DEV, check  # noqa: E402

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


# ---- issue 27: Linear.from_pair and the post-attention half as one Sequential with a channel ----------------


def _ids(d):
    return str(d).split(".")[-1]


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=_ids)
def test_linear_from_pair_matches_hf_llama_mlp(dtype):
    """Linear.from_pair(gate_proj, up_proj) -> SwiGLU -> Linear (down_proj's own Parameter) against HF's LlamaMLP in
    float64, forward and backward; the HF module's weights are views of the jitfuse weight, so its forward and
    state_dict follow an optimizer step taken on the jitfuse parameters."""
    import copy

    from transformers.models.llama.modeling_llama import LlamaMLP
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=704, hidden_act="silu")
    h, f = cfg.hidden_size, cfg.intermediate_size
    mlp = LlamaMLP(cfg).to(DEV, dtype)
    ref = copy.deepcopy(mlp).double()
    gate_param = mlp.gate_proj.weight
    seq = jt.Sequential(jt.Linear.from_pair(mlp.gate_proj, mlp.up_proj), jt.SwiGLU(), jt.Linear(f, h, bias=False),
                        device=DEV, dtype=dtype, name="llama_mlp_pair")
    seq[2].weight = mlp.down_proj.weight  # the same Parameter: nothing to share
    assert mlp.gate_proj.weight is gate_param and seq[0].weight.shape == (2 * f, h)
    assert mlp.gate_proj.weight.data_ptr() == seq[0].weight.data_ptr()
    assert mlp.up_proj.weight.data_ptr() == seq[0].weight.data_ptr() + f * h * seq[0].weight.element_size()
    assert torch.equal(seq[0].weight, torch.cat([ref.gate_proj.weight, ref.up_proj.weight]).to(dtype))

    g = torch.Generator(device=DEV).manual_seed(5)
    x = torch.randn(3, 37, h, device=DEV, dtype=dtype, generator=g)  # HF's [batch, seq, hidden]; 111 rows
    dy = torch.randn(3, 37, h, device=DEV, dtype=dtype, generator=g)
    x.requires_grad_()
    y = seq(x)
    y.backward(dy)
    x64 = x.detach().double().requires_grad_()
    r = ref(x64)
    r.backward(dy.double())
    check("output", y, r, dtype, gemm=True, chain=2)
    check("grad_input", x.grad, x64.grad, dtype, gemm=True, chain=2)
    check("grad [gate; up]", seq[0].weight.grad, torch.cat([ref.gate_proj.weight.grad, ref.up_proj.weight.grad]),
          dtype, gemm=True, chain=2)
    check("grad down", seq[2].weight.grad, ref.down_proj.weight.grad, dtype, gemm=True, chain=2)
    with torch.no_grad():
        check("HF forward through the shared weights", mlp(x), r, dtype, gemm=True, chain=2)

    opt = torch.optim.SGD(seq.parameters(), lr=0.5)  # built after the swap: it holds the fused weight
    opt.step()
    sd = mlp.state_dict()
    assert set(sd) == {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}
    assert torch.equal(sd["gate_proj.weight"], seq[0].weight[:f])
    assert torch.equal(sd["up_proj.weight"], seq[0].weight[f:])
    assert not torch.equal(sd["gate_proj.weight"], ref.gate_proj.weight.to(dtype)), "the step moved the weights"
    ref2 = copy.deepcopy(mlp).double()
    with torch.no_grad():
        r2 = ref2(x64.detach())
        check("after the step", seq(x), r2, dtype, gemm=True, chain=2)
        check("HF forward after the step", mlp(x), r2, dtype, gemm=True, chain=2)


def _post_attention_sequence(layer, dtype):
    """post_attention_layernorm -> mlp -> residual add of one HF Llama decoder layer as ONE jitfuse Sequential,
    the residual a hidden channel; the norm and down_proj Parameters are HF's own, [gate; up] shares storage."""
    ln, mlp = layer.post_attention_layernorm, layer.mlp
    h, f = ln.weight.shape[0], mlp.gate_proj.weight.shape[0]
    seq = jt.Sequential(jt.Fork("residual"), jt.RMSNorm(h, eps=ln.variance_epsilon),
                        jt.Linear.from_pair(mlp.gate_proj, mlp.up_proj), jt.SwiGLU(), jt.Linear(f, h, bias=False),
                        jt.AddChannel("residual"), device=DEV, dtype=dtype, name="llama_post_attention")
    seq[1].weight = ln.weight
    seq[4].weight = mlp.down_proj.weight
    return seq


def _attention_then_jitfuse(self, hidden_states, **kwargs):
    """LlamaDecoderLayer.forward with the post-attention half (norm, MLP, residual add) one jitfuse call."""
    residual = hidden_states
    h = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)[0]
    h = residual + h
    out = self.jf_post_attention(h.reshape(-1, h.shape[-1])).reshape(h.shape)
    return (out,) if self.jf_returns_tuple else out


def swap_post_attention(model, dtype, returns_tuple):
    """Every decoder layer's post-attention half becomes one jitfuse Sequential; returns HF's swapped-out MLPs
    (whose gate/up weights are views of the jitfuse weights)."""
    import types
    hf_mlps = []
    for layer in model.model.layers:
        hf_mlps.append(layer.mlp)
        layer.jf_post_attention = _post_attention_sequence(layer, dtype)
        layer.jf_returns_tuple = returns_tuple
        del layer.post_attention_layernorm, layer.mlp  # their parameters are the sequence's now
        layer.forward = types.MethodType(_attention_then_jitfuse, layer)
    return hf_mlps


def _hf_layout_grads(model):
    """The parameters' gradients under the original model's names (the fused [gate; up] split in two)."""
    out = {}
    for n, p in model.named_parameters():
        if p.grad is None:
            continue
        if ".jf_post_attention." not in n:
            out[n] = p.grad
            continue
        layer, op = n.split(".jf_post_attention.")
        if op == "1.weight":
            out[f"{layer}.post_attention_layernorm.weight"] = p.grad
        elif op == "2.weight":
            gate, up = p.grad.chunk(2)
            out[f"{layer}.mlp.gate_proj.weight"], out[f"{layer}.mlp.up_proj.weight"] = gate, up
        elif op == "4.weight":
            out[f"{layer}.mlp.down_proj.weight"] = p.grad
        else:
            raise AssertionError(n)
    return out


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach()


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=_ids)
def test_llama_post_attention_half_is_one_sequence(dtype):
    """HF LlamaForCausalLM (small config, random init) with each decoder layer's post_attention_layernorm + mlp
    + residual add swapped for ONE jitfuse Sequential (Fork/AddChannel "residual"): the logits and a training
    step's gradients (every parameter) are as close to the float64 model's as PyTorch's own model in the same
    dtype (at most twice its normwise error, plus a floor at the dtype's rounding), and an optimizer step built
    after the swap trains the shared weights (the swapped-out HF MLPs' state_dict follows)."""
    ids = batch(3)
    ref64 = llama(torch.float64, jit=False)
    orig = llama(dtype, jit=False)
    kinds = []
    hook = orig.model.layers[0].register_forward_hook(lambda m, a, out: kinds.append(isinstance(out, tuple)))
    logits_o, loss_o = _step(orig, ids)
    hook.remove()
    model = llama(dtype, jit=False)
    hf_mlps = swap_post_attention(model, dtype, kinds[0])
    assert not any(n.endswith("post_attention_layernorm.weight") or ".mlp." in n for n, _ in model.named_parameters())
    logits_j, loss_j = _step(model, ids)
    logits_r, loss_r = _step(ref64, ids)
    floor = {torch.float32: 1e-5, BF16: 2e-3}[dtype]
    e_j, e_o = _rel(logits_j, logits_r), _rel(logits_o, logits_r)
    assert e_j <= 2 * e_o + floor, f"logits: jitfuse {e_j:.3e}, PyTorch {e_o:.3e}"
    assert abs(loss_j.item() - loss_r.item()) <= 2 * abs(loss_o.item() - loss_r.item()) + floor * loss_r.item()
    g_j, g_o = _hf_layout_grads(model), {n: p.grad for n, p in orig.named_parameters() if p.grad is not None}
    g_r = {n: p.grad for n, p in ref64.named_parameters() if p.grad is not None}
    assert set(g_j) == set(g_o) == set(g_r)
    worst = []
    for n in g_r:
        ej, eo = _rel(g_j[n], g_r[n]), _rel(g_o[n], g_r[n])
        worst.append((ej - 2 * eo, n, ej, eo))
        assert ej <= 2 * eo + 10 * floor, f"grad {n}: jitfuse {ej:.3e}, PyTorch {eo:.3e}"
    print(f"\nworst gradient against float64 (jitfuse - 2 x PyTorch): {max(worst)}")

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # after the swap: it holds the fused weights
    before = [m.gate_proj.weight.detach().clone() for m in hf_mlps]
    opt.step()
    for layer, m, b in zip(model.model.layers, hf_mlps, before):
        fused = layer.jf_post_attention[2].weight
        sd = m.state_dict()
        assert torch.equal(sd["gate_proj.weight"], fused[:fused.shape[0] // 2])
        assert torch.equal(sd["up_proj.weight"], fused[fused.shape[0] // 2:])
        assert m.down_proj.weight is layer.jf_post_attention[4].weight  # HF's own Parameter
        assert not torch.equal(sd["gate_proj.weight"], b)
