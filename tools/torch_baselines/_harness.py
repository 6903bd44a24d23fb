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
