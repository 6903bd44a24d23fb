# Does the inference program (eval mode, or, before issue 26, any no-grad call) compute the same bits as
# the training program of the same module? Under reentrant activation checkpointing the first forward ran
# without grad (the inference program) and the recompute with grad (the training program), so any
# difference reached the gradients (issue 26, item 2's Llama note). Since issue 26 train mode always runs the
# training program; this script shows where the two programs' plans round differently.
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
    # The Llama MLP half-block as users wrote it before channels: norm and residual inside (block(h, h)).
    yield "llama_block", jt.Sequential(jt.RMSNorm(h), jt.Linear(h, 2 * f), jt.SwiGLU(), jt.Linear(f, h),
                                       jt.AddExtraInput(), device=DEV, dtype=BF16)
    yield "gpt_block", jt.Sequential(jt.LayerNorm(h), jt.Linear(h, 4 * h), jt.Bias(4 * h), jt.GELU(),
                                     jt.Linear(4 * h, h), jt.Bias(h), jt.AddExtraInput(), device=DEV, dtype=BF16)


def main():
    torch.manual_seed(0)
    for name, m in cases():
        for p in m.parameters():
            torch.nn.init.normal_(p, std=0.05)
        cols = 2 * 704 if name == "swiglu" else 256
        x = torch.randn(512, cols, device=DEV, dtype=BF16)
        extras = [torch.randn(512, 256, device=DEV, dtype=BF16)] if name.endswith("block") else []
        m.eval()
        with torch.no_grad():
            y_inf = m(x, *extras)
        m.train()
        y_tr = m(x.clone().requires_grad_(), *extras)
        d = (y_inf.float() - y_tr.detach().float()).abs().max().item()
        print(f"{name:18s} inference == training: {torch.equal(y_inf, y_tr.detach())}  max|diff| {d:.3e}")
        print("   forward groups (training): ",
              [str(g) for g in m.explain(shape=(512, cols), training=True).forward])
        print("   forward groups (inference):",
              [str(g) for g in m.explain(shape=(512, cols), training=False).forward])


if __name__ == "__main__":
    main()
