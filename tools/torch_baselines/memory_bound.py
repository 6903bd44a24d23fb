"""PyTorch baselines for the memory-bound rows of `jitfuse bench` (issue 32), in one process: the same
kernels at the same shapes and dtype (bf16), timed in PyTorch eager and under torch.compile (default mode),
beside the copy bandwidth measured in the same run:
  layernorm / rmsnorm fwd and bwd    hidden 4096, 1024, 2048, 8192, 12288 at 8192 * 4096 elements
                                     (bwd: dx, dgamma (and dbeta) from dy and the saved input)
  layernorm -> E4M3                  current scaling (amax of the norm's output, then the cast) and delayed
                                     (a given scale; amax recorded), per hidden size
  bias + dropout(0.1) + add          8192x4096, fwd and bwd (dx and the residual's gradient)
  cast + transpose (+ amax)          8192x4096 and 8192x16384: E4M3 codes and their transpose, current
                                     (amax first) and delayed (given scale)
Bytes are counted as jitfuse bench counts them (inputs read once, outputs written once, fp8_current's
second read), so the % of copy columns compare directly. Timing as jitfuse bench does: CUDA events around
each call, calls enqueued back to back, 10 warm-up calls, the median of 50; and, beside it, the kernels'
summed duration per call under torch.profiler ("kern ms"): a compiled call's host time (guards, the
wrapper) exceeds the GPU time of one of these kernels, so its event time measures the host. On the GPU machine:
  python3 tools/torch_baselines/memory_bound.py [--json out.json]
(jitfuse's Python package must be importable, for the harness; its kernels' rows come from `jitfuse bench`
in the same device run, tools/bench_memory_bound.sh.) torch.compile
runs for the norms at hidden 4096 and every other kernel unless --compile-all.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from _harness import median_ms  # noqa: E402
from jitfuse.bench_stack import _gpu_ms_per_step  # noqa: E402

E4M3_MAX = 448.0
ELEMS = 8192 * 4096
HIDDEN = (4096, 1024, 2048, 8192, 12288)


def copy_gbs(dev):
    a = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    ms = median_ms(lambda: b.copy_(a))
    return 2 * a.numel() / ms / 1e6


def norm_cases(dev, dt):
    for norm in ("layernorm", "rmsnorm"):
        for c in HIDDEN:
            m = ELEMS // c
            x = torch.randn(m, c, device=dev, dtype=dt, requires_grad=True)
            w = (1 + 0.1 * torch.randn(c, device=dev, dtype=dt)).requires_grad_()
            b = (0.1 * torch.randn(c, device=dev, dtype=dt)).requires_grad_()
            dy = torch.randn(m, c, device=dev, dtype=dt)
            if norm == "layernorm":
                def f(x, w=w, b=b, c=c):
                    return F.layer_norm(x, (c,), w, b, eps=1e-5)
                params = (x, w, b)
            else:
                def f(x, w=w, c=c):
                    return F.rms_norm(x, (c,), w, eps=1e-5)
                params = (x, w)
            shape = f"{m}x{c}"
            yield (f"{norm} fwd", shape, 2.0 * 2 * m * c, lambda f=f, x=x: f(x.detach()))

            def bwd(fn, x=x, dy=dy, params=params):
                y = fn(x)
                return torch.autograd.grad(y, params, dy)
            yield (f"{norm} bwd", shape, 2.0 * 3 * m * c, (bwd, f))


def fp8_norm_cases(dev, dt):
    for recipe in ("fp8_current", "fp8_delayed"):
        for c in HIDDEN:
            m = ELEMS // c
            x = torch.randn(m, c, device=dev, dtype=dt)
            w = 1 + 0.1 * torch.randn(c, device=dev, dtype=dt)
            b = 0.1 * torch.randn(c, device=dev, dtype=dt)
            scale = torch.tensor(E4M3_MAX / 6.0, device=dev)
            amax = torch.zeros((), device=dev)
            if recipe == "fp8_current":
                def f(x, w=w, b=b, c=c):
                    y = F.layer_norm(x, (c,), w, b, eps=1e-5)
                    a = y.abs().amax().float()
                    s = E4M3_MAX / torch.clamp(a, min=1e-12)
                    return (y.float() * s).to(torch.float8_e4m3fn), 1.0 / s
            else:
                def f(x, w=w, b=b, c=c, scale=scale, amax=amax):
                    y = F.layer_norm(x, (c,), w, b, eps=1e-5)
                    amax.copy_(y.abs().amax().float())
                    return (y.float() * scale).to(torch.float8_e4m3fn)
            nbytes = (5.0 if recipe == "fp8_current" else 3.0) * m * c
            yield (f"layernorm_{recipe} fwd", f"{m}x{c} -> e4m3", nbytes, lambda f=f, x=x: f(x))


def bda_cases(dev, dt):
    r, c = 8192, 4096
    x = torch.randn(r, c, device=dev, dtype=dt, requires_grad=True)
    res = torch.randn(r, c, device=dev, dtype=dt, requires_grad=True)
    bias = torch.randn(c, device=dev, dtype=dt, requires_grad=True)
    dy = torch.randn(r, c, device=dev, dtype=dt)

    def f(x, res, bias):
        return F.dropout(x + bias, p=0.1, training=True) + res
    nbytes = 2.0 * (3 * r * c + c)
    yield ("bias_dropout_add fwd", f"{r}x{c}", nbytes, lambda: f(x.detach(), res.detach(), bias.detach()))

    def bwd(fn):
        y = fn(x, res, bias)
        return torch.autograd.grad(y, (x, res, bias), dy)
    yield ("bias_dropout_add bwd", f"{r}x{c}", nbytes, (bwd, f))


def cast_transpose_cases(dev, dt):
    for recipe in ("fp8_delayed", "fp8_current"):
        for k in (4096, 16384):
            x = torch.randn(8192, k, device=dev, dtype=dt)
            scale = torch.tensor(E4M3_MAX / 6.0, device=dev)
            amax = torch.zeros((), device=dev)
            if recipe == "fp8_current":
                def f(x):
                    a = x.abs().amax().float()
                    s = E4M3_MAX / torch.clamp(a, min=1e-12)
                    q = (x.float() * s).to(torch.float8_e4m3fn)
                    return q, q.t().contiguous(), 1.0 / s
            else:
                def f(x, scale=scale, amax=amax):
                    amax.copy_(x.abs().amax().float())
                    q = (x.float() * scale).to(torch.float8_e4m3fn)
                    return q, q.t().contiguous()
            nbytes = (6.0 if recipe == "fp8_current" else 4.0) * 8192 * k
            yield (f"cast_transpose {recipe}", f"8192x{k} -> e4m3 + T", nbytes, lambda f=f, x=x: f(x))


def timed(case, compiled):
    """(ms, kernel ms) eager or compiled for one case; backward cases carry (bwd, fn) and compile fn only.
    ms: CUDA events around each call, as jitfuse bench times; kernel ms: the summed duration of the kernels
    one call launches (torch.profiler), which a compiled call's host time (guards, wrapper) cannot inflate
    when it exceeds the GPU time of these single kernels."""
    name, shape, nbytes, call = case
    if isinstance(call, tuple):
        bwd, fn = call
        g = torch.compile(fn) if compiled else fn
        run = lambda: bwd(g)  # noqa: E731
    else:
        # Compiled: the function the lambda closes over, re-run through a compiled wrapper.
        run = torch.compile(call) if compiled else call
    return median_ms(run), _gpu_ms_per_step(run, steps=20)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--no-compile", action="store_true", help="eager only")
    ap.add_argument("--compile-all", action="store_true",
                    help="torch.compile every row (default: the norms at hidden 4096 and every other kernel; each "
                         "compile takes seconds)")
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    gbs = copy_gbs(dev)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, copy {gbs:.0f} GB/s")
    print(f"{'kernel':34s} {'shape':22s} {'eager ms':>9s} {'% copy':>7s} {'kern ms':>8s} {'% copy':>7s} "
          f"{'compiled ms':>12s} {'% copy':>7s} {'kern ms':>8s} {'% copy':>7s}")
    rows = []
    for gen in (norm_cases, fp8_norm_cases, bda_cases, cast_transpose_cases):
        for case in gen(dev, dt):
            name, shape, nbytes, _ = case
            eager, eager_k = timed(case, False)
            sweep_row = (name.startswith("layernorm") or name.startswith("rmsnorm")) and "x4096" not in shape
            comp, comp_k = (None, None) if args.no_compile or (sweep_row and not args.compile_all) else timed(case, True)
            pct = lambda ms: 100.0 * nbytes / (ms * 1e6) / gbs  # noqa: E731
            rows.append({"kernel": name, "shape": shape, "bytes": nbytes, "eager_ms": eager,
                         "eager_pct_copy": pct(eager), "eager_kernel_ms": eager_k,
                         "eager_kernel_pct_copy": pct(eager_k), "compiled_ms": comp,
                         "compiled_pct_copy": pct(comp) if comp else None, "compiled_kernel_ms": comp_k,
                         "compiled_kernel_pct_copy": pct(comp_k) if comp_k else None})
            cs = (f"{comp:12.3f} {pct(comp):7.1f} {comp_k:8.3f} {pct(comp_k):7.1f}" if comp
                  else f"{'-':>12s} {'-':>7s} {'-':>8s} {'-':>7s}")
            print(f"{name:34s} {shape:22s} {eager:9.3f} {pct(eager):7.1f} {eager_k:8.3f} {pct(eager_k):7.1f} {cs}",
                  flush=True)
            torch._dynamo.reset()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "copy_gbs": gbs, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
