# `python -m jitfuse.bench --case hf`: unmodified Hugging Face models (from a config, random init, bf16) against
# the same models after jitfuse.torch.hf.apply (norms and MLPs; and with loss=True, the head and its loss too), in
# one process, interleaved: a training step (forward with the loss, backward, AdamW) in GPU time (CUDA events,
# median) and wall time (median), for Llama, Qwen2 and GPT-2 at hidden 2048, 4 layers, 8192 tokens. Needs
# transformers and a GPU.
import copy
import statistics
import time
from typing import Any, Callable, Dict, List, Tuple

import torch

DEV = "cuda"
DT = torch.bfloat16
TOKENS = (4, 2048)  # batch x sequence: 8192 tokens


def _models() -> List[Tuple[str, Callable[[], Any]]]:
    import transformers as t
    common = dict(hidden_size=2048, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=8,
                  max_position_embeddings=4096, vocab_size=32000)
    return [
        ("Llama (h2048, ffn 5632, 4 layers)",
         lambda: t.LlamaForCausalLM(t.LlamaConfig(intermediate_size=5632, **common))),
        ("Qwen2 (h2048, ffn 11008, 4 layers)",
         lambda: t.Qwen2ForCausalLM(t.Qwen2Config(intermediate_size=11008, **common))),
        ("GPT-2 (h2048, ffn 8192, 4 layers)",
         lambda: t.GPT2LMHeadModel(t.GPT2Config(n_embd=2048, n_layer=4, n_head=16, n_positions=4096,
                                                vocab_size=50257))),
    ]


def _step(model: Any, opt: Any, x: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        loss = model(x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return run


def _time(fn: Callable[[], None]) -> Tuple[float, float]:
    """(GPU ms by CUDA events, wall ms) of one call."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b), (time.perf_counter() - t0) * 1e3


def _interleaved(runs: Dict[str, Callable[[], None]], steps: int, warmup: int,
                 warmed: Callable[[], None] = lambda: None) -> Tuple[Dict[str, float], Dict[str, float]]:
    """Median GPU and wall ms of each of ``runs`` over ``steps`` interleaved rounds, after ``warmup`` rounds
    (``warmed()`` is called between the two, once the GPU is idle)."""
    for _ in range(warmup):
        for fn in runs.values():
            fn()
    torch.cuda.synchronize()
    warmed()
    t: Dict[str, List[Tuple[float, float]]] = {k: [] for k in runs}
    for _ in range(steps):  # interleaved rounds
        for k, fn in runs.items():
            t[k].append(_time(fn))
    return ({k: statistics.median(v[0] for v in t[k]) for k in t},
            {k: statistics.median(v[1] for v in t[k]) for k in t})


def bench_hf(steps: int = 20, warmup: int = 5) -> List[Dict[str, object]]:
    from .torch import hf
    rows: List[Dict[str, object]] = []
    g = torch.Generator(device="cpu").manual_seed(0)
    for name, make in _models():
        torch.manual_seed(0)
        plain = make().to(DEV, DT)
        swapped = copy.deepcopy(plain)
        report = hf.apply(swapped)
        with_loss = copy.deepcopy(plain)
        loss_report = hf.apply(with_loss, loss=True)
        x = torch.randint(0, 32000, TOKENS, generator=g).to(DEV)
        runs = {k: _step(m, torch.optim.AdamW(m.parameters(), lr=1e-5, foreach=True), x)
                for k, m in (("plain", plain), ("jitfuse", swapped), ("loss", with_loss))}
        gpu, wall = _interleaved(runs, steps, warmup)
        rows.append({"model": name, "swapped": f"{len(report.swapped)} ({len(report.left)} left)",
                     "HF eager GPU ms": gpu["plain"], "hf.apply GPU ms": gpu["jitfuse"],
                     "GPU ratio": gpu["jitfuse"] / gpu["plain"], "HF eager wall ms": wall["plain"],
                     "hf.apply wall ms": wall["jitfuse"], "wall ratio": wall["jitfuse"] / wall["plain"],
                     "loss=True": "swapped" if loss_report.entries[0].swapped else loss_report.entries[0].reason,
                     "loss=True GPU ms": gpu["loss"], "loss=True GPU ratio": gpu["loss"] / gpu["plain"],
                     "loss=True wall ratio": wall["loss"] / wall["plain"]})
        del plain, swapped, with_loss, runs
        torch.cuda.empty_cache()
    return rows


def bench_compile(steps: int = 15, warmup: int = 3) -> List[Dict[str, object]]:
    """The same models and step under torch.compile: backend="jitfuse" against backend="inductor"."""
    import jitfuse.torch  # noqa: F401 - registers backend="jitfuse"
    from .torch import _dynamo_backend
    rows: List[Dict[str, object]] = []
    g = torch.Generator(device="cpu").manual_seed(0)
    for name, make in _models():
        torch.manual_seed(0)
        base = make().to(DEV, DT)
        models = {"inductor": base, "jitfuse": copy.deepcopy(base), "jitfuse fp8_current": copy.deepcopy(base)}
        backends = {"inductor": "inductor", "jitfuse": "jitfuse",
                    "jitfuse fp8_current": _dynamo_backend.backend(recipe="fp8_current")}
        x = torch.randint(0, 32000, TOKENS, generator=g).to(DEV)
        n0 = len(_dynamo_backend.reports())
        runs = {k: _step(torch.compile(m, backend=backends[k]),
                         torch.optim.AdamW(m.parameters(), lr=1e-5, foreach=True), x)
                for k, m in models.items()}
        counted: List[int] = []  # the chains of the compiles the warm-up made (two jitfuse backends)
        gpu, wall = _interleaved(runs, steps, warmup, lambda: counted.append(
            sum(1 for r in _dynamo_backend.reports()[n0:] for c in r.chains if c.swapped) // 2))
        chains = counted[0]
        rows.append({"model": name, "jitfuse chains": chains, "inductor GPU ms": gpu["inductor"],
                     "jitfuse GPU ms": gpu["jitfuse"], "GPU ratio": gpu["jitfuse"] / gpu["inductor"],
                     "inductor wall ms": wall["inductor"], "jitfuse wall ms": wall["jitfuse"],
                     "wall ratio": wall["jitfuse"] / wall["inductor"],
                     "jitfuse fp8_current GPU ms": gpu["jitfuse fp8_current"],
                     "fp8 GPU ratio": gpu["jitfuse fp8_current"] / gpu["inductor"]})
        del base, models, runs
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    return rows


def static_cache(model: Any, batch: int, length: int) -> Any:
    """A Hugging Face StaticCache for ``model`` (its constructor's arguments changed across transformers versions)."""
    from transformers import StaticCache
    try:
        return StaticCache(config=model.config, max_cache_len=length)
    except TypeError:
        return StaticCache(config=model.config, max_batch_size=batch, max_cache_len=length, device=DEV,
                           dtype=next(model.parameters()).dtype)


def decode(model: Any, step: Callable[..., Any], prompt: torch.Tensor, new_tokens: int,
           timed: bool = False) -> Tuple[torch.Tensor, List[float]]:
    """Greedy decode with a static KV cache: the prompt in one forward, then ``new_tokens`` forwards of one token
    each through ``step`` (the model's forward, compiled or not). Returns the tokens [batch, new_tokens] and, with
    ``timed``, each decode step's GPU ms (CUDA events)."""
    b, n = prompt.shape
    cache = static_cache(model, b, n + new_tokens)
    with torch.no_grad():
        logits = model(input_ids=prompt, past_key_values=cache, use_cache=True,
                       cache_position=torch.arange(n, device=DEV)).logits
        tok = logits[:, -1:].argmax(-1)
        out, ms = [tok], []
        for i in range(new_tokens - 1):
            pos = torch.tensor([n + i], device=DEV)
            a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if hasattr(torch.compiler, "cudagraph_mark_step_begin"):
                torch.compiler.cudagraph_mark_step_begin()
            a.record()
            logits = step(input_ids=tok, past_key_values=cache, use_cache=True, cache_position=pos).logits
            tok = logits[:, -1:].argmax(-1).clone()
            e.record()
            out.append(tok)
            if timed:
                e.synchronize()
                ms.append(a.elapsed_time(e))
    return torch.cat(out, 1), ms


def bench_decode(batches: Tuple[int, ...] = (1, 8), prompt: int = 128, new_tokens: int = 64) -> List[Dict[str, object]]:
    """Per-token decode (greedy, static KV cache) under torch.compile(mode="reduce-overhead", CUDA graphs):
    backend="jitfuse" against backend="inductor", Llama h2048 4 layers, bf16; median GPU ms per token."""
    import jitfuse.torch  # noqa: F401 - registers backend="jitfuse"
    from .torch import _dynamo_backend
    rows: List[Dict[str, object]] = []
    name, make = _models()[0]
    torch.manual_seed(0)
    base = make().to(DEV, DT).eval()
    for b in batches:
        x = torch.randint(0, 32000, (b, prompt), generator=torch.Generator(device="cpu").manual_seed(b)).to(DEV)
        res: Dict[str, Tuple[torch.Tensor, float]] = {}
        for k in ("inductor", "jitfuse", "inductor", "jitfuse"):  # twice each, interleaved: the second counts
            torch._dynamo.reset()
            be = "inductor" if k == "inductor" else _dynamo_backend.backend(mode="reduce-overhead")
            step = torch.compile(base.forward, backend=be, **({"mode": "reduce-overhead"} if k == "inductor" else {}))
            decode(base, step, x, 8)  # compile and record the graphs
            toks, ms = decode(base, step, x, new_tokens, timed=True)
            res[k] = (toks, statistics.median(ms[4:]))
        # (Greedy tokens of a random-init bf16 model diverge once one argmax flips: test_compile_backend_gpu.py
        # checks them in fp32 against the eager model.)
        rows.append({"model": name, "batch": b, "inductor ms/token": res["inductor"][1],
                     "jitfuse ms/token": res["jitfuse"][1], "ratio": res["jitfuse"][1] / res["inductor"][1]})
    torch._dynamo.reset()
    return rows
