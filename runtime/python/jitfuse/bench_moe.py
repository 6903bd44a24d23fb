# `python -m jitfuse.bench --case moe`: the mixture-of-experts expert block (dispatch, gate/up GEMMs, SwiGLU, down
# GEMMs, the weighted combine), forward + backward from given top-k routing, bf16, at Mixtral-8x7B's, OLMoE's and
# Qwen3-MoE-30B's shapes (8192 tokens): jitfuse (dropless, and padded at capacity factor 1.25) against an eager
# PyTorch loop over the experts (Hugging Face's "eager" experts), the same block on torch._grouped_mm (Hugging
# Face's "grouped_mm" experts) eager and under torch.compile, and the bare GEMMs (torch.mm per expert on the same
# splits, six per expert: the floor). CUDA events, warm-up, median of interleaved rounds. GPU only.
import math
import os
from typing import Callable, Dict, List, Tuple

import torch
import torch.nn.functional as F

import jitfuse.torch as jt

DEV = "cuda"
DT = torch.bfloat16
# (name, hidden, expert width, experts, top-k)
SHAPES: Tuple[Tuple[str, int, int, int, int], ...] = (
    ("Mixtral-8x7B", 4096, 14336, 8, 2), ("OLMoE-1B-7B", 2048, 1024, 64, 8), ("Qwen3-30B-A3B", 2048, 768, 128, 8))


def _routing(tokens: int, experts: int, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """A router's top-k on random logits (softmax, top-k, renormalised): the load a fresh router gives."""
    g = torch.Generator(device="cpu").manual_seed(0)
    logits = torch.randn(tokens, experts, generator=g).to(DEV)
    p = torch.softmax(logits, -1)
    w, idx = torch.topk(p, k, -1)
    return idx, (w / w.sum(-1, keepdim=True)).float()


def eager_loop(x, idx, w, w1, w2):
    """Hugging Face's eager experts: a loop over the experts that got tokens."""
    out = torch.zeros_like(x)
    mask = F.one_hot(idx, w1.shape[0]).permute(2, 1, 0)
    hit = (mask.sum((-1, -2)) > 0).nonzero()
    for e in hit:
        e = e[0]
        j, t = torch.where(mask[e])
        a, b = F.linear(x[t], w1[e]).chunk(2, -1)
        y = F.linear(F.silu(a) * b, w2[e]) * w[t, j, None]
        out.index_add_(0, t, y.to(out.dtype))
    return out


def grouped_mm(x, idx, w, w1, w2):
    """Hugging Face's grouped_mm experts: sort the slots by expert, two torch._grouped_mm with device offsets."""
    t, k = idx.shape
    ids = idx.reshape(-1)
    perm = torch.argsort(ids, stable=True)
    counts = torch.histc(ids.int(), bins=w1.shape[0], min=0, max=w1.shape[0] - 1)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    xs = x[perm // k]
    a, b = torch._grouped_mm(xs, w1.transpose(-2, -1), offs=offs).chunk(2, -1)
    y = torch._grouped_mm(F.silu(a) * b, w2.transpose(-2, -1), offs=offs)
    y = y * w.reshape(-1)[perm, None].to(y.dtype)
    out = torch.empty_like(y)
    out[perm] = y
    return out.view(t, k, -1).sum(1)


def _bare(x, idx, w1, w2) -> Callable[[], None]:
    """The GEMMs alone: per expert, fwd (2), dgrad (2) and wgrad (2) with torch.mm on contiguous expert rows."""
    w1, w2 = w1.detach(), w2.detach()
    counts = torch.bincount(idx.reshape(-1), minlength=w1.shape[0]).tolist()
    rows = sum(counts)
    xs = torch.randn(rows, x.shape[1], device=DEV, dtype=DT)
    h = torch.randn(rows, w1.shape[1], device=DEV, dtype=DT)
    a = torch.randn(rows, w2.shape[2], device=DEV, dtype=DT)
    dy = torch.randn(rows, w2.shape[1], device=DEV, dtype=DT)
    dw1, dw2 = torch.empty_like(w1), torch.empty_like(w2)

    def run() -> None:
        s = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            sl = slice(s, s + n)
            torch.mm(xs[sl], w1[e].t(), out=h[sl])
            torch.mm(a[sl], w2[e].t(), out=dy[sl])
            torch.mm(dy[sl], w2[e], out=a[sl])
            torch.mm(dy[sl].t(), a[sl], out=dw2[e])
            torch.mm(h[sl], w1[e], out=xs[sl])
            torch.mm(h[sl].t(), xs[sl], out=dw1[e])
            s += n
    return run


def bench_moe(tokens: int = 8192, warmup: int = 3, rounds: int = 10,
              shapes: Tuple[Tuple[str, int, int, int, int], ...] = SHAPES) -> List[Dict[str, object]]:
    from .bench import time_cuda
    how = os.environ.get("JITFUSE_GROUPED_GEMM") or "auto"
    rows: List[Dict[str, object]] = []
    for name, h, f, e, k in shapes:
        torch.manual_seed(0)
        x = torch.randn(tokens, h, device=DEV, dtype=DT).requires_grad_()
        idx, w = _routing(tokens, e, k)
        w = w.requires_grad_()
        w1 = torch.nn.Parameter(torch.randn(e, 2 * f, h, device=DEV, dtype=DT) * h ** -0.5)
        w2 = torch.nn.Parameter(torch.randn(e, h, f, device=DEV, dtype=DT) * f ** -0.5)
        dropless = jt.Sequential(jt.MoEPermute(e, k), jt.GroupedLinear(e, h, 2 * f, weight=w1), jt.SwiGLU(),
                                 jt.GroupedLinear(e, f, h, weight=w2), jt.MoEUnpermute(), name="moe_dropless")
        cap = int(math.ceil(1.25 * tokens * k / e / 8)) * 8
        padded = jt.Sequential(jt.MoEPermute(e, k, layout="padded", capacity=cap),
                               jt.GroupedLinear(e, h, 2 * f, weight=w1), jt.SwiGLU(),
                               jt.GroupedLinear(e, f, h, weight=w2), jt.MoEUnpermute(), name="moe_padded")
        compiled = torch.compile(grouped_mm)
        dy = torch.randn(tokens, h, device=DEV, dtype=DT)

        def step(fn) -> Callable[[], None]:
            def run() -> None:
                x.grad = w.grad = w1.grad = w2.grad = None
                fn(x, idx, w, w1, w2).backward(dy)
            return run
        variants = {
            f"jitfuse dropless (grouped GEMM {how})": step(lambda *a: dropless(a[0], a[1], a[2])),
            f"jitfuse padded (capacity {cap})": step(lambda *a: padded(a[0], a[1], a[2])),
            "PyTorch eager loop (HF eager)": step(eager_loop),
            "torch._grouped_mm (HF grouped_mm)": step(grouped_mm),
            "torch._grouped_mm, torch.compile": step(compiled),
            "bare GEMMs (torch.mm per expert)": _bare(x, idx, w1, w2),
        }
        times: Dict[str, List[float]] = {n: [] for n in variants}
        for fn in variants.values():
            time_cuda(fn, 1, warmup)
        for _ in range(rounds):  # interleaved: each round times every variant once (median of 3 runs)
            for n, fn in variants.items():
                times[n].append(time_cuda(fn, 3, 0))
        flops = 3 * 2 * tokens * k * (h * 2 * f + f * h)
        med = {n: sorted(t)[len(t) // 2] for n, t in times.items()}
        base = med["PyTorch eager loop (HF eager)"]
        comp = med["torch._grouped_mm, torch.compile"]
        bare = med["bare GEMMs (torch.mm per expert)"]
        for n in variants:
            rows.append({"block": f"{name} (H {h}, I {f}, {e} experts, top-{k})", "variant": n, "ms": med[n],
                         "TFLOP/s": flops / med[n] / 1e9, "vs eager loop": base / med[n],
                         "vs compiled grouped_mm": comp / med[n], "vs bare GEMMs": med[n] / bare})
        del dropless, padded, compiled, w1, w2, x
        torch.cuda.empty_cache()
    return rows
