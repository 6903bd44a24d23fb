# GPU tests of jt.CrossEntropy: Sequential(Linear, [Bias,] CrossEntropy)(x, labels) against
# torch.nn.functional.linear + cross_entropy in float64 (loss and the gradients of x, W, b), with
# ignore_index=-100 rows and label smoothing, each reduction, z-loss and soft-capping against their float64
# formulas, int32 labels, and the errors of bad labels.
# Run: JITFUSE_LIBRARY=build/runtime/libjitfuse.so python3 -m pytest runtime/python/tests/test_cross_entropy_gpu.py -m gpu -v
import pytest

from conftest import need_torch

torch = need_torch()  # or a skip of this module: no torch, or one jitfuse.torch refuses
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

import torch.nn.functional as F  # noqa: E402

import jitfuse  # noqa: E402
import jitfuse.torch as jt  # noqa: E402

pytestmark = pytest.mark.gpu
DEV = "cuda"
# DESIGN's tolerances; the GEMMs' fp32 accumulation order differs from float64: fp16's for fp32.
TOLS = {torch.float32: (1e-3, 1e-5), torch.float16: (2e-3, 1e-5), torch.bfloat16: (3.2e-2, 1e-5)}


def check(name, actual, ref, dtype):
    rtol, atol = TOLS[dtype]
    a, r = actual.double(), ref.double()
    assert a.shape == r.shape, f"{name}: shape {tuple(a.shape)} != {tuple(r.shape)}"
    assert torch.isfinite(a).all(), f"{name}: non-finite values"
    err = (a - r).abs().max().item()
    bound = atol + rtol * max(r.abs().max().item(), 1e-30)
    assert err <= bound, f"{name} ({dtype}): max|err| {err:.3e} > {bound:.3e} (max|ref| {r.abs().max().item():.3e})"


def labels_for(rows, v, ignore=-100, dtype=torch.int64, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    y = torch.randint(0, v, rows, generator=g)
    drop = torch.rand(rows, generator=g) < 0.2
    drop.view(-1)[0] = False
    y[drop] = ignore
    return y.to(device=DEV, dtype=dtype)


def reference(x, w, b, y, reduction, ignore, eps, z_loss, softcap):
    """float64 loss of cross_entropy(linear(x, w, b)) with the jitfuse extensions (z-loss, soft-capping)."""
    z = F.linear(x, w, b)
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    z2, y1 = z.reshape(-1, z.shape[-1]), y.reshape(-1).long()
    per_row = F.cross_entropy(z2, y1, ignore_index=ignore, label_smoothing=eps, reduction="none")
    if z_loss:
        per_row = per_row + z_loss * torch.logsumexp(z2, -1) ** 2 * (y1 != ignore)
    if reduction == "none":
        return per_row.reshape(y.shape)
    if reduction == "sum":
        return per_row.sum().reshape(1)
    return (per_row.sum() / (y1 != ignore).sum()).reshape(1)


def run(dtype, rows, h, v, bias=False, reduction="mean", ignore=-100, eps=0.0, z_loss=0.0, softcap=0.0,
        label_dtype=torch.int64, seed=0, chunk_mib=None):
    torch.manual_seed(seed)
    ops = [jt.Linear(h, v)] + ([jt.Bias(v)] if bias else []) + [
        jt.CrossEntropy(reduction, ignore, eps, z_loss, softcap, label_dtype, chunk_mib=chunk_mib)]
    m = jt.Sequential(*ops, device=DEV, dtype=dtype)
    if bias:
        with torch.no_grad():
            m[1].bias.uniform_(-0.5, 0.5)
    x = (torch.randn(*rows, h, device=DEV) * 2).to(dtype).requires_grad_()
    y = labels_for(rows, v, ignore, label_dtype, seed)
    loss = m(x, y)
    g = torch.randn_like(loss)
    (loss * g).sum().backward()
    xr = x.detach().double().requires_grad_()
    wr = m[0].weight.detach().double().requires_grad_()
    br = m[1].bias.detach().double().requires_grad_() if bias else None
    ref = reference(xr, wr, br, y, reduction, ignore, eps, z_loss, softcap)
    (ref * g.double()).sum().backward()
    check("loss", loss, ref, dtype)
    check("grad x", x.grad, xr.grad, dtype)
    check("grad W", m[0].weight.grad, wr.grad, dtype)
    if bias:
        check("grad b", m[1].bias.grad, br.grad, dtype)
    assert y.grad is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_matches_torch_cross_entropy(dtype, reduction):
    # mean / sum: the joint head (gradients in the forward); none: the unfused ops.
    run(dtype, (7,), 64, 50257, reduction=reduction)
    run(dtype, (3, 5), 32, 1000, bias=True, reduction=reduction, eps=0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ignore_index_label_smoothing_z_loss_softcap_int32(dtype):
    run(dtype, (9,), 48, 1000, ignore=-100, eps=0.1)
    run(dtype, (9,), 48, 1000, ignore=0)
    run(dtype, (9,), 48, 1000, z_loss=1e-2)
    run(dtype, (9,), 48, 1000, softcap=5.0)
    run(dtype, (9,), 48, 1000, reduction="sum", eps=0.2, z_loss=1e-3, softcap=30.0, label_dtype=torch.int32)


def test_several_chunks_bf16():
    # 1030 rows of Llama-3's vocabulary: chunks of 1024 and 6 rows under a 256 MiB logits budget; GPT-2's odd
    # vocabulary (the weight and bias padded to 50264 rows) in 128-row chunks (16 MiB), an upstream gradient != 1.
    run(torch.bfloat16, (1030,), 16, 128256, chunk_mib=256)
    run(torch.bfloat16, (300,), 24, 50257, bias=True, chunk_mib=16)


def test_eval_mode_and_no_grad_give_the_loss():
    torch.manual_seed(1)
    m = jt.Sequential(jt.Linear(32, 500), jt.CrossEntropy(), device=DEV, dtype=torch.bfloat16)
    x = torch.randn(6, 32, device=DEV, dtype=torch.bfloat16)
    y = labels_for((6,), 500)
    ref = reference(x.double(), m[0].weight.double(), None, y, "mean", -100, 0.0, 0.0, 0.0)
    with torch.no_grad():
        check("train mode, no grad", m(x, y), ref, torch.bfloat16)
        m.eval()
        check("eval mode", m(x, y), ref, torch.bfloat16)


def test_bad_labels_raise_clear_errors():
    m = jt.Sequential(jt.Linear(16, 100), jt.CrossEntropy(), device=DEV, dtype=torch.bfloat16)
    x = torch.randn(4, 16, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"labels \(extra input 0\) must be a torch.int64 tensor"):
        m(x, torch.zeros(4, device=DEV, dtype=torch.int32))
    with pytest.raises(TypeError, match=r"labels \(extra input 0\) must be a torch.int64 tensor"):
        m(x, torch.zeros(4, device=DEV, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"labels \(extra input 0\) are on cpu"):
        m(x, torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"labels \(extra input 0\) have shape \[5\]"):
        m(x, torch.zeros(5, device=DEV, dtype=torch.int64))


def test_a_hugging_face_llama_trains_with_the_fused_head():
    """An HF Llama (from a config, random init, Llama-3's 128,256 vocabulary) trained 50 AdamW steps under
    bf16 autocast twice from the same weights: once with its own head and loss (lm_head, logits.float(),
    shifted labels with ignore_index -100), once with the head and loss as one jt.Sequential(Linear,
    CrossEntropy) on the model's own lm_head weight. The first losses agree to bf16 rounding, the curves
    track each other, and both learn; each step's peak memory is printed beside its loss."""
    transformers = pytest.importorskip("transformers")
    import copy
    cfg = transformers.LlamaConfig(vocab_size=128256, hidden_size=256, intermediate_size=512,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(cfg).to(DEV)
    fused = copy.deepcopy(ref)
    head = jt.Sequential(jt.Linear(cfg.hidden_size, cfg.vocab_size), jt.CrossEntropy(), device=DEV)
    head[0].weight = fused.lm_head.weight  # the model's own parameter: AdamW updates it, the head reads it live
    g = torch.Generator(device="cpu").manual_seed(1)
    batches = []
    for _ in range(4):
        ids = torch.randint(0, 2000, (4, 128), generator=g).to(DEV)
        labels = ids.clone()
        labels[:, :3] = -100  # a prompt without loss
        batches.append((ids, labels))
    opt_r = torch.optim.AdamW(ref.parameters(), lr=2e-3)
    opt_f = torch.optim.AdamW(fused.parameters(), lr=2e-3)

    def step(fn, opt):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fn()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return float(loss), (torch.cuda.max_memory_allocated() - base) / 2**20

    def fused_loss(ids, labels):
        hidden = fused.model(input_ids=ids).last_hidden_state
        x = hidden[:, :-1].reshape(-1, cfg.hidden_size)
        return head(x, labels[:, 1:].reshape(-1))

    curve = []
    for i in range(50):
        ids, labels = batches[i % len(batches)]
        r = step(lambda: ref(input_ids=ids, labels=labels).loss, opt_r)
        f = step(lambda: fused_loss(ids, labels), opt_f)
        curve.append((r, f))
        print(f"step {i}: HF loss {r[0]:.4f} (peak {r[1]:.0f} MiB), fused head {f[0]:.4f} (peak {f[1]:.0f} MiB)")
    # The fused loss comes back in bf16 (as F.cross_entropy of bf16 logits; HF's is float32): 1 % is a few of
    # its ulps at 6-12. Step by step only while the runs are near: AdamW on two roundings of the same
    # gradients drifts apart (H100, session 36: within 1 % through step 23, up to 7 % at step 48), so the
    # end of the curve is compared as the mean of its last ten steps.
    for i, ((r, _), (f, _)) in enumerate(curve[:10]):
        assert abs(f - r) <= 1e-2 * r, f"step {i}: fused {f} vs HF {r}"
    tail_r = sum(r for (r, _), _ in curve[-10:]) / 10
    tail_f = sum(f for _, (f, _) in curve[-10:]) / 10
    assert abs(tail_f - tail_r) <= 0.04 * tail_r, f"last ten steps: fused {tail_f} vs HF {tail_r}"
    assert tail_f < 0.6 * curve[0][1][0] and tail_r < 0.6 * curve[0][0][0], "the models did not learn"
    assert all(f_peak < r_peak for (_, r_peak), (_, f_peak) in curve[1:]), "the fused head used more memory"


def test_the_head_backward_writes_in_place_and_serves_one_backward():
    """The chunked head's backward scales the saved dx and dW in place (jf_program_grad_aliases): it allocates
    no gradient (W.grad lives in the forward's saved block), the gradients still match float64 for an upstream
    gradient other than 1, and a second backward through the same forward is refused with a message."""
    from jitfuse.torch import _calls
    torch.manual_seed(3)
    m = jt.Sequential(jt.Linear(64, 50257), jt.CrossEntropy(), device=DEV, dtype=torch.bfloat16)
    w = m[0].weight
    x = torch.randn(300, 64, device=DEV, dtype=torch.bfloat16).requires_grad_()
    y = labels_for((300,), 50257)
    loss = m(x, y)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    (loss * 0.37).backward(retain_graph=True)
    torch.cuda.synchronize()
    grew = torch.cuda.max_memory_allocated() - before
    assert grew < w.numel() * w.element_size() // 4, f"the backward allocated {grew} bytes"
    assert w.grad.untyped_storage().nbytes() > w.numel() * w.element_size()  # a view of the saved block
    xr = x.detach().double().requires_grad_()
    wr = w.detach().double().requires_grad_()
    (reference(xr, wr, None, y, "mean", -100, 0.0, 0.0, 0.0) * 0.37).sum().backward()
    check("grad x (in place)", x.grad, xr.grad, torch.bfloat16)
    check("grad W (in place)", w.grad, wr.grad, torch.bfloat16)
    with pytest.raises(RuntimeError, match="second backward .* retain_graph=True is not supported"):
        loss.backward()

    # A gradient anywhere else in the saved block is refused by the library (only the exact place is allowed).
    prog = m._jf_keys[True][torch.bfloat16]
    from jitfuse.torch._registry import device_program
    dp = device_program(prog, x.get_device())
    # The argument block of this thread (the backward above ran on autograd's): built by a plain call first.
    scratch = torch.zeros(dp.info(tuple(x.shape), True).saved_bytes, dtype=torch.uint8, device=DEV)
    _calls.run_backward(dp, x.detach(), [y], loss.detach(), [], [w.detach()], scratch,
                        torch.ones(1, device=DEV, dtype=torch.bfloat16), [])
    c = dp._tls.calls[("b", x.shape)]
    kept = list(c.aliases)
    (i0, _, n0, s0, t0), (_, off1, _, _, _) = sorted(kept)
    assert i0 == 0  # grad_input, then the weight's gradient
    saved = torch.empty(c.saved_block_bytes, dtype=torch.uint8, device=DEV)
    c.aliases = [(0, off1, n0, s0, t0)]  # dx over the saved dW
    try:
        with pytest.raises(jitfuse.JitfuseError, match="overlaps"):
            _calls.run_backward(dp, x.detach(), [y], loss.detach(), [], [w.detach()], saved,
                                torch.ones(1, device=DEV, dtype=torch.bfloat16), [], in_place=True)
    finally:
        c.aliases = kept
