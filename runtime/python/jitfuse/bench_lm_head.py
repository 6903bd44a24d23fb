# `python -m jitfuse.bench --case lm_head`: the language-model head with its loss (linear + cross-entropy,
# forward and backward) through jitfuse's chunked joint fusion against PyTorch eager and torch.compile, in one
# process: step time (CUDA events, warm-up, median) and the step's peak memory above what was resident before
# it (inputs, weight), for Llama-3-8B, Gemma-2-9B and GPT-2 heads at 8192 tokens, bf16. GPU only.
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

import jitfuse.torch as jt

DEV = "cuda"
DT = torch.bfloat16
# (name, hidden, vocabulary): the heads issue 47 names.
HEADS: Tuple[Tuple[str, int, int], ...] = (
    ("Llama-3-8B", 4096, 128256), ("Gemma-2-9B", 3584, 256000), ("GPT-2", 768, 50257))


# The chunk budgets measured (CrossEntropy's chunk_mib; None: automatic, the default).
CHUNKS_MIB = (None, 256, 512, 1024)


def _labels(tokens: int, vocab: int) -> torch.Tensor:
    """Random class indices with every tenth row ignored (-100), as shifted causal-LM labels have some."""
    g = torch.Generator(device="cpu").manual_seed(0)
    y = torch.randint(0, vocab, (tokens,), generator=g)
    y[::10] = -100
    return y.to(DEV)


def _measure(step: Callable[[], torch.Tensor], clear: Callable[[], None], warmup: int,
             iters: int) -> Tuple[float, float, float]:
    """(median ms, peak MiB above the memory allocated before the step, the loss) of step(); clear() drops
    the gradients before each step, so the peak counts the step's gradients and nothing of the last one."""
    from .bench import time_cuda

    def run() -> None:
        clear()  # host work only: drops references, the caching allocator keeps the memory
        step()
    ms = time_cuda(run, iters, warmup)
    clear()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return ms, peak, float(loss)


def bench_lm_head(tokens: int = 8192, warmup: int = 3, iters: int = 10,
                  heads: Tuple[Tuple[str, int, int], ...] = HEADS) -> List[Dict[str, object]]:
    rows: List[Dict[str, object]] = []
    for name, h, v in heads:
        torch.manual_seed(0)
        x = (torch.randn(tokens, h, device=DEV) * 0.5).to(DT).requires_grad_()
        w = torch.nn.Parameter((torch.randn(v, h, device=DEV) * h ** -0.5).to(DT))
        y = _labels(tokens, v)
        heads: Dict[Optional[int], jt.Sequential] = {}
        for mib in CHUNKS_MIB:
            heads[mib] = jt.Sequential(jt.Linear(h, v), jt.CrossEntropy(chunk_mib=mib), device=DEV, dtype=DT)
            with torch.no_grad():
                heads[mib][0].weight.copy_(w)

        def loss_bf16(x_: torch.Tensor, w_: torch.Tensor, y_: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(F.linear(x_, w_), y_, ignore_index=-100)

        def loss_hf(x_: torch.Tensor, w_: torch.Tensor, y_: torch.Tensor) -> torch.Tensor:
            # Hugging Face's causal-LM loss: the logits upcast to float32 first.
            return F.cross_entropy(F.linear(x_, w_).float(), y_, ignore_index=-100)

        compiled = torch.compile(loss_bf16)

        def torch_step(fn: Callable[..., torch.Tensor]) -> Callable[[], torch.Tensor]:
            def step() -> torch.Tensor:
                loss = fn(x, w, y)
                loss.backward()
                return loss.detach()
            return step

        def jf_step(head: jt.Sequential) -> Callable[[], torch.Tensor]:
            def step() -> torch.Tensor:
                loss = head(x, y)
                loss.backward()
                return loss.detach()
            return step

        def clear() -> None:
            x.grad = w.grad = None
            for m in heads.values():
                m[0].weight.grad = None

        variants = {"PyTorch eager": torch_step(loss_bf16), "PyTorch eager, fp32 logits (HF)": torch_step(loss_hf),
                    "torch.compile": torch_step(compiled)}
        for mib, m in heads.items():
            variants["jitfuse" if mib is None else f"jitfuse, chunk_mib={mib}"] = jf_step(m)
        got = {k: _measure(fn, clear, warmup, iters) for k, fn in variants.items()}
        for k, (ms, peak, loss) in got.items():
            rows.append({"head": f"{name} ({h}x{v})", "variant": k, "ms": ms, "peak MiB": peak,
                         "vs eager time": ms / got["PyTorch eager"][0],
                         "vs eager memory": peak / got["PyTorch eager"][1],
                         "vs compile time": ms / got["torch.compile"][0],
                         "vs compile memory": peak / got["torch.compile"][1], "loss": loss})
        del heads, x, w, y, compiled
        torch.cuda.empty_cache()
    return rows
