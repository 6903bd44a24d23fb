// Microbenchmark of row-norm forward variants (bf16 layernorm/rmsnorm) against the copy bandwidth, to
// choose the codegen of skeletons/rownorm. Built and run on the GPU machine: nvcc -O3 -arch=sm_90a.
#include "common.cuh"
__device__ __forceinline__ float block_sum(float v, float* sm) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) sm[warp] = v;
  __syncthreads();
  float t = lane < nw ? sm[lane] : 0.f;
  return warp_sum(t);
}
// Two sums in one reduction (one pair of barriers).
__device__ __forceinline__ float2 block_sum2(float a, float b, float2* sm) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  a = warp_sum(a); b = warp_sum(b);
  __syncthreads();
  if (lane == 0) sm[warp] = make_float2(a, b);
  __syncthreads();
  float2 t = lane < nw ? sm[lane] : make_float2(0.f, 0.f);
  return make_float2(warp_sum(t.x), warp_sum(t.y));
}

// The statistics + output of one row held in x (float), shared by every variant.
// STATS 0: two reductions (mean, then centred squares) as codegen does today; 1: one reduction of
// (sum, sum of squares shifted by the row's first element K) -- exact enough and one barrier pair.
template <int C, int T, int NCH, bool RMS, int STATS>
__device__ __forceinline__ void finish_row(float (&x)[NCH][8], i64 r, u16* out, const u16* g, const u16* b,
                                           float* sm, float kshift) {
  float mu = 0.f, var;
  if (RMS) {
    float s2 = 0.f;
#pragma unroll
    for (int k = 0; k < NCH; ++k) for (int e = 0; e < 8; ++e) s2 += x[k][e] * x[k][e];
    var = block_sum(s2, sm) * (1.f / C);
  } else if (STATS == 0) {
    float s1 = 0.f;
#pragma unroll
    for (int k = 0; k < NCH; ++k) for (int e = 0; e < 8; ++e) s1 += x[k][e];
    mu = block_sum(s1, sm) * (1.f / C);
    float s2 = 0.f;
#pragma unroll
    for (int k = 0; k < NCH; ++k) {
      const int c0 = (k * T + (int)threadIdx.x) * 8;
      if (c0 < C) for (int e = 0; e < 8; ++e) { const float d = x[k][e] - mu; s2 += d * d; }
    }
    var = block_sum(s2, sm) * (1.f / C);
  } else {
    float s1 = 0.f, s2 = 0.f;
#pragma unroll
    for (int k = 0; k < NCH; ++k) {
      const int c0 = (k * T + (int)threadIdx.x) * 8;
      if (c0 < C) for (int e = 0; e < 8; ++e) { const float d = x[k][e] - kshift; s1 += d; s2 += d * d; }
    }
    float2 s = block_sum2(s1, s2, reinterpret_cast<float2*>(sm));
    const float m1 = s.x * (1.f / C);
    mu = kshift + m1;
    var = fmaxf(s.y * (1.f / C) - m1 * m1, 0.f);
  }
  const float rs = rsqrtf(var + 1e-5f);
#pragma unroll
  for (int k = 0; k < NCH; ++k) {
    const int c0 = (k * T + (int)threadIdx.x) * 8;
    if (c0 < C) {
      float gw[8], bw[8], v[8];
      unpack(*reinterpret_cast<const uint4*>(g + c0), gw);
      if (!RMS) unpack(*reinterpret_cast<const uint4*>(b + c0), bw);
      for (int e = 0; e < 8; ++e) v[e] = RMS ? x[k][e] * rs * gw[e] : (x[k][e] - mu) * rs * gw[e] + bw[e];
      *reinterpret_cast<uint4*>(out + r * C + c0) = pack(v);
    }
  }
}

// A: today's generated kernel: one block per row, row loaded into registers.
template <int C, int T, int NCH, int MINB, bool RMS, int STATS>
__global__ void __launch_bounds__(T, MINB) k_base(const u16* __restrict__ in, u16* __restrict__ out, i64 rows,
                                                  const u16* __restrict__ g, const u16* __restrict__ b) {
  __shared__ float sm[66];
  for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
    float x[NCH][8];
#pragma unroll
    for (int k = 0; k < NCH; ++k) {
      const int c0 = (k * T + (int)threadIdx.x) * 8;
      if (c0 < C) unpack(*reinterpret_cast<const uint4*>(in + r * C + c0), x[k]);
      else for (int e = 0; e < 8; ++e) x[k][e] = 0.f;
    }
    finish_row<C, T, NCH, RMS, STATS>(x, r, out, g, b, sm, STATS ? bf(in[r * C]) : 0.f);
  }
}

// B: persistent, the next row prefetched into registers (packed) while this one is reduced and stored.
template <int C, int T, int NCH, int MINB, bool RMS, int STATS>
__global__ void __launch_bounds__(T, MINB) k_regpf(const u16* __restrict__ in, u16* __restrict__ out, i64 rows,
                                                   const u16* __restrict__ g, const u16* __restrict__ b) {
  __shared__ float sm[66];
  uint4 nx[NCH];
  float nk = 0.f;
  i64 r = blockIdx.x;
  if (STATS && r < rows) nk = bf(in[r * C]);
#pragma unroll
  for (int k = 0; k < NCH; ++k) {
    const int c0 = (k * T + (int)threadIdx.x) * 8;
    if (c0 < C && r < rows) nx[k] = *reinterpret_cast<const uint4*>(in + r * C + c0);
  }
  for (; r < rows; r += gridDim.x) {
    float x[NCH][8];
#pragma unroll
    for (int k = 0; k < NCH; ++k) {
      const int c0 = (k * T + (int)threadIdx.x) * 8;
      if (c0 < C) unpack(nx[k], x[k]); else for (int e = 0; e < 8; ++e) x[k][e] = 0.f;
    }
    const i64 rn = r + gridDim.x;
    const float kk = nk;
    if (STATS && rn < rows) nk = bf(in[rn * C]);
#pragma unroll
    for (int k = 0; k < NCH; ++k) {
      const int c0 = (k * T + (int)threadIdx.x) * 8;
      if (c0 < C && rn < rows) nx[k] = *reinterpret_cast<const uint4*>(in + rn * C + c0);
    }
    finish_row<C, T, NCH, RMS, STATS>(x, r, out, g, b, sm, kk);
  }
}


// C: persistent, a ring of D rows in shared memory filled by cp.async (each thread copies and later reads
// only its own chunks, so no barrier guards the ring).
template <int C, int T, int NCH, int D, bool RMS, int STATS>
__global__ void __launch_bounds__(T) k_ring(const u16* __restrict__ in, u16* __restrict__ out, i64 rows,
                                            const u16* __restrict__ g, const u16* __restrict__ b) {
  __shared__ float sm[66];
  extern __shared__ uint4 ring[];  // [D][NCH][T]
  auto issue = [&](i64 row, int slot) {
#pragma unroll
    for (int k = 0; k < NCH; ++k) {
      const int c0 = (k * T + (int)threadIdx.x) * 8;
      const bool ok = c0 < C && row < rows;
      cp_async16(&ring[(slot * NCH + k) * T + threadIdx.x], in + (ok ? row * C + c0 : 0), ok);
    }
    cp_commit();
  };
#pragma unroll
  for (int d = 0; d < D - 1; ++d) issue(blockIdx.x + (i64)d * gridDim.x, d);
  int slot = 0;
  for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
    issue(r + (i64)(D - 1) * gridDim.x, (slot + D - 1) % D);
    cp_wait<D - 1>();
    float x[NCH][8];
#pragma unroll
    for (int k = 0; k < NCH; ++k) {
      const int c0 = (k * T + (int)threadIdx.x) * 8;
      if (c0 < C) unpack(ring[(slot * NCH + k) * T + threadIdx.x], x[k]); else for (int e = 0; e < 8; ++e) x[k][e] = 0.f;
    }
    finish_row<C, T, NCH, RMS, STATS>(x, r, out, g, b, sm, STATS ? __shfl_sync(0xffffffffu, x[0][0], 0) : 0.f);
    slot = (slot + 1) % D;
  }
  cp_wait<0>();
}


// B2: persistent, two rows prefetched (packed) ahead.
template <int C, int T, int NCH, bool RMS>
__global__ void __launch_bounds__(T) k_regpf2(const u16* __restrict__ in, u16* __restrict__ out, i64 rows,
                                              const u16* __restrict__ g, const u16* __restrict__ b) {
  __shared__ float sm[66];
  uint4 n1[NCH], n2[NCH];
  i64 r = blockIdx.x;
  const i64 G = gridDim.x;
#pragma unroll
  for (int k = 0; k < NCH; ++k) {
    const int c0 = (k * T + (int)threadIdx.x) * 8;
    if (c0 < C && r < rows) n1[k] = *reinterpret_cast<const uint4*>(in + r * C + c0);
    if (c0 < C && r + G < rows) n2[k] = *reinterpret_cast<const uint4*>(in + (r + G) * C + c0);
  }
  for (; r < rows; r += G) {
    float x[NCH][8];
#pragma unroll
    for (int k = 0; k < NCH; ++k) {
      const int c0 = (k * T + (int)threadIdx.x) * 8;
      if (c0 < C) unpack(n1[k], x[k]); else for (int e = 0; e < 8; ++e) x[k][e] = 0.f;
      n1[k] = n2[k];
      if (c0 < C && r + 2 * G < rows) n2[k] = *reinterpret_cast<const uint4*>(in + (r + 2 * G) * C + c0);
    }
    finish_row<C, T, NCH, RMS, 0>(x, r, out, g, b, sm, 0.f);
  }
}

// Copy kernels of the same geometry: the ceiling for this size and launch shape.
template <int C, int T, int NCH>
__global__ void __launch_bounds__(T) k_copy(const u16* __restrict__ in, u16* __restrict__ out, i64 rows,
                                            const u16* __restrict__, const u16* __restrict__) {
  for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
    uint4 v[NCH];
#pragma unroll
    for (int k = 0; k < NCH; ++k) { const int c0 = (k * T + (int)threadIdx.x) * 8; if (c0 < C) v[k] = *reinterpret_cast<const uint4*>(in + r * C + c0); }
#pragma unroll
    for (int k = 0; k < NCH; ++k) { const int c0 = (k * T + (int)threadIdx.x) * 8; if (c0 < C) *reinterpret_cast<uint4*>(out + r * C + c0) = v[k]; }
  }
}

// ---- backward: dx = rs * (g*dy - xhat * mean(g*dy*xhat) - mean(g*dy)); dgamma/dbeta partials per block.
// SMEMACC: dgamma/dbeta accumulate in shared memory (each thread owns its columns) instead of registers.
// PF: the next row's dy and x prefetched (packed) into registers.
template <int C, int T, int NCH, bool SMEMACC, bool PF>
__global__ void __launch_bounds__(T) k_bwd(const u16* __restrict__ dy, const u16* __restrict__ xs,
                                           const float* __restrict__ mean, const float* __restrict__ rstd,
                                           u16* __restrict__ dx, i64 rows, const u16* __restrict__ g,
                                           float* __restrict__ pg, float* __restrict__ pb) {
  __shared__ float sm[66];
  extern __shared__ float acc[];  // SMEMACC: [2][NCH][8][T]
  float dgam[SMEMACC ? 1 : NCH][8], dbet[SMEMACC ? 1 : NCH][8];
  if (SMEMACC) { for (int i = threadIdx.x; i < 2 * NCH * 8 * T; i += T) acc[i] = 0.f; }
  else { for (int k = 0; k < NCH; ++k) for (int e = 0; e < 8; ++e) { dgam[k][e] = 0.f; dbet[k][e] = 0.f; } }
  uint4 pdy[PF ? NCH : 1], px[PF ? NCH : 1];
  float pmu = 0.f, prs = 0.f;
  i64 r = blockIdx.x;
  if (PF && r < rows) {
#pragma unroll
    for (int k = 0; k < NCH; ++k) { const int c0 = (k * T + (int)threadIdx.x) * 8; if (c0 < C) { pdy[k] = *reinterpret_cast<const uint4*>(dy + r * C + c0); px[k] = *reinterpret_cast<const uint4*>(xs + r * C + c0); } }
    pmu = mean[r]; prs = rstd[r];
  }
  for (; r < rows; r += gridDim.x) {
    float gr[NCH][8], x[NCH][8];
    float mu, rs;
    if (PF) {
      mu = pmu; rs = prs;
#pragma unroll
      for (int k = 0; k < NCH; ++k) { unpack(pdy[k], gr[k]); unpack(px[k], x[k]); }
      const i64 rn = r + gridDim.x;
      if (rn < rows) {
#pragma unroll
        for (int k = 0; k < NCH; ++k) { const int c0 = (k * T + (int)threadIdx.x) * 8; if (c0 < C) { pdy[k] = *reinterpret_cast<const uint4*>(dy + rn * C + c0); px[k] = *reinterpret_cast<const uint4*>(xs + rn * C + c0); } }
        pmu = mean[rn]; prs = rstd[rn];
      }
    } else {
      mu = mean[r]; rs = rstd[r];
#pragma unroll
      for (int k = 0; k < NCH; ++k) { const int c0 = (k * T + (int)threadIdx.x) * 8; unpack(*reinterpret_cast<const uint4*>(dy + r * C + c0), gr[k]); unpack(*reinterpret_cast<const uint4*>(xs + r * C + c0), x[k]); }
    }
    float s1 = 0.f, s2 = 0.f;
#pragma unroll
    for (int k = 0; k < NCH; ++k) {
      const int c0 = (k * T + (int)threadIdx.x) * 8;
      float gw[8]; unpack(*reinterpret_cast<const uint4*>(g + c0), gw);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float xh = (x[k][e] - mu) * rs, wdy = gw[e] * gr[k][e];
        s1 += wdy * xh; s2 += wdy;
        if (SMEMACC) { acc[((0 * NCH + k) * 8 + e) * T + threadIdx.x] += gr[k][e] * xh; acc[((1 * NCH + k) * 8 + e) * T + threadIdx.x] += gr[k][e]; }
        else { dgam[k][e] += gr[k][e] * xh; dbet[k][e] += gr[k][e]; }
      }
    }
    float2 c = block_sum2(s1, s2, reinterpret_cast<float2*>(sm));
    const float c1 = c.x * (1.f / C), c2 = c.y * (1.f / C);
#pragma unroll
    for (int k = 0; k < NCH; ++k) {
      const int c0 = (k * T + (int)threadIdx.x) * 8;
      float gw[8], d[8]; unpack(*reinterpret_cast<const uint4*>(g + c0), gw);
      for (int e = 0; e < 8; ++e) d[e] = rs * (gw[e] * gr[k][e] - (x[k][e] - mu) * rs * c1 - c2);
      *reinterpret_cast<uint4*>(dx + r * C + c0) = pack(d);
    }
  }
#pragma unroll
  for (int k = 0; k < NCH; ++k) {
    const int c0 = (k * T + (int)threadIdx.x) * 8;
    for (int e = 0; e < 8; ++e) {
      pg[(i64)blockIdx.x * C + c0 + e] = SMEMACC ? acc[((0 * NCH + k) * 8 + e) * T + threadIdx.x] : dgam[k][e];
      pb[(i64)blockIdx.x * C + c0 + e] = SMEMACC ? acc[((1 * NCH + k) * 8 + e) * T + threadIdx.x] : dbet[k][e];
    }
  }
}

template <typename K>
static void run_bwd(const char* name, K kern, int C, i64 rows, int T, size_t smem, u16* dy, u16* xs, float* mean,
                    float* rstd, u16* dx, u16* g, float* pg, float* pb) {
  if (smem > 48 * 1024) CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  int dev; cudaGetDevice(&dev); cudaDeviceProp p; cudaGetDeviceProperties(&p, dev);
  int occ = 0; CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kern, T, smem));
  cudaFuncAttributes fa; cudaFuncGetAttributes(&fa, kern);
  i64 grid = std::min<i64>(rows, (i64)p.multiProcessorCount * occ);
  std::vector<cudaEvent_t> ev(202); for (auto& e : ev) cudaEventCreate(&e);
  for (int i = 0; i < 20; ++i) kern<<<(unsigned)grid, T, smem>>>(dy, xs, mean, rstd, dx, rows, g, pg, pb);
  CK(cudaGetLastError()); CK(cudaDeviceSynchronize());
  for (int i = 0; i < 101; ++i) { cudaEventRecord(ev[2 * i]); kern<<<(unsigned)grid, T, smem>>>(dy, xs, mean, rstd, dx, rows, g, pg, pb); cudaEventRecord(ev[2 * i + 1]); }
  CK(cudaDeviceSynchronize());
  std::vector<float> t; for (int i = 0; i < 101; ++i) { float ms; cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]); t.push_back(ms); }
  std::sort(t.begin(), t.end());
  const double ms = t[50], bytes = 3.0 * rows * C * 2 + 8.0 * rows + 2.0 * grid * C * 4;
  std::vector<u16> o((size_t)rows * C);
  CK(cudaMemcpy(o.data(), dx, o.size() * 2, cudaMemcpyDeviceToHost));
  double sum = 0; for (size_t i = 0; i < o.size(); i += 97) { unsigned u = (unsigned)o[i] << 16; float f; memcpy(&f, &u, 4); sum += f; }
  printf("%-34s cols %5d rows %6lld grid %6lld occ %2d regs %3d smem %6zu  %7.2f us  %6.0f GB/s  %5.1f %%  chk %.6g\n", name, C, rows, grid, occ,
         fa.numRegs, smem, ms * 1e3, bytes / (ms * 1e-3) / 1e9, 100.0 * bytes / (ms * 1e-3) / 1e9 / g_copy, sum);
  for (auto& e : ev) cudaEventDestroy(e);
}

template <int C>
static void sweep_bwd() {
  constexpr int CH = C / 8;
  constexpr int T = std::min(1024, std::max(32, ((CH + 3) / 4 + 31) / 32 * 32));
  constexpr int NCH = (CH + T - 1) / T;
  i64 rows = (8192LL * 4096) / C;
  size_t n = (size_t)rows * C;
  u16 *dy, *xs, *dx, *g; float *mean, *rstd, *pg, *pb;
  CK(cudaMalloc(&dy, n * 2)); CK(cudaMalloc(&xs, n * 2)); CK(cudaMalloc(&dx, n * 2)); CK(cudaMalloc(&g, C * 2));
  CK(cudaMalloc(&mean, rows * 4)); CK(cudaMalloc(&rstd, rows * 4)); CK(cudaMalloc(&pg, 4096LL * C * 4)); CK(cudaMalloc(&pb, 4096LL * C * 4));
  std::vector<u16> h(n); unsigned s = 777;
  for (auto& v : h) { s = s * 1664525u + 1013904223u; float f = ((s >> 8) * (1.f / 16777216.f)) * 2.f - 1.f; unsigned u; memcpy(&u, &f, 4); v = (u16)(u >> 16); }
  CK(cudaMemcpy(dy, h.data(), n * 2, cudaMemcpyHostToDevice)); CK(cudaMemcpy(xs, h.data() + 1, (n - 1) * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(g, h.data() + 7, C * 2, cudaMemcpyHostToDevice));
  std::vector<float> mr(rows, 0.01f); CK(cudaMemcpy(mean, mr.data(), rows * 4, cudaMemcpyHostToDevice));
  for (auto& v : mr) v = 1.7f; CK(cudaMemcpy(rstd, mr.data(), rows * 4, cudaMemcpyHostToDevice));
  printf("-- layernorm backward C=%d T=%d NCH=%d (bytes: dy, x read, dx written, partials)\n", C, T, NCH);
  run_bwd("bwd base (regs acc)", k_bwd<C, T, NCH, false, false>, C, rows, T, 0, dy, xs, mean, rstd, dx, g, pg, pb);
  run_bwd("bwd regs acc + prefetch", k_bwd<C, T, NCH, false, true>, C, rows, T, 0, dy, xs, mean, rstd, dx, g, pg, pb);
  if constexpr (NCH % 2 == 0 && 2 * T <= 1024) {
    run_bwd("bwd 2T NCH/2", k_bwd<C, 2 * T, NCH / 2, false, false>, C, rows, 2 * T, 0, dy, xs, mean, rstd, dx, g, pg, pb);
    run_bwd("bwd 2T NCH/2 + prefetch", k_bwd<C, 2 * T, NCH / 2, false, true>, C, rows, 2 * T, 0, dy, xs, mean, rstd, dx, g, pg, pb);
  }
  if constexpr (NCH % 4 == 0 && 4 * T <= 1024) {
    run_bwd("bwd 4T NCH/4 + prefetch", k_bwd<C, 4 * T, NCH / 4, false, true>, C, rows, 4 * T, 0, dy, xs, mean, rstd, dx, g, pg, pb);
  }
  cudaFree(dy); cudaFree(xs); cudaFree(dx); cudaFree(g); cudaFree(mean); cudaFree(rstd); cudaFree(pg); cudaFree(pb);
}

// P: the row kept packed (the storage dtype) in registers and unpacked in each pass: half the registers
// of a float row, so more rows fit per SM. PF: persistent with the next row prefetched (packed).
template <int C, int T, int NCH, int MINB, bool RMS, bool PF>
__global__ void __launch_bounds__(T, MINB) k_packed(const u16* __restrict__ in, u16* __restrict__ out, i64 rows,
                                                    const u16* __restrict__ g, const u16* __restrict__ b) {
  __shared__ float sm[66];
  uint4 nx[PF ? NCH : 1];
  i64 r = blockIdx.x;
  if (PF) {
#pragma unroll
    for (int k = 0; k < NCH; ++k) { const int c0 = (k * T + (int)threadIdx.x) * 8; if (c0 < C && r < rows) nx[k] = *reinterpret_cast<const uint4*>(in + r * C + c0); }
  }
  for (; r < rows; r += gridDim.x) {
    uint4 x[NCH];
#pragma unroll
    for (int k = 0; k < NCH; ++k) {
      const int c0 = (k * T + (int)threadIdx.x) * 8;
      if (PF) { x[k] = nx[k]; if (c0 < C && r + gridDim.x < rows) nx[k] = *reinterpret_cast<const uint4*>(in + (r + gridDim.x) * C + c0); }
      else if (c0 < C) x[k] = *reinterpret_cast<const uint4*>(in + r * C + c0);
      if (c0 >= C) x[k] = make_uint4(0, 0, 0, 0);
    }
    float mu = 0.f, s2 = 0.f;
    if (!RMS) {
      float s1 = 0.f;
#pragma unroll
      for (int k = 0; k < NCH; ++k) { float v[8]; unpack(x[k], v); for (int e = 0; e < 8; ++e) s1 += v[e]; }
      mu = block_sum(s1, sm) * (1.f / C);
#pragma unroll
      for (int k = 0; k < NCH; ++k) {
        const int c0 = (k * T + (int)threadIdx.x) * 8;
        float v[8]; unpack(x[k], v);
        if (c0 < C) for (int e = 0; e < 8; ++e) { const float d = v[e] - mu; s2 += d * d; }
      }
    } else {
#pragma unroll
      for (int k = 0; k < NCH; ++k) { float v[8]; unpack(x[k], v); for (int e = 0; e < 8; ++e) s2 += v[e] * v[e]; }
    }
    const float rs = rsqrtf(block_sum(s2, sm) * (1.f / C) + 1e-5f);
#pragma unroll
    for (int k = 0; k < NCH; ++k) {
      const int c0 = (k * T + (int)threadIdx.x) * 8;
      if (c0 < C) {
        float gw[8], bw[8], v[8], xv[8];
        unpack(x[k], xv);
        unpack(*reinterpret_cast<const uint4*>(g + c0), gw);
        if (!RMS) unpack(*reinterpret_cast<const uint4*>(b + c0), bw);
        for (int e = 0; e < 8; ++e) v[e] = RMS ? xv[e] * rs * gw[e] : (xv[e] - mu) * rs * gw[e] + bw[e];
        *reinterpret_cast<uint4*>(out + r * C + c0) = pack(v);
      }
    }
  }
}

// Q: Quack's forward geometry (quack/rmsnorm.py + rmsnorm_config.py, read in session 31): TPR threads per
// row, RPB rows per block, each thread C / (8 TPR) chunks of 8 held packed; the row's sums are warp
// shuffles, plus one shared-memory exchange between the row's warps when TPR > 32 (bf16 on sm90: TPR 32 up
// to C 3072, 64 up to 6144, 128 up to 16K; 128 threads per block). No barrier is shared between rows
// beyond the block's one __syncthreads pair per sum.
template <int C, int TPR, int RPB, bool RMS>
__device__ __forceinline__ float row_sum(float v, float* sm) {
  v = warp_sum(v);
  if (TPR == 32) return v;
  constexpr int WPR = TPR / 32;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, row_warp0 = warp / WPR * WPR;
  __syncthreads();
  if (lane == 0) sm[warp] = v;
  __syncthreads();
  float t = 0.f;
#pragma unroll
  for (int w = 0; w < WPR; ++w) t += sm[row_warp0 + w];
  return t;
}
template <int C, int TPR, int RPB, bool RMS>
__global__ void __launch_bounds__(TPR * RPB) k_rows(const u16* __restrict__ in, u16* __restrict__ out, i64 rows,
                                                    const u16* __restrict__ g, const u16* __restrict__ b) {
  constexpr int NCH = C / (8 * TPR);
  static_assert(C % (8 * TPR) == 0, "whole chunks per thread");
  __shared__ float sm[TPR * RPB / 32];
  const int t = threadIdx.x % TPR;
  const i64 r = (i64)blockIdx.x * RPB + threadIdx.x / TPR;
  const bool live = r < rows;  // every thread reaches the barriers
  uint4 x[NCH];
#pragma unroll
  for (int k = 0; k < NCH; ++k)
    x[k] = live ? *reinterpret_cast<const uint4*>(in + r * C + (k * TPR + t) * 8) : make_uint4(0, 0, 0, 0);
  float mu = 0.f, s2 = 0.f;
  if (!RMS) {
    float s1 = 0.f;
#pragma unroll
    for (int k = 0; k < NCH; ++k) { float v[8]; unpack(x[k], v); for (int e = 0; e < 8; ++e) s1 += v[e]; }
    mu = row_sum<C, TPR, RPB, RMS>(s1, sm) * (1.f / C);
#pragma unroll
    for (int k = 0; k < NCH; ++k) { float v[8]; unpack(x[k], v); for (int e = 0; e < 8; ++e) { const float d = v[e] - mu; s2 += d * d; } }
  } else {
#pragma unroll
    for (int k = 0; k < NCH; ++k) { float v[8]; unpack(x[k], v); for (int e = 0; e < 8; ++e) s2 += v[e] * v[e]; }
  }
  const float rs = rsqrtf(row_sum<C, TPR, RPB, RMS>(s2, sm) * (1.f / C) + 1e-5f);
  if (!live) return;
#pragma unroll
  for (int k = 0; k < NCH; ++k) {
    const int c0 = (k * TPR + t) * 8;
    float gw[8], bw[8], v[8], xv[8];
    unpack(x[k], xv);
    unpack(*reinterpret_cast<const uint4*>(g + c0), gw);
    if (!RMS) unpack(*reinterpret_cast<const uint4*>(b + c0), bw);
    for (int e = 0; e < 8; ++e) v[e] = RMS ? xv[e] * rs * gw[e] : (xv[e] - mu) * rs * gw[e] + bw[e];
    *reinterpret_cast<uint4*>(out + r * C + c0) = pack(v);
  }
}

// The ceiling of the warp-per-row shape: the same loads and stores, nothing else.
template <int C, int W>
__global__ void __launch_bounds__(W * 32) k_copy_warprow(const u16* __restrict__ in, u16* __restrict__ out, i64 rows,
                                                         const u16* __restrict__, const u16* __restrict__) {
  constexpr int NCH = C / 256;
  const int lane = threadIdx.x & 31;
  const i64 r = (i64)blockIdx.x * W + (threadIdx.x >> 5);
  if (r >= rows) return;
  uint4 x[NCH];
#pragma unroll
  for (int k = 0; k < NCH; ++k) x[k] = *reinterpret_cast<const uint4*>(in + r * C + (k * 32 + lane) * 8);
#pragma unroll
  for (int k = 0; k < NCH; ++k) *reinterpret_cast<uint4*>(out + r * C + (k * 32 + lane) * 8) = x[k];
}

struct Bufs { u16 *in, *out, *g, *b; i64 rows; int cols; };
static std::vector<u16> ref_out;

template <typename K>
static void run(const char* name, K kern, const Bufs& B, int T, size_t smem, bool persistent, bool check,
                int rows_per_block = 1) {
  if (smem > 48 * 1024) CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  int dev; cudaGetDevice(&dev); cudaDeviceProp p; cudaGetDeviceProperties(&p, dev);
  int occ = 0; CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kern, T, smem));
  cudaFuncAttributes fa; cudaFuncGetAttributes(&fa, kern);
  i64 grid = persistent ? std::min<i64>(B.rows, (i64)p.multiProcessorCount * occ)
                        : (B.rows + rows_per_block - 1) / rows_per_block;
  CK(cudaMemset(B.out, 0xff, (size_t)B.rows * B.cols * 2));
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  std::vector<cudaEvent_t> ev(202); for (auto& e : ev) cudaEventCreate(&e);
  for (int i = 0; i < 20; ++i) kern<<<(unsigned)grid, T, smem>>>(B.in, B.out, B.rows, B.g, B.b);
  CK(cudaGetLastError()); CK(cudaDeviceSynchronize());
  for (int i = 0; i < 101; ++i) { cudaEventRecord(ev[2 * i]); kern<<<(unsigned)grid, T, smem>>>(B.in, B.out, B.rows, B.g, B.b); cudaEventRecord(ev[2 * i + 1]); }
  CK(cudaDeviceSynchronize());
  std::vector<float> t; for (int i = 0; i < 101; ++i) { float ms; cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]); t.push_back(ms); }
  std::sort(t.begin(), t.end());
  const double ms = t[50], bytes = 2.0 * B.rows * B.cols * 2;
  std::vector<u16> o((size_t)B.rows * B.cols);
  CK(cudaMemcpy(o.data(), B.out, o.size() * 2, cudaMemcpyDeviceToHost));
  double maxd = 0; size_t bad = 0;
  if (check) { ref_out = o; } else {
    for (size_t i = 0; i < o.size(); ++i) {
      float a, c; unsigned ua = (unsigned)o[i] << 16, uc = (unsigned)ref_out[i] << 16; memcpy(&a, &ua, 4); memcpy(&c, &uc, 4);
      if (!(std::fabs(a - c) <= 0.02 * std::fabs(c) + 1e-3)) ++bad;
      maxd = std::max(maxd, (double)std::fabs(a - c));
    }
  }
  printf("%-34s cols %5d rows %6lld grid %6lld occ %2d regs %3d smem %6zu  %7.2f us  %6.0f GB/s  %5.1f %%  maxdiff %.3g bad %zu\n", name, B.cols,
         B.rows, grid, occ, fa.numRegs, smem, ms * 1e3, bytes / (ms * 1e-3) / 1e9, 100.0 * bytes / (ms * 1e-3) / 1e9 / g_copy, maxd, bad);
  for (auto& e : ev) cudaEventDestroy(e);
}

template <int C, bool RMS>
static void sweep(const char* norm) {
  constexpr int CH = C / 8;
  constexpr int T = std::min(1024, std::max(32, ((CH + 3) / 4 + 31) / 32 * 32));
  constexpr int NCH = (CH + T - 1) / T;
  constexpr int MINB = std::max(1, std::min(16, 65536 / (T * 64)));
  Bufs B; B.cols = C; B.rows = (8192LL * 4096) / C;
  size_t n = (size_t)B.rows * C;
  CK(cudaMalloc(&B.in, n * 2)); CK(cudaMalloc(&B.out, n * 2)); CK(cudaMalloc(&B.g, C * 2)); CK(cudaMalloc(&B.b, C * 2));
  std::vector<u16> h(n); unsigned s = 12345;
  for (auto& v : h) { s = s * 1664525u + 1013904223u; float f = ((s >> 8) * (1.f / 16777216.f)) * 2.f - 1.f + 0.3f; unsigned u; memcpy(&u, &f, 4); v = (u16)(u >> 16); }
  CK(cudaMemcpy(B.in, h.data(), n * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(B.g, h.data(), C * 2, cudaMemcpyHostToDevice)); CK(cudaMemcpy(B.b, h.data() + C, C * 2, cudaMemcpyHostToDevice));
  printf("-- %s C=%d T=%d NCH=%d MINB=%d\n", norm, C, T, NCH, MINB);
  run("A base (today)", k_base<C, T, NCH, MINB, RMS, 0>, B, T, 0, false, true);
  run("copy, one block per row", k_copy<C, T, NCH>, B, T, 0, false, false);
  run("B regpf persistent", k_regpf<C, T, NCH, 1, RMS, 0>, B, T, 0, true, false);
  run("P packed minb", k_packed<C, T, NCH, MINB, RMS, false>, B, T, 0, false, false);
  run("P packed 1.5 minb", k_packed<C, T, NCH, (MINB * 3 / 2 > 0 ? MINB * 3 / 2 : 1), RMS, false>, B, T, 0, false, false);
  run("P packed 2 minb", k_packed<C, T, NCH, (MINB * 2 <= 32 ? MINB * 2 : 32), RMS, false>, B, T, 0, false, false);
  run("P packed, 1", k_packed<C, T, NCH, 1, RMS, false>, B, T, 0, false, false);
  run("P packed + prefetch, 1", k_packed<C, T, NCH, 1, RMS, true>, B, T, 0, true, false);
  run("P packed + prefetch, minb", k_packed<C, T, NCH, MINB, RMS, true>, B, T, 0, true, false);
  run("P packed + prefetch, 1.5minb", k_packed<C, T, NCH, (MINB * 3 / 2 > 0 ? MINB * 3 / 2 : 1), RMS, true>, B, T, 0, true, false);
  if constexpr (T % 64 == 0) {
    run("P packed T/2 2NCH + prefetch", k_packed<C, T / 2, NCH * 2, 1, RMS, true>, B, T / 2, 0, true, false);
    run("P packed T/2 2NCH, 2minb", k_packed<C, T / 2, NCH * 2, (MINB * 2 <= 32 ? MINB * 2 : 32), RMS, false>, B, T / 2, 0, false, false);
  }
  if constexpr (C % 256 == 0 && C <= 2048) {  // at 4096 a lane's 16 chunks take 171-255 registers
    run("Q warp per row, 4 rows/block", k_rows<C, 32, 4, RMS>, B, 128, 0, false, false, 4);
    run("Q warp per row, 8 rows/block", k_rows<C, 32, 8, RMS>, B, 256, 0, false, false, 8);
    run("copy, warp per row, 4 rows/block", k_copy_warprow<C, 4>, B, 128, 0, false, false, 4);
  }
  if constexpr (C % 512 == 0 && C >= 2048 && C <= 4096) run("Q 64 threads/row, 2 rows/block", k_rows<C, 64, 2, RMS>, B, 128, 0, false, false, 2);
  if constexpr (C % 1024 == 0 && C >= 4096) run("Q 128 threads/row, 1 row/block", k_rows<C, 128, 1, RMS>, B, 128, 0, false, false, 1);
  cudaFree(B.in); cudaFree(B.out); cudaFree(B.g); cudaFree(B.b);
}

// ./norm_fwd        the forward variants at hidden 4096, 1024, 2048, 8192, 12288 (layernorm and rmsnorm)
// ./norm_fwd bwd    also session 18's backward variants (tools/microbench/norm_bwd.cu has the current ones)
int main(int argc, char** argv) {
  cudaDeviceProp p; cudaGetDeviceProperties(&p, 0);
  g_copy = copy_gbs();
  printf("%s, %d SMs, copy %.0f GB/s (1 GiB DtoD, read+write)\n", p.name, p.multiProcessorCount, g_copy);
  sweep<4096, false>("layernorm");
  sweep<4096, true>("rmsnorm");
  sweep<1024, false>("layernorm");
  sweep<1024, true>("rmsnorm");
  sweep<2048, false>("layernorm");
  sweep<2048, true>("rmsnorm");
  sweep<8192, false>("layernorm");
  sweep<8192, true>("rmsnorm");
  sweep<12288, false>("layernorm");
  sweep<12288, true>("rmsnorm");
  if (argc > 1 && strcmp(argv[1], "bwd") == 0) {
    sweep_bwd<4096>();
    sweep_bwd<1024>();
    sweep_bwd<8192>();
    sweep_bwd<2048>();
  }
  return 0;
}
