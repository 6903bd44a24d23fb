#!/usr/bin/env bash
# One GPU run of everything issue 32's table needs (docs/benchmarks.md, "Memory-bound kernels"): the
# memory-bound rows of `jitfuse bench`, the PyTorch eager / torch.compile timings of the same kernels from
# the same process tree (tools/torch_baselines/memory_bound.py), and Nsight Compute's DRAM throughput,
# registers and occupancy of each generated kernel. On the GPU machine, from the checkout, after a build:
#   tools/bench_memory_bound.sh [OUT_DIR]        (default: bench-out/; BUILD=build, ITERS=100)
# NCU_TIMEOUT (default 240 s) bounds each ncu run.
# Writes bench.txt, torch.json (+ torch.log), microbench_norm_{fwd,bwd}.txt and ncu_<case>.csv; a missing
# torch, nvcc or ncu skips its part and says so. Nothing here is timed by tests: numbers go to docs/benchmarks.md by hand, with the GPU
# and the date.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${1:-bench-out}"
build="${BUILD:-build}"
iters="${ITERS:-100}"
jf="$build/tools/jitfuse"
mkdir -p "$out"
if [[ ! -x $jf ]]; then
  echo "bench_memory_bound: $jf not found: build first (cmake --build $build)" >&2
  exit 2
fi
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
cases=(layernorm rmsnorm layernorm_fp8_delayed layernorm_fp8_current bias_dropout_add cast_transpose)

nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader > "$out/gpu.txt" 2>&1
status=0
for c in "${cases[@]}"; do
  echo "== jitfuse bench --case $c" | tee -a "$out/bench.txt"
  "$jf" bench --case "$c" --iters "$iters" >> "$out/bench.txt" 2>&1 || status=1
done

if python3 -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
  # the baselines' harness imports jitfuse's Python package (session 32's run lost them without this)
  PYTHONPATH="$PWD/runtime/python${PYTHONPATH:+:$PYTHONPATH}" JITFUSE_LIBRARY="${JITFUSE_LIBRARY:-$PWD/$build/runtime/libjitfuse.so}" \
  timeout 300 python3 tools/torch_baselines/memory_bound.py --json "$out/torch.json" > "$out/torch.log" 2>&1 || status=1
else
  echo "bench_memory_bound: no PyTorch with CUDA here: the eager/compile baselines are skipped" | tee "$out/torch.log"
fi

# The hand-written variants of the norm kernels (tools/microbench): prebuilt in $MB (build them where nvcc
# is quick: nvcc -O3 -std=c++17 -arch=sm_90a tools/microbench/norm_fwd.cu -o build/mb/norm_fwd, same for
# norm_bwd), else built here when nvcc is found; MICROBENCH=0 skips them.
mb="${MB:-$build/mb}"
if [[ ${MICROBENCH:-1} != 0 ]]; then
  nvcc="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"
  for m in norm_fwd norm_bwd; do
    if [[ ! -x $mb/$m && -x $nvcc ]]; then
      mkdir -p "$mb" && "$nvcc" -O3 -std=c++17 -arch=sm_90a "tools/microbench/$m.cu" -o "$mb/$m" || status=1
    fi
    if [[ -x $mb/$m ]]; then
      timeout 300 "$mb/$m" > "$out/microbench_$m.txt" 2>&1 || status=1
    else
      echo "bench_memory_bound: no $mb/$m and no nvcc: microbenchmark $m skipped" | tee "$out/microbench_$m.txt"
    fi
  done
fi

ncu="$(command -v ncu || echo /usr/local/cuda/bin/ncu)"
if [[ -x $ncu ]]; then
  metrics=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,dram__bytes_write.sum,launch__registers_per_thread,launch__grid_size,launch__block_size,sm__warps_active.avg.pct_of_peak_sustained_active
  # <case>:<launches>: enough launches to cover each hidden size's kernels once after bench's warm-up
  for spec in layernorm:40 rmsnorm:40 layernorm_fp8_delayed:20 layernorm_fp8_current:30 bias_dropout_add:8 cast_transpose:8; do
    c=${spec%%:*}
    n=${spec##*:}
    timeout "${NCU_TIMEOUT:-240}" "$ncu" --kernel-name regex:'^jf_' --launch-count "$n" --metrics "$metrics" --csv \
      "$jf" bench --case "$c" --warmup 0 --iters 1 > "$out/ncu_$c.csv" 2> "$out/ncu_$c.log" || status=1
  done
else
  echo "bench_memory_bound: ncu not found: the DRAM throughput columns are skipped" | tee "$out/ncu.txt"
fi
exit $status
