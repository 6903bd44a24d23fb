// Helpers shared by the row-norm microbenchmarks (norm_fwd.cu, norm_bwd.cu): bf16 packing, a warp sum, CUDA
// error checks and the device-to-device copy bandwidth every result is compared with.
#pragma once
#include <cuda_runtime.h>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
typedef unsigned short u16;
typedef long long i64;
static float g_copy;  // GB/s of a 1 GiB device-to-device copy, read + write (copy_gbs)
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1); } } while (0)

__device__ __forceinline__ float bf(u16 h) { return __uint_as_float(((unsigned)h) << 16); }
__device__ __forceinline__ u16 tobf(float f) { u16 h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
__device__ __forceinline__ void unpack(const uint4& raw, float (&v)[8]) {
  const u16* h = reinterpret_cast<const u16*>(&raw);
#pragma unroll
  for (int e = 0; e < 8; ++e) v[e] = bf(h[e]);
}
__device__ __forceinline__ uint4 pack(const float (&v)[8]) {
  uint4 raw; u16* h = reinterpret_cast<u16*>(&raw);
#pragma unroll
  for (int e = 0; e < 8; ++e) h[e] = tobf(v[e]);
  return raw;
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// cp.async of 16 bytes global -> shared (pred false: zero-fill), its group commit and wait.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool pred = true) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  const int n = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem), "r"(n));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

static float copy_gbs() {
  const size_t bytes = 1ull << 30;
  void *a, *b; CK(cudaMalloc(&a, bytes)); CK(cudaMalloc(&b, bytes));
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  std::vector<float> t;
  for (int i = 0; i < 12; ++i) {
    cudaEventRecord(e0); cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice); cudaEventRecord(e1);
    cudaEventSynchronize(e1); float ms; cudaEventElapsedTime(&ms, e0, e1); if (i >= 2) t.push_back(ms);
  }
  std::sort(t.begin(), t.end());
  cudaFree(a); cudaFree(b);
  return (float)(2.0 * bytes / (t[t.size() / 2] * 1e-3) / 1e9);
}
