// Device helpers shared by every skeleton: dtype conversion through PTX (no CUDA headers needed, so
// NVRTC compiles with no include path), 8-element chunk I/O as 16-byte vectors, warp/block sums.
#pragma once

typedef unsigned short jf_u16;
typedef unsigned int jf_u32;
typedef unsigned long long jf_u64;
typedef long long jf_i64;

struct jf_f32 {
  typedef float storage;
  static __device__ __forceinline__ float load(float v) { return v; }
  static __device__ __forceinline__ float store(float v) { return v; }
};
struct jf_f16 {
  typedef jf_u16 storage;
  static __device__ __forceinline__ float load(jf_u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
  }
  static __device__ __forceinline__ jf_u16 store(float f) {
    jf_u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
  }
};
struct jf_bf16 {
  typedef jf_u16 storage;
  static __device__ __forceinline__ float load(jf_u16 h) { return __uint_as_float(((jf_u32)h) << 16); }
  static __device__ __forceinline__ jf_u16 store(float f) {
    jf_u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
  }
};

// Loads 8 consecutive elements. VEC: p is 16-byte aligned (16B or 2x16B loads); else scalar with bound n.
template <typename DT, bool VEC>
__device__ __forceinline__ void jf_load8(const typename DT::storage* __restrict__ p, float (&v)[8], int n = 8) {
  if (VEC) {
    if (sizeof(typename DT::storage) == 2) {
      uint4 raw = *reinterpret_cast<const uint4*>(p);
      const jf_u16* h = reinterpret_cast<const jf_u16*>(&raw);
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] = DT::load(h[e]);
    } else {
      float4 a = reinterpret_cast<const float4*>(p)[0];
      float4 b = reinterpret_cast<const float4*>(p)[1];
      v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
      v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    }
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = e < n ? DT::load(p[e]) : 0.f;
  }
}

template <typename DT, bool VEC>
__device__ __forceinline__ void jf_store8(typename DT::storage* __restrict__ p, const float (&v)[8], int n = 8) {
  if (VEC) {
    if (sizeof(typename DT::storage) == 2) {
      uint4 raw;
      jf_u16* h = reinterpret_cast<jf_u16*>(&raw);
#pragma unroll
      for (int e = 0; e < 8; ++e) h[e] = DT::store(v[e]);
      *reinterpret_cast<uint4*>(p) = raw;
    } else {
      reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
      reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
    }
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e)
      if (e < n) p[e] = DT::store(v[e]);
  }
}

// A chunk of 8 elements kept in the storage dtype: a row held in registers this way takes half the
// registers of floats for fp16/bf16, so more rows are in flight per SM (rownorm forward and backward).
// 16-bit dtypes are kept as four 32-bit words (two elements each), so each word is one register from
// the 16-byte load to the unpack: an array of eight 16-bit values let ptxas split them into a register
// apiece (layernorm backward 189-196 registers against 167 for the packed form; docs/benchmarks.md).
template <typename DT, int S = sizeof(typename DT::storage)>
struct alignas(16) jf_raw8 {
  typename DT::storage h[8];
};
template <typename DT>
struct alignas(16) jf_raw8<DT, 2> {
  jf_u32 w[4];
};
template <typename DT, bool VEC>
__device__ __forceinline__ void jf_load_raw8(const typename DT::storage* __restrict__ p, jf_raw8<DT>& r, int n = 8) {
  if constexpr (sizeof(typename DT::storage) == 2) {
    if (VEC) {
      const uint4 q = *reinterpret_cast<const uint4*>(p);
      r.w[0] = q.x; r.w[1] = q.y; r.w[2] = q.z; r.w[3] = q.w;
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const jf_u32 lo = 2 * i < n ? (jf_u32)p[2 * i] : 0u, hi = 2 * i + 1 < n ? (jf_u32)p[2 * i + 1] : 0u;
        r.w[i] = lo | (hi << 16);
      }
    }
  } else if (VEC && sizeof(typename DT::storage) == 4) {
    reinterpret_cast<float4*>(r.h)[0] = reinterpret_cast<const float4*>(p)[0];
    reinterpret_cast<float4*>(r.h)[1] = reinterpret_cast<const float4*>(p)[1];
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) r.h[e] = e < n ? p[e] : typename DT::storage(0);
  }
}
template <typename DT>
__device__ __forceinline__ void jf_unpack8(const jf_raw8<DT>& r, float (&v)[8]) {
  if constexpr (sizeof(typename DT::storage) == 2) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[2 * i] = DT::load((jf_u16)(r.w[i] & 0xffffu));
      v[2 * i + 1] = DT::load((jf_u16)(r.w[i] >> 16));
    }
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = DT::load(r.h[e]);
  }
}
template <typename DT>
__device__ __forceinline__ void jf_zero_raw8(jf_raw8<DT>& r) {
  if constexpr (sizeof(typename DT::storage) == 2) {
#pragma unroll
    for (int i = 0; i < 4; ++i) r.w[i] = 0u;
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) r.h[e] = typename DT::storage(0);
  }
}

__device__ __forceinline__ float jf_warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum over the block; every thread gets the result. `smem` holds at least 33 floats.
__device__ __forceinline__ float jf_block_sum(float v, float* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  v = jf_warp_sum(v);
  __syncthreads();
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  float t = lane < nwarps ? smem[lane] : 0.f;
  t = jf_warp_sum(t);
  return t;
}

// Two sums over the block in one reduction (one pair of barriers); every thread gets both. `smem` holds
// at least 64 floats.
__device__ __forceinline__ float2 jf_block_sum2(float a, float b, float* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  a = jf_warp_sum(a);
  b = jf_warp_sum(b);
  __syncthreads();
  if (lane == 0) {
    smem[warp] = a;
    smem[32 + warp] = b;
  }
  __syncthreads();
  float ta = lane < nwarps ? smem[lane] : 0.f, tb = lane < nwarps ? smem[32 + lane] : 0.f;
  return make_float2(jf_warp_sum(ta), jf_warp_sum(tb));
}
