"""Tensor parallelism on several GPUs (docs/parallel.md): numerics and timings of jitfuse's parallel blocks.

Launch one process per GPU:

    torchrun --nproc-per-node 2 tools/multigpu/tp.py check            # TP=2 and TP=2+SP vs one GPU
    torchrun --nproc-per-node 2 tools/multigpu/tp.py head             # the vocab-parallel LM head vs float64
    torchrun --nproc-per-node 2 tools/multigpu/tp.py bench [--fp8]    # Llama MLP: jitfuse vs DTensor, bf16
    torchrun --nproc-per-node 2 tools/multigpu/tp.py arnorm           # all-reduce + residual + RMSNorm, decode
    torchrun --nproc-per-node 2 tools/multigpu/tp.py train [--sp]     # HF Llama, TP(+SP) MLPs, 100 AdamW steps vs 1 GPU

`check`: every rank builds the single-GPU Llama and GPT-2 MLP blocks from one seed, cuts Megatron's shards
out of their weights (column: rows of the weight, a gated op's gate and up halves each; row: columns), runs
the tensor-parallel Sequential on its token shard (SP) or on all tokens (TP alone) and compares output,
input gradient and every weight gradient with the single-GPU sequence's (the sequence-parallel parameters'
gradients after their all-reduce), then each SP block's forward as CUDA-graph replays against its eager forward;
then the Llama block with TP+SP under fp8_current against the fp32 one-GPU block: no further from it than the
same FP8 block on one GPU is (twice its error, plus 0.02 of the largest value). Exit status 1 on any mismatch. Sizes: --hidden 256 --ffn 1024 --tokens 512.
`head`: the language-model head split by vocabulary (``Linear(tensor_parallel="column")`` then
``CrossEntropy(vocab_parallel=True)``), joint (chunked) and unfused (``reduction="none"``), TP and TP+SP, with
ignored rows, label smoothing, z-loss and soft-capping, against PyTorch's float64 loss and gradients of the
whole head (this rank's rows of dW). Exit status 1 on any mismatch.
`bench`: forward + backward (bf16) of the Llama MLP block -- Fork, RMSNorm(h), column Linear(h, 2f), SwiGLU,
row Linear(f, h), AddChannel (the residual) -- on --tokens x --hidden (default 8192 x 4096, --ffn 14336).
Variants, all in one process: jitfuse TP, jitfuse TP+SP, jitfuse FP8 TP+SP (``recipe="fp8_current"``, with
--fp8); PyTorch DTensor TP and TP+SP (``parallelize_module`` over an HF-style gate_proj / up_proj / down_proj
MLP with ``torch.nn.RMSNorm``), eager and ``torch.compile``d (--no-compile skips those); for the breakdown,
jitfuse's block at world size 1 with this rank's shard shapes on all tokens (the compute alone) and
torch.distributed's collectives alone at the block's sizes (TP: 2 all_reduce of [tokens, h]; TP+SP:
2 all_gather_into_tensor + 2 reduce_scatter_tensor between [tokens/W, h] and [tokens, h]). Every variant is
built and warmed up (compiled) first, then --rounds interleaved rounds each time every variant: CUDA events
around each forward + backward, median of --iters after 2 warm-ups. A variant's time is the median over
rounds, then the maximum over ranks. The whole block on one GPU (rank 0 alone, before the rounds) gives the
scaling. Rank 0 prints a markdown table (ms, ratio to compiled DTensor TP+SP) and the breakdown of jitfuse
TP and TP+SP: hidden share = (T_compute + T_comm - T) / T_comm, scaling = T_one_gpu / T. A variant that
raises on any rank is dropped on every rank (an all-reduced flag) and reported with its error.
`arnorm`: inference (eval, no_grad) all-reduce + residual add + RMSNorm at decode sizes, tokens 1, 8, 32, 128 x
hidden 4096, 8192, bf16: jitfuse's fused ``Sequential(AllReduce(), AddExtraInput(), MakeExtraOutput(),
RMSNorm(h))`` called as ``model(x, residual) -> (y, new_residual)``; the same planned under
JITFUSE_PEER_ALLREDUCE=0 ("jitfuse NCCL path": its own group name, so its own sequence and plans); and the
baseline torch.distributed.all_reduce (NCCL) then jitfuse's ``Sequential(AddExtraInput(), MakeExtraOutput(),
RMSNorm(h))``. Each is checked on every rank against float64 (the sum of every rank's x, + residual, RMSNorm
with a random weight; max |err| / max |ref| < 2e-2), then timed: eager (200 calls between two CUDA events,
median of 7, interleaved) and as CUDA-graph replays (20 calls captured per graph, 10 replays per
measurement). Microseconds per call (max over ranks) and baseline / fused. Exit status 1 on any mismatch.
JF_TP_WATCHDOG=<seconds>: every rank prints its Python stacks and exits after that long (a hang).
Needs PyTorch, NCCL and JITFUSE_LIBRARY / PYTHONPATH=runtime/python as for the package.
"""
import argparse
import contextlib
import faulthandler
import os
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import jitfuse.torch as jt


def blocks(kind, h, f, tp, sp, world, dtype, recipe=None):
    kw = (lambda mode: dict(tensor_parallel=mode, sequence_parallel=sp, world_size=world)) if tp else (lambda m: {})
    if kind == "llama":
        ops = [jt.Fork("residual"), jt.RMSNorm(h), jt.Linear(h, 2 * f, **kw("column")), jt.SwiGLU(),
               jt.Linear(f, h, **kw("row")), jt.AddChannel("residual")]
    else:
        ops = [jt.Fork("residual"), jt.LayerNorm(h), jt.Linear(h, f, **kw("column")), jt.Bias(f // (world if tp else 1)),
               jt.GELU(), jt.Linear(f, h, **kw("row")), jt.Bias(h), jt.AddChannel("residual")]
    return jt.Sequential(*ops, recipe=recipe, device="cuda", dtype=dtype)


def shard_state(named, ops, kind, rank, world):
    """Megatron's shards for ``rank`` of the single-GPU block's tensors ``named`` (parameters or gradients)."""
    out = {}
    for name, p in named.items():
        idx = int(name.split(".")[0])
        op = ops[idx]
        if isinstance(op, jt.Linear):
            col = idx == 2
            if col and kind == "llama":  # [gate; up]: each half's rows r
                g, u = p.chunk(2, dim=0)
                p = torch.cat([g.chunk(world, 0)[rank], u.chunk(world, 0)[rank]])
            else:
                p = p.chunk(world, dim=0 if col else 1)[rank]
        elif isinstance(op, jt.Bias) and idx == 3:  # the column-parallel bias
            p = p.chunk(world, 0)[rank]
        out[name] = p.contiguous()
    return out


def compare(pairs, label, tol=1e-4):
    """Mismatches among (what, got, want): max |got - want| / max |want| < tol, in float64; printed by rank 0 and by
    any rank that mismatches."""
    rank, bad = dist.get_rank(), 0
    for what, got, want in pairs:
        want = want.detach().double()
        err = (got.detach().double() - want).abs().max().item() / max(want.abs().max().item(), 1e-6)
        ok = err < tol
        bad += not ok
        if not ok or rank == 0:
            print(f"rank {rank} {label}: {what} max rel err {err:.2e} {'ok' if ok else 'MISMATCH'}", flush=True)
    return bad


def any_rank_failed(bad):
    flag = torch.tensor([bad], device="cuda")
    dist.all_reduce(flag)
    return 1 if flag.item() else 0


def curves_agree(label, parallel, one, last=5, drop=0.5):
    """Training curves of the parallel model and one GPU's: ok when the means of their `last` losses are within
    1 % and the parallel loss fell by more than `drop`; printed by rank 0 and by a rank that disagrees. 0 or 1."""
    rank = dist.get_rank()
    p, o = statistics.mean(parallel[-last:]), statistics.mean(one[-last:])
    rel = abs(p - o) / o
    ok = rel < 0.01 and parallel[-1] < parallel[0] - drop
    if rank == 0 or not ok:
        print(f"rank {rank} {label}: first loss {parallel[0]:.4f}, final (mean of the last {last}) {p:.4f} against "
              f"one GPU's {o:.4f}: {rel:.2%} apart {'ok' if ok else 'MISMATCH'}", flush=True)
    return 0 if ok else 1


def check(args):
    rank, world = dist.get_rank(), dist.get_world_size()
    jt.distributed.set_process_group(None, "tp")
    bad = 0
    for kind in ("llama", "gpt2"):
        for sp in (False, True):
            torch.manual_seed(1234)
            full = blocks(kind, args.hidden, args.ffn, False, False, 1, torch.float32)
            x = torch.randn(args.tokens, args.hidden, device="cuda")
            dy = torch.randn(args.tokens, args.hidden, device="cuda")
            xf = x.clone().requires_grad_(True)
            yf = full(xf)
            yf.backward(dy)
            tp = blocks(kind, args.hidden, args.ffn, True, sp, world, torch.float32)
            tp.load_state_dict(shard_state(full.state_dict(), full._ops, kind, rank, world))
            rows = slice(rank * args.tokens // world, (rank + 1) * args.tokens // world) if sp else slice(None)
            xt = x[rows].clone().requires_grad_(True)
            yt = tp(xt)
            yt.backward(dy[rows])
            jt.distributed.allreduce_sequence_parallel_grads(tp)
            ref_grads = shard_state({n: p.grad for n, p in full.named_parameters()}, full._ops, kind, rank, world)
            pairs = [("output", yt, yf[rows]), ("grad_input", xt.grad, xf.grad[rows])]
            pairs += [(f"grad {n}", p.grad, ref_grads[n]) for n, p in tp.named_parameters()]
            bad += compare(pairs, f"{kind} TP={world}{'+SP' if sp else ''}")
            if sp:
                bad += graph_replays(tp, xt.shape, f"{kind} TP={world}+SP")
    bad += check_fp8(args, rank, world)
    return any_rank_failed(bad)


def check_fp8(args, rank, world):
    """The Llama block under fp8_current with TP+SP (its SP windows cast each operand once; the reduce-scatter
    halves run FP8 GEMMs over row blocks of the codes) against the fp32 block on one GPU, beside the same FP8 block on
    one GPU: output, input gradient and every weight gradient no further from fp32 than FP8 itself is on one GPU
    (max error / max value within twice the one-GPU FP8 block's, plus 0.02; a row block read at the wrong rows or
    with the wrong scale is off by the whole value)."""
    torch.manual_seed(1234)
    full = blocks("llama", args.hidden, args.ffn, False, False, 1, torch.float32)
    x = torch.randn(args.tokens, args.hidden, device="cuda")
    dy = torch.randn(args.tokens, args.hidden, device="cuda")
    xf = x.clone().requires_grad_(True)
    yf = full(xf)
    yf.backward(dy)
    rows = slice(rank * args.tokens // world, (rank + 1) * args.tokens // world)

    def run(model, xs, dys):
        xs = xs.bfloat16().requires_grad_(True)
        y = model(xs)
        y.backward(dys.bfloat16())
        return y, xs.grad

    one = blocks("llama", args.hidden, args.ffn, False, False, 1, torch.bfloat16, recipe="fp8_current")
    one.load_state_dict(full.state_dict(), strict=False)  # FP8 recipe state: its own
    y1, dx1 = run(one, x, dy)
    tp = blocks("llama", args.hidden, args.ffn, True, True, world, torch.bfloat16, recipe="fp8_current")
    tp.load_state_dict(shard_state(full.state_dict(), full._ops, "llama", rank, world), strict=False)
    yt, dxt = run(tp, x[rows], dy[rows])
    jt.distributed.allreduce_sequence_parallel_grads(tp)
    want = shard_state({n: p.grad for n, p in full.named_parameters()}, full._ops, "llama", rank, world)
    one_g = shard_state({n: p.grad for n, p in one.named_parameters()}, full._ops, "llama", rank, world)
    rel = lambda got, ref: (got.detach().double() - ref.detach().double()).abs().max().item() / max(
        ref.detach().abs().max().item(), 1e-6)
    pairs = [("output", yt, y1[rows], yf[rows]), ("grad_input", dxt, dx1[rows], xf.grad[rows])]
    pairs += [(f"grad {n}", p.grad, one_g[n], want[n]) for n, p in tp.named_parameters()]
    bad = 0
    for what, got, fp8_one, ref in pairs:
        e, e1 = rel(got, ref), rel(fp8_one, ref)
        ok = e <= 2 * e1 + 0.02
        bad += not ok
        if rank == 0 or not ok:
            print(f"rank {rank} llama TP={world}+SP fp8_current: {what} max rel err {e:.2e} from fp32 (the one-GPU FP8 "
                  f"block's {e1:.2e}) {'ok' if ok else 'MISMATCH'}", flush=True)
    return bad


def graph_replays(model, shape, label):
    """The block's forward (eval, no grad) captured in a CUDA graph and replayed on 3 new inputs, an eager call of
    the same input between replays (the copy-engine reduce-scatter's flags and acks as the graph recorded them,
    then as the eager call sets them): every replay equals the eager forward to 1e-6."""
    model.eval()
    pairs = []
    with torch.no_grad():
        static = torch.randn(shape, device="cuda")
        model(static)  # prepared before the capture
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            model(static)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = model(static)
        for i in range(3):
            static.copy_(torch.randn(shape, device="cuda"))
            g.replay()
            got = out.clone()
            pairs.append((f"graph replay {i}", got, model(static)))
    model.train()
    return compare(pairs, label + " graph", tol=1e-6)


def head_reference(x, w, labels, ce):
    """Float64 loss (and per-row losses for reduction none) of the whole head, as CrossEntropy defines it."""
    z = x @ w.t()
    if ce["softcap"]:
        z = ce["softcap"] * torch.tanh(z / ce["softcap"])
    keep = labels != -100
    lse = torch.logsumexp(z, dim=-1)
    zy = z.gather(1, labels.clamp(min=0)[:, None])[:, 0]
    eps = ce["label_smoothing"]
    rows = lse - (1 - eps) * zy - eps * z.mean(dim=-1) + ce["z_loss"] * lse * lse
    rows = torch.where(keep, rows, torch.zeros_like(rows))
    if ce["reduction"] == "none":
        return rows
    return rows.sum() / (keep.sum() if ce["reduction"] == "mean" else 1)


def check_head(args):
    rank, world = dist.get_rank(), dist.get_world_size()
    jt.distributed.set_process_group(None, "tp")
    h, v, n = args.hidden, args.vocab, args.tokens
    bad = 0
    settings = [dict(reduction="mean", label_smoothing=0.0, z_loss=0.0, softcap=0.0),
                dict(reduction="sum", label_smoothing=0.1, z_loss=1e-3, softcap=0.0),
                dict(reduction="mean", label_smoothing=0.0, z_loss=0.0, softcap=3.0),
                dict(reduction="none", label_smoothing=0.1, z_loss=1e-3, softcap=3.0)]  # unfused
    for ce in settings:
        for sp in (False, True):
            torch.manual_seed(4321)
            x = torch.randn(n, h, device="cuda", dtype=torch.float64)
            w = torch.randn(v, h, device="cuda", dtype=torch.float64) / h ** 0.5
            labels = torch.randint(0, v, (n,), device="cuda")
            labels[::7] = -100
            dy = torch.rand(n, device="cuda", dtype=torch.float64) if ce["reduction"] == "none" else None
            xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
            ref = head_reference(xr, wr, labels, ce)
            ref.backward(dy if dy is not None else torch.ones_like(ref))
            model = jt.Sequential(jt.Linear(h, v, tensor_parallel="column", sequence_parallel=sp, world_size=world),
                                  jt.CrossEntropy(vocab_parallel=True, chunk_mib=1, **ce),
                                  device="cuda", dtype=torch.float32)
            shard = slice(rank * v // world, (rank + 1) * v // world)
            with torch.no_grad():
                model._ops[0].weight.copy_(w[shard].float())
            rows = slice(rank * n // world, (rank + 1) * n // world) if sp else slice(None)
            xt = x[rows].float().clone().requires_grad_(True)
            loss = model(xt, labels)
            loss.backward(dy.float() if dy is not None else torch.ones_like(loss))
            pairs = [("loss", loss, ref), ("grad_input", xt.grad, xr.grad[rows]),
                     ("grad weight", model._ops[0].weight.grad, wr.grad[shard])]
            bad += compare(pairs, f"head V={v} TP={world}{'+SP' if sp else ''} {ce}")
    return any_rank_failed(bad)


# ---- shared by bench and arnorm ------------------------------------------------------------------------

def attempt(label, fn, failed):
    """fn()'s value, or None when it raised on any rank: the ranks agree through an all-reduced flag, so that
    every rank drops the same variants and runs the same collectives after. ``failed``: label -> error text."""
    if label in failed:
        return None
    out, err = None, None
    try:
        out = fn()
    except Exception as e:  # noqa: BLE001 - a variant's failure is reported, the others still run
        err = "".join(traceback.format_exception_only(type(e), e)).strip()
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__, limit=-4))
        print(f"rank {dist.get_rank()} {label}: FAILED\n{tb[-3000:]}", flush=True)
    flag = torch.tensor([0 if err is None else 1], device="cuda")
    dist.all_reduce(flag)
    if flag.item():
        failed[label] = (err or "failed on another rank").replace("\n", " ")[:300]
        return None
    return out


def events_ms(fn, reps):
    """Milliseconds between two CUDA events around ``reps`` calls of fn (launched back to back)."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def max_over_ranks(values):
    """Each value's maximum over ranks (every rank passes the same number, -1 for none)."""
    t = torch.tensor(values, dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


# ---- bench: the Llama MLP block, jitfuse vs DTensor ---------------------------------------------------------

ONE_GPU = "jitfuse one GPU (whole block, rank 0)"
COMPUTE = "jitfuse compute only (W=1, this rank's shard shapes, all tokens)"
COMM_TP = "NCCL only, TP: 2 x all_reduce [tokens, h]"
COMM_SP = "NCCL only, TP+SP: 2 x (all_gather + reduce_scatter)"
REFERENCE = "DTensor TP+SP compiled"


class TorchMLP(nn.Module):
    """Hugging Face Llama's MLP: down(silu(gate(x)) * up(x)), bias-free linears."""

    def __init__(self, h, f, **kw):
        super().__init__()
        self.gate_proj = nn.Linear(h, f, bias=False, **kw)
        self.up_proj = nn.Linear(h, f, bias=False, **kw)
        self.down_proj = nn.Linear(f, h, bias=False, **kw)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TorchLlamaBlock(nn.Module):
    """The MLP half of a Llama layer: x + mlp(rmsnorm(x)), the block jitfuse's ``blocks("llama")`` is."""

    def __init__(self, h, f, **kw):
        super().__init__()
        self.norm = nn.RMSNorm(h, eps=1e-5, **kw)
        self.mlp = TorchMLP(h, f, **kw)

    def forward(self, x):
        return x + self.mlp(self.norm(x))


def dtensor_plan(sp):
    """PyTorch's TP tutorial plan for the feed-forward (torchtitan's), sequence dim 0 of [tokens, h]: the MLP's
    input is made a DTensor once (PrepareModuleInput: TP+SP all-gathers it there, once for gate and up; TP takes
    it replicated, so the backward all-reduces the summed dgrad of gate and up once), gate and up column-wise,
    down row-wise (TP: all-reduce; TP+SP: reduce-scatter to Shard(0)); TP+SP: the norm on the token shard."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)
    seq = Shard(0) if sp else Replicate()
    plan = {"mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=seq)}
    if sp:
        plan["norm"] = SequenceParallel(sequence_dim=0)
    return plan


def train_step(model, rows, h, dt):
    """(fn, tensors): fn runs one forward + backward of ``model`` on random [rows, h]; the tensors' gradients
    are cleared before each timed step (as a training step's zero_grad(set_to_none=True))."""
    x = torch.randn(rows, h, device="cuda", dtype=dt, requires_grad=True)
    dy = torch.randn(rows, h, device="cuda", dtype=dt)

    def fn():
        model(x).backward(dy)
    return fn, [x] + list(model.parameters())


def step_ms(fn, tensors, iters, warm):
    """Median over ``iters`` (after ``warm``) of one step between two CUDA events."""
    times = []
    for i in range(warm + iters):
        for t in tensors:
            t.grad = None
        times.append(events_ms(fn, 1))
    return statistics.median(times[warm:])


def jitfuse_variants(args, world, dt):
    """(label, build) of the jitfuse variants; build() -> (fn, tensors)."""
    h, f, n = args.hidden, args.ffn, args.tokens

    def tp(sp, recipe=None):
        def build():
            torch.manual_seed(1234)
            return train_step(blocks("llama", h, f, True, sp, world, dt, recipe), n // world if sp else n, h, dt)
        return build

    def compute():
        torch.manual_seed(1234)
        return train_step(blocks("llama", h, f // world, False, False, 1, dt), n, h, dt)

    out = [("jitfuse TP", tp(False)), ("jitfuse TP+SP", tp(True))]
    if args.fp8:
        out.append(("jitfuse FP8 TP+SP (fp8_current)", tp(True, "fp8_current")))
    return out + [(COMPUTE, compute)]


def dtensor_variants(args, world, dt):
    """(label, build) of the DTensor variants: per TP / TP+SP one parallelized module, called eager and through
    torch.compile (the compiled module wraps the same parameters)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    h, f, n = args.hidden, args.ffn, args.tokens
    mesh = init_device_mesh("cuda", (world,))
    out = []
    for sp in (False, True):
        box = {}

        def model(sp=sp, box=box):
            if "m" not in box:
                torch.manual_seed(1234)
                box["m"] = parallelize_module(TorchLlamaBlock(h, f, device="cuda", dtype=dt), mesh, dtensor_plan(sp))
            return box["m"]
        rows, name = (n // world, "TP+SP") if sp else (n, "TP")
        out.append((f"DTensor {name} eager", lambda model=model, rows=rows: train_step(model(), rows, h, dt)))
        if not args.no_compile:
            out.append((f"DTensor {name} compiled",
                        lambda model=model, rows=rows: train_step(torch.compile(model()), rows, h, dt)))
    return out


def comm_variants(args, world, dt):
    """(label, build) of torch.distributed's collectives alone at the block's sizes (zeros: NCCL's time does not
    depend on the values, and repeated in-place sums stay finite)."""
    h, n = args.hidden, args.tokens

    def tp():
        full = torch.zeros(n, h, device="cuda", dtype=dt)

        def fn():
            for _ in range(2):  # forward: after the row linear; backward: the column linear's dgrad
                dist.all_reduce(full)
        return fn, []

    def sp():
        full = torch.zeros(n, h, device="cuda", dtype=dt)
        shard = torch.zeros(n // world, h, device="cuda", dtype=dt)

        def fn():
            for _ in range(2):  # forward: gather before the column linear, scatter after the row linear; backward
                dist.all_gather_into_tensor(full, shard)
                dist.reduce_scatter_tensor(shard, full)
        return fn, []
    return [(COMM_TP, tp), (COMM_SP, sp)]


def one_gpu_ms(args, dt):
    """Rank 0: the whole block on one GPU (no collectives), median of 2 * --iters; -1 if it fails."""
    try:
        torch.manual_seed(1234)
        fn, tensors = train_step(blocks("llama", args.hidden, args.ffn, False, False, 1, dt), args.tokens,
                                 args.hidden, dt)
        return step_ms(fn, tensors, 2 * args.iters, 5)
    except Exception:  # noqa: BLE001
        print(f"rank 0 {ONE_GPU}: FAILED\n{traceback.format_exc(limit=-4)}", flush=True)
        return -1.0


def bench(args):
    rank, world = dist.get_rank(), dist.get_world_size()
    jt.distributed.set_process_group(None, "tp")
    dt, failed = torch.bfloat16, {}
    one = one_gpu_ms(args, dt) if rank == 0 else -1.0
    torch.cuda.empty_cache()
    dist.barrier()
    variants = jitfuse_variants(args, world, dt)
    variants += attempt("DTensor setup", lambda: dtensor_variants(args, world, dt), failed) or []
    variants += comm_variants(args, world, dt)
    ready = []
    for label, build in variants:  # build and warm up (JIT kernels, torch.compile) before any timing
        t0 = time.time()

        def warmed(build=build):
            fn, tensors = build()
            step_ms(fn, tensors, 1, 2)
            return fn, tensors
        got = attempt(label, warmed, failed)
        if rank == 0:
            print(f"{label}: ready in {time.time() - t0:.1f} s" if got else f"{label}: dropped", flush=True)
        if got:
            ready.append((label, got))
    times = {label: [] for label, _ in variants}
    for _ in range(args.rounds):
        for label, (fn, tensors) in ready:
            ms = attempt(label, lambda: step_ms(fn, tensors, args.iters, 2), failed)
            if ms is not None:
                times[label].append(ms)
    labels = [label for label, _ in variants]
    vals = [statistics.median(times[l]) if times[l] and l not in failed else -1.0 for l in labels]
    ms = dict(zip(labels + [ONE_GPU], max_over_ranks(vals + [one])))
    if rank == 0:
        bench_report(args, world, labels + [ONE_GPU], ms, failed)
    return 0


def bench_report(args, world, labels, ms, failed):
    print(f"\n## Llama MLP block, TP={world}, tokens {args.tokens}, hidden {args.hidden}, ffn {args.ffn}, bf16, "
          f"forward + backward ({torch.cuda.get_device_name()}, torch {torch.__version__})\n"
          f"ms: median over {args.rounds} interleaved rounds of the median of {args.iters} steps, max over ranks\n")
    ref = ms.get(REFERENCE, -1.0)
    print(f"| variant | ms | ms / {REFERENCE} |\n|---|---:|---:|")
    for label in labels:
        v = ms[label]
        if v < 0:
            print(f"| {label} | failed: {failed.get(label, 'see the log')} | |")
        else:
            print(f"| {label} | {v:.3f} | {f'{v / ref:.3f}' if ref > 0 else 'n/a'} |")
    one = ms[ONE_GPU]
    print(f"\n| jitfuse | T ms | T_compute ms | T_comm ms | hidden share | scaling (one GPU / T, ideal {world}) |"
          f"\n|---|---:|---:|---:|---:|---:|")
    for label, comm in (("jitfuse TP", COMM_TP), ("jitfuse TP+SP", COMM_SP)):
        t, c, m = ms.get(label, -1.0), ms.get(COMPUTE, -1.0), ms.get(comm, -1.0)
        if min(t, c, m) <= 0:
            print(f"| {label} | n/a (a part failed) | | | | |")
            continue
        scaling = f"{one / t:.2f}x" if one > 0 else "n/a"
        print(f"| {label} | {t:.3f} | {c:.3f} | {m:.3f} | {(c + m - t) / m:.0%} | {scaling} |")
    print(f"\nT_compute: the block at world size 1 with this rank's shard shapes (Linear(h, 2f/{world}), "
          f"Linear(f/{world}, h)) on all {args.tokens} tokens; T_comm: the collectives alone (torch.distributed); "
          f"hidden share = (T_compute + T_comm - T) / T_comm")
    for label, err in failed.items():
        if label not in labels:
            print(f"failed: {label}: {err}")
    sys.stdout.flush()


# ---- arnorm: all-reduce + residual + RMSNorm at decode sizes -------------------------------------------------

AR_TOKENS, AR_HIDDEN = (1, 8, 32, 128), (4096, 8192)
PEER_ENV = "JITFUSE_PEER_ALLREDUCE"
NCCL_GROUP = "tp_nccl"  # the NCCL-path sequence's group: another key, so not the fused sequence's plans
FUSED, NCCL_PATH, BASELINE = "jitfuse fused", "jitfuse NCCL path", "NCCL + jitfuse norm"
AR_VARIANTS = (BASELINE, FUSED, NCCL_PATH)


@contextlib.contextmanager
def peer_allreduce_off():
    """JITFUSE_PEER_ALLREDUCE=0 while the NCCL-path sequence is built and planned (its first call per shape)."""
    old = os.environ.get(PEER_ENV)
    os.environ[PEER_ENV] = "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(PEER_ENV, None)
        else:
            os.environ[PEER_ENV] = old


def arnorm_models(h, dt):
    """{label: (inference Sequential, context of its first call per shape)} and the norm weight (random, the
    same on every rank). Identical Sequentials share one sequence (the key is a hash of the ops), so the NCCL
    path's all-reduce names its own group (the same ranks registered again): its own sequence and plans."""
    weight = (1 + 0.5 * torch.randn(h, generator=torch.Generator().manual_seed(0))).to("cuda", dt)

    def norm():
        return [jt.AddExtraInput(), jt.MakeExtraOutput(), jt.RMSNorm(h)]
    fused = jt.Sequential(jt.AllReduce(), *norm(), name="ar_norm", device="cuda", dtype=dt)
    with peer_allreduce_off():
        nccl = jt.Sequential(jt.AllReduce(group=NCCL_GROUP), *norm(), name="ar_norm_nccl", device="cuda", dtype=dt)
    base = jt.Sequential(*norm(), name="norm", device="cuda", dtype=dt)
    for m in (fused, nccl, base):
        m.eval()
        m._ops[-1].weight.copy_(weight)
    models = {BASELINE: (base, contextlib.nullcontext), FUSED: (fused, contextlib.nullcontext),
              NCCL_PATH: (nccl, peer_allreduce_off)}
    return models, weight


def arnorm_call(label, model):
    """model(x, residual) -> (y, new residual) of a variant; the baseline all-reduces x in place first."""
    if label == BASELINE:
        return lambda x, r: (dist.all_reduce(x), model(x, r))[1]
    return model


def arnorm_reference(x, res, weight, eps, world):
    """Float64: h = sum over ranks of x + residual, y = h rsqrt(mean(h^2) + eps) weight."""
    xs = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(xs, x)
    h = sum(v.double() for v in xs) + res.double()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.double(), h


def arnorm_check(models, weight, x, res, t, h, failed):
    """Checks each variant on (x, res) against float64 (its first call at this shape: it plans); mismatches and
    failures."""
    rank, bad = dist.get_rank(), 0
    want_y, want_h = arnorm_reference(x, res, weight, models[FUSED][0]._ops[-1].eps, dist.get_world_size())
    for label, (model, ctx) in models.items():
        def one():
            xc = x.clone()
            with ctx():
                y, new_res = arnorm_call(label, model)(xc, res)
            torch.cuda.synchronize()
            if label != BASELINE and rank == 0 and not torch.equal(xc, x):
                print(f"note: {label} changed its input x in place (tokens {t}, hidden {h})", flush=True)
            return compare([("y", y, want_y), ("new residual", new_res, want_h)],
                           f"{label} tokens {t} hidden {h}", tol=2e-2)
        got = attempt(f"{label} tokens {t} hidden {h}", one, failed)
        bad += 1 if got is None else got
    return bad


def arnorm_time(fns, reps, per_call, us, prefix, failed):
    """Interleaved: 7 times, each variant's ``reps`` calls of fn between two CUDA events; the median in
    microseconds per call (``per_call`` calls per fn) into us[prefix + (label,)]."""
    got = {label: [] for label in fns}
    for _ in range(7):
        for label, fn in fns.items():
            ms = attempt(" ".join(map(str, prefix + (label,))), lambda: events_ms(fn, reps), failed)
            if ms is not None:
                got[label].append(ms * 1000.0 / (reps * per_call))
    for label, v in got.items():
        if len(v) == 7:
            us[prefix + (label,)] = statistics.median(v)


def capture(fn, calls):
    """A CUDA graph of ``calls`` calls of fn (warmed up on a side stream first, as torch.cuda.graph asks;
    thread_local: the NCCL watchdog thread's event queries during the capture do not invalidate it)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        for _ in range(calls):
            fn()
    g.replay()  # the first replay uploads the graph: not timed
    torch.cuda.synchronize()
    return g


def arnorm_case(models, weight, t, h, failed, us):
    """One (tokens, hidden): check every variant, then time them eager and as CUDA-graph replays."""
    rank, dt = dist.get_rank(), torch.bfloat16
    res = torch.randn(t, h, generator=torch.Generator().manual_seed(0)).to("cuda", dt)  # every rank's
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(1000 + rank)).to("cuda", dt)  # this rank's
    bad = arnorm_check(models, weight, x, res, t, h, failed)
    bufs = {label: (torch.zeros_like(x) if label == BASELINE else x.clone()) for label in models}
    fns = {}  # zeros for the baseline's in-place all-reduce (NCCL's time does not depend on the values)
    for label, (model, _) in models.items():
        if f"{label} tokens {t} hidden {h}" not in failed:
            call, buf = arnorm_call(label, model), bufs[label]
            fns[label] = lambda call=call, buf=buf: call(buf, res)
    for label, fn in fns.items():
        attempt(f"eager tokens {t} hidden {h} {label}", lambda: [fn() for _ in range(20)], failed)
    live = {label: fn for label, fn in fns.items() if f"eager tokens {t} hidden {h} {label}" not in failed}
    arnorm_time(live, 200, 1, us, ("eager", t, h), failed)
    graphs = {}
    for label, fn in live.items():
        g = attempt(f"graph tokens {t} hidden {h} {label}", lambda: capture(fn, 20), failed)
        if g is not None:
            graphs[label] = g.replay
    arnorm_time(graphs, 10, 20, us, ("graph", t, h), failed)
    del graphs
    torch.cuda.synchronize()
    return bad


def arnorm_report(us, failed):
    keys = list(us)  # the same keys in the same order on every rank (failures are agreed on)
    vals = dict(zip(keys, max_over_ranks([us[k] for k in keys])))
    if dist.get_rank():
        return
    print(f"\n## all-reduce + residual + RMSNorm, TP={dist.get_world_size()}, bf16, inference "
          f"({torch.cuda.get_device_name()}, torch {torch.__version__}); us per call, median of 7, max over ranks")
    for mode, what in (("eager", "eager: 200 calls between two events"), ("graph", "CUDA graph: 20 calls per "
                                                                                   "graph, 10 replays")):
        print(f"\n{what}\n\n| tokens | hidden | {' | '.join(AR_VARIANTS)} | {BASELINE} / {FUSED} |\n"
              f"|---:|---:|{'---:|' * (len(AR_VARIANTS) + 1)}")
        for h in AR_HIDDEN:
            for t in AR_TOKENS:
                cells = [vals.get((mode, t, h, v)) for v in AR_VARIANTS]
                text = [f"{c:.1f}" if c is not None else "failed" for c in cells]
                base, fused = cells[0], cells[1]
                speed = f"{base / fused:.2f}x" if base and fused else "n/a"
                print(f"| {t} | {h} | {' | '.join(text)} | {speed} |")
    for label, err in failed.items():
        print(f"failed: {label}: {err}")
    sys.stdout.flush()


def arnorm(args):
    rank = dist.get_rank()
    jt.distributed.set_process_group(None, "tp")
    jt.distributed.set_process_group(None, NCCL_GROUP)  # the same ranks under a second name (the NCCL path)
    if rank == 0 and os.environ.get(PEER_ENV) is not None:
        print(f"note: {PEER_ENV}={os.environ[PEER_ENV]} is set for the whole run: '{FUSED}' is planned under it",
              flush=True)
    bad, failed, us = 0, {}, {}
    with torch.no_grad():
        for h in AR_HIDDEN:
            built = attempt(f"build hidden {h}", lambda: arnorm_models(h, torch.bfloat16), failed)
            if built is None:
                bad += 1
                continue
            for t in AR_TOKENS:
                bad += arnorm_case(built[0], built[1], t, h, failed, us)
            del built
            torch.cuda.empty_cache()
    arnorm_report(us, failed)
    return any_rank_failed(bad)


class HfTpMLP(torch.nn.Module):
    """A Hugging Face Llama MLP as this rank's tensor-parallel jitfuse Sequential: column-parallel [gate_r; up_r],
    SwiGLU, row-parallel down[:, r] (its all-reduce inserted by jitfuse); world 1: the plain swap."""

    def __init__(self, mlp, world, rank, name, sp=False):
        super().__init__()
        f, h = mlp.gate_proj.weight.shape
        self.sp = sp and world > 1
        kw = (lambda m: dict(tensor_parallel=m, world_size=world, sequence_parallel=self.sp)) if world > 1 else \
            (lambda m: {})
        self.seq = jt.Sequential(jt.Linear(h, 2 * f, **kw("column")), jt.SwiGLU(), jt.Linear(f, h, **kw("row")),
                                 device="cuda", dtype=mlp.gate_proj.weight.dtype, name=name)
        rows = slice(rank * f // world, (rank + 1) * f // world)
        with torch.no_grad():
            self.seq[0].weight.copy_(torch.cat([mlp.gate_proj.weight[rows], mlp.up_proj.weight[rows]]))
            self.seq[2].weight.copy_(mlp.down_proj.weight[:, rows])

    def forward(self, hs):
        x = hs.reshape(-1, hs.shape[-1])
        if not self.sp:
            return self.seq(x).reshape(hs.shape)
        # Sequence parallelism inside the MLP of a replicated model: this rank's token shard in, every rank's out.
        return FromShard.apply(self.seq(ToShard.apply(x))).reshape(hs.shape)


class ToShard(torch.autograd.Function):
    """This rank's rows of a tensor every rank holds whole; backward: every rank's rows of the gradient gathered."""

    @staticmethod
    def forward(ctx, x):
        w, r = dist.get_world_size(), dist.get_rank()
        n = x.shape[0] // w
        return x[r * n:(r + 1) * n].contiguous()

    @staticmethod
    def backward(ctx, g):
        out = torch.empty((g.shape[0] * dist.get_world_size(),) + tuple(g.shape[1:]), device=g.device, dtype=g.dtype)
        dist.all_gather_into_tensor(out, g.contiguous())
        return out


class FromShard(torch.autograd.Function):
    """Every rank's rows gathered (the replicated model after the MLP); backward: this rank's rows of the gradient
    (every rank computed the same whole gradient)."""

    @staticmethod
    def forward(ctx, y):
        out = torch.empty((y.shape[0] * dist.get_world_size(),) + tuple(y.shape[1:]), device=y.device, dtype=y.dtype)
        dist.all_gather_into_tensor(out, y.contiguous())
        return out

    @staticmethod
    def backward(ctx, g):
        w, r = dist.get_world_size(), dist.get_rank()
        n = g.shape[0] // w
        return g[r * n:(r + 1) * n].contiguous()


def hf_llama(world, rank, sp=False):
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=704, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=4, vocab_size=512, max_position_embeddings=128)
    m = transformers.LlamaForCausalLM(cfg).to("cuda", torch.float32)
    for i, layer in enumerate(m.model.layers):
        layer.mlp = HfTpMLP(layer.mlp, world, rank, f"hf_tp_mlp_w{world}{'_sp' if sp else ''}_{i}", sp)
    return m


def train(args):
    """An HF Llama (fp32, random init) with tensor-parallel jitfuse MLPs, 100 AdamW steps on 4 batches cycled, on
    every rank, against the same model with the whole MLPs on one GPU (each rank runs both): the final loss (mean
    of the last 5 steps) within 1 %. The other parameters are replicated and see the same gradients on every rank
    (the row-parallel all-reduce makes the MLP outputs whole), so they need no all-reduce."""
    rank, world = dist.get_rank(), dist.get_world_size()
    jt.distributed.set_process_group(None, "tp")
    gen = torch.Generator(device="cuda").manual_seed(7)
    batches = [torch.randint(0, 512, (4, 64), device="cuda", generator=gen) for _ in range(4)]
    curves = {}
    for w in (1, world):
        model = hf_llama(w, rank if w > 1 else 0, args.sp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        curve = []
        for step in range(args.steps):
            ids = batches[step % len(batches)]
            opt.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            curve.append(loss.item())
        curves[w] = curve
    label = f"HF Llama TP={world}{'+SP' if args.sp else ''}, {args.steps} AdamW steps"
    return any_rank_failed(curves_agree(label, curves[world], curves[1]))


SIZES = {"bench": (4096, 14336, 8192)}  # --hidden, --ffn, --tokens when not given; the others: 256, 1024, 512


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["check", "head", "bench", "arnorm", "train"])
    ap.add_argument("--steps", type=int, default=100, help="train: AdamW steps")
    ap.add_argument("--vocab", type=int, default=1000, help="head: the vocabulary (a multiple of the world size)")
    ap.add_argument("--hidden", type=int, default=None, help="default 256 (bench: 4096)")
    ap.add_argument("--ffn", type=int, default=None, help="default 1024 (bench: 14336)")
    ap.add_argument("--tokens", type=int, default=None, help="default 512 (bench: 8192)")
    ap.add_argument("--rounds", type=int, default=5, help="bench: interleaved rounds")
    ap.add_argument("--iters", type=int, default=20, help="bench: timed steps per variant per round")
    ap.add_argument("--fp8", action="store_true", help="bench: also jitfuse TP+SP under recipe fp8_current")
    ap.add_argument("--no-compile", action="store_true", help="bench: skip the torch.compile'd DTensor variants")
    ap.add_argument("--sp", action="store_true", help="train: sequence-parallel MLPs (this rank's tokens in each)")
    args = ap.parse_args()
    for name, value in zip(("hidden", "ffn", "tokens"), SIZES.get(args.mode, (256, 1024, 512))):
        if getattr(args, name) is None:
            setattr(args, name, value)
    if os.environ.get("JF_TP_WATCHDOG"):  # seconds: every rank prints its Python stacks and exits after them
        faulthandler.dump_traceback_later(int(os.environ["JF_TP_WATCHDOG"]), exit=True)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    try:
        rc = {"check": check, "head": check_head, "bench": bench, "arnorm": arnorm, "train": train}[args.mode](args)
    finally:
        dist.destroy_process_group()
    sys.exit(rc)


if __name__ == "__main__":
    main()
