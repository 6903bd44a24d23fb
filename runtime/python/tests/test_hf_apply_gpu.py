# GPU tests of jitfuse.torch.hf.apply: unmodified Hugging Face models (from a config, random init) with their
# norms and MLPs swapped in place, against a float64 copy of the unmodified model (logits and gradients), in
# AdamW training with autocast and gradient checkpointing, greedy generate(), save_pretrained/from_pretrained,
# revert, and hostile modules (a forward that computes something else, dtypes the swap does not take).
import copy
import warnings

import pytest

from conftest import need_torch

torch = need_torch()  # or a skip of this module: no torch, or one jitfuse.torch refuses
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
transformers = pytest.importorskip("transformers")

from torch import nn  # noqa: E402

import jitfuse.torch as jt  # noqa: E402
from jitfuse.torch import hf  # noqa: E402
from jitfuse.torch._registry import existing_programs  # noqa: E402
from test_torch_gpu import DEV  # noqa: E402

pytestmark = pytest.mark.gpu
V, H, F, L = 256, 64, 160, 2


def _cfg(arch):
    t = transformers
    common = dict(vocab_size=V, hidden_size=H, intermediate_size=F, num_hidden_layers=L, num_attention_heads=4,
                  max_position_embeddings=128)
    if arch == "llama":
        return t.LlamaConfig(num_key_value_heads=2, **common), t.LlamaForCausalLM
    if arch == "mistral":
        return t.MistralConfig(num_key_value_heads=2, sliding_window=None, **common), t.MistralForCausalLM
    if arch == "qwen2":
        return t.Qwen2Config(num_key_value_heads=2, **common), t.Qwen2ForCausalLM
    if arch == "qwen3":
        if not hasattr(t, "Qwen3Config"):
            pytest.skip("this transformers has no Qwen3")
        return t.Qwen3Config(num_key_value_heads=2, head_dim=16, **common), t.Qwen3ForCausalLM
    if arch == "gemma":
        return t.GemmaConfig(num_key_value_heads=2, head_dim=16, hidden_activation="gelu_pytorch_tanh",
                             **common), t.GemmaForCausalLM
    if arch == "gemma2":
        return t.Gemma2Config(num_key_value_heads=2, head_dim=16, hidden_activation="gelu_pytorch_tanh",
                              query_pre_attn_scalar=16, **common), t.Gemma2ForCausalLM
    if arch == "phi3":
        return t.Phi3Config(num_key_value_heads=4, pad_token_id=0, **common), t.Phi3ForCausalLM
    if arch == "gpt2":
        return (t.GPT2Config(vocab_size=V, n_embd=H, n_layer=L, n_head=4, n_positions=128, resid_pdrop=0.0,
                             embd_pdrop=0.0, attn_pdrop=0.0), t.GPT2LMHeadModel)
    raise ValueError(arch)


ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "gpt2"]


def build(arch, dtype=torch.float32, seed=0):
    cfg, cls = _cfg(arch)
    cfg._attn_implementation = "eager"  # float64 reference: eager attention runs in any dtype
    torch.manual_seed(seed)
    m = cls(cfg).to(DEV, dtype)
    with torch.no_grad():  # random norm weights (Gemma's start at 0, Llama's at 1): the probe must tell them apart
        for n, p in m.named_parameters():
            if "norm" in n or "ln_" in n:
                p.add_(torch.randn_like(p) * 0.1)
    return m


def ids(batch=2, seq=24, seed=1):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, V, (batch, seq), generator=g).to(DEV)


def train(model, forward=None, steps=30, seed=7, lr=3e-3, autocast=False, opt=None):
    """Losses of ``steps`` AdamW steps of a causal LM on tokens of a learnable distribution (the first quarter of
    the vocabulary); ``forward``: what computes the loss's outputs (a compiled model; default the model)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr) if opt is None else opt
    forward = model if forward is None else forward  # a compiled module has no truth value (len())
    g = torch.Generator(device="cpu").manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randint(0, V // 4, (4, 32), generator=g).to(DEV)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = forward(x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def expected_swaps(arch):
    norms_per_layer = {"gemma2": 4, "qwen3": 4}.get(arch, 2)  # Qwen3: q_norm, k_norm too
    return L, L * norms_per_layer + 1  # MLPs; norms (+ the final norm)


@pytest.mark.parametrize("arch", ARCHS)
def test_apply_matches_float64_forward_and_backward(arch):
    model = build(arch)
    ref = copy.deepcopy(model).double()
    report = hf.apply(model)
    n_mlp, n_norm = expected_swaps(arch)
    mlps = [e for e in report.swapped if e.kind == "mlp"]
    norms = [e for e in report.swapped if e.kind == "norm"]
    assert len(mlps) == n_mlp and len(norms) == n_norm, str(report)
    assert not report.left, str(report)
    x = ids()
    # Outputs poisoned before the call cannot show through: every logit comes from this forward.
    out = model(x, labels=x)
    r = ref(x, labels=x)
    assert rel_err(out.logits, r.logits) < 2e-3, arch  # fp32 GEMMs may run TF32
    out.loss.backward()
    r.loss.backward()
    checked = 0
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if any(k in n for k in ("mlp", "norm", "ln_")) and p.grad is not None:
            assert rel_err(p.grad, q.grad) < 5e-3, f"{arch}: grad of {n}"
            checked += 1
    assert checked >= 3 * L, arch
    # Every swapped module ran jitfuse: its sequence has a program on this device.
    for path, seq in hf.swapped(model).items():
        assert existing_programs(seq._jf_keys[True][torch.float32]), path


def test_state_dict_is_unchanged_and_save_pretrained_round_trips(tmp_path):
    model = build("llama")
    keys = list(model.state_dict().keys())
    params_before = [id(p) for p in model.parameters()]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    hf.apply(model)
    assert list(model.state_dict().keys()) == keys
    assert [id(p) for p in model.parameters()] == params_before  # the same Parameter objects
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    # gate and up share one buffer: the fused GEMM's weight is a view of their memory.
    mlp = model.model.layers[0].mlp
    g, u = mlp.gate_proj.weight, mlp.up_proj.weight
    assert u.data_ptr() == g.data_ptr() + g.numel() * g.element_size()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = ids()
    model(x, labels=x).loss.backward()
    opt.step()
    model.save_pretrained(tmp_path)
    again = type(model).from_pretrained(tmp_path, attn_implementation="eager").to(DEV)
    for (k, v), (k2, v2) in zip(model.state_dict().items(), again.state_dict().items()):
        assert k == k2 and torch.equal(v, v2), k
    hf.apply(again)
    with torch.no_grad():
        assert torch.equal(model(x).logits, again(x).logits)


def test_generate_gives_the_unmodified_models_greedy_tokens():
    for arch in ("llama", "gpt2"):
        model = build(arch)
        plain = copy.deepcopy(model)
        hf.apply(model)
        prompt = ids(batch=1, seq=8, seed=3)
        kw = dict(max_new_tokens=32, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            a = model.generate(prompt, **kw)
            b = plain.generate(prompt, **kw)
        assert torch.equal(a, b), arch


def test_revert_restores_the_original_forwards():
    model = build("qwen2")
    plain = copy.deepcopy(model)
    n = len(hf.apply(model).swapped)
    assert hf.revert(model) == n and not hf.swapped(model)
    x = ids()
    with torch.no_grad():
        assert torch.equal(model(x).logits, plain(x).logits)  # the original kernels on the same values
    assert len(hf.apply(model).swapped) == n  # and again


def test_deepcopy_of_an_applied_model_reads_its_own_parameters():
    model = build("llama")
    hf.apply(model)
    twin = copy.deepcopy(model)  # Parameter.__deepcopy__ clones each: gate and up lose their shared buffer
    with torch.no_grad():
        for p in twin.model.layers[0].mlp.parameters():
            p.mul_(0.5)
    x = ids()
    hf._warned_split = False
    with torch.no_grad():
        with pytest.warns(UserWarning, match="no longer share one buffer"):
            y = twin(x).logits
        assert not torch.equal(model(x).logits, y)
    assert len(hf.apply(twin).swapped) > 0  # re-joins them: no copy per call
    mlp = twin.model.layers[0].mlp
    assert hf._adjacent(mlp.gate_proj.weight, mlp.up_proj.weight)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            assert torch.equal(twin(x).logits, y)
        ref = copy.deepcopy(twin)
        hf.revert(ref)
        assert rel_err(twin(x).logits, ref(x).logits) < 2e-3


def test_adamw_autocast_checkpointing_tracks_the_unmodified_model():
    # Optimizer built BEFORE apply (the Parameters stay the same objects), bf16 autocast over fp32 weights,
    # gradient checkpointing on: the loss curve stays within rounding of the unmodified model's.
    def run(swap, steps=30):
        model = build("llama", seed=5)
        model.gradient_checkpointing_enable()
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        if swap:
            hf.apply(model)
        return train(model, steps=steps, autocast=True, opt=opt)
    a, b = run(True), run(False)
    assert abs(a[0] - b[0]) / b[0] < 0.01
    assert b[-1] < 0.8 * b[0] and a[-1] < 0.8 * a[0]  # both learn
    tail = lambda v: sum(v[-5:]) / 5  # noqa: E731
    assert abs(tail(a) - tail(b)) / tail(b) < 0.05, (a, b)


def test_hostile_modules_are_left_with_the_reason():
    model = build("llama")

    class Doubled(type(model.model.layers[0].mlp)):
        def forward(self, x):
            return 2 * super().forward(x)

    model.model.layers[0].mlp.__class__ = Doubled
    act = model.model.layers[1].mlp.act_fn
    model.model.layers[1].mlp.act_fn = nn.Softplus()
    ref = copy.deepcopy(model)
    report = hf.apply(model)
    left = {e.path: e.reason for e in report.left}
    assert "model.layers.0.mlp" in left and "does not compute" in left["model.layers.0.mlp"], str(report)
    assert "model.layers.1.mlp" in left and "activation" in left["model.layers.1.mlp"], str(report)
    x = ids()
    with torch.no_grad():
        assert rel_err(model(x).logits, ref(x).logits) < 2e-3  # a correct model, never a wrong one
    model.model.layers[1].mlp.act_fn = act


def test_inputs_the_swap_does_not_take_run_the_original_forward():
    model = build("llama")
    norm = model.model.norm
    plain = copy.deepcopy(norm)
    hf.apply(model)
    x16 = torch.randn(5, H, device=DEV, dtype=torch.bfloat16)
    with torch.no_grad():  # float32 weight, bfloat16 input outside autocast: HF's output is float32
        y = norm(x16)
        assert y.dtype == plain(x16).dtype and torch.equal(y, plain(x16))
        xc = torch.randn(5, H)
        assert torch.equal(norm.cpu()(xc), plain.cpu()(xc))  # off CUDA
    norm.to(DEV)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            z = norm(torch.randn(5, H, device=DEV))
    assert z.dtype == torch.float32


def test_a_moved_model_still_runs_and_apply_rejoins():
    model = build("llama")
    hf.apply(model)
    model.to(torch.bfloat16)  # .to() gives gate and up their own storage
    hf._warned_split = False  # the warning is once per process
    x = ids()
    with pytest.warns(UserWarning, match="no longer share one buffer"):
        with torch.no_grad():
            a = model(x).logits
    hf.apply(model)
    mlp = model.model.layers[0].mlp
    g = mlp.gate_proj.weight
    assert mlp.up_proj.weight.data_ptr() == g.data_ptr() + g.numel() * g.element_size()
    with torch.no_grad():
        assert torch.equal(model(x).logits, a)


# ---- PEFT / LoRA ----------------------------------------------------------------------------------------------


def _lora(model, targets, seed, random_b=False):
    peft = pytest.importorskip("peft")
    torch.manual_seed(seed)  # LoRA's A (and B with random_b) are drawn here: the same for both copies
    cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets, lora_dropout=0.0,
                          init_lora_weights=not random_b)
    return peft.get_peft_model(model, cfg)


def test_lora_on_attention_trains_with_the_swapped_norms_and_mlps():
    """PEFT LoRA on q_proj/v_proj (the base frozen), then hf.apply: the norms and MLPs are swapped (their
    frozen weights read live), the LoRA weights train, and the loss curve is the unswapped PEFT model's."""
    base = build("llama", seed=5)
    a = _lora(copy.deepcopy(base), ["q_proj", "v_proj"], 1)
    b = _lora(copy.deepcopy(base), ["q_proj", "v_proj"], 1)
    report = hf.apply(b)
    assert len([e for e in report.swapped if e.kind == "mlp"]) == L, str(report)
    frozen = {n: p.detach().clone() for n, p in b.named_parameters() if "mlp" in n}
    la = train(a, steps=20, seed=3)
    lb = train(b, steps=20, seed=3)
    assert abs(la[0] - lb[0]) / la[0] < 1e-3, (la, lb)
    assert abs(sum(la[-5:]) - sum(lb[-5:])) / sum(la[-5:]) < 0.01, (la, lb)
    for n, p in b.named_parameters():
        if "mlp" in n:
            assert torch.equal(p, frozen[n]), n   # frozen by PEFT: never updated
    assert any(p.requires_grad for n, p in b.named_parameters() if "lora_" in n)


def test_a_projection_wrapped_after_apply_runs_its_lora_layer():
    """hf.apply first, then LoRA on the MLP's projections: each wrapped MLP runs its own forward again (which
    calls the LoRA layers), with one warning; the model equals the PEFT model that was never swapped."""
    base = build("llama", seed=6)
    ref = _lora(copy.deepcopy(base), ["gate_proj", "up_proj", "down_proj"], 2, random_b=True)
    model = copy.deepcopy(base)
    hf.apply(model)
    model = _lora(model, ["gate_proj", "up_proj", "down_proj"], 2, random_b=True)
    hf._warned_replaced = False  # the warning is once per process
    x = ids()
    with pytest.warns(UserWarning, match="replaced after apply"):
        with torch.no_grad():
            y = model(x).logits
    with torch.no_grad():
        assert rel_err(y, ref(x).logits) < 1e-4


# ---- loss=True: the causal LM's head and HF's loss as the fused chunked head ---------------------------------


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt2"])
def test_loss_swap_matches_hf_loss_and_gradients(arch):
    # Gemma-2: final_logit_softcapping (30) on the logits; GPT-2: the head tied to the token embedding. Float32
    # weights: the loss and every parameter's gradient within fp32 rounding of HF's own head and loss, with
    # labels that ignore a prompt (-100); logits=None when labels are given, HF's logits without them.
    ref = build(arch, seed=3)
    fused = copy.deepcopy(ref)
    report = hf.apply(fused, loss=True)
    loss_entries = [e for e in report.entries if e.kind == "loss"]
    assert len(loss_entries) == 1 and loss_entries[0].swapped, str(report)
    assert "lm_head+loss" in hf.swapped(fused)
    x = ids(seed=11)
    labels = x.clone()
    labels[:, :5] = -100
    for m in (ref, fused):
        m.train()
    out_r = ref(input_ids=x, labels=labels)
    out_f = fused(input_ids=x, labels=labels)
    assert out_f.logits is None
    assert rel_err(out_f.loss, out_r.loss) < 1e-4
    out_r.loss.backward()
    out_f.loss.backward()
    gr = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    gf = {n: p.grad for n, p in fused.named_parameters() if p.grad is not None}
    assert gr.keys() == gf.keys()
    for n in gr:
        assert rel_err(gf[n], gr[n]) < 2e-3, n
    # Gradient accumulation: HF's num_items_in_batch (the loss summed, divided by the batch's token count).
    items = torch.tensor(int((labels[:, 1:] != -100).sum()) + 7, device=DEV)
    a = ref(input_ids=x, labels=labels, num_items_in_batch=items).loss
    b = fused(input_ids=x, labels=labels, num_items_in_batch=items).loss
    assert rel_err(b, a) < 1e-4
    # Without labels, the logits (the original forward).
    with torch.no_grad():
        assert rel_err(fused(input_ids=x).logits, ref(input_ids=x).logits) < 1e-4
    assert hf.revert(fused) >= 1 and fused(input_ids=x, labels=labels).logits is not None


def test_loss_swap_trains_like_hf_under_autocast_and_compile():
    # bf16 autocast over fp32 weights, AdamW, 30 steps: the fused head's curve tracks HF's own; then the same
    # under torch.compile with the jitfuse backend (the head runs eagerly, the rest compiled).
    def run(swap, compiled=False):
        model = build("llama", seed=5)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        if swap:
            assert hf.apply(model, loss=True).entries[0].swapped
        fwd = torch.compile(model, backend="jitfuse") if compiled else None
        return train(model, forward=fwd, steps=30, autocast=True, opt=opt)
    a, b, c = run(True), run(False), run(True, compiled=True)
    for got in (a, c):
        assert abs(got[0] - b[0]) / b[0] < 0.01, (got, b)
        tail = lambda v: sum(v[-5:]) / 5  # noqa: E731
        assert abs(tail(got) - tail(b)) / tail(b) < 0.05, (got, b)
    assert b[-1] < 0.8 * b[0] and a[-1] < 0.8 * a[0]


def test_loss_swap_is_left_with_the_reason_where_it_cannot_run():
    class NotCausal(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = nn.Conv1d(4, 4, 1)

    report = hf.apply(NotCausal().to(DEV), loss=True)
    e = [x for x in report.entries if x.kind == "loss"]
    assert len(e) == 1 and not e[0].swapped and "no nn.Linear lm_head" in e[0].reason
    # A head whose forward does something else (a scaled loss) fails the probe and is left.
    model = build("llama", seed=2)
    orig = type(model).forward

    def scaled(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        if out.loss is not None:
            out.loss = out.loss * 2
        return out

    model.forward = scaled.__get__(model)
    report = hf.apply(model, loss=True, norms=False, mlps=False)
    assert not report.entries[0].swapped and "not HF's shifted cross-entropy" in report.entries[0].reason
