"""PyTorch baselines for `jitfuse bench --case decode`: the same MLP inference (bf16, 4096 -> 16384 -> 4096,
linear + bias + tanh-GELU + linear + bias) at M = 1, 16, 128, per call, eager and as a replayed CUDA graph.

Timing as jitfuse bench does: CUDA events around each call, calls enqueued back to back, 10 warm-up calls,
the median of 50. Run on the GPU machine: python3 tools/torch_baselines/decode_mlp.py
"""
import torch
import torch.nn.functional as F

from _harness import median_ms


def main():
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    H, Fd = 4096, 16384
    w1 = torch.randn(Fd, H, device=dev, dtype=dt) * 0.02
    b1 = torch.randn(Fd, device=dev, dtype=dt)
    w2 = torch.randn(H, Fd, device=dev, dtype=dt) * 0.02
    b2 = torch.randn(H, device=dev, dtype=dt)

    def mlp(x):
        return F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)

    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    with torch.no_grad():
        for M in (1, 16, 128):
            x = torch.randn(M, H, device=dev, dtype=dt)
            eager = median_ms(lambda: mlp(x))
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    mlp(x)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                y = mlp(x)
            graph = median_ms(lambda: g.replay())
            print(f"torch decode M={M:<4} eager {eager * 1e3:8.1f} us   graph {graph * 1e3:8.1f} us")


if __name__ == "__main__":
    main()
