"""Host time per call of two builds of libjitfuse.so, A/B in one process (issue 12).

Host timings on the GPU machine move by tens of percent from one process to the next (the same library,
even PyTorch eager), which hides a change of a few microseconds between two processes. Here both
libraries are loaded into one process (two dlopen handles, one CUDA context), each with its own context
and sequences, and their calls are interleaved: per round, every case is timed with A then B (B then A
in odd rounds), and the report gives the median and minimum over rounds and the median of the per-round
ratios B/A.

A case is timed as the host time of jf_forward / jf_backward alone (arguments built once, through
ctypes): batches of 8 calls, timed from the first call's start to the last one's return, synchronised
outside the timing (so the GPU, which runs these small problems in microseconds, is never what a call
waits for); the median over the batches.

  python3 tools/torch_baselines/host_ab.py OLD/libjitfuse.so NEW/libjitfuse.so [--rounds 12] [--json out]
"""
import argparse
import json
import statistics

import torch

from jitfuse import lib as jl
from _harness import TrainingCall, host_us

DEV = "cuda"
DT = torch.bfloat16


def cases(h, m=16):
    mlp = [{"op": "layernorm", "eps": 1e-5}, {"op": "linear", "in_features": h, "out_features": 4 * h}, {"op": "bias"},
           {"op": "gelu", "approximate": "tanh"}, {"op": "linear", "in_features": 4 * h, "out_features": h},
           {"op": "bias"}, {"op": "add_extra_input"}]
    out = {"bias+gelu": ([{"op": "bias"}, {"op": "gelu", "approximate": "tanh"}], "bf16", 0), "mlp": (mlp, "bf16", 1)}
    if m % 16 == 0:  # FP8 GEMMs need the row count a multiple of 16
        out["mlp fp8_delayed"] = (mlp, "fp8_delayed", 1)
    return out


class Case(TrainingCall):
    """One sequence of one library, prepared for (m, h) in training and inference, arguments built once."""

    def __init__(self, library, name, ops, recipe, n_extra, m, h):
        super().__init__()
        self.ctx = jl.Context(lib=library)
        self.seq = jl.Sequence.from_ops(self.ctx, ops, recipe=recipe, name=name.replace(" ", "_").replace("+", "_"))
        self.cdll = library.cdll
        self.lib = library
        shape = (m, h)
        info = self.seq.info(shape, True)
        inf = self.seq.info(shape, False)
        g = torch.Generator(device=DEV).manual_seed(0)
        rnd = lambda s: (torch.randn(s, device=DEV, dtype=torch.float32, generator=g) * 0.5).to(DT)  # noqa: E731
        x = rnd(shape)
        extras = [rnd(shape) for _ in range(n_extra)]
        params = [rnd(p.shape) for p in info.params]
        names = [(p.op_index, p.name.encode()) for p in info.params]
        self.handle = self.seq.handle
        self.build(info, max(info.forward_workspace_bytes, inf.forward_workspace_bytes), names, x, extras, params, rnd)

    def set_training(self, on):
        self.fa.training = 1 if on else 0



def pieces(c):
    def fwd_train():
        c.set_training(True)
        c.forward()

    def fwd_inf():
        c.set_training(False)
        c.forward()

    def bwd():
        c.set_training(True)
        c.backward()
    return {"jf_forward (training)": fwd_train, "jf_forward (inference)": fwd_inf, "jf_backward": bwd}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("a", help="libjitfuse.so A (before)")
    ap.add_argument("b", help="libjitfuse.so B (after)")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--m", type=int, default=16)
    ap.add_argument("--h", type=int, default=1024)
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.cuda.init()
    torch.empty(1, device=DEV)
    libs = {"A": jl.load_library(a.a), "B": jl.load_library(a.b)}
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, M={a.m}, cols={a.h}")
    print(f"A: {a.a} ({libs['A'].version}), B: {a.b} ({libs['B'].version})")
    built = {k: {n: Case(lib, n, *spec, a.m, a.h) for n, spec in cases(a.h, a.m).items()} for k, lib in libs.items()}
    # Same results from both (the first calls): outputs and gradients of one forward + backward.
    for n in cases(a.h, a.m):
        ca, cb = built["A"][n], built["B"][n]
        for c in (ca, cb):
            c.set_training(True)
            c.forward()
            c.backward()
        torch.cuda.synchronize()
        same = torch.equal(ca.out, cb.out) and torch.equal(ca.gx, cb.gx) and all(
            torch.equal(x, y) for x, y in zip(ca.grads, cb.grads))
        print(f"  {n}: A and B outputs and gradients bit-identical after one step: {same}")
    res = {}
    for r in range(a.rounds):
        order = ["A", "B"] if r % 2 == 0 else ["B", "A"]
        for n in cases(a.h, a.m):
            for piece in pieces(built["A"][n]):
                for k in order:
                    res.setdefault((n, piece), {}).setdefault(k, []).append(host_us(pieces(built[k][n])[piece], batches=60))
    out = []
    print(f"\nhost us per call, {a.rounds} rounds (A then B, alternating order):")
    print("| case | call | A median (min) | B median (min) | B/A, median of rounds |")
    print("|---|---|---:|---:|---:|")
    for (n, piece), v in res.items():
        ra = [y / x for x, y in zip(v["A"], v["B"])]
        row = {"case": n, "call": piece, "A": v["A"], "B": v["B"], "A_median": statistics.median(v["A"]),
               "B_median": statistics.median(v["B"]), "A_min": min(v["A"]), "B_min": min(v["B"]),
               "ratio_median": statistics.median(ra)}
        out.append(row)
        print(f"| {n} | {piece} | {row['A_median']:.2f} ({row['A_min']:.2f}) | {row['B_median']:.2f} "
              f"({row['B_min']:.2f}) | {row['ratio_median']:.3f} |", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
