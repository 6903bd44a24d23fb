# Host-bound timings of jitfuse.torch (issue 28): one process, interleaved rounds. `paths`: a module call and a
# forward+backward on the C++ extension and on the pure-Python path against PyTorch; `stack`: 4-layer Llama- and
# GPT-2-style block stacks, training step wall and GPU time, eager and compiled, PyTorch against jitfuse.
"""python -m jitfuse.bench --case paths|stack (GPU only)."""

import statistics
import time
from typing import Any, Callable, Dict, List

import torch
import torch.nn.functional as F
from torch import nn

import jitfuse.torch as jt
from jitfuse.torch import modules as _modules

DEV = "cuda"
DT = torch.bfloat16


def _per_call_us(fn: Callable[[], Any], calls: int) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    dt = time.perf_counter() - t
    torch.cuda.synchronize()
    return dt / calls * 1e6


def _rounds(layers: Dict[str, Callable[[], Any]], calls: int, rounds: int) -> Dict[str, float]:
    """Median over rounds of each layer's host µs per call; every round times every layer once, in turn."""
    for fn in layers.values():  # warm-up (prepare, allocator)
        for _ in range(20):
            fn()
    got: Dict[str, List[float]] = {k: [] for k in layers}
    for _ in range(rounds):
        for k, fn in layers.items():
            got[k].append(_per_call_us(fn, calls))
    return {k: statistics.median(v) for k, v in got.items()}


class _PathSwitch:
    """Runs a callable with Sequential's eager call on the pure-Python path (jitfuse.torch.modules.ext_forward)."""

    def __init__(self, fn: Callable[[], Any]):
        self.fn = fn

    def __call__(self) -> Any:
        saved = _modules.ext_forward
        _modules.ext_forward = None
        try:
            return self.fn()
        finally:
            _modules.ext_forward = saved


def bench_paths(calls: int = 1000, rounds: int = 7, m: int = 16, h: int = 1024) -> List[Dict[str, object]]:
    """Host µs per call at M = m (tiny GPU work: the host is the bottleneck)."""
    x = torch.randn(m, h, device=DEV, dtype=DT)
    bias_gelu = jt.Sequential(jt.Bias(h), jt.GELU(), device=DEV, dtype=DT).eval()
    lbg = jt.Sequential(jt.Linear(h, h), jt.Bias(h), jt.GELU(), device=DEV, dtype=DT)
    w = lbg[0].weight.detach().clone().requires_grad_()
    b = lbg[1].bias.detach().clone().requires_grad_()
    xg = x.clone().requires_grad_()
    dy = torch.randn(m, h, device=DEV, dtype=DT)

    def nograd_call() -> None:
        with torch.no_grad():
            bias_gelu(x)

    def jf_step() -> None:
        lbg(xg).backward(dy)

    def torch_step() -> None:
        F.gelu(F.linear(xg, w) + b, approximate="tanh").backward(dy)

    def neg() -> None:
        with torch.no_grad():
            torch.neg(x)

    layers: Dict[str, Callable[[], Any]] = {"torch.neg (one PyTorch op, no grad)": neg}
    layers["torch.empty_like (one allocation)"] = lambda: torch.empty_like(x)
    # The layers of a call, each alone: the C ABI through ctypes (arguments built once), the op through the
    # dispatcher from Python, the extension's entry without the module, then the module call.
    from jitfuse.torch._registry import device_program
    key = bias_gelu._jf_keys[False][DT]
    params = bias_gelu._params()
    prog = device_program(key, x.get_device())
    prog.forward(x, [], params, None, False, with_saved_block=False)
    c = prog._tls.calls[(x.shape, False)]
    stream = torch.cuda.current_stream().cuda_stream
    layers["C ABI jf_program_forward through ctypes (arguments built once)"] = (
        lambda: prog._jf_program_forward(c.handle, c.args_ref, c.saved_handle_ref, stream))
    op = torch.ops.jitfuse.forward.default

    def op_call() -> None:
        with torch.no_grad():
            op(key, x, [], params, None, False)
    layers["jitfuse::forward from Python (dispatcher), no grad"] = op_call
    has_ext = _modules.ext_forward is not None
    if has_ext:
        entry = _modules.ext_forward

        def entry_call() -> None:
            with torch.no_grad():
                entry(key, x, (), params, None, False, 0)
        layers["extension entry module_forward (no module), no grad"] = entry_call
        layers["module call, no grad: C++ op"] = nograd_call
    layers["module call, no grad: pure-Python path"] = _PathSwitch(nograd_call)
    if has_ext:
        layers["linear+bias+gelu fwd+bwd: C++ op + C++ autograd"] = jf_step
    layers["linear+bias+gelu fwd+bwd: pure-Python path"] = _PathSwitch(jf_step)
    layers["F.linear -> +bias -> gelu fwd+bwd: PyTorch autograd"] = torch_step
    res = _rounds(layers, calls, rounds)
    return [{"layer": k, "us per call": v} for k, v in res.items()]


# ---- block stacks ---------------------------------------------------------------------------------


class _Attention(nn.Module):
    """Causal self-attention core (SDPA) between a projection in and a projection out (given as modules)."""

    def __init__(self, heads: int):
        super().__init__()
        self.heads = heads

    def forward(self, qkv: torch.Tensor, b: int, s: int) -> torch.Tensor:
        h3 = qkv.shape[-1]
        q, k, v = qkv.view(b, s, 3, self.heads, h3 // (3 * self.heads)).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return o.transpose(1, 2).reshape(b * s, h3 // 3)


class TorchBlock(nn.Module):
    def __init__(self, kind: str, h: int, f: int, heads: int):
        super().__init__()
        self.kind = kind
        norm = (lambda: nn.RMSNorm(h, eps=1e-5)) if kind == "llama" else (lambda: nn.LayerNorm(h))
        bias = kind == "gpt2"
        self.n1, self.n2 = norm(), norm()
        self.qkv = nn.Linear(h, 3 * h, bias=bias)
        self.o = nn.Linear(h, h, bias=bias)
        self.attn = _Attention(heads)
        if kind == "llama":
            self.up = nn.Linear(h, 2 * f, bias=False)
        else:
            self.up = nn.Linear(h, f)
        self.down = nn.Linear(f, h, bias=bias)

    def forward(self, x: torch.Tensor, b: int, s: int) -> torch.Tensor:
        x = x + self.o(self.attn(self.qkv(self.n1(x)), b, s))
        y = self.up(self.n2(x))
        if self.kind == "llama":
            g, u = y.chunk(2, dim=-1)
            y = F.silu(g) * u
        else:
            y = F.gelu(y, approximate="tanh")
        return x + self.down(y)


class JitfuseBlock(nn.Module):
    """The same block with every norm, linear, bias, activation and residual add in jitfuse Sequentials (three
    per block: norm + qkv, out-projection + residual, the whole MLP half with its residual as a channel)."""

    def __init__(self, kind: str, h: int, f: int, heads: int):
        super().__init__()
        kw = {"device": DEV, "dtype": DT}
        gpt = kind == "gpt2"
        norm = (lambda: jt.LayerNorm(h)) if gpt else (lambda: jt.RMSNorm(h, eps=1e-5))
        self.pre = jt.Sequential(norm(), jt.Linear(h, 3 * h), *([jt.Bias(3 * h)] if gpt else []), name="qkv", **kw)
        self.post = jt.Sequential(jt.Linear(h, h), *([jt.Bias(h)] if gpt else []), jt.AddExtraInput(),
                                  name="attn_out", **kw)
        self.attn = _Attention(heads)
        if gpt:
            mlp = [jt.Fork("residual"), norm(), jt.Linear(h, f), jt.Bias(f), jt.GELU(), jt.Linear(f, h), jt.Bias(h),
                   jt.AddChannel("residual")]
        else:
            mlp = [jt.Fork("residual"), norm(), jt.Linear(h, 2 * f), jt.SwiGLU(), jt.Linear(f, h),
                   jt.AddChannel("residual")]
        self.mlp = jt.Sequential(*mlp, name="mlp", **kw)

    def forward(self, x: torch.Tensor, b: int, s: int) -> torch.Tensor:
        x = self.post(self.attn(self.pre(x), b, s), x)
        return self.mlp(x)


class Stack(nn.Module):
    def __init__(self, blocks: List[nn.Module], b: int, s: int):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.b, self.s = b, s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = blk(x, self.b, self.s)
        return x


def _gpu_ms_per_step(step: Callable[[], None], steps: int = 5) -> float:
    """Sum of the GPU kernels' durations per step (torch.profiler), whatever the host does between them."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    total = 0.0
    for e in prof.key_averages():
        if e.device_type == DeviceType.CUDA:
            total += getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
    return total / steps / 1e3


def bench_stack(kinds=("llama", "gpt2"), layers: int = 4, h: int = 1024, b: int = 8, s: int = 512,
                steps: int = 20, rounds: int = 3, python_path: bool = True) -> List[Dict[str, object]]:
    """Training step (forward, loss, backward, AdamW) of a `layers`-block stack at batch b x s, hidden h: wall
    ms per step (steps back to back, synchronised at the end; median of interleaved rounds) and GPU ms per
    step (kernel time), PyTorch against jitfuse, eager and torch.compile (default mode)."""
    rows = []
    heads = h // 64
    for kind in kinds:
        f = 4 * h if kind == "gpt2" else 2816 * h // 1024
        torch.manual_seed(0)
        ref = Stack([TorchBlock(kind, h, f, heads) for _ in range(layers)], b, s).to(DEV, DT)
        jfm = Stack([JitfuseBlock(kind, h, f, heads) for _ in range(layers)], b, s)
        x = torch.randn(b * s, h, device=DEV, dtype=DT)

        def make_step(model: nn.Module) -> Callable[[], None]:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

            def step() -> None:
                loss = model(x).float().square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            return step

        variants: Dict[str, Callable[[], None]] = {
            "pytorch eager": make_step(ref), "jitfuse eager": make_step(jfm)}
        if python_path and _modules.ext_forward is not None:
            variants["jitfuse eager, pure-Python path"] = _PathSwitch(make_step(jfm))
        torch._dynamo.reset()
        variants["pytorch torch.compile"] = make_step(torch.compile(ref))
        variants["jitfuse torch.compile"] = make_step(torch.compile(jfm))
        for fn in variants.values():
            for _ in range(5):
                fn()
        wall: Dict[str, List[float]] = {k: [] for k in variants}
        for _ in range(rounds):
            for k, fn in variants.items():
                torch.cuda.synchronize()
                t = time.perf_counter()
                for _ in range(steps):
                    fn()
                torch.cuda.synchronize()
                wall[k].append((time.perf_counter() - t) / steps * 1e3)
        for k, fn in variants.items():
            rows.append({"stack": f"{kind} {layers}x(h {h}, {b}x{s})", "variant": k,
                         "wall ms/step": statistics.median(wall[k]), "GPU ms/step": _gpu_ms_per_step(fn)})
            print(rows[-1], flush=True)  # partial results survive a time limit
        del ref, jfm, variants
        torch.cuda.empty_cache()
    return rows


# ---- the exported package ---------------------------------------------------------------------------


def _latency_us(fn: Callable[[], Any], calls: int) -> float:
    """Median µs from a call to its result on the GPU (each call synchronised): what one batch-1 request waits."""
    ts = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e6


def _back_to_back_us(fn: Callable[[], Any], calls: int) -> float:
    """µs per call of `calls` calls in a row, the GPU's work included (synchronised once, at the end)."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / calls * 1e6


def _graphed(fn: Callable[[], Any]) -> Callable[[], Any]:
    """fn captured once in a CUDA graph (after warm-up on a side stream); returns the replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    _graphed.keep.append((g, out))  # the graph's output buffers live as long as the process
    return g.replay


_graphed.keep = []  # type: ignore[attr-defined]


def bench_export(workdir: str, h: int = 1024, rows: int = 1, calls: int = 2000,
                 rounds: int = 5) -> List[Dict[str, object]]:
    """Per-call latency at batch `rows` of a two-Sequential model (LayerNorm, up-projection + GELU; down-projection
    + residual): eager jitfuse (module calls) and its CUDA graph, against the AOTInductor package of its
    torch.export run from Python (plain and captured in a CUDA graph) and from the C++ host
    runtime/torch/examples/aoti_run.cpp (built beside the extension: plain and captured). Interleaved rounds in one
    process, median; the C++ host is a second process, timed by itself."""
    import os
    import subprocess
    from pathlib import Path

    from jitfuse.torch import _ext

    kw = {"device": DEV, "dtype": DT}

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = jt.Sequential(jt.LayerNorm(h), jt.Linear(h, 4 * h), jt.Bias(4 * h), jt.GELU(), name="up", **kw)
            self.b = jt.Sequential(jt.Linear(4 * h, h), jt.Bias(h), jt.AddExtraInput(), name="down", **kw)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x), x)

    model = Model().eval()
    x = torch.randn(rows, h, device=DEV, dtype=DT)
    d = Path(workdir)
    d.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        ref = model(x)
        ep = torch.export.export(model, (x,))
    pkg = torch._inductor.aoti_compile_and_package(ep, package_path=str(d / "model.pt2"))
    jt.export_definitions(model, d / "model.jfseq")
    runner = torch._inductor.aoti_load_package(pkg)
    variants: Dict[str, Callable[[], Any]] = {}
    notes: Dict[str, str] = {}
    with torch.no_grad():
        y = runner(x)
        y = y[0] if isinstance(y, (list, tuple)) else y
        notes["AOTInductor package, from Python"] = "output = eager: %s" % bool(torch.equal(y, ref))
        variants["eager module calls"] = lambda: model(x)
        variants["eager, CUDA graph replay"] = _graphed(lambda: model(x))
        variants["AOTInductor package, from Python"] = lambda: runner(x)
        try:  # the single-threaded runner: the default one queries CUDA events, which a capture forbids
            single = torch._inductor.aoti_load_package(pkg, run_single_threaded=True)
            variants["AOTInductor package, from Python, CUDA graph replay"] = _graphed(lambda: single(x))
        except Exception as e:  # noqa: BLE001 - reported in the table
            notes["AOTInductor package, from Python, CUDA graph replay"] = f"capture failed: {e}"[:200]
        for fn in variants.values():
            for _ in range(20):
                fn()
        lat: Dict[str, List[float]] = {k: [] for k in variants}
        b2b: Dict[str, List[float]] = {k: [] for k in variants}
        for _ in range(rounds):
            for k, fn in variants.items():
                lat[k].append(_latency_us(fn, calls // rounds))
                b2b[k].append(_back_to_back_us(fn, calls // rounds))
    out = [{"call (batch %d, hidden %d)" % (rows, h): k, "latency us": statistics.median(lat[k]),
            "back-to-back us/call": statistics.median(b2b[k]), "note": notes.get(k, "")} for k in variants]
    out += [{"call (batch %d, hidden %d)" % (rows, h): k, "latency us": float("nan"),
             "back-to-back us/call": float("nan"), "note": v} for k, v in notes.items() if k not in variants]
    exe = Path(_ext.EXT.path) / "jitfuse_aoti_run" if _ext.EXT is not None else None
    if exe is not None and exe.exists():
        (d / "x.bin").write_bytes(x.cpu().view(torch.int16).numpy().tobytes())
        r = subprocess.run([str(exe), pkg, str(d / "model.jfseq"), str(d / "x.bin"), str(rows), str(h),
                            str(d / "y.bin"), str(calls)], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "JITFUSE_TORCH_SEQUENCES": str(d / "model.jfseq")})
        print(r.stdout + (r.stderr if r.returncode else ""))
        for line in r.stdout.splitlines():
            # "jitfuse_aoti_run: <variant>: latency X us, back-to-back Y us per call"
            parts = line.split(": ")
            if len(parts) == 3 and parts[2].startswith("latency"):
                nums = [float(t) for t in parts[2].replace(",", " ").split() if t.replace(".", "", 1).isdigit()]
                out.append({"call (batch %d, hidden %d)" % (rows, h): f"AOTInductor package, C++ host, {parts[1]}",
                            "latency us": nums[0], "back-to-back us/call": nums[1], "note": "second process"})
    return out
