"""Where the host time of a jitfuse.torch call goes (issue 12): each piece of a call timed alone.

Small M (the GPU work is a few microseconds, so the host is the bottleneck); every number is host
microseconds per call, the median of 5 batches of N calls each (synchronised before and after a batch,
never inside it). Pieces: PyTorch primitives a call uses (torch.empty, data_ptr, the current stream),
jf_forward / jf_backward through ctypes alone (arguments built once, pointers fixed), the package's
kernel (Program.forward), the module call with and without autograd, the training step, and PyTorch
eager / a trivial Python autograd.Function for scale. Then a cProfile of training steps.

Run on the GPU machine, with the package to measure on PYTHONPATH:
  python3 tools/torch_baselines/host_overhead.py [--calls 2000] [--profile] [--json out.json]
  python3 tools/torch_baselines/host_overhead.py --layers 5   # a no-grad call's layers vs the floors, interleaved
"""
import argparse
import cProfile
import ctypes
import io
import json
import os
import pstats
import statistics

import torch
import torch.nn.functional as F

import jitfuse.torch as jt
from jitfuse.torch import _runtime as rt
from _harness import TrainingCall, host_us

DEV = "cuda"
DT = torch.bfloat16


def per_call_us(fn, calls, batches=5, warmup=50):
    """Throughput: µs per call over `batches` batches of calls // batches calls each (host_us with large
    batches, so a batch also waits where the launch queue fills)."""
    return host_us(fn, batches, batch=max(1, calls // batches), warmup=warmup)


class Raw(TrainingCall):
    """jf_forward / jf_backward arguments built once from torch tensors (no jitfuse.torch code per call)."""

    def __init__(self, model, x, extras):
        super().__init__()
        key = model._jf_keys[True][x.dtype]
        self.prog = rt.program(key, torch.cuda.current_device())
        self.handle = self.prog.sequence.handle
        self.cdll = self.prog.sequence.lib.cdll
        info = self.prog.info(tuple(x.shape), True)
        self.info = info
        self.lib = self.prog.sequence.lib
        fws_bytes = max(info.forward_workspace_bytes, self.prog.info(tuple(x.shape), False).forward_workspace_bytes)
        params = [p.detach() for p in model._params()]
        names = [(i, n.encode()) for i, n in self.prog.definition.params]
        self.build(info, fws_bytes, names, x, extras, params, lambda s: torch.randn(s, device=DEV, dtype=DT))


class _Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


def models(h, fp8=False):
    bg = jt.Sequential(jt.Bias(h), jt.GELU(), device=DEV, dtype=DT, name="bias_gelu")
    mlp = jt.Sequential(jt.LayerNorm(h), jt.Linear(h, 4 * h), jt.Bias(4 * h), jt.GELU(), jt.Linear(4 * h, h),
                        jt.Bias(h), jt.AddExtraInput(), device=DEV, dtype=DT, name="mlp")
    out = {"bias+gelu": (bg, 0), "mlp": (mlp, 1)}
    if fp8:
        out["mlp fp8_delayed"] = (jt.Sequential(jt.LayerNorm(h), jt.Linear(h, 4 * h), jt.Bias(4 * h), jt.GELU(),
                                                jt.Linear(4 * h, h), jt.Bias(h), jt.AddExtraInput(), recipe="fp8_delayed",
                                                device=DEV, dtype=DT, name="mlp_fp8"), 1)
    return out


class Results(dict):
    def __setitem__(self, k, v):
        super().__setitem__(k, v)
        print(f"  {k:55s} {v:8.2f}" if isinstance(v, float) else f"  {k:55s} {v}", flush=True)


def measure_raw(calls, m, h):
    """jf_forward / jf_backward through ctypes alone: host time (host_us) and throughput (per_call_us)."""
    r = Results()
    x = torch.randn(m, h, device=DEV, dtype=DT)
    for name, (model, ne) in models(h, fp8=True).items():
        extras = [torch.randn(m, h, device=DEV, dtype=DT) for _ in range(ne)]
        xg = x.clone().requires_grad_()
        try:
            model(xg, *extras).sum().backward()  # prepares training
            with torch.no_grad():
                model(x, *extras)
            torch.cuda.synchronize()
            raw = Raw(model, x, extras)
        except Exception as e:  # noqa: BLE001 (a case that cannot run is reported, the others still run)
            r[f"{name}: skipped"] = f"{type(e).__name__}: {e}"
            continue
        r[f"{name}: jf_forward (training), host"] = host_us(raw.forward, calls // 8, warmup=50)
        raw.fa.training = 0
        r[f"{name}: jf_forward (inference), host"] = host_us(raw.forward, calls // 8, warmup=50)
        raw.fa.training = 1
        raw.forward()
        r[f"{name}: jf_backward, host"] = host_us(raw.backward, calls // 8, warmup=50)
        r[f"{name}: jf_forward (training), throughput"] = per_call_us(raw.forward, calls)
        r[f"{name}: jf_backward, throughput"] = per_call_us(raw.backward, calls)
    return r


# An empty kernel with jf_forward's kind of arguments (three pointers and a count), loaded from PTX.
_NOOP_PTX = b""".version 8.0
.target sm_90
.address_size 64
.visible .entry noop(.param .u64 a, .param .u64 b, .param .u64 c, .param .u32 n) { ret; }
"""


class EmptyLaunch:
    """cuLaunchKernel of the empty kernel through ctypes (its first argument set per call), and the
    least a pure-Python module call can do around it: allocate its output and launch."""

    def __init__(self, x):
        cuda = ctypes.CDLL("libcuda.so.1")
        mod, self.fn = ctypes.c_void_p(), ctypes.c_void_p()
        torch.cuda.synchronize()
        assert cuda.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(_NOOP_PTX)) == 0
        assert cuda.cuModuleGetFunction(ctypes.byref(self.fn), mod, b"noop") == 0
        self.a = ctypes.c_uint64(x.data_ptr())
        self.vals = (self.a, ctypes.c_uint64(0), ctypes.c_uint64(0), ctypes.c_uint32(16))
        self.argv = (ctypes.c_void_p * 4)(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in self.vals])
        self.launch = cuda.cuLaunchKernel
        self.launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 6 + [ctypes.c_uint, ctypes.c_void_p,
                                                                          ctypes.c_void_p, ctypes.c_void_p]
        launch, fn, argv, a, raw = self.launch, self.fn, self.argv, self.a, torch._C._cuda_getCurrentRawStream
        self.call = lambda: launch(fn, 1, 1, 1, 32, 1, 1, 0, raw(0), argv, None)

        class Noop(torch.nn.Module):
            def forward(self, t):
                o = torch.empty_like(t)
                a.value = o.data_ptr()
                launch(fn, 1, 1, 1, 32, 1, 1, 0, raw(0), argv, None)
                return o
        self.module = Noop()


def measure_floor(r, calls, x):
    """The floors a call through ctypes cannot go under: a ctypes call into a C function that returns at
    once, cuLaunchKernel of an empty kernel through ctypes, the same launch behind a module call and an
    output allocation, and one PyTorch op (C++ all the way)."""
    e = EmptyLaunch(x)
    r["ctypes cuLaunchKernel(empty kernel), host"] = host_us(e.call, calls // 8)
    memcmp = ctypes.CDLL(None).memcmp
    memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    r["ctypes memcmp(p, p, 0) (a C call's floor)"] = per_call_us(lambda: memcmp(e.fn, e.fn, 0), calls)
    with torch.no_grad():
        r["nn.Module: empty_like + raw stream + ctypes launch, host"] = host_us(lambda: e.module(x), calls // 8)
    torch.cuda.synchronize()
    r["torch.neg(x) (one PyTorch op), host"] = host_us(lambda: torch.neg(x), calls // 8)
    r["F.gelu(x, tanh) (one PyTorch op), host"] = host_us(lambda: F.gelu(x, approximate="tanh"), calls // 8)


def measure_layers(rounds, m, h):
    """bias + gelu without grad, each layer of a call against the floors, host time, interleaved: every
    round times every layer once (host_us, 200 batches of 8), so that a process's speed, which moves by
    tens of percent between processes on the GPU machines, affects all layers alike; median (min) of rounds."""
    x = torch.randn(m, h, device=DEV, dtype=DT)
    model, _ = models(h)["bias+gelu"]
    model.eval()
    with torch.no_grad():
        model(x)
    key = model._jf_keys[False][x.dtype]
    prog = rt.program(key, torch.cuda.current_device())
    params = [p.detach() for p in model._params()]
    model.train()
    xg = x.clone().requires_grad_()
    model(xg).sum().backward()
    raw = Raw(model, x, [])
    raw.fa.training = 0
    model.eval()
    e = EmptyLaunch(x)
    layers = {
        "torch.neg(x) (one PyTorch op)": lambda: torch.neg(x),
        "torch.empty_like(x)": lambda: torch.empty_like(x),
        "ctypes launch of the empty kernel": e.call,
        "floor: nn.Module, empty_like + ctypes launch": lambda: e.module(x),
        "ctypes jf_forward (arguments built once)": raw.forward,
        "Program.forward": lambda: prog.forward(x, [], params, None, False, with_saved_block=False, cache_workspace=True),
        "module.forward(x)": lambda: model.forward(x),
        "module(x)": lambda: model(x),
        "jitfuse::forward op via the dispatcher": lambda: torch.ops.jitfuse.forward.default(key, x, [], params, None,
                                                                                               False),
    }
    res = {k: [] for k in layers}
    with torch.no_grad():
        for _ in range(rounds):
            for k, f in layers.items():
                res[k].append(host_us(f, 200))
    r = Results()
    for k, v in res.items():
        r[f"{k}, host, median (min) of {rounds} rounds"] = f"{statistics.median(v):8.2f} ({min(v):.2f})"
    return r


def measure(calls, m, h):
    r = Results()
    x = torch.randn(m, h, device=DEV, dtype=DT)
    big = torch.empty(1 << 20, dtype=torch.uint8, device=DEV)
    dev = torch.device(DEV, torch.cuda.current_device())
    # PyTorch primitives
    r["torch.empty(shape, dtype, device)"] = per_call_us(lambda: torch.empty((m, h), dtype=DT, device=dev), calls)
    r["torch.empty_like(x)"] = per_call_us(lambda: torch.empty_like(x), calls)
    r["x.new_empty(shape)"] = per_call_us(lambda: x.new_empty((m, h)), calls)
    r["torch.empty(n, uint8)"] = per_call_us(lambda: torch.empty((4096,), dtype=torch.uint8, device=dev), calls)
    r["big[a:b].view(bf16).view(shape)"] = per_call_us(lambda: big[0:m * h * 2].view(DT).view(m, h), calls)
    r["x.data_ptr()"] = per_call_us(lambda: x.data_ptr(), calls)
    r["x.device"] = per_call_us(lambda: x.device, calls)
    r["x._version"] = per_call_us(lambda: x._version, calls)
    r["tuple(x.shape)"] = per_call_us(lambda: tuple(x.shape), calls)
    r["torch.cuda.current_device()"] = per_call_us(torch.cuda.current_device, calls)
    r["_cuda_getCurrentRawStream"] = per_call_us(lambda: torch._C._cuda_getCurrentRawStream(0), calls)
    r["torch.cuda.is_current_stream_capturing()"] = per_call_us(torch.cuda.is_current_stream_capturing, calls)
    r["torch.compiler.is_compiling()"] = per_call_us(torch.compiler.is_compiling, calls)
    cdll = rt.context(torch.cuda.current_device()).lib.cdll
    r["ctypes jf_abi_version()"] = per_call_us(cdll.jf_abi_version, calls)
    measure_floor(r, calls, x)
    # PyTorch eager for scale
    b = torch.zeros(h, device=DEV, dtype=DT, requires_grad=True)
    xg = x.clone().requires_grad_()
    with torch.no_grad():
        r["eager bias+gelu, no grad"] = per_call_us(lambda: F.gelu(x + b, approximate="tanh"), calls)

    def eager_step():
        y = F.gelu(xg + b, approximate="tanh")
        torch.autograd.backward([y], [torch.ones_like(y)])
    r["eager bias+gelu fwd+bwd step"] = per_call_us(eager_step, calls)

    def twice_step():
        y = _Twice.apply(xg)
        torch.autograd.backward([y], [torch.ones_like(y)])
    r["python autograd.Function (x*2) fwd+bwd step"] = per_call_us(twice_step, calls)
    # jitfuse
    for name, (model, ne) in models(h).items():
        extras = [torch.randn(m, h, device=DEV, dtype=DT) for _ in range(ne)]
        xg = x.clone().requires_grad_()
        model(xg, *extras).sum().backward()  # prepares training
        with torch.no_grad():
            model(x, *extras)
        torch.cuda.synchronize()
        raw = Raw(model, x, extras)
        r[f"{name}: info"] = {"saved_bytes": raw.info.saved_bytes, "fwd_ws": raw.info.forward_workspace_bytes,
                              "bwd_ws": raw.info.backward_workspace_bytes, "params": len(raw.prog.definition.params)}
        r[f"{name}: ctypes jf_forward (training) alone"] = per_call_us(raw.forward, calls)
        raw.fa.training = 0
        r[f"{name}: ctypes jf_forward (inference) alone"] = per_call_us(raw.forward, calls)
        r[f"{name}: ctypes jf_forward (inference) alone, host"] = host_us(raw.forward, calls // 8)
        floor_lib = os.environ.get("HOST_FLOOR_LOOP")  # tools/microbench/host_floor.cpp built as a library
        if floor_lib and name == "bias+gelu":
            loop = ctypes.CDLL(floor_lib).host_floor_loop
            loop.restype = ctypes.c_double
            loop.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
            vals = []
            for _ in range(max(1, calls // 64)):
                torch.cuda.synchronize()
                vals.append(loop(raw.handle, ctypes.addressof(raw.fa), raw.stream, 8))
            r[f"{name}: jf_forward (inference) in a C loop in this process, host"] = statistics.median(vals)
        raw.fa.training = 1
        raw.forward()
        r[f"{name}: ctypes jf_backward alone"] = per_call_us(raw.backward, calls)
        prog = raw.prog
        params = [p.detach() for p in model._params()]
        r[f"{name}: Program.forward (inference)"] = per_call_us(
            lambda: prog.forward(x, extras, params, None, False), calls)
        r[f"{name}: Program.forward (training)"] = per_call_us(
            lambda: prog.forward(x, extras, params, None, True), calls)
        outs = prog.forward(x, extras, params, None, True)
        dy = torch.ones_like(outs[0])
        r[f"{name}: Program.backward"] = per_call_us(
            lambda: prog.backward(x, extras, outs[0], list(outs[1:-1]), params, outs[-1], dy, []), calls)
        with torch.no_grad():
            r[f"{name}: module(x) no grad"] = per_call_us(lambda: model(x, *extras), calls)
            r[f"{name}: module(x) no grad, host"] = host_us(lambda: model(x, *extras), calls // 8)
        r[f"{name}: op via dispatcher, no grad"] = per_call_us(
            lambda: torch.ops.jitfuse.forward.default(raw.prog.definition.key, x, extras, params, None, False), calls)
        r[f"{name}: module(x) with grad (forward only)"] = per_call_us(lambda: model(xg, *extras), calls)
        ys = model(xg, *extras)

        def step():
            y = model(xg, *extras)
            torch.autograd.backward([y], [torch.ones_like(y)])
        r[f"{name}: module fwd+bwd step"] = per_call_us(step, calls)

        def bwd_only():
            y = model(xg, *extras)
            torch.autograd.backward([y], [dy])
        r[f"{name}: module fwd+bwd step (dy given)"] = per_call_us(bwd_only, calls)
        del ys
    return r


def profile_step(steps, m, h):
    model, _ = models(h)["bias+gelu"]
    x = torch.randn(m, h, device=DEV, dtype=DT, requires_grad=True)
    dy = torch.ones(m, h, device=DEV, dtype=DT)

    def step():
        y = model(x)
        torch.autograd.backward([y], [dy])
    for _ in range(50):
        step()
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        step()
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
    out = s.getvalue()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(20):
            step()
        torch.cuda.synchronize()
    out += "\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--m", type=int, default=16)
    ap.add_argument("--h", type=int, default=1024)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--raw-only", action="store_true",
                    help="only jf_forward / jf_backward through ctypes (host time and throughput), with an FP8 MLP")
    ap.add_argument("--side-stream", action="store_true", help="run every call on a created stream")
    ap.add_argument("--layers", type=int, metavar="ROUNDS",
                    help="only the layers of a no-grad bias + gelu call against the floors, ROUNDS interleaved rounds")
    a = ap.parse_args()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, M={a.m}, cols={a.h}")
    if a.layers:
        r = measure_layers(a.layers, a.m, a.h)
    elif a.side_stream:  # everything on a created stream instead of the legacy default stream
        with torch.cuda.stream(torch.cuda.Stream()):
            r = measure_raw(a.calls, a.m, a.h) if a.raw_only else measure(a.calls, a.m, a.h)
    else:
        r = measure_raw(a.calls, a.m, a.h) if a.raw_only else measure(a.calls, a.m, a.h)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)
    if a.profile:
        print(profile_step(500, a.m, a.h))


if __name__ == "__main__":
    main()
