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
import ctypes
import json
import statistics

import torch

import jitfuse._abi as abi
from jitfuse import lib as jl
from _harness import ArgBlocks, host_us

DEV = "cuda"
DT = torch.bfloat16
_TORCH = {(abi.kDLBfloat, 16, 1): torch.bfloat16, (abi.kDLFloat, 16, 1): torch.float16,
          (abi.kDLFloat, 32, 1): torch.float32}


def cases(h, m=16):
    mlp = [{"op": "layernorm", "eps": 1e-5}, {"op": "linear", "in_features": h, "out_features": 4 * h}, {"op": "bias"},
           {"op": "gelu", "approximate": "tanh"}, {"op": "linear", "in_features": 4 * h, "out_features": h},
           {"op": "bias"}, {"op": "add_extra_input"}]
    out = {"bias+gelu": ([{"op": "bias"}, {"op": "gelu", "approximate": "tanh"}], "bf16", 0), "mlp": (mlp, "bf16", 1)}
    if m % 16 == 0:  # FP8 GEMMs need the row count a multiple of 16
        out["mlp fp8_delayed"] = (mlp, "fp8_delayed", 1)
    return out


class Case(ArgBlocks):
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
        grads = [torch.zeros_like(p) for p in params]
        out = torch.empty(info.outputs[0].shape, dtype=_TORCH[info.outputs[0].dl_dtype], device=DEV)
        eouts = [torch.empty(o.shape, dtype=DT, device=DEV) for o in info.outputs[1:]]
        fws_bytes = max(info.forward_workspace_bytes, inf.forward_workspace_bytes)
        saved = torch.empty(max(info.saved_bytes, 1), dtype=torch.uint8, device=DEV)
        fws = torch.empty(max(fws_bytes, 1), dtype=torch.uint8, device=DEV)
        bws = torch.empty(max(info.backward_workspace_bytes, 1), dtype=torch.uint8, device=DEV)
        gx = torch.empty_like(x)
        gextras = [torch.empty_like(e) for e in extras]
        dy = rnd(out.shape)
        deo = [rnd(o.shape) for o in eouts]
        self.keep += [x, extras, params, grads, out, eouts, saved, fws, bws, gx, gextras, dy, deo]
        names = [(p.op_index, p.name.encode()) for p in info.params]
        f = self.fa = abi.jf_forward_args()
        f.input = self.dl(x)
        f.extra_inputs, f.n_extra_inputs = self.arr(extras), len(extras)
        f.output = self.dl(out)
        f.extra_outputs, f.n_extra_outputs = self.arr(eouts), len(eouts)
        f.params, f.n_params = self.parr(names, params), len(params)
        f.training = 1
        f.saved = saved.data_ptr() if info.saved_bytes else None
        f.saved_bytes = info.saved_bytes
        f.workspace = fws.data_ptr() if fws_bytes else None
        f.workspace_bytes = fws_bytes
        b = self.ba = abi.jf_backward_args()
        b.input, b.extra_inputs, b.n_extra_inputs = f.input, f.extra_inputs, f.n_extra_inputs
        b.output, b.extra_outputs, b.n_extra_outputs = f.output, f.extra_outputs, f.n_extra_outputs
        b.params, b.n_params = f.params, f.n_params
        b.saved, b.saved_bytes = f.saved, f.saved_bytes
        b.grad_output = self.dl(dy)
        b.grad_extra_outputs, b.n_grad_extra_outputs = self.arr(deo), len(deo)
        b.grad_input = self.dl(gx)
        b.grad_extra_inputs, b.n_grad_extra_inputs = self.arr(gextras), len(gextras)
        b.grads, b.n_grads = self.parr(names, grads), len(grads)
        b.workspace = bws.data_ptr() if info.backward_workspace_bytes else None
        b.workspace_bytes = info.backward_workspace_bytes
        self.stream = torch.cuda.current_stream().cuda_stream
        self.saved_h = abi.jf_saved()
        self.handle = self.seq.handle
        self.out, self.gx, self.grads = out, gx, grads

    def forward(self):
        st = self.cdll.jf_forward(self.handle, ctypes.byref(self.fa), ctypes.byref(self.saved_h), self.stream)
        assert st == 0, self.lib.last_error()

    def backward(self):
        st = self.cdll.jf_backward(self.handle, ctypes.byref(self.ba), self.stream)
        assert st == 0, self.lib.last_error()

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
