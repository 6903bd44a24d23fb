"""Expert parallelism on several GPUs (docs/parallel.md#expert-parallelism): the dropless expert block with
``MoEDispatch`` / ``MoECombine`` around this rank's experts, against float64 and one GPU.

Launch one process per GPU:

    torchrun --nproc-per-node 2 tools/multigpu/ep.py check     # every rank's outputs and gradients vs float64
    torchrun --nproc-per-node 2 tools/multigpu/ep.py train     # a small MoE LM, 60 AdamW steps vs one GPU
    torchrun --nproc-per-node 2 tools/multigpu/ep.py hf        # HF Mixtral with hf.apply(expert_parallel="ep")
    torchrun --nproc-per-node 2 tools/multigpu/ep.py bench     # Mixtral-like block: EP vs one GPU, NCCL alone

`check`: E experts (default 8, top-2), every rank its own tokens (a different seed per rank) and routing
(skewed: expert 0 takes about a third of the slots; the last expert none), the same full expert weights on every
rank from one seed, this rank's experts ``[r E/W, (r+1) E/W)`` cut out of them. The block
``MoEPermute, MoEDispatch, GroupedLinear(E/W, h, 2f), SwiGLU, GroupedLinear(E/W, f, h), MoECombine, MoEUnpermute``
runs forward and backward; the reference is the float64 MoE of every rank's tokens (all-gathered) with the full
weights: this rank's output, dx and dprobs, and the gradients of this rank's experts (summed over every rank's
tokens). fp32 (tolerance 1e-4) and bf16 (3e-2), and a ``max_rows`` below the rows routed (every rank must fail
with the same error, then run the next call); the padded layout (capacity = the mean rows per expert: the hot
expert drops slots, GShard's first-come order in the reference) in fp32, and in a CUDA graph (3 replays with new
tokens and routing equal to the eager call); ranks with different token counts (fp32), and one rank's default
``max_rows`` overflowing while another's would not (every rank fails alike). Exit status 1 on any mismatch.
`train [--checkpoint] [--compile]`: a two-layer MoE language model (embedding, per layer a router (torch) and the
jitfuse block with the residual, RMSNorm, head) on W x 4 batches; every rank trains on its own batch (data parallel) with its experts
(expert parallel): non-expert gradients averaged over ranks, expert gradients divided by W (each rank's loss
reaches every expert). The reference is the same model with all experts on one GPU on the concatenated batch.
Final loss (mean of the last 5 steps) within 1 %. --checkpoint runs each EP layer under torch.utils.checkpoint
(non-reentrant: the backward recomputes the layer, its dispatch and combine exchanges included, on every rank in
the same order); --compile runs the EP model under torch.compile (Inductor around the jitfuse blocks).
`hf`: a 2-layer Hugging Face Mixtral (fp32, from a config) with ``jitfuse.torch.hf.apply(model,
expert_parallel="ep")`` (every rank keeps its experts) against the unmodified model, every rank on its own
tokens: logits, gradients (this rank's experts' against the all-reduced full gradients), greedy generate() of 8
tokens, and 20 AdamW steps (DP + EP) against the unmodified model on every rank's batch (within 1 %); with
--checkpoint the EP model trains under HF's gradient checkpointing (non-reentrant).
`bench`: forward + backward (bf16) of the expert block at --tokens per rank x --hidden, --experts, top --topk, ffn
--ffn (default Mixtral-8x7B: 8192 x 4096, 8 experts, top-2, 14336): EP at W ranks (each rank its tokens, E/W
experts; the default max_rows W T k, and 1.25 T k); the whole block on one GPU (all experts, the same tokens per GPU: the same GEMM work per GPU); and
torch.distributed.all_to_all_single of the permuted rows there and back (the exchange alone, forward +
backward). Interleaved rounds, CUDA events, median; the maximum over ranks.
Needs PyTorch, NCCL and JITFUSE_LIBRARY / PYTHONPATH=runtime/python as for the package.
"""
import argparse
import faulthandler
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import jitfuse.torch as jt
from jitfuse.bench import time_cuda  # CUDA events around each call, median after the warm-up

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tp import any_rank_failed, curves_agree  # noqa: E402  (tools/multigpu/tp.py: the same checks' helpers)


def routing(tokens, experts, topk, gen, skew=True):
    """(indices [T, k] int64, probs [T, k] fp32): distinct experts per token; skewed: the first slot is expert 0
    for about a third of the tokens, the last expert never chosen."""
    live = experts - 1 if skew and experts > topk + 1 else experts
    scores = torch.rand(tokens, live, device="cuda", generator=gen)
    if skew:
        scores[torch.rand(tokens, device="cuda", generator=gen) < 0.33, 0] = 2.0
    idx = scores.topk(topk, dim=1).indices
    probs = torch.rand(tokens, topk, device="cuda", generator=gen) + 0.1
    return idx, (probs / probs.sum(1, keepdim=True)).float()


def block(h, f, experts, topk, world, dtype, name, max_rows=None, w1=None, w2=None, capacity=None):
    """The expert block: expert-parallel over `world` ranks (world > 1 or EP wanted: dispatch and combine), or
    all experts here (world 0); `capacity`: the padded layout (fixed rows per rank and expert)."""
    local = experts // max(world, 1)
    ops = [jt.MoEPermute(experts, topk) if capacity is None else
           jt.MoEPermute(experts, topk, layout="padded", capacity=capacity)]
    if world:
        ops.append(jt.MoEDispatch(group="ep", max_rows=max_rows))
    ops += [jt.GroupedLinear(local, h, 2 * f, weight=w1), jt.SwiGLU(), jt.GroupedLinear(local, f, h, weight=w2)]
    if world:
        ops.append(jt.MoECombine(group="ep"))
    ops.append(jt.MoEUnpermute())
    return jt.Sequential(*ops, device="cuda", dtype=dtype, name=name)


def reference(x, idx, probs, w1, w2, dy):
    """float64 MoE and its gradients: (y, dx, dprobs, dw1, dw2)."""
    x, probs = x.double().requires_grad_(True), probs.double().requires_grad_(True)
    w1, w2 = w1.double().requires_grad_(True), w2.double().requires_grad_(True)
    f = w2.shape[2]
    y = torch.zeros_like(x)
    for j in range(idx.shape[1]):
        for e in range(w1.shape[0]):
            rows = (idx[:, j] == e).nonzero().squeeze(1)
            if rows.numel() == 0:
                continue
            a = x[rows] @ w1[e].T
            hmid = F.silu(a[:, :f]) * a[:, f:]
            y = y.index_add(0, rows, probs[rows, j:j + 1] * (hmid @ w2[e].T))
    y.backward(dy.double())
    return y.detach(), x.grad, probs.grad, w1.grad, w2.grad


def gather(t):
    """Every rank's rows of t, concatenated in rank order (ranks may hold different row counts)."""
    n = torch.tensor([t.shape[0]], device="cuda")
    sizes = [torch.empty_like(n) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, n)
    most = max(int(x.item()) for x in sizes)
    padded = torch.zeros((most, *t.shape[1:]), dtype=t.dtype, device=t.device)
    padded[:t.shape[0]] = t
    out = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(out, padded)
    return torch.cat([o[:int(x.item())] for o, x in zip(out, sizes)])


def rel_err(got, want):
    want = want.double()
    return (got.double() - want).abs().max().item() / max(want.abs().max().item(), 1e-6)


def kept(idx, experts, capacity):
    """GShard's capacity on one rank's routing: slot (t, j) is kept when fewer than `capacity` slots before it (in
    token, then slot order) chose its expert. A float mask [T, k]."""
    keep = torch.ones(idx.shape, device=idx.device)
    if capacity is None:
        return keep
    flat = idx.reshape(-1)
    for e in range(experts):
        hit = flat == e
        keep.view(-1)[hit & (hit.cumsum(0) > capacity)] = 0
    return keep


def check_case(args, dtype, tol, capacity=None, extra=0):
    """`extra`: rank r runs tokens + extra * r tokens (ranks with different token counts)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    e, k, h, f = args.experts, args.topk, args.hidden, args.ffn
    t = args.tokens + extra * rank
    first = sum(args.tokens + extra * r for r in range(rank))  # this rank's first row among every rank's
    local = e // world
    g = torch.Generator(device="cuda").manual_seed(99)  # the same full weights on every rank
    w1 = torch.randn(e, 2 * f, h, device="cuda", generator=g) / h ** 0.5
    w2 = torch.randn(e, h, f, device="cuda", generator=g) / f ** 0.5
    mine = torch.Generator(device="cuda").manual_seed(1000 + rank)  # this rank's tokens
    x = torch.randn(t, h, device="cuda", generator=mine)
    dy = torch.randn(t, h, device="cuda", generator=mine)
    idx, probs = routing(t, e, k, mine)
    name = f"ep_check_{dtype}{'' if capacity is None else f'_cap{capacity}'}_{extra}".replace("torch.", "")
    ep = block(h, f, e, k, world, dtype, name, capacity=capacity)
    with torch.no_grad():
        ep[2].weight.copy_(w1[rank * local:(rank + 1) * local])
        ep[4].weight.copy_(w2[rank * local:(rank + 1) * local])
    xd = x.to(dtype).requires_grad_(True)
    pd = probs.clone().requires_grad_(True)
    y = ep(xd, idx, pd)
    y.backward(dy.to(dtype))
    keep = kept(idx, e, capacity)  # a dropped slot adds nothing and gets a zero gradient
    y_ref, dx_ref, dp_ref, dw1_ref, dw2_ref = reference(gather(x.to(dtype).float()), gather(idx), gather(probs * keep),
                                                        w1.to(dtype).float(), w2.to(dtype).float(),
                                                        gather(dy.to(dtype).float()))
    rows, ex = slice(first, first + t), slice(rank * local, (rank + 1) * local)
    pairs = [("y", y, y_ref[rows]), ("dx", xd.grad, dx_ref[rows]), ("dprobs", pd.grad, dp_ref[rows] * keep),
             ("dW1 (this rank's experts)", ep[2].weight.grad, dw1_ref[ex]),
             ("dW2 (this rank's experts)", ep[4].weight.grad, dw2_ref[ex])]
    bad = 0
    for what, got, want in pairs:
        err = rel_err(got, want)
        bad += not err < tol
        if rank == 0 or not err < tol:
            print(f"rank {rank} EP={world} {dtype}{'' if capacity is None else f' padded, capacity {capacity}'}"
                  f"{f', {t} tokens here' if extra else ''}: {what} max rel err {err:.2e} "
                  f"{'ok' if err < tol else 'MISMATCH'}", flush=True)
    return bad


def check_uneven_overflow(args):
    """Ranks with different token counts (rank r: tokens x (r + 1)) that all route to rank 0's experts: rank 0's
    default max_rows (W x its own permuted rows) overflows while rank 1's would not; every rank must fail with the
    same error (none may wait in the exchange), then run the next call."""
    rank, world = dist.get_rank(), dist.get_world_size()
    e, k, h, f = args.experts, args.topk, args.hidden, args.ffn
    t = args.tokens * (rank + 1)
    local = e // world
    mine = torch.Generator(device="cuda").manual_seed(5000 + rank)
    x = torch.randn(t, h, device="cuda", generator=mine)
    idx = torch.rand(t, local, device="cuda", generator=mine).argsort(1)[:, :k]  # rank 0's experts only
    probs = torch.full((t, k), 1.0 / k, device="cuda")
    msg = ""
    try:
        block(h, f, e, k, world, torch.float32, "ep_uneven")(x, idx, probs)
    except Exception as err:  # noqa: BLE001 - the error is what is checked
        msg = str(err)
    ok = "rank 0's experts got" in msg and "max_rows" in msg
    roomy = block(h, f, e, k, world, torch.float32, "ep_uneven_roomy", max_rows=world * args.tokens * world * k)
    ok = ok and bool(torch.isfinite(roomy(x, idx, probs)).all())
    if rank == 0 or not ok:
        print(f"rank {rank} EP={world}, {t} tokens here: one rank's max_rows too small -> every rank "
              f"{'failed alike, then ran: ok' if ok else 'MISMATCH'}: {msg[:240]}", flush=True)
    return 0 if ok else 1


def check_graph(args):
    """The padded expert-parallel block (fixed rows per rank and expert) in inference, captured in a CUDA graph on
    every rank: a replay with new tokens and routing equals the eager call bit for bit."""
    rank, world = dist.get_rank(), dist.get_world_size()
    e, k, h, f, t = args.experts, args.topk, args.hidden, args.ffn, args.tokens
    ep = block(h, f, e, k, world, torch.bfloat16, "ep_graph", capacity=t * k // e).eval()
    mine = torch.Generator(device="cuda").manual_seed(4000 + rank)
    x = torch.randn(t, h, device="cuda", generator=mine).bfloat16()
    idx, probs = routing(t, e, k, mine)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(s):
        for _ in range(2):
            ep(x, idx, probs)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(g):
        y = ep(x, idx, probs)
    bad = 0
    for rep in range(3):
        x.copy_(torch.randn(t, h, device="cuda", generator=mine))
        i2, p2 = routing(t, e, k, mine)
        idx.copy_(i2)
        probs.copy_(p2)
        g.replay()
        with torch.no_grad():
            want = ep(x, idx, probs)
        bad += not torch.equal(y, want)
    print(f"rank {rank} EP={world} padded block in a CUDA graph: 3 replays with new routing "
          f"{'equal to eager' if not bad else 'MISMATCH'}", flush=True)
    return bad


def check_overflow(args):
    """A max_rows below what the routing sends: every rank fails with the same error; the next call runs."""
    rank, world = dist.get_rank(), dist.get_world_size()
    e, k, h, f, t = args.experts, args.topk, args.hidden, args.ffn, args.tokens
    small = block(h, f, e, k, world, torch.float32, "ep_small", max_rows=t * k // (2 * world))
    mine = torch.Generator(device="cuda").manual_seed(2000 + rank)
    x = torch.randn(t, h, device="cuda", generator=mine)
    idx, probs = routing(t, e, k, mine, skew=True)
    msg = ""
    try:
        small(x, idx, probs)
    except Exception as err:  # noqa: BLE001 - the error is what is checked
        msg = str(err)
    ok = "max_rows" in msg and "raise it" in msg
    full = block(h, f, e, k, world, torch.float32, "ep_after")
    ok = ok and bool(torch.isfinite(full(x, idx, probs)).all())
    if rank == 0 or not ok:
        print(f"rank {rank} EP={world}: max_rows too small -> {'ok' if ok else 'MISMATCH'}: {msg[:300]}", flush=True)
    return 0 if ok else 1


def check(args):
    jt.distributed.set_process_group(None, "ep")
    cap = args.tokens * args.topk // args.experts  # the mean: the hot expert drops slots
    bad = (check_case(args, torch.float32, 1e-4) + check_case(args, torch.bfloat16, 3e-2) + check_overflow(args)
           + check_case(args, torch.float32, 1e-4, capacity=cap) + check_graph(args)
           + check_case(args, torch.float32, 1e-4, extra=40) + check_uneven_overflow(args))
    return any_rank_failed(bad)


class MoELayer(nn.Module):
    """x + MoE(rmsnorm(x)) with a torch router (softmax, top-k, renormalised) and the jitfuse expert block."""

    def __init__(self, h, f, experts, topk, world, rank, name):
        super().__init__()
        self.topk = topk
        self.norm = nn.RMSNorm(h, eps=1e-5, device="cuda")
        self.router = nn.Linear(h, experts, bias=False, device="cuda")
        self.experts = block(h, f, experts, topk, world, torch.float32, name)
        self.world, self.rank = world, rank

    def forward(self, x):
        hs = self.norm(x).reshape(-1, x.shape[-1])
        p = torch.softmax(self.router(hs).float(), dim=-1)
        probs, idx = p.topk(self.topk, dim=-1)
        probs = probs / probs.sum(-1, keepdim=True)
        return x + self.experts(hs, idx, probs).reshape(x.shape)


class MoELM(nn.Module):
    def __init__(self, vocab, h, f, experts, topk, world, rank, layers=2, checkpoint=False):
        super().__init__()
        self.checkpoint = checkpoint  # each layer's activations recomputed in the backward (non-reentrant)
        self.embed = nn.Embedding(vocab, h, device="cuda")
        self.layers = nn.ModuleList(MoELayer(h, f, experts, topk, world, rank, f"ep_lm_w{world}_{i}")
                                    for i in range(layers))
        self.norm = nn.RMSNorm(h, eps=1e-5, device="cuda")
        self.head = nn.Linear(h, vocab, bias=False, device="cuda")

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False) if self.checkpoint else layer(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))


def lm(args, world, rank):
    """The model from seed 0; with world > 0 this rank's experts cut out of the full ones."""
    torch.manual_seed(0)
    full = MoELM(args.vocab, args.hidden, args.ffn, args.experts, args.topk, 0, 0)
    if not world:
        return full
    ep = MoELM(args.vocab, args.hidden, args.ffn, args.experts, args.topk, world, rank, checkpoint=args.checkpoint)
    ep.load_state_dict({k: v for k, v in full.state_dict().items() if ".experts." not in k}, strict=False)
    local = slice(rank * (args.experts // world), (rank + 1) * (args.experts // world))
    with torch.no_grad():
        for mine, whole in zip(ep.layers, full.layers):  # the grouped linears: ops 2, 4 here, 1, 3 there
            mine.experts[2].weight.copy_(whole.experts[1].weight[local])
            mine.experts[4].weight.copy_(whole.experts[3].weight[local])
    return ep


def train(args):
    rank, world = dist.get_rank(), dist.get_world_size()
    jt.distributed.set_process_group(None, "ep")
    gen = torch.Generator(device="cuda").manual_seed(7)
    batches = [[torch.randint(0, args.vocab, (4, 64), device="cuda", generator=gen) for _ in range(world)]
               for _ in range(4)]
    curves = {}
    for w in (0, world):
        model = lm(args, w, rank)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        # --compile: the EP model's forward under torch.compile (Inductor around the jitfuse blocks; the
        # reference stays eager)
        run = torch.compile(model) if w and args.compile else model
        curve = []
        for step in range(args.steps):
            group = batches[step % len(batches)]
            opt.zero_grad(set_to_none=True)
            loss = run(group[rank] if w else torch.cat(group))
            loss.backward()
            if w:
                ep_grads(model, w)
                both = loss.detach().clone()
                dist.all_reduce(both)
                loss = both / w
            opt.step()
            curve.append(loss.item())
        curves[w] = curve
    how = "".join(f", {k}" for k in ("checkpoint", "compile") if getattr(args, k))
    return any_rank_failed(curves_agree(f"MoE LM EP={world}{how}, {args.steps} AdamW steps", curves[world], curves[0]))


def hf_mixtral():
    """A 2-layer Mixtral (fp32, random init from seed 0; transformers' fused experts)."""
    import transformers
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=4, vocab_size=512,
                                     num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=128)
    return transformers.MixtralForCausalLM(cfg).to("cuda", torch.float32)


def ep_grads(model, world):
    """Data parallel + expert parallel: non-expert gradients averaged over ranks, expert gradients / W."""
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        if ".experts." not in name:
            dist.all_reduce(p.grad)
        p.grad /= world


def check_hf(args):
    """An unmodified HF Mixtral against the same model after ``hf.apply(model, expert_parallel="ep")`` on every
    rank (its own tokens): logits, the loss's gradients (this rank's experts' summed over every rank's tokens),
    greedy generate(), and 20 AdamW steps (DP + EP) against one GPU on every rank's batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    jt.distributed.set_process_group(None, "ep")
    ref, ep = hf_mixtral(), hf_mixtral()
    report = jt.hf.apply(ep, expert_parallel="ep")
    swapped = [e for e in report.entries if e.kind == "experts" and e.swapped and "expert-parallel" in e.what]
    bad = 0 if len(swapped) == 2 else 1
    local = slice(rank * 8 // world, (rank + 1) * 8 // world)
    gen = torch.Generator(device="cuda").manual_seed(1000 + rank)
    ids = torch.randint(0, 512, (2, 32), device="cuda", generator=gen)
    out_ep, out_ref = ep(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
    out_ep.loss.backward()
    out_ref.loss.backward()
    pairs = [("logits", out_ep.logits, out_ref.logits)]
    full = dict(ref.named_parameters())
    for name, p in ep.named_parameters():
        want = full[name].grad
        if ".experts." in name:
            want = want.clone()
            dist.all_reduce(want)  # every rank's tokens reach this rank's experts
            want = want[local]
        if name.endswith(("layers.0.mlp.experts.gate_up_proj", "layers.1.mlp.experts.down_proj", "layers.0.mlp.gate.weight",
                          "embed_tokens.weight", "layers.1.self_attn.q_proj.weight")):
            pairs.append((f"d {name}", p.grad, want))
    for what, got, want in pairs:
        err = rel_err(got, want)
        bad += not err < 1e-3
        if rank == 0 or not err < 1e-3:
            print(f"rank {rank} HF Mixtral EP={world}: {what} max rel err {err:.2e} {'ok' if err < 1e-3 else 'MISMATCH'}",
                  flush=True)
    prompt = ids[:1, :8]
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        same = torch.equal(ep.generate(prompt, **kw), ref.generate(prompt, **kw))
    bad += not same
    print(f"rank {rank} HF Mixtral EP={world}: greedy generate() of 8 tokens {'equal' if same else 'MISMATCH'}",
          flush=True)
    # The padded layout (expert_capacity: fixed rows per rank and expert, CUDA-graph capturable); a factor of
    # E / k gives every expert room for every token: no drop, the unmodified model's logits.
    padded = hf_mixtral()
    jt.hf.apply(padded, expert_parallel="ep", expert_capacity=4.0)
    with torch.no_grad():
        err = rel_err(padded(input_ids=ids).logits, ref(input_ids=ids).logits)
    bad += not err < 1e-3
    if rank == 0 or not err < 1e-3:
        print(f"rank {rank} HF Mixtral EP={world}, expert_capacity 4 (padded): logits max rel err {err:.2e} "
              f"{'ok' if err < 1e-3 else 'MISMATCH'}", flush=True)
    bad += hf_train(args, rank, world)
    return any_rank_failed(bad)


def hf_train(args, rank, world):
    gen = torch.Generator(device="cuda").manual_seed(7)
    batches = [[torch.randint(0, 512, (2, 32), device="cuda", generator=gen) for _ in range(world)] for _ in range(4)]
    curves = {}
    jt.distributed.set_process_group(None, "ep")
    for w in (0, world):
        model = hf_mixtral()
        if w:
            jt.hf.apply(model, expert_parallel="ep")
            if args.checkpoint:  # HF's own: each decoder layer recomputed in the backward, exchanges included
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        curve = []
        for step in range(20):
            group = batches[step % len(batches)]
            opt.zero_grad(set_to_none=True)
            ids = group[rank] if w else torch.cat(group)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            if w:
                ep_grads(model, w)
                loss = loss.detach().clone()
                dist.all_reduce(loss)
                loss /= w
            opt.step()
            curve.append(loss.item())
        curves[w] = curve
    how = ", gradient checkpointing" if args.checkpoint else ""
    return curves_agree(f"HF Mixtral EP={world}{how}, 20 AdamW steps", curves[world], curves[0], last=3, drop=0.0)


def bench(args):
    rank, world = dist.get_rank(), dist.get_world_size()
    jt.distributed.set_process_group(None, "ep")
    e, k, h, f, t, dt = args.experts, args.topk, args.hidden, args.ffn, args.tokens, torch.bfloat16
    mine = torch.Generator(device="cuda").manual_seed(3000 + rank)
    x = (torch.randn(t, h, device="cuda", generator=mine) * 0.5).to(dt).requires_grad_(True)
    dy = torch.randn(t, h, device="cuda", generator=mine).to(dt)
    idx, probs = routing(t, e, k, mine, skew=False)
    probs.requires_grad_(True)
    variants = {}
    ep = block(h, f, e, k, world, dt, "ep_bench")
    variants[f"jitfuse EP={world} ({e // world} experts per GPU)"] = lambda: ep(x, idx, probs).backward(dy)
    bound = (t * k * 5 // 4 + 7) // 8 * 8
    ep_b = block(h, f, e, k, world, dt, "ep_bench_bound", max_rows=bound)
    variants[f"jitfuse EP={world}, max_rows {bound} (1.25 T k)"] = lambda: ep_b(x, idx, probs).backward(dy)
    one = block(h, f, e, k, 0, dt, "ep_bench_one")
    variants["jitfuse one GPU (all experts, same tokens per GPU)"] = lambda: one(x, idx, probs).backward(dy)
    rows = torch.randn(t * k, h, device="cuda", dtype=dt)
    back = torch.empty_like(rows)

    def exchange():  # the permuted rows there and back, twice (forward and backward), even splits
        for _ in range(2):
            dist.all_to_all_single(back, rows)
            dist.all_to_all_single(rows, back)
    variants["torch all_to_all_single alone (4 x T k rows)"] = exchange
    for fn in variants.values():
        fn()
    torch.cuda.synchronize()
    ms = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            for p in (x, probs, *ep.parameters(), *ep_b.parameters(), *one.parameters()):
                p.grad = None
            dist.barrier()
            ms[name].append(time_cuda(fn, args.iters, warmup=3))
    med = torch.tensor([statistics.median(v) for v in ms.values()], dtype=torch.float64, device="cuda")
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"\nexpert block fwd+bwd, bf16, {t} tokens per GPU x hidden {h}, {e} experts top-{k}, ffn {f}, "
              f"W={world} ({torch.cuda.get_device_name()}); ms, max over ranks of the median of {args.rounds} rounds")
        base = med[list(variants).index("jitfuse one GPU (all experts, same tokens per GPU)")].item()
        for name, v in zip(variants, med.tolist()):
            print(f"| {name} | {v:.3f} | {v / base:.3f}x one GPU |")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["check", "train", "hf", "bench"])
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=None, help="default 128 (bench: 4096)")
    ap.add_argument("--ffn", type=int, default=None, help="default 192 (bench: 14336)")
    ap.add_argument("--tokens", type=int, default=None, help="per rank; default 384 (bench: 8192)")
    ap.add_argument("--vocab", type=int, default=512, help="train")
    ap.add_argument("--steps", type=int, default=60, help="train: AdamW steps")
    ap.add_argument("--checkpoint", action="store_true",
                    help="train: each EP layer under torch.utils.checkpoint; hf: HF's gradient checkpointing")
    ap.add_argument("--compile", action="store_true", help="train: the EP model under torch.compile")
    ap.add_argument("--rounds", type=int, default=5, help="bench: interleaved rounds")
    ap.add_argument("--iters", type=int, default=10, help="bench: timed steps per variant per round")
    args = ap.parse_args()
    for name, small, big in (("hidden", 128, 4096), ("ffn", 192, 14336), ("tokens", 384, 8192)):
        if getattr(args, name) is None:
            setattr(args, name, big if args.mode == "bench" else small)
    if os.environ.get("JF_TP_WATCHDOG"):
        faulthandler.dump_traceback_later(int(os.environ["JF_TP_WATCHDOG"]), exit=True)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    try:
        rc = {"check": check, "train": train, "hf": check_hf, "bench": bench}[args.mode](args)
    finally:
        dist.destroy_process_group()
    sys.exit(rc)


if __name__ == "__main__":
    main()
