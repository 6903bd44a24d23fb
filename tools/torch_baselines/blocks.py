"""PyTorch baselines for `jitfuse bench --case blocks` (issue 27), in one process: the Llama-style MLP half-block
(x -> rmsnorm -> linear 4096 -> 2*14336 -> swiglu -> linear 14336 -> 4096 -> + x) and the GPT-2-style one
(x -> layernorm -> linear 4096 -> 16384 -> bias -> tanh-gelu -> linear -> bias -> dropout 0.1 -> + x), 8192
tokens, bf16, forward + backward (dy given), timed three ways with the same weights:
  eager     the block written with torch.nn.functional
  compiled  torch.compile of that function (default mode)
  jitfuse   the block as ONE jitfuse.torch.Sequential with a hidden "residual" channel
Timing as jitfuse bench does: CUDA events around each step, steps enqueued back to back, 10 warm-up steps,
the median of 50. Run on the GPU machine:
  JITFUSE_LIBRARY=build/runtime/libjitfuse.so PYTHONPATH=runtime/python python3 tools/torch_baselines/blocks.py
"""
import argparse

import torch
import torch.nn.functional as F

import jitfuse.torch as jt
from _harness import median_ms

H, I_LLAMA, F_GPT2, TOKENS = 4096, 14336, 16384, 8192


def llama(dev, dt):
    w_norm = torch.ones(H, device=dev, dtype=dt)
    w1 = (torch.randn(2 * I_LLAMA, H, device=dev, dtype=dt) * 0.02).requires_grad_()
    w2 = (torch.randn(H, I_LLAMA, device=dev, dtype=dt) * 0.02).requires_grad_()
    w_norm.requires_grad_()

    def block(x):
        h = F.rms_norm(x, (H,), w_norm, eps=1e-5)
        gate, up = F.linear(h, w1).chunk(2, dim=-1)  # jitfuse's swiglu gates the first half
        return x + F.linear(F.silu(gate) * up, w2)

    seq = jt.Sequential(jt.Fork("residual"), jt.RMSNorm(H, eps=1e-5), jt.Linear(H, 2 * I_LLAMA),
                        jt.SwiGLU(), jt.Linear(I_LLAMA, H), jt.AddChannel("residual"), device=dev, dtype=dt)
    with torch.no_grad():
        seq[1].weight.copy_(w_norm)
        seq[2].weight.copy_(w1)
        seq[4].weight.copy_(w2)
    return block, seq


def gpt2(dev, dt):
    ln_w = torch.ones(H, device=dev, dtype=dt, requires_grad=True)
    ln_b = torch.zeros(H, device=dev, dtype=dt, requires_grad=True)
    w1 = (torch.randn(F_GPT2, H, device=dev, dtype=dt) * 0.02).requires_grad_()
    b1 = torch.zeros(F_GPT2, device=dev, dtype=dt, requires_grad=True)
    w2 = (torch.randn(H, F_GPT2, device=dev, dtype=dt) * 0.02).requires_grad_()
    b2 = torch.zeros(H, device=dev, dtype=dt, requires_grad=True)

    def block(x):
        h = F.layer_norm(x, (H,), ln_w, ln_b, eps=1e-5)
        h = F.gelu(F.linear(h, w1, b1), approximate="tanh")
        return x + F.dropout(F.linear(h, w2, b2), p=0.1, training=True)

    seq = jt.Sequential(jt.Fork("residual"), jt.LayerNorm(H, eps=1e-5), jt.Linear(H, F_GPT2), jt.Bias(F_GPT2),
                        jt.GELU("tanh"), jt.Linear(F_GPT2, H), jt.Bias(H), jt.Dropout(0.1),
                        jt.AddChannel("residual"), device=dev, dtype=dt)
    with torch.no_grad():
        seq[2].weight.copy_(w1)
        seq[5].weight.copy_(w2)
    return block, seq


def step(fn, x, dy):
    def run():
        y = fn(x)
        y.backward(dy)
    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    for name, make in (("llama block", llama), ("gpt2 block", gpt2)):
        block, seq = make(dev, dt)
        x = torch.randn(TOKENS, H, device=dev, dtype=dt, requires_grad=True)
        dy = torch.randn(TOKENS, H, device=dev, dtype=dt)
        compiled = torch.compile(block)
        times = {}
        for label, fn in (("eager", block), ("compiled", compiled), ("jitfuse", seq)):
            times[label] = median_ms(step(fn, x, dy), warmup=10, iters=args.iters)
        print(f"{name} bf16 fwd+bwd  eager {times['eager']:7.3f} ms   torch.compile {times['compiled']:7.3f} ms   "
              f"jitfuse {times['jitfuse']:7.3f} ms   (jitfuse / eager {times['jitfuse'] / times['eager']:.3f}, "
              f"/ compile {times['jitfuse'] / times['compiled']:.3f})")
        del block, seq, compiled
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
