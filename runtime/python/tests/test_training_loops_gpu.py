# GPU tests of issue 26: the training setups that gave silently wrong results or crashed (fused optimizers
# under FP8, checkpointing with dropout, non-contiguous parameters, FP8 outputs' gradients, autocast,
# FP8 state in state_dict, inference_mode, module names, memory and deepcopy), each against PyTorch's own
# result for the same setup or a float64 reference. Run as test_torch_gpu.py (python3 -m pytest -m gpu).
import copy
import gc
import io

import pytest

from conftest import need_torch

torch = need_torch()  # or a skip of this module: no torch, or one jitfuse.torch refuses
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

import torch.nn.functional as F  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

import jitfuse.torch as jt  # noqa: E402
import jitfuse.torch._registry as registry  # noqa: E402
from jitfuse.errors import JitfuseError  # noqa: E402
from test_torch_gpu import (DEV, FP8_RECIPES, FP8_STEP_MOVES, FP8_TOL, check, fp8_flags, fp8_inputs, fp8_mlp,  # noqa: E402
                            gelu_tanh, randomize, reference, rel_err)

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16


# ---- 1. FP8 weights follow every optimizer ----------------------------------------------------------

@pytest.mark.parametrize("recipe", FP8_RECIPES)
@pytest.mark.parametrize("writer", ["adamw_fused", "adamw_foreach", "foreach_add", "data_copy"])
def test_fp8_forward_follows_any_weight_write(recipe, writer):
    model = fp8_mlp(recipe)
    g = torch.Generator(device=DEV).manual_seed(21)
    x, e, dy = fp8_inputs(g)
    flags = fp8_flags(model)
    params = list(model.parameters())
    opt = None
    if writer.startswith("adamw"):
        opt = torch.optim.AdamW(params, lr=0.02, fused=writer == "adamw_fused", foreach=writer == "adamw_foreach")
    for step in range(3):
        (r_old,), _, _, _ = reference(model, x, [e], dy, [])
        model.zero_grad(set_to_none=True)
        y = model(x, e)
        y.backward(dy)
        assert rel_err(y.detach(), r_old) <= FP8_TOL, f"step {step}: the forward ran on stale weights"
        with torch.no_grad():
            if opt is not None:
                opt.step()
            elif writer == "foreach_add":
                torch._foreach_add_(params, [torch.randn_like(p) * p.float().std().item() for p in params])
            else:  # through .data: invisible to the version counter
                for p in params:
                    p.data.copy_(p.data + torch.randn_like(p) * p.float().std().item())
        (r_new,), _, _, _ = reference(model, x, [e], dy, [])
        assert rel_err(r_old, r_new) > FP8_STEP_MOVES, "the write must move the output"
    assert flags() == [0, 0, 0], flags()  # every forward cast the weights


def test_fp8_fused_adamw_loss_curve_matches_foreach():
    losses = {}
    for fused in (True, False):
        torch.manual_seed(3)
        model = fp8_mlp("fp8_delayed")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused, foreach=not fused)
        g = torch.Generator(device=DEV).manual_seed(4)
        curve = []
        for _ in range(20):
            x, e, target = fp8_inputs(g)
            opt.zero_grad(set_to_none=True)
            loss = F.mse_loss(model(x, e).float(), target.float())
            loss.backward()
            opt.step()
            curve.append(loss.item())
        losses[fused] = curve
    diff = max(abs(a - b) / abs(b) for a, b in zip(losses[True], losses[False]))
    assert diff < 0.02, (diff, losses)
    assert losses[True][-1] < losses[True][0]


# ---- 2. dropout under activation checkpointing ---------------------------------------------------

def _dropout_block(dtype=BF16):
    m = jt.Sequential(jt.LayerNorm(256), jt.Linear(256, 512), jt.Bias(512), jt.GELU(), jt.Dropout(0.3),
                      jt.Linear(512, 256), jt.Bias(256), jt.Dropout(0.2), jt.AddExtraInput(), device=DEV, dtype=dtype)
    randomize(m)
    return m


def _grads(model, x, e, dy, ckpt=None):
    x = x.detach().requires_grad_()
    model.zero_grad(set_to_none=True)
    if ckpt is None:
        y = model(x, e)
    else:
        y = checkpoint(model, x, e, use_reentrant=ckpt)
    y.backward(dy)
    return y.detach(), [x.grad] + [p.grad for p in model.parameters()]


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_with_dropout_gives_the_uncheckpointed_gradients(reentrant):
    model = _dropout_block()
    x = torch.randn(96, 256, device=DEV, dtype=BF16)
    e, dy = torch.randn_like(x), torch.randn_like(x)
    torch.manual_seed(5)
    y_ref, g_ref = _grads(model, x, e, dy)
    torch.manual_seed(5)
    y_ck, g_ck = _grads(model, x, e, dy, ckpt=reentrant)
    assert torch.equal(y_ck, y_ref)
    for a, b in zip(g_ck, g_ref):
        assert torch.equal(a, b), "the recompute drew another dropout mask"
    # And a different seed draws different masks (dropout is live).
    torch.manual_seed(6)
    y_other, _ = _grads(model, x, e, dy)
    assert not torch.equal(y_other, y_ref)


def test_manual_seed_reproduces_dropout():
    model = _dropout_block()
    x = torch.randn(64, 256, device=DEV, dtype=BF16)
    e = torch.randn_like(x)
    torch.manual_seed(11)
    a = model(x, e)
    b = model(x, e)
    torch.manual_seed(11)
    assert torch.equal(model(x, e), a) and torch.equal(model(x, e), b) and not torch.equal(a, b)


# ---- 3. parameters: layout and shape checked at every call ------------------------------------------

def test_non_contiguous_parameter_is_used_correctly():
    torch.manual_seed(12)
    conv_w = torch.randn(128, 96, device=DEV, dtype=BF16) / 12  # Conv1D layout [in, out], as GPT-2's
    model = jt.Sequential(jt.Linear(128, 96), jt.Bias(96), jt.GELU(), device=DEV, dtype=BF16)
    randomize(model)
    model[0].weight = torch.nn.Parameter(conv_w.t())  # [out, in], non-contiguous
    assert not model[0].weight.is_contiguous()
    x = torch.randn(40, 128, device=DEV, dtype=BF16, requires_grad=True)
    dy = torch.randn(40, 96, device=DEV, dtype=BF16)
    y = model(x)
    y.backward(dy)
    x64 = x.detach().double().requires_grad_()
    w64 = conv_w.double().t().detach().requires_grad_()
    b64 = model[1].bias.detach().double().requires_grad_()
    r = gelu_tanh(x64 @ w64.T + b64)
    r.backward(dy.double())
    check("output", y, r, BF16, gemm=True)
    check("grad_input", x.grad, x64.grad, BF16, gemm=True)
    assert model[0].weight.grad.shape == (96, 128)
    check("grad weight", model[0].weight.grad, w64.grad, BF16, gemm=True)
    with torch.no_grad():  # the no-grad (inference) path too
        check("inference output", model(x.detach()), r, BF16, gemm=True)


def test_parameter_of_wrong_shape_assigned_after_a_call_is_refused():
    model = jt.Sequential(jt.Linear(64, 32), jt.Bias(32), device=DEV, dtype=BF16)
    x = torch.randn(8, 64, device=DEV, dtype=BF16)
    model(x)
    model[1].bias = torch.nn.Parameter(torch.randn(16, device=DEV, dtype=BF16))
    for grad in (True, False):
        with torch.set_grad_enabled(grad), pytest.raises(JitfuseError, match=r"tensor 'params op 1 \(bias\) 'bias'': expected shape 32, got 16"):
            model(x)
    model[1].bias = torch.nn.Parameter(torch.randn(32, device=DEV, dtype=torch.float16))
    with pytest.raises((JitfuseError, TypeError), match="float16|dtype"):
        model(x)


# ---- 4. an FP8 output: codes + scale, gradient straight through and unrounded -----------------------

@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_fp8_quantize_output_carries_scale_and_unrounded_gradient(recipe):
    model = jt.Sequential(jt.Bias(256), jt.GELU(), jt.Quantize(), recipe=recipe, device=DEV, dtype=BF16)
    randomize(model)
    x = torch.randn(64, 256, device=DEV, dtype=BF16, requires_grad=True)
    for _ in range(3):  # fp8_delayed: the scale comes from the history of earlier calls
        y = model(x)
    assert isinstance(y, jt.Float8Tensor) and y.dtype == BF16
    assert y.fp8_data.dtype == torch.float8_e4m3fn and y.scale_inv.dtype == torch.float32
    x64 = x.detach().double().requires_grad_()
    ref = gelu_tanh(x64 + model[0].bias.double())
    assert rel_err(y.dequantize(), ref) <= FP8_TOL
    assert rel_err(y.fp8_data.double() * y.scale_inv.double(), ref) <= FP8_TOL
    assert rel_err(y.float(), ref) <= FP8_TOL  # any op sees the decoded values
    # Gradients of 1e-4 and 1000 (0 and NaN once rounded to E4M3) arrive as they are.
    dy = torch.where(torch.rand(64, 256, device=DEV) < 0.5, 1e-4, 1000.0).to(BF16)
    y.backward(dy)
    ref.backward(dy.double())
    assert torch.isfinite(x.grad).all()
    check("grad_input", x.grad, x64.grad, BF16, chain=2)
    with torch.no_grad():
        yi = model(x)
    assert isinstance(yi, jt.Float8Tensor) and rel_err(yi.dequantize(), ref) <= FP8_TOL


# ---- 5. autocast ---------------------------------------------------------------------------------

def test_autocast_computes_in_the_autocast_dtype_with_fp32_master_weights():
    model = jt.Sequential(jt.LayerNorm(128), jt.Linear(128, 256), jt.Bias(256), jt.GELU(), jt.Linear(256, 128),
                          device=DEV, dtype=torch.float32)
    randomize(model)
    x = torch.randn(48, 128, device=DEV, requires_grad=True)
    dy = torch.randn(48, 128, device=DEV)
    with torch.autocast("cuda", dtype=BF16):
        y = model(x)
    assert y.dtype == BF16
    y.backward(dy.to(BF16))
    for p in model.parameters():
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32
    assert x.grad.dtype == torch.float32
    # Reference: float64 on the bf16-rounded parameters and input (what autocast computes with).
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(BF16).float())
    (r_y,), r_dx, _, r_dp = reference(rounded, x.detach().to(BF16).float(), [], dy.to(BF16), [])
    check("output", y, r_y, BF16, gemm=True, chain=2)
    check("grad_input", x.grad, r_dx, BF16, gemm=True, chain=2)
    for n, p in model.named_parameters():
        check(f"grad {n}", p.grad, r_dp[n], BF16, gemm=True, chain=2)
    # Outside autocast, a dtype mismatch is an error, not a silent fp32 run.
    with pytest.raises((TypeError, JitfuseError), match="dtype|parameters must match"):
        model(x.detach().to(BF16))


# ---- 6. FP8 recipe state in state_dict ------------------------------------------------------------

def _train(model, g, steps):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ys = []
    for _ in range(steps):
        x, e, dy = fp8_inputs(g)
        opt.zero_grad(set_to_none=True)
        y = model(x, e)
        y.backward(dy)
        opt.step()
        assert torch.isfinite(y).all()
        ys.append(y.detach().clone())
    return ys


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_fp8_state_dict_round_trip_resumes_the_run(recipe):
    model = fp8_mlp(recipe)
    _train(model, torch.Generator(device=DEV).manual_seed(30), 5)
    sd = model.state_dict()
    assert "_extra_state" in sd and sd["_extra_state"]["recipe"] == recipe
    if recipe == "fp8_block":  # each block's scale comes from its own amax: no state to save
        assert sd["_extra_state"]["blocks"] == {}
    else:
        hist = sd["_extra_state"]["blocks"]["1.weight"]
        assert hist[0].item() != 1.0 or recipe == "fp8_current"  # delayed: a scale learned from the amax history
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    resumed = fp8_mlp(recipe)
    randomize(resumed, scale=3.0)  # other weights, fresh state: everything must come from the checkpoint
    resumed.load_state_dict(torch.load(buf, weights_only=False))
    a = _train(model, torch.Generator(device=DEV).manual_seed(31), 4)
    b = _train(resumed, torch.Generator(device=DEV).manual_seed(31), 4)
    for i, (ya, yb) in enumerate(zip(a, b)):
        assert torch.equal(ya, yb), f"step {i} after the resume differs"
    # A fresh module without the state differs (delayed: its scales start at 1).
    if recipe == "fp8_delayed":
        fresh = fp8_mlp(recipe)
        fresh.load_state_dict({k: v for k, v in sd.items() if k != "_extra_state"}, strict=False)
        c = _train(fresh, torch.Generator(device=DEV).manual_seed(31), 1)
        assert not torch.equal(c[0], a[0])
    with pytest.raises(ValueError, match="recipe"):
        other = "fp8_current" if recipe == "fp8_delayed" else "fp8_delayed"
        fp8_mlp(other).load_state_dict(sd)
    # Hostile extra state: a clear error naming what is wrong, the module's state untouched.
    before = resumed.get_extra_state()["blocks"]
    with pytest.raises(ValueError, match="not jitfuse FP8 recipe state"):
        resumed.set_extra_state({"format": "something/else"})
    with pytest.raises(ValueError, match="not jitfuse FP8 recipe state"):
        resumed.set_extra_state([1, 2, 3])
    bad = {k: v for k, v in sd["_extra_state"].items()}
    if recipe != "fp8_block":
        bad["blocks"] = dict(bad["blocks"], **{"1.weight": torch.zeros(2)})  # a block is >= 3 floats
        with pytest.raises(ValueError, match=r"FP8 state '1.weight': expected a float32 tensor of shape"):
            fp8_mlp(recipe).set_extra_state(bad)
    bad["blocks"] = {"9.input": torch.zeros(3)}
    with pytest.raises(ValueError, match="has tensors"):
        fp8_mlp(recipe).set_extra_state(bad)
    after = resumed.get_extra_state()["blocks"]
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_plain_recipe_state_dict_has_no_extra_state():
    model = jt.Sequential(jt.Linear(64, 64), device=DEV, dtype=BF16)
    assert set(model.state_dict()) == {"0.weight"}


# ---- 7. inference_mode ----------------------------------------------------------------------------

@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_fp8_created_and_run_under_inference_mode(recipe):
    with torch.inference_mode():
        model = fp8_mlp(recipe)
        g = torch.Generator(device=DEV).manual_seed(40)
        x, e, dy = fp8_inputs(g)
        y = model(x, e)
        y2 = model(x, e)
    (r_y,), _, _, _ = reference(model, x.clone(), [e.clone()], dy.clone(), [])
    assert rel_err(y.clone(), r_y) <= FP8_TOL and rel_err(y2.clone(), r_y) <= FP8_TOL
    model2 = fp8_mlp(recipe)  # created outside, run inside
    with torch.inference_mode():
        y3 = model2(x, e)
    (r_y3,), _, _, _ = reference(model2, x.clone(), [e.clone()], dy.clone(), [])
    assert rel_err(y3.clone(), r_y3) <= FP8_TOL


# ---- 8. names never collide ----------------------------------------------------------------------

def test_identical_modules_with_different_names_and_dtypes():
    mods = []
    for i in range(3):
        for dt in (torch.float32, torch.float16, BF16):
            m = jt.Sequential(jt.Linear(64, 64), jt.Bias(64), jt.GELU(), device=DEV, dtype=dt, name=f"layer{i}.mlp")
            randomize(m)
            mods.append((m, dt))
    for m, dt in mods:
        x = torch.randn(16, 64, device=DEV, dtype=dt)
        r = gelu_tanh(x.double() @ m[0].weight.double().T + m[1].bias.double())
        check("output", m(x), r, dt, gemm=True)


# ---- 9. memory freed with the module, deepcopy independent -----------------------------------------

def _device_free():
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


def test_fp8_module_memory_is_freed_with_the_module():
    g = torch.Generator(device=DEV).manual_seed(50)
    x, e, dy = fp8_inputs(g)

    def make_and_run():
        m = fp8_mlp("fp8_delayed")
        m(x, e).backward(dy)
        return sorted({k for d in m._jf_keys.values() for k in d.values()})
    make_and_run()  # warm: libraries, workspaces, the first kernel loads
    before = _device_free()
    keys = []
    for _ in range(8):
        keys += make_and_run()
    after = _device_free()
    assert before - after < 8 << 20, f"{(before - after) / 2**20:.1f} MiB not freed after 8 modules"
    assert not any(k in registry._definitions for k in keys)
    assert not any(k in keys for k, _ in registry._programs)


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_fp8_deepcopy_is_independent(recipe):
    model = fp8_mlp(recipe)
    _train(model, torch.Generator(device=DEV).manual_seed(60), 3)
    twin = copy.deepcopy(model)
    assert twin._jf_keys != model._jf_keys
    state = model.get_extra_state()
    for k, v in twin.get_extra_state()["blocks"].items():
        assert torch.equal(v, state["blocks"][k]), k  # the copy starts from the same state
    g = torch.Generator(device=DEV).manual_seed(61)
    x, e, _ = fp8_inputs(g)
    with torch.no_grad():
        assert torch.equal(twin(x, e), model(x, e))
    state = model.get_extra_state()
    _train(twin, torch.Generator(device=DEV).manual_seed(62), 3)  # moves the copy's weights and state only
    tb = twin.get_extra_state()["blocks"]
    if recipe != "fp8_block":  # (fp8_block keeps no state)
        assert any(not torch.equal(v, state["blocks"][k]) for k, v in tb.items()), "training moved the copy's state"
    for k, v in model.get_extra_state()["blocks"].items():
        assert torch.equal(v, state["blocks"][k]), f"training the copy changed the original's state {k}"
    for n, p in model.named_parameters():
        assert not torch.equal(p, dict(twin.named_parameters())[n])
