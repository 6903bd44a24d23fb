// The FP8 recipe-state update kernels as text templates, which codegen fills in (codegen/src/fp8_update.cpp)
// and appends to the source of the cast kernel they follow; the device helpers they call are in ops/fp8.cuh.
// Not a header: embedded into jf_codegen only. "// @section NAME" starts a section (its trailing blank lines
// are dropped); ${name} is a value codegen substitutes, and a line that is only ${name} takes a whole section.
//   current_amax   fp8_current, after the amax pass: the maximum of its per-block partials
//   delayed        fp8_delayed, one quantize op's state (it holds scale_inv, written here)
//   delayed_batch  fp8_delayed, every FP8 GEMM operand/output state of a pass in one launch (block b: state b)
//   history_roll   the body the two delayed kernels share (1024 threads; `hist` and `len` in scope): reduce the
//                  partials into this call's amax, roll the history (newest first), record the amax, write
//                  scale_inv = 1 / the scale used, then the next scale from the history's maximum

// @section current_amax
// fp8_current: amax_history[0] = max over the blocks' partial amax (the cast pass reads it)
extern "C" __global__ void __launch_bounds__(1024) ${kernel}(const float* __restrict__ part, int count, float* __restrict__ hist) {
  const float m = jf_amax_reduce(part, count);
  if (threadIdx.x == 0) hist[0] = m;
}

// @section delayed
// fp8_delayed (${format}): roll the amax history, record this call's amax, scale_inv = 1 / the scale used,
// scale = ${format_max} / max(history) / 2^margin for the next call. One thread per history entry (len <= 1024).
extern "C" __global__ void __launch_bounds__(1024) ${kernel}(const float* __restrict__ part, int count, float* __restrict__ hist, int len, float* __restrict__ scale, float* __restrict__ scale_inv) {
  __shared__ float jf_sm[32];
${history_roll}
}

// @section delayed_batch
// fp8_delayed (${format}): for each state b of this pass (block b): roll its amax history, record the
// pass's amax, scale = ${format_max} / max(history) / 2^margin for the next call (the cast kernels wrote the
// scale_inv they used; an FP8 GEMM output's scale_inv is written here). One thread per history entry
// (len <= 1024).
struct JfFp8Batch { const float* part[${batch}]; float* hist[${batch}]; float* scale[${batch}]; float* scale_inv[${batch}]; int count[${batch}]; int n; int len; };
extern "C" __global__ void __launch_bounds__(1024) ${kernel}(const JfFp8Batch b) {
  __shared__ float jf_sm[32];
  const int t = blockIdx.x;
  if (t >= b.n) return;
  float* __restrict__ hist = b.hist[t];
  const int len = b.len;
${history_roll}
}

// @section history_roll
  const float a = jf_amax_reduce(${part}, ${count});  // thread 0
  const int i = threadIdx.x;
  const float keep = i + 1 < len ? hist[i] : 0.f;
  float m = keep;
  __syncthreads();
  if (i + 1 < len) hist[i + 1] = keep;
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if ((threadIdx.x & 31) == 0) jf_sm[threadIdx.x >> 5] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int k = 0; k < 32; ++k) m = fmaxf(m, jf_sm[k]);
    m = fmaxf(m, a);
    hist[0] = a;
    ${if_scale_inv}${scale_inv} = 1.f / ${scale};
    ${scale} = jf_fp8_scale_of<${e5m2}>(m, ${margin_pow2});
  }
