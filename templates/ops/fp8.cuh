// FP8 (E4M3) casts and the per-tensor amax reduction that feeds their scales. The conversion is done
// with integer operations (round to nearest even, saturating at +-448, NaN kept as NaN), so the same
// kernel compiles for every arch and matches runtime/reference bit for bit.
#pragma once

#define JF_E4M3_MAX 448.f

__device__ __forceinline__ unsigned char jf_to_e4m3(float x) {
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
}

// Stores 8 values times `scale` as E4M3 bytes. VEC: p is 8-byte aligned (one 8-byte store).
template <bool VEC>
__device__ __forceinline__ void jf_store8_e4m3(unsigned char* __restrict__ p, const float (&v)[8], float scale, int n = 8) {
  if (VEC) {
    jf_u32 lo = 0, hi = 0;
#pragma unroll
    for (int e = 0; e < 4; ++e) lo |= (jf_u32)jf_to_e4m3(v[e] * scale) << (8 * e);
#pragma unroll
    for (int e = 0; e < 4; ++e) hi |= (jf_u32)jf_to_e4m3(v[4 + e] * scale) << (8 * e);
    *reinterpret_cast<uint2*>(p) = make_uint2(lo, hi);
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

// Folds this thread's amax into *amax (every thread of the block calls it) (a non-negative float: its bits order like unsigned integers, so
// the result does not depend on the order the blocks arrive in).
__device__ __forceinline__ void jf_amax_flush(float am, float* amax) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, o));
  if (((threadIdx.x + threadIdx.y * blockDim.x) & 31) == 0 && am > 0.f) atomicMax(reinterpret_cast<unsigned int*>(amax), __float_as_uint(am));
}

// scale = 448 / amax / 2^margin; 1 while amax is 0 (nothing seen yet) or not finite.
__device__ __forceinline__ float jf_fp8_scale(float amax, float margin_pow2) {
  return (amax > 0.f && amax < 3.0e38f) ? JF_E4M3_MAX / amax / margin_pow2 : 1.f;
}
