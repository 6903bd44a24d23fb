# Training-step timings of jitfuse.torch against PyTorch eager and torch.compile (MLP block and the
# transformer-layer skeleton), and the host overhead per custom-op call at small M. GPU only.
"""python -m jitfuse.bench [--iters N] [--case default|paths|stack|export|lm_head|hf|moe]

Cases (bf16): the MLP block of tools/examples/mlp.json at 8192x4096 -> 16384 -> 4096 and the transformer
layer of tools/examples/transformer_layer.json at 8192x1024, one training step (forward + backward, no
optimizer) each through jitfuse.torch, PyTorch eager and torch.compile (default mode), timed with CUDA
events (median). Then the per-call host time of jitfuse.torch at M = 1..128 (inference and training).
"""

import argparse
import statistics
import time
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

import jitfuse.torch as jt

DEV = "cuda"
DT = torch.bfloat16


class TorchMLP(torch.nn.Module):
    def __init__(self, h: int, f: int):
        super().__init__()
        self.ln = torch.nn.LayerNorm(h)
        self.fc1 = torch.nn.Linear(h, f)
        self.fc2 = torch.nn.Linear(f, h)

    def forward(self, x, res):
        return self.fc2(F.gelu(self.fc1(self.ln(x)), approximate="tanh")) + res


class TorchLayer(torch.nn.Module):
    def __init__(self, h: int, f: int, p: float):
        super().__init__()
        self.rms = torch.nn.RMSNorm(h, eps=1e-6) if hasattr(torch.nn, "RMSNorm") else None
        self.proj = torch.nn.Linear(h, h)
        self.ln = torch.nn.LayerNorm(h)
        self.fc1 = torch.nn.Linear(h, 2 * f)
        self.fc2 = torch.nn.Linear(f, h, bias=False)
        self.p = p

    def forward(self, x, e0, e1):
        r0 = x
        h = self.rms(x) if self.rms is not None else x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        h = F.dropout(self.proj(h), self.p, self.training) + e0
        r1 = h
        a, b = self.fc1(self.ln(h)).chunk(2, -1)
        h = F.silu(self.fc2(F.silu(a) * b * 0.5)) + e1
        return h, r0, r1


def jf_mlp(h: int, f: int) -> jt.Sequential:
    return jt.Sequential(jt.LayerNorm(h), jt.Linear(h, f), jt.Bias(f), jt.GELU(), jt.Linear(f, h), jt.Bias(h),
                         jt.AddExtraInput(), device=DEV, dtype=DT, name="mlp")


def jf_layer(h: int, f: int, p: float) -> jt.Sequential:
    return jt.Sequential(jt.MakeExtraOutput(), jt.RMSNorm(h, eps=1e-6), jt.Linear(h, h), jt.Bias(h),
                         jt.Dropout(p, seed=1234), jt.AddExtraInput(), jt.MakeExtraOutput(), jt.LayerNorm(h),
                         jt.Linear(h, 2 * f), jt.Bias(2 * f), jt.SwiGLU(), jt.Scale(0.5), jt.Linear(f, h), jt.SiLU(),
                         jt.AddExtraInput(), device=DEV, dtype=DT, name="transformer_layer")


def time_cuda(fn: Callable[[], None], iters: int, warmup: int = 5) -> float:
    """Median milliseconds of fn over iters, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ms: List[float] = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ms.append(a.elapsed_time(b))
    return statistics.median(ms)


def train_step(model: torch.nn.Module, inputs: List[torch.Tensor]) -> Callable[[], None]:
    x = inputs[0].detach().requires_grad_()
    rest = inputs[1:]

    def step() -> None:
        out = model(x, *rest)
        outs = list(out) if isinstance(out, tuple) else [out]
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    return step


def bench_steps(iters: int) -> List[Dict[str, object]]:
    rows = []
    cases = [("MLP 8192x4096->16384->4096", lambda: jf_mlp(4096, 16384), lambda: TorchMLP(4096, 16384), (8192, 4096), 1),
             ("transformer layer 8192x1024", lambda: jf_layer(1024, 2816, 0.1), lambda: TorchLayer(1024, 2816, 0.1),
              (8192, 1024), 2)]
    for name, make_jf, make_torch, shape, n_extra in cases:
        inputs = [torch.randn(*shape, device=DEV, dtype=DT) for _ in range(1 + n_extra)]
        jf_model = make_jf()
        tm = make_torch().to(DEV, DT)
        r = {"case": name}
        r["jitfuse.torch"] = time_cuda(train_step(jf_model, inputs), iters)
        r["pytorch eager"] = time_cuda(train_step(tm, inputs), iters)
        torch._dynamo.reset()
        r["torch.compile"] = time_cuda(train_step(torch.compile(tm), inputs), iters, warmup=10)
        torch._dynamo.reset()
        r["jitfuse.torch + torch.compile"] = time_cuda(train_step(torch.compile(jf_model, fullgraph=True), inputs),
                                                       iters, warmup=10)
        rows.append(r)
        del jf_model, tm
        torch.cuda.empty_cache()
    return rows


def bench_host_overhead(calls: int) -> List[Dict[str, object]]:
    """Host microseconds per call (the GPU work is tiny, so the host is the bottleneck; synchronised at the end)."""
    rows = []
    model = jt.Sequential(jt.Bias(1024), jt.GELU(), device=DEV, dtype=DT)
    for m in (1, 16, 128):
        x = torch.randn(m, 1024, device=DEV, dtype=DT)
        xg = x.clone().requires_grad_()
        r: Dict[str, object] = {"M": m}
        with torch.no_grad():
            for _ in range(20):
                model(x)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(calls):
                model(x)
            r["forward (no grad) us"] = (time.perf_counter() - t) / calls * 1e6
            torch.cuda.synchronize()
        step = train_step(model, [xg])
        for _ in range(20):
            step()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            step()
        r["forward+backward us"] = (time.perf_counter() - t) / calls * 1e6
        torch.cuda.synchronize()
        ref = torch.nn.GELU(approximate="tanh")
        b = torch.zeros(1024, device=DEV, dtype=DT)
        with torch.no_grad():
            t = time.perf_counter()
            for _ in range(calls):
                ref(x + b)
            r["pytorch eager bias+gelu us"] = (time.perf_counter() - t) / calls * 1e6
            torch.cuda.synchronize()
        rows.append(r)
    return rows


def table(rows: List[Dict[str, object]]) -> str:
    keys = list(rows[0])
    out = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        out.append("| " + " | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in r.values()) + " |")
    return "\n".join(out)


def _print_compile() -> None:
    from .bench_hf import bench_compile
    print("\nthe same under torch.compile: backend=\"jitfuse\" against backend=\"inductor\":\n")
    print(table(bench_compile()))


def _print_decode() -> None:
    from .bench_hf import bench_decode
    print("\ndecode, one token per step (greedy, static KV cache), mode=\"reduce-overhead\" (CUDA graphs), "
          "median GPU ms per token:\n")
    print(table(bench_decode()))


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m jitfuse.bench")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--skip-steps", action="store_true", help="only the host-overhead table")
    ap.add_argument("--case", choices=("default", "paths", "stack", "export", "lm_head", "hf", "compile", "decode", "moe"), default="default",
                    help="paths: host time per call, C++ extension vs pure-Python vs PyTorch (one process); "
                         "stack: 4-layer Llama/GPT-2 block stacks, training step wall and GPU time; "
                         "lm_head: linear + cross-entropy fwd+bwd, time and peak memory vs eager and compile; "
                         "hf: Hugging Face models, unmodified vs jitfuse.torch.hf.apply, training step (then under "
                         "torch.compile, and decode); compile: only the torch.compile table; decode: only the decode table "
                         "(reduce-overhead, per token); "
                         "moe: the expert block fwd+bwd vs an eager loop, torch._grouped_mm (eager, compiled), bare GEMMs")
    a = ap.parse_args()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"jitfuse.torch C++ extension: {'loaded' if jt.extension_active() else 'not loaded'}")
    if a.case == "decode":
        _print_decode()
        return
    if a.case == "compile":
        _print_compile()
        return
    if a.case == "hf":
        from .bench_hf import bench_hf
        print("\nHugging Face training step (forward + loss, backward, AdamW), bf16, 8192 tokens, median ms of "
              "interleaved rounds:\n")
        print(table(bench_hf()))
        _print_compile()
        _print_decode()
        return
    if a.case == "moe":
        from .bench_moe import bench_moe
        print("\nMoE expert block (dispatch, gate/up, SwiGLU, down, combine), forward + backward from given top-k "
              "routing, 8192 tokens, bf16, median ms of interleaved rounds:\n")
        print(table(bench_moe()))
        return
    if a.case == "lm_head":
        from .bench_lm_head import bench_lm_head
        print("\nLM head + cross-entropy, forward + backward, 8192 tokens, bf16 (median ms; peak MiB above the "
              "resident inputs and weight):\n")
        print(table(bench_lm_head()))
        return
    if a.case != "default":
        from . import bench_stack
        if a.case == "paths":
            print("\nhost us per call (median of interleaved rounds; M = 16, hidden 1024, bf16):\n")
            print(table(bench_stack.bench_paths(calls=a.calls // 2)))
        elif a.case == "stack":
            print("\ntraining step of a 4-layer block stack (forward, loss, backward, AdamW):\n")
            import os
            print(table(bench_stack.bench_stack(steps=int(os.environ.get("JF_STACK_STEPS", 20)),
                                                rounds=int(os.environ.get("JF_STACK_ROUNDS", 3)))))
        else:
            import tempfile
            print("\nper-call latency, eager vs exported (AOTInductor):\n")
            print(table(bench_stack.bench_export(tempfile.mkdtemp(prefix="jitfuse_export_"))))
        return
    if not a.skip_steps:
        print("\ntraining step (forward + backward), median ms:\n")
        print(table(bench_steps(a.iters)))
    print("\nhost time per call at small M (bias + gelu, 1024 cols), us:\n")
    print(table(bench_host_overhead(a.calls)))


if __name__ == "__main__":
    main()
