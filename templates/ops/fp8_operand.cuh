// FP8 casts of GEMM operands: E5M2 (gradients) beside E4M3, as format-generic conversions, 8-code stores
// and scales. ops/fp8.cuh stays as the quantize op's kernels have always included it (its text is part of
// their sources and cache keys); kernels that cast an operand, or cast to E5M2, include this file as well.
#pragma once
#include "ops/fp8.cuh"

#define JF_E5M2_MAX 57344.f

// One float to E5M2 bits: rounded to nearest even, saturated to +-57344 (0x7B, infinities included), NaN
// kept (0x7F with the sign), subnormals in steps of 2^-16 (runtime/reference's e5m2_bits).
__device__ __forceinline__ unsigned char jf_to_e5m2(float x) {
#if __CUDA_ARCH__ >= 890
  unsigned short r;
  asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.f), "f"(x));
  return (unsigned char)(r & 0xFFu);
#else
  const jf_u32 u = __float_as_uint(x);
  const jf_u32 s = (u >> 24) & 0x80u;
  const float a = fabsf(x);
  if (a != a) return (unsigned char)(s | 0x7Fu);
  if (a >= JF_E5M2_MAX) return (unsigned char)(s | 0x7Bu);
  if (a < 6.103515625e-05f) return (unsigned char)(s | (jf_u32)__float2int_rn(a * 65536.f));  // below 2^-14
  int e = (int)((u >> 23) & 0xFFu) - 127;
  jf_u32 m = (u & 0x7FFFFFu) >> 21;
  const jf_u32 rem = u & 0x1FFFFFu;
  if (rem > 0x100000u || (rem == 0x100000u && (m & 1u))) ++m;
  if (m == 4u) { m = 0u; ++e; }
  // Below 57344 = 1.75 * 2^15 the rounding ends at 57344 at most: the code never passes 0x7B.
  return (unsigned char)(s | ((jf_u32)(e + 15) << 2) | m);
#endif
}

template <bool E5M2>
__device__ __forceinline__ unsigned char jf_to_fp8(float x) {
  return E5M2 ? jf_to_e5m2(x) : jf_to_e4m3(x);
}

template <bool E5M2>
__device__ __forceinline__ float jf_fp8_max() {
  return E5M2 ? JF_E5M2_MAX : JF_E4M3_MAX;
}

// The 8 codes of v[e] * scale: element e in byte e % 4 of w[e / 4] (the byte order of memory).
template <bool E5M2>
__device__ __forceinline__ void jf_cvt8_fp8(const float (&v)[8], float scale, jf_u32 (&w)[2]) {
  w[0] = 0u;
  w[1] = 0u;
#if __CUDA_ARCH__ >= 890
#pragma unroll
  for (int e = 0; e < 8; e += 2) {  // one instruction per pair: element e in the low byte
    unsigned short r;
    if (E5M2)
      asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(v[e + 1] * scale), "f"(v[e] * scale));
    else
      asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(v[e + 1] * scale), "f"(v[e] * scale));
    w[e >> 2] |= (jf_u32)r << (8 * (e & 3));
  }
#else
#pragma unroll
  for (int e = 0; e < 8; ++e) w[e >> 2] |= (jf_u32)jf_to_fp8<E5M2>(v[e] * scale) << (8 * (e & 3));
#endif
}

// Stores 8 codes. VEC: p is 8-byte aligned (one 8-byte store); else byte by byte, the first n.
template <bool VEC>
__device__ __forceinline__ void jf_store8_codes(unsigned char* __restrict__ p, const jf_u32 (&w)[2], int n = 8) {
  if (VEC) {
    *reinterpret_cast<uint2*>(p) = make_uint2(w[0], w[1]);
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e)
      if (e < n) p[e] = (unsigned char)(w[e >> 2] >> (8 * (e & 3)));
  }
}

// Stores 8 values times `scale` as FP8 codes of the format (jf_store8_e4m3 for either format).
template <bool E5M2, bool VEC>
__device__ __forceinline__ void jf_store8_fp8(unsigned char* __restrict__ p, const float (&v)[8], float scale, int n = 8) {
  jf_u32 w[2];
  jf_cvt8_fp8<E5M2>(v, scale, w);
  jf_store8_codes<VEC>(p, w, n);
}

// scale = the format's max / amax / 2^margin; 1 while amax is 0 (nothing seen yet) or not finite.
template <bool E5M2>
__device__ __forceinline__ float jf_fp8_scale_of(float amax, float margin_pow2) {
  return (amax > 0.f && amax < 3.0e38f) ? jf_fp8_max<E5M2>() / amax / margin_pow2 : 1.f;
}
