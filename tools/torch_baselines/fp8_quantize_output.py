"""The FP8 GEMM writing a quantized output (issue 13): `Linear -> Bias -> Quantize` under fp8_delayed
through jitfuse.torch, planned as `fp8_linear_quantize` (the GEMM writes E4M3 with D scale and AMAX_D)
or, with JITFUSE_FP8_GEMM_OUTPUT_OFF=1 in the environment of a second run, as before (the GEMM writes bf16,
a quantize kernel and its state update follow), against PyTorch's bare `torch._scaled_mm` on the same FP8
operands with bf16 and with E4M3 output.

Timing as jitfuse bench does: CUDA events around each call, calls enqueued back to back, 10 warm-up calls,
the median of 50. Run on the GPU machine (jitfuse importable, JITFUSE_LIBRARY set):
    python3 tools/torch_baselines/fp8_quantize_output.py            # the new plan
    JITFUSE_FP8_GEMM_OUTPUT_OFF=1 python3 ...                        # the old plan, same library
"""
import json
import os
import sys
import tempfile

OVERRIDE = os.environ.get("JITFUSE_FP8_GEMM_OUTPUT_OFF") == "1"
if OVERRIDE:
    # The three rules replaced by versions that never apply under FP8: the plan of before.
    d = tempfile.mkdtemp()
    rules = []
    for name, pattern in (("fp8_norm_linear_quantize", [["layernorm", "rmsnorm"], "linear", "bias?", "quantize"]),
                          ("fp8_act_linear_quantize", ["gelu", "linear", "bias?", "quantize"]),
                          ("fp8_linear_quantize", ["linear", "bias?", "quantize"])):
        rules.append({"name": name, "overrides": True, "math": "off for this measurement", "pass": "forward", "priority": 1,
                      "pattern": pattern, "conditions": {"recipes": ["fp32"]},
                      "impl": {"kind": "generated", "skeleton": "fp8_cast"}})
    with open(os.path.join(d, "off.json"), "w") as f:
        json.dump({"format": "jitfuse.rules/1", "rules": rules}, f)
    os.environ["JITFUSE_RULE_PATH"] = d

import torch  # noqa: E402

import jitfuse.torch as jt  # noqa: E402
from _harness import median_ms  # noqa: E402



def main():
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    plan = "old plan (bf16 GEMM output + quantize kernel)" if OVERRIDE else "fp8_linear_quantize"
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; jitfuse: {plan}")
    rows = []
    for M, K, N in ((8192, 4096, 4096), (8192, 4096, 16384), (8192, 16384, 4096)):
        model = jt.Sequential(jt.Linear(K, N), jt.Bias(N), jt.Quantize(), recipe="fp8_delayed", device=dev, dtype=dt)
        x = torch.randn(M, K, device=dev, dtype=dt)
        with torch.no_grad():
            t_inf = median_ms(lambda: model(x))
        if M == 8192 and K == N:
            print(repr(model))  # its fused groups: which plan ran
        x8 = x.to(torch.float8_e4m3fn)
        w8 = model[0].weight.detach().to(torch.float8_e4m3fn)
        one = torch.ones((), device=dev, dtype=torch.float32)
        bias = model[1].bias.detach()
        bare = {}
        for name, out in (("bf16", dt), ("e4m3", torch.float8_e4m3fn)):
            try:
                kw = {"scale_result": one} if out != dt else {}
                bare[name] = median_ms(lambda: torch._scaled_mm(x8, w8.t(), one, one, bias=bias if out == dt else None,
                                                                out_dtype=out, use_fast_accum=True, **kw))
            except Exception as e:  # noqa: BLE001 -- report what this PyTorch cannot do
                bare[name] = None
                print(f"  torch._scaled_mm -> {name}: {type(e).__name__}: {e}".splitlines()[0])
        tflops = 2 * M * N * K / (t_inf * 1e-3) / 1e12
        rows.append({"M": M, "K": K, "N": N, "jitfuse_ms": t_inf, "bare_bf16_ms": bare["bf16"],
                     "bare_e4m3_ms": bare["e4m3"], "plan": plan})
        fmt = lambda v: f"{v:.4f}" if v is not None else "n/a"  # noqa: E731
        print(f"{M}x{K} -> {N}: jitfuse linear+bias+quantize {t_inf:.4f} ms ({tflops:.0f} TFLOP/s); "
              f"bare _scaled_mm bf16+bias {fmt(bare['bf16'])} ms, e4m3 out {fmt(bare['e4m3'])} ms")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
