"""What the scripts of tools/torch_baselines share: GPU timing with CUDA events, host timing of a call,
and C ABI argument blocks built from torch tensors (DLTensors, tensor arrays, jf_param arrays) for calling
jf_forward / jf_backward through ctypes with the arguments built once. Imported by its siblings (the
directory of a script run as `python3 tools/torch_baselines/x.py` is on sys.path)."""
import ctypes
import statistics
import time

import torch

import jitfuse._abi as abi

DL_DTYPE = {torch.bfloat16: (abi.kDLBfloat, 16), torch.float16: (abi.kDLFloat, 16),
            torch.float32: (abi.kDLFloat, 32), torch.uint8: (abi.kDLUInt, 8), torch.int64: (abi.kDLInt, 64)}
if hasattr(torch, "float8_e4m3fn"):
    DL_DTYPE[torch.float8_e4m3fn] = (abi.kDLFloat8_e4m3fn, 8)
TORCH_DTYPE = {(code, bits, 1): t for t, (code, bits) in DL_DTYPE.items()}  # a DLPack (code, bits, lanes)


def median_ms(fn, warmup=10, iters=50):
    """GPU time per call as jitfuse bench measures it: CUDA events around each call, calls enqueued back to
    back after `warmup` untimed ones, the median of `iters`."""
    for _ in range(warmup):
        fn()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ev)


def host_us(fn, batches, batch=8, warmup=16):
    """Host time alone, µs per call: `batches` batches of `batch` calls (few enough launches that the launch
    queue never fills and the GPU is never what a call waits for), each timed from the first call's start
    to the last call's return, synchronised outside the timing; the median over batches."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    res = []
    for _ in range(max(1, batches)):
        t = time.perf_counter_ns()
        for _ in range(batch):
            fn()
        res.append((time.perf_counter_ns() - t) / batch / 1e3)
        torch.cuda.synchronize()
    return statistics.median(res)


class ArgBlocks:
    """C ABI argument blocks over torch tensors; everything made is kept alive in self.keep."""

    def __init__(self):
        self.keep = []

    def dl(self, t):
        shape = (ctypes.c_int64 * t.dim())(*t.shape)
        d = abi.DLTensor()
        d.data = t.data_ptr()
        d.device = abi.DLDevice(abi.kDLCUDA, t.device.index or 0)
        d.ndim = t.dim()
        code, bits = DL_DTYPE[t.dtype]
        d.dtype = abi.DLDataType(code, bits, 1)
        d.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
        self.keep += [shape, d]
        return ctypes.pointer(d)

    def arr(self, ts):
        a = (ctypes.POINTER(abi.DLTensor) * max(len(ts), 1))()
        for i, t in enumerate(ts):
            a[i] = self.dl(t)
        self.keep.append(a)
        return ctypes.cast(a, ctypes.POINTER(ctypes.POINTER(abi.DLTensor)))

    def parr(self, names, ts):
        a = (abi.jf_param * max(len(ts), 1))()
        for i, ((op, n), t) in enumerate(zip(names, ts)):
            a[i].op_index, a[i].name, a[i].tensor = op, n, self.dl(t)
        self.keep.append(a)
        return ctypes.cast(a, ctypes.POINTER(abi.jf_param))


class TrainingCall(ArgBlocks):
    """jf_forward / jf_backward of one prepared training shape, their arguments built once over fresh torch
    tensors (outputs, saved buffer, workspaces, gradient buffers; dy and the extra outputs' gradients from
    ``rnd(shape)``), so that a call through ctypes does nothing else. The caller sets ``cdll``, ``lib`` (the
    jitfuse.lib.Library, for the error text) and ``handle`` (the jf_sequence), then calls :meth:`build`."""

    def build(self, info, fws_bytes, names, x, extras, params, rnd):
        """info: the training ProgramInfo; fws_bytes: the forward workspace (the larger of training and
        inference, so that both run with it); names: (op_index, name bytes) of each parameter."""
        dev = x.device
        out = torch.empty(info.outputs[0].shape, dtype=TORCH_DTYPE[info.outputs[0].dl_dtype], device=dev)
        eouts = [torch.empty(o.shape, dtype=x.dtype, device=dev) for o in info.outputs[1:]]
        saved = torch.empty(max(info.saved_bytes, 1), dtype=torch.uint8, device=dev)
        fws = torch.empty(max(fws_bytes, 1), dtype=torch.uint8, device=dev)
        bws = torch.empty(max(info.backward_workspace_bytes, 1), dtype=torch.uint8, device=dev)
        gx = torch.empty_like(x)
        gextras = [torch.empty_like(e) for e in extras]
        grads = [torch.zeros_like(p) for p in params]
        dy = rnd(out.shape)
        deo = [rnd(o.shape) for o in eouts]
        self.keep += [x, extras, params, grads, out, eouts, saved, fws, bws, gx, gextras, dy, deo]
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
        self.out, self.gx, self.grads = out, gx, grads

    def forward(self):
        st = self.cdll.jf_forward(self.handle, ctypes.byref(self.fa), ctypes.byref(self.saved_h), self.stream)
        assert st == 0, self.lib.last_error()

    def backward(self):
        st = self.cdll.jf_backward(self.handle, ctypes.byref(self.ba), self.stream)
        assert st == 0, self.lib.last_error()
