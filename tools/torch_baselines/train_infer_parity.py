# Does a no-grad forward (the inference program) compute the same bits as a training forward (the training
# program) of the same module? Under reentrant activation checkpointing the first forward runs without grad
# and the recompute with it, so any difference reaches the gradients (issue 26, item 2's Llama note).
"""Usage: python3 tools/torch_baselines/train_infer_parity.py  (GPU; prints one line per sequence)."""

import torch

import jitfuse.torch as jt

DEV = "cuda"
BF16 = torch.bfloat16


def cases():
    h, f = 256, 704
    yield "rmsnorm", jt.Sequential(jt.RMSNorm(h), device=DEV, dtype=BF16)
    yield "layernorm", jt.Sequential(jt.LayerNorm(h), device=DEV, dtype=BF16)
    yield "linear", jt.Sequential(jt.Linear(h, f), device=DEV, dtype=BF16)
    yield "swiglu", jt.Sequential(jt.SwiGLU(), device=DEV, dtype=BF16)
    yield "llama_mlp", jt.Sequential(jt.Linear(h, 2 * f), jt.SwiGLU(), jt.Linear(f, h), device=DEV, dtype=BF16)
    yield "gpt_mlp", jt.Sequential(jt.Linear(h, 4 * h), jt.Bias(4 * h), jt.GELU(), jt.Linear(4 * h, h), jt.Bias(h),
                                   device=DEV, dtype=BF16)
    yield "linear_bias_gelu", jt.Sequential(jt.Linear(h, f), jt.Bias(f), jt.GELU(), device=DEV, dtype=BF16)


def main():
    torch.manual_seed(0)
    for name, m in cases():
        for p in m.parameters():
            torch.nn.init.normal_(p, std=0.05)
        cols = 2 * 704 if name == "swiglu" else 256
        x = torch.randn(512, cols, device=DEV, dtype=BF16)
        with torch.no_grad():
            y_inf = m(x)
        y_tr = m(x.clone().requires_grad_())
        d = (y_inf.float() - y_tr.detach().float()).abs().max().item()
        print(f"{name:18s} inference == training: {torch.equal(y_inf, y_tr.detach())}  max|diff| {d:.3e}")
        print("   forward groups (training): ",
              [str(g) for g in m.explain(shape=(512, cols), training=True).forward])
        print("   forward groups (inference):",
              [str(g) for g in m.explain(shape=(512, cols), training=False).forward])


if __name__ == "__main__":
    main()
