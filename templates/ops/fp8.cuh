// FP8 (E4M3) casts and the per-tensor amax reduction that feeds their scales. The conversion rounds to
// nearest even, saturates at +-448 and keeps NaN (runtime/reference's e4m3_bits): one PTX instruction
// on sm_89+, integer operations elsewhere.
#pragma once

#define JF_E4M3_MAX 448.f

__device__ __forceinline__ unsigned char jf_to_e4m3(float x) {
#if __CUDA_ARCH__ >= 890
  // The hardware conversion (Ada, Hopper): the same rounding and saturation as the integer path below.
  unsigned short r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.f), "f"(x));
  return (unsigned char)(r & 0xFFu);
#else
  const jf_u32 u = __float_as_uint(x);
  const jf_u32 s = (u >> 24) & 0x80u;
  const float a = fabsf(x);
  if (a != a) return (unsigned char)(s | 0x7Fu);
  if (a >= JF_E4M3_MAX) return (unsigned char)(s | 0x7Eu);
  if (a < 0.015625f) return (unsigned char)(s | (jf_u32)__float2int_rn(a * 512.f));  // subnormals: steps of 2^-9
  int e = (int)((u >> 23) & 0xFFu) - 127;
  jf_u32 m = (u & 0x7FFFFFu) >> 20;
  const jf_u32 rem = u & 0xFFFFFu;
  if (rem > 0x80000u || (rem == 0x80000u && (m & 1u))) ++m;
  if (m == 8u) { m = 0u; ++e; }
  if (e > 8 || (e == 8 && m == 7u)) return (unsigned char)(s | 0x7Eu);
  return (unsigned char)(s | ((jf_u32)(e + 7) << 3) | m);
#endif
}

// Stores 8 values times `scale` as E4M3 bytes. VEC: p is 8-byte aligned (one 8-byte store).
template <bool VEC>
__device__ __forceinline__ void jf_store8_e4m3(unsigned char* __restrict__ p, const float (&v)[8], float scale, int n = 8) {
  if (VEC) {
    jf_u32 w[2] = {0u, 0u};
#if __CUDA_ARCH__ >= 890
#pragma unroll
    for (int e = 0; e < 8; e += 2) {  // one instruction per pair: element e in the low byte
      unsigned short r;
      asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(v[e + 1] * scale), "f"(v[e] * scale));
      w[e >> 2] |= (jf_u32)r << (8 * (e & 3));
    }
#else
#pragma unroll
    for (int e = 0; e < 8; ++e) w[e >> 2] |= (jf_u32)jf_to_e4m3(v[e] * scale) << (8 * (e & 3));
#endif
    *reinterpret_cast<uint2*>(p) = make_uint2(w[0], w[1]);
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e)
      if (e < n) p[e] = jf_to_e4m3(v[e] * scale);
  }
}

__device__ __forceinline__ void jf_amax8(float& am, const float (&v)[8], int n = 8) {
#pragma unroll
  for (int e = 0; e < 8; ++e)
    if (e < n) am = fmaxf(am, fabsf(v[e]));
}

// Writes the block's amax (max over every thread's `am`) to part[block]: one partial per block, reduced
// by a one-block kernel afterwards, so the result does not depend on block order and no block waits on
// a same-address atomic (one atomicMax per warp measured 0.087 ms for layernorm + delayed cast on an
// H200, against 0.044 ms now; docs/benchmarks.md). Every thread of the block calls it.
// VEC: the calling kernel's variant (JF_VEC). Each variant calls its own explicit specialization, so each
// has its own function-scope jf_amax_sm: one array shared by the vector and scalar entry points of a module
// changed their SASS (instruction schedule), and a function template's implicit instantiations did too;
// two plain specializations compile each kernel exactly as it compiled in a program of its own.
template <bool VEC>
__device__ __forceinline__ void jf_amax_flush(float am, float* part);
#define JF_AMAX_FLUSH_BODY                                                                    \
  {                                                                                           \
    __shared__ float jf_amax_sm[32];                                                          \
    const int lin = threadIdx.x + threadIdx.y * blockDim.x;                                   \
    _Pragma("unroll") for (int o = 16; o > 0; o >>= 1) am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, o)); \
    if ((lin & 31) == 0) jf_amax_sm[lin >> 5] = am;                                           \
    __syncthreads();                                                                          \
    if (lin == 0) {                                                                           \
      const int nw = (blockDim.x * blockDim.y + 31) >> 5;                                     \
      for (int w = 1; w < nw; ++w) am = fmaxf(am, jf_amax_sm[w]);                             \
      part[blockIdx.y * gridDim.x + blockIdx.x] = am;                                         \
    }                                                                                         \
  }
template <>
__device__ __forceinline__ void jf_amax_flush<true>(float am, float* part) JF_AMAX_FLUSH_BODY
template <>
__device__ __forceinline__ void jf_amax_flush<false>(float am, float* part) JF_AMAX_FLUSH_BODY
#undef JF_AMAX_FLUSH_BODY

// The maximum of part[0 .. count) for a block of 1024 threads; valid in thread 0. Eight independent loads
// per thread are in flight at once: one block is latency-bound, and a loop of dependent-looking loads
// cost ~20 us for 8192 partials on an H200.
__device__ __forceinline__ float jf_amax_reduce(const float* __restrict__ part, int count) {
  __shared__ float jf_red_sm[32];
  float m[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (int base = threadIdx.x; base < count; base += 8 * 1024) {
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int i = base + u * 1024;
      if (i < count) m[u] = fmaxf(m[u], part[i]);
    }
  }
#pragma unroll
  for (int u = 1; u < 8; ++u) m[0] = fmaxf(m[0], m[u]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m[0] = fmaxf(m[0], __shfl_xor_sync(0xffffffffu, m[0], o));
  if ((threadIdx.x & 31) == 0) jf_red_sm[threadIdx.x >> 5] = m[0];
  __syncthreads();
  if (threadIdx.x == 0)
    for (int w = 1; w < 32; ++w) m[0] = fmaxf(m[0], jf_red_sm[w]);
  return m[0];
}

// scale = 448 / amax / 2^margin; 1 while amax is 0 (nothing seen yet) or not finite.
__device__ __forceinline__ float jf_fp8_scale(float amax, float margin_pow2) {
  return (amax > 0.f && amax < 3.0e38f) ? JF_E4M3_MAX / amax / margin_pow2 : 1.f;
}
