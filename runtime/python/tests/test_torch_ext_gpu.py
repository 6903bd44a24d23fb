# GPU tests of jitfuse.torch's C++ extension (runtime/torch): the path chosen by JITFUSE_TORCH_EXTENSION, the C++
# eager call against the pure-Python one in the same process (bit-identical) and float64, the C++ autograd
# under saved-tensor hooks and checkpointing, hostile calls of the C++ ops, torch.compile with zero breaks, and FP8
# modules (trailing Quantize included) through the extension only.
# Run twice: JITFUSE_TORCH_EXTENSION=1 and =0 (the other tests of the package run on whichever path is loaded).
import os
from pathlib import Path

import pytest

from conftest import need_torch

torch = need_torch()  # or a skip of this module: no torch, or one jitfuse.torch refuses
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

import jitfuse  # noqa: E402
import jitfuse.torch as jt  # noqa: E402
from jitfuse.errors import JitfuseError  # noqa: E402
from jitfuse.torch import _ext, modules  # noqa: E402
from test_torch_gpu import (DEV, FP8_RECIPES, FP8_TOL, check, fp8_errors, fp8_inputs, fp8_mlp, fp8_step,  # noqa: E402
                            gelu_tanh, mlp, randomize, reference, rel_err, transformer_layer)

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16
needs_ext = pytest.mark.skipif(not _ext.active(), reason="the C++ extension is not loaded in this process")


def test_the_environment_variable_selects_the_path():
    mode = os.environ.get("JITFUSE_TORCH_EXTENSION")
    if mode == "1":
        assert jt.extension_active() and modules.ext_forward is not None
        assert _ext.EXT.built_for_torch() == torch.__version__
    elif mode == "0":
        assert not jt.extension_active() and modules.ext_forward is None
    else:
        pytest.skip("JITFUSE_TORCH_EXTENSION not set: either path may serve")


def _step(model, x, e, dy):
    x = x.detach().requires_grad_()
    e = e.detach().requires_grad_()
    for p in model.parameters():
        p.grad = None
    y = model(x, e)
    y.backward(dy)
    return y.detach(), x.grad, e.grad, {n: p.grad.clone() for n, p in model.named_parameters()}


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_cpp_and_python_eager_paths_agree_bitwise_and_with_float64(monkeypatch, dtype):
    """The same programs run either way: the C++ entry + C++ autograd, and the Python direct call + Python
    autograd.Function (modules.ext_forward = None), give the same bits; both match float64."""
    model = mlp(128, 256, dtype)
    randomize(model)
    g = torch.Generator(device=DEV).manual_seed(3)
    x = torch.randn(37, 128, device=DEV, dtype=dtype, generator=g)
    e = torch.randn(37, 128, device=DEV, dtype=dtype, generator=g)
    dy = torch.randn(37, 128, device=DEV, dtype=dtype, generator=g)
    cpp = _step(model, x, e, dy)
    monkeypatch.setattr(modules, "ext_forward", None)
    py = _step(model, x, e, dy)
    for a, b in zip(cpp[:3], py[:3]):
        assert torch.equal(a, b)
    for n in cpp[3]:
        assert torch.equal(cpp[3][n], py[3][n]), n
    (r_y,), r_dx, (r_de,), r_dp = reference(model, x, [e], dy, [])
    check("output", cpp[0], r_y, dtype, gemm=True)
    check("grad_input", cpp[1], r_dx, dtype, gemm=True)
    check("grad_extra", cpp[2], r_de, dtype, gemm=True)
    for n in r_dp:
        check(f"grad {n}", cpp[3][n], r_dp[n], dtype, gemm=True)


def test_cpp_autograd_under_saved_tensor_hooks_and_checkpoint():
    """The C++ node saves real tensors: saved-tensor hooks see them (packed and unpacked), and a reentrant and
    a non-reentrant checkpoint of a dropout sequence give the gradients of the plain run (same masks)."""
    model = transformer_layer(128, 256, BF16, p=0.1)
    randomize(model)
    x = torch.randn(16, 128, device=DEV, dtype=BF16)
    e0, e1 = torch.randn_like(x), torch.randn_like(x)
    packed, unpacked = [], []

    def pack(t):
        packed.append(t.shape)
        return t

    def unpack(t):
        unpacked.append(t.shape)
        return t

    xg = x.clone().requires_grad_()
    torch.manual_seed(7)
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        y, r0, r1 = model(xg, e0, e1)
    (y.float().sum() + r1.float().sum()).backward()
    n_params = len(list(model.parameters()))
    assert len(packed) >= 1 + 2 + n_params + 1 and len(unpacked) == len(packed)
    ref_grad = xg.grad.clone()
    from torch.utils.checkpoint import checkpoint
    for reentrant in (False, True):
        xc = x.clone().requires_grad_()
        torch.manual_seed(7)
        y2, _, r1b = checkpoint(lambda a: model(a, e0, e1), xc, use_reentrant=reentrant)
        (y2.float().sum() + r1b.float().sum()).backward()
        assert torch.equal(y2, y), f"use_reentrant={reentrant}: the recompute drew other dropout masks"
        check(f"grad_input, use_reentrant={reentrant}", xc.grad, ref_grad, BF16, gemm=True)


@needs_ext
def test_the_module_call_in_cpp_is_the_python_calls_twin(monkeypatch):
    """Sequential.__call__ in C++ (modules.ext_call): taken when nothing unusual is about (Python's
    _eager_forward never runs), the same bits and dropout masks as the Python path, the shape explain() shows;
    a hook of the module or a global one, autocast, a forward override or a wrong call hand the call back to
    Python (which runs the hooks and raises the errors), leaving PyTorch's generator as it was."""
    assert modules.ext_call is not None
    model = transformer_layer(128, 256, BF16, p=0.1)
    randomize(model)
    x = torch.randn(16, 128, device=DEV, dtype=BF16)
    e0, e1 = torch.randn_like(x), torch.randn_like(x)
    torch.manual_seed(11)
    py_out = modules.Sequential._eager_forward(model, x, e0, e1)
    calls = []
    real = modules.Sequential._eager_forward

    def counted(self, *a):
        calls.append(len(a))
        return real(self, *a)
    monkeypatch.setattr(modules.Sequential, "_eager_forward", counted)
    torch.manual_seed(11)
    cpp_out = model(x, e0, e1)
    assert calls == [], "the C++ call fell back to Python"
    for a, b in zip(cpp_out, py_out):
        assert torch.equal(a, b)
    assert model._jf_last_shape == x.shape

    seen = []
    h = model.register_forward_hook(lambda m, i, o: seen.append("module"))
    model(x, e0, e1)
    h.remove()
    g = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: seen.append("global"))
    model(x, e0, e1)
    g.remove()
    assert seen == ["module", "global"] and calls == [3, 3]
    with torch.autocast("cuda", dtype=BF16):
        model(x.float(), e0, e1)
    assert calls == [3, 3, 3]
    state = torch.cuda.get_rng_state()
    with pytest.raises(TypeError, match="extra input"):
        model(x, e0)
    assert torch.equal(torch.cuda.get_rng_state(), state), "a call handed back to Python drew random numbers"

    class Doubled(modules.Sequential):
        def forward(self, input, *extra):
            return super().forward(input, *extra)
    sub = Doubled(jt.Bias(128), jt.GELU(), device=DEV, dtype=BF16)
    sub(x)
    assert calls[-1] == 1  # the override's super().forward reached _eager_forward
    n = len(calls)
    model(x, e0, e1)
    assert len(calls) == n


@needs_ext
def test_hostile_calls_of_the_ops_raise_clear_errors():
    model = mlp(64, 128, BF16)
    x = torch.randn(8, 64, device=DEV, dtype=BF16)
    e = torch.randn_like(x)
    key = model._jf_keys[True][BF16]
    params = list(model._params())
    with pytest.raises(Exception, match="unknown sequence key"):
        torch.ops.jitfuse.forward.default(123456789, x, [e], params, None, False)
    with pytest.raises(Exception, match="extra input"):
        torch.ops.jitfuse.forward.default(key, x, [], params, None, False)
    # Shapes, dtypes and layouts are the library's to check (its messages, naming the tensor).
    with pytest.raises(Exception, match=r"tensor 'input' is not contiguous row-major: strides \(1,8\) for shape 8x64"):
        torch.ops.jitfuse.forward.default(key, x.t().contiguous().t(), [e], params, None, False)
    with pytest.raises(Exception, match=r"tensor 'params op 1 \(linear\) 'weight'': expected shape 128x64, got "
                                        r"32x64"):
        torch.ops.jitfuse.forward.default(key, x, [e], params[:2] + [params[2][:32]] + params[3:], None, False)
    with pytest.raises(Exception, match=r"tensor 'input': expected dtype bf16 for this recipe, got float16"):
        torch.ops.jitfuse.forward.default(key, x.half(), [e.half()], [p.half() for p in params], None, False)
    with torch.no_grad():
        outs = torch.ops.jitfuse.forward.default(key, x, [e], params, None, True)
    with pytest.raises(TypeError, match=rf"jitfuse::forward: sequence '.*' takes 1 extra input\(s\) \(add_extra_input ops "
                                        rf"without a channel\) and "
                                        rf"{len(params)} parameter\(s\); got 1 and {len(params) + 1}"):
        torch.ops.jitfuse.forward.default(key, x, [e], params + params[:1], None, False)
    # The saved buffer's size is the library's check (its message names both sizes).
    with pytest.raises(Exception, match=r"saved buffer is \d+ bytes; this program needs \d+"):
        torch.ops.jitfuse.backward.default(key, x, [e], outs[0], [], params, outs[-1][:-1], torch.ones_like(x), [])
    with pytest.raises(TypeError, match=r"jitfuse::backward: .* takes 1 extra input\(s\) \(add_extra_input ops without a "
                                          r"channel\), 0 extra output\(s\)"):
        torch.ops.jitfuse.backward.default(key, x, [], outs[0], [], params, outs[-1], torch.ones_like(x), [])
    # The process survives every one of them: a good call still runs and matches float64.
    with torch.no_grad():
        y = model(x, e)
    (r,), *_ = reference(model, x, [e], torch.zeros_like(x), [])
    check("output after errors", y, r, BF16, gemm=True)


def test_module_errors_keep_their_types():
    model = jt.Sequential(jt.Linear(64, 32), jt.Bias(32), device=DEV, dtype=BF16)
    x = torch.randn(8, 64, device=DEV, dtype=BF16)
    with pytest.raises(ValueError, match="CUDA"):
        model(x.cpu())
    with pytest.raises(TypeError, match="extra input"):
        model(x, x)
    model(x)
    model[1].bias = torch.nn.Parameter(torch.randn(16, device=DEV, dtype=BF16))
    with pytest.raises(JitfuseError, match=r"tensor 'params op 1 \(bias\) 'bias'': expected shape 32, got 16"):
        model(x)


# ---- FP8 through the extension (issue 41, "one torch path") ---------------------------------------------

def _refuse_the_ctypes_path(monkeypatch):
    """Any call of the pure-Python path's kernels (DeviceProgram.forward / .backward: ctypes
    jf_program_forward / jf_program_backward) fails the test."""
    from jitfuse.torch._registry import DeviceProgram

    def refuse(*args, **kwargs):
        raise AssertionError("a call took the ctypes path although the C++ extension is loaded")
    monkeypatch.setattr(DeviceProgram, "forward", refuse)
    monkeypatch.setattr(DeviceProgram, "backward", refuse)


@needs_ext
@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_fp8_modules_run_through_the_extension(monkeypatch, recipe):
    """An FP8 Sequential (its own salted key) trains and infers through the extension only: every forward and
    backward reaches the C ABI from C++ (the extension's record), none through ctypes; the output and every
    gradient match float64 within the FP8 tolerance; the fp8_weights_unchanged promise reaches the C++ op."""
    model = fp8_mlp(recipe)
    g = torch.Generator(device=DEV).manual_seed(41)
    key, dev = model._jf_keys[True][BF16], torch.cuda.current_device()
    _refuse_the_ctypes_path(monkeypatch)
    fp8_step(model, *fp8_inputs(g))  # prepares (the delayed recipe state starts from scale 1)
    _ext.EXT.watch_calls(key, dev)
    for call in range(3):
        x, e, dy = fp8_inputs(g)
        y, grads = fp8_step(model, x, e, dy)
        errs, _ = fp8_errors(model, x, e, dy, y, grads)
        assert all(v <= FP8_TOL for v in errs.values()), f"call {call}: {errs}"
    x, e, dy = fp8_inputs(g)
    with torch.no_grad():
        model(x, e)  # fp8_delayed: this input's amax in the history, so the next two calls use one scale
        y_recast = model(x, e).clone()
        with jt.fp8_weights_unchanged():
            y_reused = model(x, e).clone()
    assert torch.equal(y_reused, y_recast)  # same weights: reusing their FP8 copies gives the same bits
    (r_y,), *_ = reference(model, x, [e], dy, [])
    assert rel_err(y_recast, r_y) <= FP8_TOL
    assert _ext.EXT.watched_calls(key, dev) == ["forward", "backward"] * 3 + ["forward", "forward",
                                                                             "forward:fp8_weights_unchanged"]


@needs_ext
@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_fp8_quantize_output_through_the_extension(monkeypatch, recipe):
    """A trailing Quantize with the extension: without a gradient, module_forward returns the E4M3 codes and
    the scale_inv that decodes them (a copy per call: an earlier output still decodes after later calls
    moved the recipe state), wrapped in a Float8Tensor; with one, the Python node around the C++ op keeps
    the gradient bf16 (1e-4 and 1000 arrive unrounded). Against float64, output memory poisoned with E4M3
    NaN codes first; no call through ctypes."""
    model = jt.Sequential(jt.Bias(256), jt.GELU(), jt.Quantize(), recipe=recipe, device=DEV, dtype=BF16)
    randomize(model)
    key, dev = model._jf_keys[True][BF16], torch.cuda.current_device()
    _refuse_the_ctypes_path(monkeypatch)
    g = torch.Generator(device=DEV).manual_seed(42)
    x = torch.randn(64, 256, device=DEV, dtype=BF16, generator=g)
    ref = gelu_tanh(x.double() + model[0].bias.detach().double())
    with torch.no_grad():
        for _ in range(3):  # fp8_delayed: the scale comes from the amax history of earlier calls
            model(x)
    _ext.EXT.watch_calls(key, dev)
    ys = []
    for scale in (1.0, 0.25):  # the second input moves the amax (fp8_current: the scale moves on; a larger
        # input would saturate under fp8_delayed, whose scale comes from the history)
        poison = torch.full((64, 256), 0x7F, device=DEV, dtype=torch.uint8)  # E4M3 NaN codes
        del poison  # freed: the output's codes take this block from the caching allocator
        with torch.no_grad():
            y = model(x * scale)
        assert isinstance(y, jt.Float8Tensor) and y.dtype == BF16 and not y.requires_grad
        assert y.fp8_data.dtype == torch.float8_e4m3fn and y.fp8_data.shape == x.shape
        assert y.scale_inv.dtype == torch.float32 and y.scale_inv.shape == (1,)
        state = registry_state(key, dev)
        assert torch.equal(y.scale_inv, state[1:2])  # this call's scale_inv, as the recipe state holds it
        ys.append(y)
    for scale, y in zip((1.0, 0.25), ys):  # each output decodes with its own scale_inv
        r = gelu_tanh(x.double() * scale + model[0].bias.detach().double())
        assert rel_err(y.dequantize(), r) <= FP8_TOL, scale
    # With a gradient: a Float8Tensor whose gradient arrives in bf16, unrounded.
    xg = x.clone().requires_grad_()
    y = model(xg)
    assert isinstance(y, jt.Float8Tensor) and y.requires_grad and y.dtype == BF16
    assert rel_err(y.dequantize(), ref) <= FP8_TOL
    dy = torch.where(torch.rand(64, 256, device=DEV, generator=g) < 0.5, 1e-4, 1000.0).to(BF16)
    model.zero_grad(set_to_none=True)
    y.backward(dy)
    x64 = x.double().requires_grad_()
    b64 = model[0].bias.detach().double().requires_grad_()
    gelu_tanh(x64 + b64).backward(dy.double())
    assert torch.isfinite(xg.grad).all()
    check("grad_input", xg.grad, x64.grad, BF16, chain=2)
    check("grad bias", model[0].bias.grad, b64.grad, BF16, gemm=True, chain=2)
    assert _ext.EXT.watched_calls(key, dev) == ["forward", "forward", "forward", "backward"]


def registry_state(key, dev):
    """The trailing quantize's recipe-state block [scale, scale_inv, amax_history...] of (key, device)."""
    from jitfuse.torch._registry import device_program
    return device_program(key, dev).fp8_output_state()


def test_compiled_fullgraph_and_reduce_overhead_have_no_breaks():
    torch._dynamo.reset()
    model = mlp(128, 256, BF16)
    randomize(model)
    x = torch.randn(32, 128, device=DEV, dtype=BF16)
    e = torch.randn_like(x)
    with torch.no_grad():
        ref = model(x, e)
    explain = torch._dynamo.explain(model)(x, e)
    assert explain.graph_break_count == 0 and explain.graph_count == 1
    for mode in ("default", "reduce-overhead"):
        torch._dynamo.reset()
        cm = torch.compile(model, fullgraph=True, mode=mode)
        for _ in range(3):
            xg = x.clone().requires_grad_()
            y = cm(xg, e)
            y.float().sum().backward()
            assert xg.grad is not None and bool(torch.isfinite(xg.grad).all()), mode
        with torch.no_grad():
            for _ in range(3):
                yc = cm(x, e).clone()  # a CUDA-graph output is overwritten by the next replay
        assert torch.equal(yc, ref), mode


@needs_ext
def test_the_fake_kernels_are_the_extensions_meta_kernels():
    """On the extension path the ops' fake kernels are its C++ Meta kernels (no Python fake registered): under
    FakeTensorMode a forward (inference and training, with the saved block) and a backward give the shapes,
    dtypes and devices of the real calls; with a symbolic batch size the outputs' batch dim is the input's
    (symbolic through the package's set_symbolic_meta hook where a shape environment gives the saved block a
    data-dependent size -- torch.compile(dynamic=True), test_compile_backend_gpu.py -- else specialised);
    opcheck's fake-tensor check passes through them; torch.export traces through them."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from jitfuse.torch import _ops
    assert not _ops.FAKE_IN_PYTHON
    for op in ("jitfuse::forward", "jitfuse::backward"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "Meta")
    model = transformer_layer(128, 256, BF16, p=0.1)
    x = torch.randn(24, 128, device=DEV, dtype=BF16)
    extras = [torch.randn_like(x), torch.randn_like(x)]
    key = model._jf_keys[model.training][BF16]
    params = list(model._params())
    rng = torch.randint(0, 1 << 62, (2,), dtype=torch.int64, device=DEV)
    rng = rng if model._jf_uses_rng[model.training] else None
    fwd, bwd = torch.ops.jitfuse.forward.default, torch.ops.jitfuse.backward.default

    def meta(ts):
        return [(tuple(t.shape), t.dtype, t.device) for t in ts]

    with torch.no_grad():
        real = {tr: fwd(key, x, extras, params, rng, tr) for tr in (False, True)}
        outs = real[True]
        n_extra = model._n_extra_outputs
        dy = torch.randn_like(outs[0])
        gextra = [torch.randn_like(o) for o in outs[1:1 + n_extra]]
        real_b = bwd(key, x, extras, outs[0], list(outs[1:1 + n_extra]), params, outs[-1], dy, gextra)
    for shape_env in (None, ShapeEnv()):
        with FakeTensorMode(shape_env=shape_env) as mode:
            def fk(t):
                return mode.from_tensor(t) if t is not None else None
            fx, fe, fp = fk(x), [fk(t) for t in extras], [fk(t) for t in params]
            if shape_env is not None:  # a symbolic batch size
                from torch._dynamo.source import ConstantSource
                from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext
                ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])
                fx = mode.from_tensor(x, source=ConstantSource("x"), symbolic_context=ctx)
                assert isinstance(fx.shape[0], torch.SymInt)
            for tr in (False, True):
                got = fwd(key, fx, fe, fp, fk(rng), tr)
                if shape_env is None:
                    assert meta(got) == meta(real[tr]), (shape_env, tr)
                    continue
                # Symbolic rows: the outputs keep fx's batch dim; the saved block's size is unbacked.
                keep = got[:-1] if tr else got
                assert all(t.shape[0] is fx.shape[0] or str(t.shape[0]) == str(fx.shape[0]) for t in keep[:1 + n_extra])
                assert [(t.dtype, t.device) for t in got] == [(t.dtype, t.device) for t in real[tr]], tr
                if tr:  # data-dependent under compile; FakeTensorMode alone may give it the real call's size
                    n = got[-1].shape[0]
                    assert isinstance(n, torch.SymInt) or n == real[tr][-1].shape[0], (n, real[tr][-1].shape)
            if shape_env is not None:  # counts and dtype are checked before the symbolic hook answers
                with pytest.raises(Exception, match="extra input"):
                    fwd(key, fx, [], fp, fk(rng), False)
                with pytest.raises(Exception, match="the program runs"):
                    fwd(key, fx.float(), fe, fp, fk(rng), False)
            fo = [fk(t) for t in outs]
            got_b = bwd(key, fx, fe, fo[0], fo[1:1 + n_extra], fp, fo[-1], fk(dy), [fk(t) for t in gextra])
            assert meta(got_b) == meta(real_b)
    with pytest.raises(Exception, match="extra input"):
        with FakeTensorMode() as mode:
            fwd(key, mode.from_tensor(x), [], [mode.from_tensor(p) for p in params], None, False)
    torch.library.opcheck(fwd, (key, x.detach().requires_grad_(), extras, params, rng, True),
                          test_utils=("test_schema", "test_faketensor"))

    class Wrap(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x, a, b):
            return self.m(x, a, b)

    model.eval()  # dropout off: the float64 reference has no mask
    ep = torch.export.export(Wrap(model), (x, *extras))
    with torch.no_grad():
        y_ep = ep.module()(x, *extras)
    y_ep = list(y_ep) if isinstance(y_ep, (tuple, list)) else [y_ep]
    refs, *_ = reference(model, x, extras, torch.zeros_like(x), [torch.zeros_like(x)] * n_extra)
    assert len(y_ep) == len(refs) == 1 + n_extra
    for i, (a, r) in enumerate(zip(y_ep, refs)):
        check(f"exported output {i}", a, r, BF16, gemm=True, chain=2)


def test_version_mismatch_message(tmp_path, monkeypatch):
    d = tmp_path / "ext"
    d.mkdir()
    (d / _ext.LIB_NAME).write_bytes(b"")
    (d / _ext.BUILD_INFO).write_text('{"format": "jitfuse.torch_build/1", "torch": "1.0.0+other"}')
    monkeypatch.setenv("JITFUSE_TORCH_EXTENSION_DIR", str(d))
    monkeypatch.setattr(_ext, "candidate_dirs", lambda: [d])
    found, why = _ext.find(torch.__version__)
    assert found is None
    assert "built for torch 1.0.0+other" in why and torch.__version__ in why and "JITFUSE_TORCH_EXTENSION=0" in why


MISMATCH_SCRIPT = """
import math, sys, warnings
import torch
real = torch.__version__
torch.__version__ = "2.99.0+elsewhere"  # the built extension now meets another (supported) torch
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    import jitfuse.torch as jt
msgs = [str(m.message) for m in w if "built for torch" in str(m.message)]
assert msgs, [str(m.message) for m in w]
assert f"built for torch {real}" in msgs[0] and "runs torch 2.99.0+elsewhere" in msgs[0], msgs[0]
assert "using the pure-Python ops" in msgs[0], msgs[0]
assert not jt.extension_active()
from jitfuse.torch import modules
assert modules.ext_forward is None
model = jt.Sequential(jt.Linear(64, 64), jt.Bias(64), jt.GELU(), device="cuda", dtype=torch.float32)
g = torch.Generator(device="cuda").manual_seed(5)
x = torch.randn(9, 64, device="cuda", generator=g)
with torch.no_grad():
    for p in model.parameters():
        p.copy_(torch.randn(p.shape, device="cuda", generator=g) / 8)
    y = model(x)
    w_, b_ = model._ops[0].weight.double(), model._ops[1].bias.double()
    h = x.double() @ w_.T + b_
    ref = 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))
err = (y.double() - ref).abs().max().item()
assert err <= 1e-3 * ref.abs().max().item() + 1e-5, err  # fp32 GEMM tolerance (TF32)
print("pure-Python path after the mismatch:", err)
"""


@needs_ext
def test_a_build_meeting_another_torch_falls_back_to_the_pure_python_ops(tmp_path):
    """A process whose torch is not the one the extension was built for (its version faked before import): the
    loader warns naming both versions and what to do, loads nothing, and the pure-Python ops run the module."""
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "JITFUSE_TORCH_EXTENSION"}
    # The package as this process imports it (conftest puts the checkout's on sys.path, not on PYTHONPATH).
    env["PYTHONPATH"] = os.pathsep.join([str(Path(jitfuse.__file__).parent.parent)] +
                                        ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    r = subprocess.run([sys.executable, "-c", MISMATCH_SCRIPT], env=env, capture_output=True, text=True, timeout=300,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "pure-Python path after the mismatch" in r.stdout


EXIT_SCRIPT = r"""
import torch, jitfuse.torch as jt
torch.manual_seed(0)
mods = [jt.Sequential(jt.LayerNorm(256), jt.Linear(256, 512), jt.Bias(512), jt.GELU(), jt.Linear(512, 256),
                      jt.Bias(256), dtype=torch.bfloat16, device="cuda")]
for recipe in ("fp8_delayed", "fp8_current"):
    mods.append(jt.Sequential(jt.Linear(256, 512), jt.Bias(512), jt.GELU(), jt.Linear(512, 256), recipe=recipe,
                              dtype=torch.bfloat16, device="cuda"))
x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
for m in mods:
    for _ in range(2):
        m(x).float().square().mean().backward()
    with torch.no_grad():
        m(x)
torch.cuda.synchronize()
print("ok", jt.extension_active())
"""


@pytest.mark.parametrize("ext", ["1", "0"])
def test_a_process_using_the_modules_exits_cleanly(ext):
    """Programs held by the C++ extension (and the ctypes path) are closed before their contexts at interpreter
    exit: the process exits 0 with nothing on stderr about the heap (an abort at exit, H100 run 1 of session 35)."""
    import subprocess
    import sys
    if ext == "1" and _ext.find(torch.__version__)[0] is None:
        pytest.skip("the C++ extension is not built here (" + _ext.find(torch.__version__)[1] + ")")
    env = dict(os.environ, JITFUSE_TORCH_EXTENSION=ext, MALLOC_CHECK_="3")
    r = subprocess.run([sys.executable, "-c", EXIT_SCRIPT], env=env, capture_output=True, text=True, timeout=240,
                       cwd=str(Path(__file__).parent))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[:1] == ["ok"], r.stdout
    for bad in ("malloc", "free()", "corrupted", "double free", "fatal signal"):
        assert bad not in r.stderr, r.stderr[-3000:]
