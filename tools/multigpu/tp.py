"""Tensor parallelism on several GPUs (docs/parallel.md): numerics and bench of jitfuse's parallel MLP blocks.

Launch one process per GPU:

    torchrun --nproc-per-node 2 tools/multigpu/tp.py check            # TP=2 and TP=2+SP vs one GPU
    torchrun --nproc-per-node 2 tools/multigpu/tp.py head             # the vocab-parallel LM head vs float64
    torchrun --nproc-per-node 8 tools/multigpu/tp.py bench --hidden 4096 --tokens 8192

`check`: every rank builds the single-GPU Llama and GPT-2 MLP blocks from one seed, cuts Megatron's shards
out of their weights (column: rows of the weight, a gated op's gate and up halves each; row: columns), runs
the tensor-parallel Sequential on its token shard (SP) or on all tokens (TP alone) and compares output,
input gradient and every weight gradient with the single-GPU sequence's (the sequence-parallel parameters'
gradients after their all-reduce). Exit status 1 on any mismatch.
`head`: the language-model head split by vocabulary (``Linear(tensor_parallel="column")`` then
``CrossEntropy(vocab_parallel=True)``), joint (chunked) and unfused (``reduction="none"``), TP and TP+SP, with
ignored rows, label smoothing, z-loss and soft-capping, against PyTorch's float64 loss and gradients of the
whole head (this rank's rows of dW). Exit status 1 on any mismatch.
`bench`: forward + backward of the TP MLP block per rank, CUDA events, median of 50 after 10 warm-ups,
against the same block on one GPU with the whole weights (rank 0 prints).
Needs PyTorch, NCCL and JITFUSE_LIBRARY / PYTHONPATH=runtime/python as for the package.
"""
import argparse
import faulthandler
import os
import statistics
import sys

import torch
import torch.distributed as dist

import jitfuse.torch as jt


def blocks(kind, h, f, tp, sp, world, dtype):
    kw = (lambda mode: dict(tensor_parallel=mode, sequence_parallel=sp, world_size=world)) if tp else (lambda m: {})
    if kind == "llama":
        ops = [jt.Fork("residual"), jt.RMSNorm(h), jt.Linear(h, 2 * f, **kw("column")), jt.SwiGLU(),
               jt.Linear(f, h, **kw("row")), jt.AddChannel("residual")]
    else:
        ops = [jt.Fork("residual"), jt.LayerNorm(h), jt.Linear(h, f, **kw("column")), jt.Bias(f // (world if tp else 1)),
               jt.GELU(), jt.Linear(f, h, **kw("row")), jt.Bias(h), jt.AddChannel("residual")]
    return jt.Sequential(*ops, device="cuda", dtype=dtype)


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


def compare(pairs, label):
    """Mismatches among (what, got, want): max |got - want| / max |want| < 1e-4, in float64; printed by rank 0 and by
    any rank that mismatches."""
    rank, bad = dist.get_rank(), 0
    for what, got, want in pairs:
        want = want.detach().double()
        err = (got.detach().double() - want).abs().max().item() / max(want.abs().max().item(), 1e-6)
        ok = err < 1e-4
        bad += not ok
        if not ok or rank == 0:
            print(f"rank {rank} {label}: {what} max rel err {err:.2e} {'ok' if ok else 'MISMATCH'}", flush=True)
    return bad


def any_rank_failed(bad):
    flag = torch.tensor([bad], device="cuda")
    dist.all_reduce(flag)
    return 1 if flag.item() else 0


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
    return any_rank_failed(bad)


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


def bench(args):
    rank, world = dist.get_rank(), dist.get_world_size()
    jt.distributed.set_process_group(None, "tp")
    dt = torch.bfloat16

    def timed(model, x, dy):
        times = []
        for i in range(60):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            y = model(x)
            y.backward(dy)
            b.record()
            b.synchronize()
            if i >= 10:
                times.append(a.elapsed_time(b))
        return statistics.median(times)

    for kind in ("llama", "gpt2"):
        for sp in (False, True):
            tp = blocks(kind, args.hidden, args.ffn, True, sp, world, dt)
            rows = args.tokens // world if sp else args.tokens
            x = torch.randn(rows, args.hidden, device="cuda", dtype=dt, requires_grad=True)
            dy = torch.randn(rows, args.hidden, device="cuda", dtype=dt)
            ms = timed(tp, x, dy)
            if rank == 0:
                print(f"{kind} TP={world}{'+SP' if sp else ''} tokens {args.tokens} hidden {args.hidden} ffn "
                      f"{args.ffn}: {ms:.3f} ms per forward+backward", flush=True)
        if rank == 0:
            one = blocks(kind, args.hidden, args.ffn, False, False, 1, dt)
            x = torch.randn(args.tokens, args.hidden, device="cuda", dtype=dt, requires_grad=True)
            print(f"{kind} one GPU: {timed(one, x, torch.randn_like(x)):.3f} ms", flush=True)
        dist.barrier()
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["check", "head", "bench"])
    ap.add_argument("--vocab", type=int, default=1000, help="head: the vocabulary (a multiple of the world size)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=512)
    args = ap.parse_args()
    if os.environ.get("JF_TP_WATCHDOG"):  # seconds: every rank prints its Python stacks and exits after them
        faulthandler.dump_traceback_later(int(os.environ["JF_TP_WATCHDOG"]), exit=True)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    try:
        rc = {"check": check, "head": check_head, "bench": bench}[args.mode](args)
    finally:
        dist.destroy_process_group()
    sys.exit(rc)


if __name__ == "__main__":
    main()
