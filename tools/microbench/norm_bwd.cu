// Microbenchmark of row-norm backward variants (bf16 layernorm/rmsnorm, dx with dgamma/dbeta partials)
// against the copy bandwidth, to choose the codegen of skeletons/rownorm's backward (issue 32). Built and run
// on the GPU machine: nvcc -O3 -std=c++17 -arch=sm_90a tools/microbench/norm_bwd.cu -o norm_bwd && ./norm_bwd
// Bytes as jitfuse bench counts them: dy and x read, dx written (the partials and statistics not counted).
//   reg  the generated kernel's structure (session 28): persistent grid, the next row's dy and x prefetched
//        into registers, gamma re-read per pass, dgamma/dbeta in registers.
//   cpS  the next S-1 rows of dy and x staged in shared memory by cp.async (each thread copies and reads its
//        own 16-byte chunks, so the ring needs no barrier), the registers hold one row.
//   +g   gamma (raw) held in registers for the whole kernel instead of re-read per pass.
//   cl2  (hidden >= 8192) a cluster of 2 CTAs per row, half the columns each, the row sums exchanged through
//        distributed shared memory (Quack's layout for 8K < hidden <= 16K); written in session 31, not yet run.
//   sacc R  (session 37, issue 46; written and compiled, not yet run) dgamma/dbeta accumulated in shared memory
//        (each thread read-modify-writes its own columns, so no barrier or atomic) instead of 8 (rmsnorm) or 16
//        (layernorm) registers per chunk, which frees 32-64 registers for more resident warps; R rows per CTA
//        (R groups of T threads, each its own row, one block reduction slot per group), gamma and the next row
//        in registers as "reg 4ch +g"; the R groups' accumulators are summed into the block's partial row.
//        ptxas (sm_90a, CUDA 13.0): layernorm 4096 "sacc1 4ch" 127 registers against 167 for "reg 4ch +g" (4
//        blocks of 128 threads per SM instead of 3), rmsnorm 127 against 128; 8192 "sacc1 4ch" 128 against
//        168 (layernorm); 12288 "sacc1 4ch" 131 (layernorm) against 168, no spills; "sacc2" at 12288 (768
//        threads) spills 256-360 bytes and at 8192 "sacc2 2ch" layernorm 48: expect those to lose.
#include <cooperative_groups.h>

#include "common.cuh"
namespace cg = cooperative_groups;
template <bool TWO>
__device__ __forceinline__ float2 block_sum(float a, float b, float* sm) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  a = warp_sum(a);
  if (TWO) b = warp_sum(b);
  __syncthreads();
  if (lane == 0) { sm[warp] = a; if (TWO) sm[32 + warp] = b; }
  __syncthreads();
  float ta = lane < nw ? sm[lane] : 0.f, tb = TWO && lane < nw ? sm[32 + lane] : 0.f;
  return make_float2(warp_sum(ta), TWO ? warp_sum(tb) : 0.f);
}

struct RowSums {  // the whole row's sums from this block's: one block per row
  __device__ float2 operator()(float2 v) const { return v; }
};
// One row's math on dy (gr) and x in registers; accumulates dgamma/dbeta; writes dx. This block owns the W
// columns from `base` (W < C: a cluster shares the row, `sums` adds the other blocks' sums).
template <int C, int T, int NCH, bool RMS, bool GREG, int W = C, typename Sums = RowSums>
__device__ __forceinline__ void row_math(const uint4 (&gq)[NCH], const uint4 (&xq)[NCH], const uint4 (&graw)[NCH],
                                         const u16* __restrict__ g, float mu, float rs, i64 r, u16* __restrict__ dx,
                                         float (&dgam)[NCH][8], float (&dbet)[NCH][8], float* sm, int base = 0,
                                         Sums sums = {}) {
  g += base;
  dx += base;
  float s1 = 0.f, s2 = 0.f;
#pragma unroll
  for (int k = 0; k < NCH; ++k) {
    const int c0 = (k * T + (int)threadIdx.x) * 8;
    if (c0 < W) {
      float gw[8], dy[8], x[8];
      unpack(GREG ? graw[k] : *reinterpret_cast<const uint4*>(g + c0), gw);
      unpack(gq[k], dy);
      unpack(xq[k], x);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float xh = (x[e] - mu) * rs, wdy = gw[e] * dy[e];
        s1 += wdy * xh; s2 += wdy;
        dgam[k][e] += dy[e] * xh;
        if (!RMS) dbet[k][e] += dy[e];
      }
    }
  }
  const float2 c = sums(block_sum<!RMS>(s1, s2, sm));
  const float c1 = c.x * (1.f / C), c2 = RMS ? 0.f : c.y * (1.f / C);
#pragma unroll
  for (int k = 0; k < NCH; ++k) {
    const int c0 = (k * T + (int)threadIdx.x) * 8;
    if (c0 < W) {
      float gw[8], dy[8], x[8], d[8];
      unpack(GREG ? graw[k] : *reinterpret_cast<const uint4*>(g + c0), gw);
      unpack(gq[k], dy);
      unpack(xq[k], x);
#pragma unroll
      for (int e = 0; e < 8; ++e) d[e] = rs * (gw[e] * dy[e] - (x[e] - mu) * rs * c1 - c2);
      *reinterpret_cast<uint4*>(dx + r * C + c0) = pack(d);
    }
  }
}

template <int C, int T, int NCH, bool RMS>
__device__ __forceinline__ void flush(float (&dgam)[NCH][8], float (&dbet)[NCH][8], float* pg, float* pb) {
#pragma unroll
  for (int k = 0; k < NCH; ++k) {
    const int c0 = (k * T + (int)threadIdx.x) * 8;
    if (c0 < C) {
      float4* q = reinterpret_cast<float4*>(pg + (i64)blockIdx.x * C + c0);
      q[0] = make_float4(dgam[k][0], dgam[k][1], dgam[k][2], dgam[k][3]);
      q[1] = make_float4(dgam[k][4], dgam[k][5], dgam[k][6], dgam[k][7]);
      if (!RMS) {
        float4* p = reinterpret_cast<float4*>(pb + (i64)blockIdx.x * C + c0);
        p[0] = make_float4(dbet[k][0], dbet[k][1], dbet[k][2], dbet[k][3]);
        p[1] = make_float4(dbet[k][4], dbet[k][5], dbet[k][6], dbet[k][7]);
      }
    }
  }
}

// reg: today's generated structure.
template <int C, int T, int NCH, bool RMS, bool GREG>
__global__ void __launch_bounds__(T) k_reg(const u16* __restrict__ dy, const u16* __restrict__ xs, const float* __restrict__ mean,
                                           const float* __restrict__ rstd, u16* __restrict__ dx, i64 rows,
                                           const u16* __restrict__ g, float* __restrict__ pg, float* __restrict__ pb) {
  __shared__ float sm[64];
  float dgam[NCH][8], dbet[NCH][8];
#pragma unroll
  for (int k = 0; k < NCH; ++k) for (int e = 0; e < 8; ++e) { dgam[k][e] = 0.f; dbet[k][e] = 0.f; }
  uint4 graw[NCH], pq[NCH], px[NCH];
#pragma unroll
  for (int k = 0; k < NCH; ++k) {
    const int c0 = (k * T + (int)threadIdx.x) * 8;
    graw[k] = make_uint4(0, 0, 0, 0); pq[k] = graw[k]; px[k] = graw[k];
    if (GREG && c0 < C) graw[k] = *reinterpret_cast<const uint4*>(g + c0);
    if (c0 < C && blockIdx.x < rows) {
      pq[k] = *reinterpret_cast<const uint4*>(dy + (i64)blockIdx.x * C + c0);
      px[k] = *reinterpret_cast<const uint4*>(xs + (i64)blockIdx.x * C + c0);
    }
  }
  for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
    uint4 gq[NCH], xq[NCH];
#pragma unroll
    for (int k = 0; k < NCH; ++k) { gq[k] = pq[k]; xq[k] = px[k]; }
    const i64 rn = r + gridDim.x;
    if (rn < rows) {
#pragma unroll
      for (int k = 0; k < NCH; ++k) {
        const int c0 = (k * T + (int)threadIdx.x) * 8;
        if (c0 < C) { pq[k] = *reinterpret_cast<const uint4*>(dy + rn * C + c0); px[k] = *reinterpret_cast<const uint4*>(xs + rn * C + c0); }
      }
    }
    const float mu = RMS ? 0.f : mean[r], rs = rstd[r];
    row_math<C, T, NCH, RMS, GREG>(gq, xq, graw, g, mu, rs, r, dx, dgam, dbet, sm);
  }
  flush<C, T, NCH, RMS>(dgam, dbet, pg, pb);
}

// sacc R: R rows per CTA, dgamma/dbeta in shared memory (dynamic: R * C floats each), gamma and the next row in
// registers. Every group runs the same number of iterations (a group past the last row only joins the barriers).
template <int C, int T, int NCH, bool RMS, int R>
__global__ void __launch_bounds__(T * R) k_sacc(const u16* __restrict__ dy, const u16* __restrict__ xs,
                                                const float* __restrict__ mean, const float* __restrict__ rstd,
                                                u16* __restrict__ dx, i64 rows, const u16* __restrict__ g,
                                                float* __restrict__ pg, float* __restrict__ pb) {
  extern __shared__ float acc[];  // [R][C] dgamma, then [R][C] dbeta (layernorm)
  __shared__ float sm[R][64];
  const int grp = threadIdx.x / T, tid = threadIdx.x % T, lane = tid & 31, warp = tid >> 5;
  constexpr int NW = (T + 31) / 32;
  float* ag = acc + grp * C;
  float* ab = acc + (R + grp) * C;
  uint4 graw[NCH], pq[NCH], px[NCH];
  const i64 first = (i64)blockIdx.x * R + grp;
#pragma unroll
  for (int k = 0; k < NCH; ++k) {
    const int c0 = (k * T + tid) * 8;
    graw[k] = make_uint4(0, 0, 0, 0); pq[k] = graw[k]; px[k] = graw[k];
    if (c0 < C) {
      graw[k] = *reinterpret_cast<const uint4*>(g + c0);
      reinterpret_cast<float4*>(ag + c0)[0] = make_float4(0.f, 0.f, 0.f, 0.f);
      reinterpret_cast<float4*>(ag + c0)[1] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (!RMS) {
        reinterpret_cast<float4*>(ab + c0)[0] = make_float4(0.f, 0.f, 0.f, 0.f);
        reinterpret_cast<float4*>(ab + c0)[1] = make_float4(0.f, 0.f, 0.f, 0.f);
      }
      if (first < rows) {
        pq[k] = *reinterpret_cast<const uint4*>(dy + first * C + c0);
        px[k] = *reinterpret_cast<const uint4*>(xs + first * C + c0);
      }
    }
  }
  const i64 stride = (i64)gridDim.x * R;
  for (i64 base = (i64)blockIdx.x * R; base < rows; base += stride) {
    const i64 r = base + grp;
    const bool live = r < rows;
    uint4 gq[NCH], xq[NCH];
#pragma unroll
    for (int k = 0; k < NCH; ++k) { gq[k] = pq[k]; xq[k] = px[k]; }
    const i64 rn = r + stride;
    if (rn < rows) {
#pragma unroll
      for (int k = 0; k < NCH; ++k) {
        const int c0 = (k * T + tid) * 8;
        if (c0 < C) { pq[k] = *reinterpret_cast<const uint4*>(dy + rn * C + c0); px[k] = *reinterpret_cast<const uint4*>(xs + rn * C + c0); }
      }
    }
    const float mu = RMS || !live ? 0.f : mean[r], rs = live ? rstd[r] : 0.f;
    float s1 = 0.f, s2 = 0.f;
#pragma unroll
    for (int k = 0; k < NCH; ++k) {
      const int c0 = (k * T + tid) * 8;
      if (c0 < C && live) {
        float gw[8], d[8], x[8], a[8], b[8];
        unpack(graw[k], gw); unpack(gq[k], d); unpack(xq[k], x);
        float4* qa = reinterpret_cast<float4*>(ag + c0);
        float4 a0 = qa[0], a1 = qa[1];
        a[0] = a0.x; a[1] = a0.y; a[2] = a0.z; a[3] = a0.w; a[4] = a1.x; a[5] = a1.y; a[6] = a1.z; a[7] = a1.w;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const float xh = (x[e] - mu) * rs, wdy = gw[e] * d[e];
          s1 += wdy * xh; s2 += wdy;
          a[e] += d[e] * xh;
        }
        qa[0] = make_float4(a[0], a[1], a[2], a[3]); qa[1] = make_float4(a[4], a[5], a[6], a[7]);
        if (!RMS) {
          float4* qb = reinterpret_cast<float4*>(ab + c0);
          float4 b0 = qb[0], b1 = qb[1];
          b[0] = b0.x + d[0]; b[1] = b0.y + d[1]; b[2] = b0.z + d[2]; b[3] = b0.w + d[3];
          b[4] = b1.x + d[4]; b[5] = b1.y + d[5]; b[6] = b1.z + d[6]; b[7] = b1.w + d[7];
          qb[0] = make_float4(b[0], b[1], b[2], b[3]); qb[1] = make_float4(b[4], b[5], b[6], b[7]);
        }
      }
    }
    // Each group's row sums: warp sums, then the group's warps through its own slots.
    s1 = warp_sum(s1);
    if (!RMS) s2 = warp_sum(s2);
    __syncthreads();
    if (lane == 0) { sm[grp][warp] = s1; if (!RMS) sm[grp][32 + warp] = s2; }
    __syncthreads();
    float t1 = lane < NW ? sm[grp][lane] : 0.f, t2 = !RMS && lane < NW ? sm[grp][32 + lane] : 0.f;
    t1 = warp_sum(t1);
    if (!RMS) t2 = warp_sum(t2);
    const float c1 = t1 * (1.f / C), c2 = RMS ? 0.f : t2 * (1.f / C);
#pragma unroll
    for (int k = 0; k < NCH; ++k) {
      const int c0 = (k * T + tid) * 8;
      if (c0 < C && live) {
        float gw[8], d[8], x[8], o[8];
        unpack(graw[k], gw); unpack(gq[k], d); unpack(xq[k], x);
#pragma unroll
        for (int e = 0; e < 8; ++e) o[e] = rs * (gw[e] * d[e] - (x[e] - mu) * rs * c1 - c2);
        *reinterpret_cast<uint4*>(dx + r * C + c0) = pack(o);
      }
    }
  }
  __syncthreads();
  // The block's partial row: group 0's threads sum the R groups' accumulators of their columns.
  if (grp == 0) {
#pragma unroll
    for (int k = 0; k < NCH; ++k) {
      const int c0 = (k * T + tid) * 8;
      if (c0 < C) {
        for (int e = 0; e < 8; ++e) {
          float a = 0.f, b = 0.f;
          for (int q = 0; q < R; ++q) { a += acc[q * C + c0 + e]; if (!RMS) b += acc[(R + q) * C + c0 + e]; }
          pg[(i64)blockIdx.x * C + c0 + e] = a;
          if (!RMS) pb[(i64)blockIdx.x * C + c0 + e] = b;
        }
      }
    }
  }
}

// cpS: an S-row ring of dy and x in shared memory, filled by cp.async; thread-private slots.
template <int C, int T, int NCH, bool RMS, bool GREG, int S>
__global__ void __launch_bounds__(T) k_cp(const u16* __restrict__ dy, const u16* __restrict__ xs, const float* __restrict__ mean,
                                          const float* __restrict__ rstd, u16* __restrict__ dx, i64 rows,
                                          const u16* __restrict__ g, float* __restrict__ pg, float* __restrict__ pb) {
  __shared__ float sm[64];
  extern __shared__ uint4 ring[];  // [S][2][NCH][T]
  float dgam[NCH][8], dbet[NCH][8];
#pragma unroll
  for (int k = 0; k < NCH; ++k) for (int e = 0; e < 8; ++e) { dgam[k][e] = 0.f; dbet[k][e] = 0.f; }
  uint4 graw[NCH];
#pragma unroll
  for (int k = 0; k < NCH; ++k) {
    const int c0 = (k * T + (int)threadIdx.x) * 8;
    graw[k] = make_uint4(0, 0, 0, 0);
    if (GREG && c0 < C) graw[k] = *reinterpret_cast<const uint4*>(g + c0);
  }
  auto issue = [&](i64 row, int slot) {
    if (row < rows) {
#pragma unroll
      for (int k = 0; k < NCH; ++k) {
        const int c0 = (k * T + (int)threadIdx.x) * 8;
        if (c0 < C) {
          cp_async16(&ring[((slot * 2 + 0) * NCH + k) * T + threadIdx.x], dy + row * C + c0);
          cp_async16(&ring[((slot * 2 + 1) * NCH + k) * T + threadIdx.x], xs + row * C + c0);
        }
      }
    }
    cp_commit();
  };
#pragma unroll
  for (int s = 0; s < S - 1; ++s) issue(blockIdx.x + (i64)s * gridDim.x, s);
  int slot = 0;
  for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
    issue(r + (i64)(S - 1) * gridDim.x, (slot + S - 1) % S);
    const float mu = RMS ? 0.f : mean[r], rs = rstd[r];
    cp_wait<S - 1>();
    uint4 gq[NCH], xq[NCH];
#pragma unroll
    for (int k = 0; k < NCH; ++k) {
      gq[k] = ring[((slot * 2 + 0) * NCH + k) * T + threadIdx.x];
      xq[k] = ring[((slot * 2 + 1) * NCH + k) * T + threadIdx.x];
    }
    row_math<C, T, NCH, RMS, GREG>(gq, xq, graw, g, mu, rs, r, dx, dgam, dbet, sm);
    slot = (slot + 1) % S;
  }
  cp_wait<0>();
  flush<C, T, NCH, RMS>(dgam, dbet, pg, pb);
}

struct Bufs {
  u16 *dy, *xs, *dx, *g;
  float *mean, *rstd, *pg, *pb;
  i64 rows;
};

// cl2: Quack's backward layout for 8K < hidden <= 16K (quack/rmsnorm_config.py, read in session 31): a
// cluster of 2 CTAs owns each row, each CTA half of its columns, so a thread carries half the dgamma/dbeta
// accumulators and row registers. The row sums: a block reduction, then the two CTAs' sums exchanged through
// distributed shared memory, one cluster barrier per row (slots alternate by row, so a slot is rewritten
// only after the peer passed the next row's barrier). Partials: row blockIdx.x holds this CTA's half, zeros
// in the other (the checksum sums every partial row). gamma held in registers.
template <int C, int T, int NCH, bool RMS>
__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(T)
    k_cl2(const u16* __restrict__ dy, const u16* __restrict__ xs, const float* __restrict__ mean, const float* __restrict__ rstd,
          u16* __restrict__ dx, i64 rows, const u16* __restrict__ g, float* __restrict__ pg, float* __restrict__ pb) {
  constexpr int H = C / 2;
  __shared__ float sm[64];
  __shared__ float2 slot[2];
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = (int)cluster.block_rank(), base = rank * H;
  const i64 cid = blockIdx.x / 2, ncl = gridDim.x / 2;
  float dgam[NCH][8], dbet[NCH][8];
  uint4 graw[NCH], pq[NCH], px[NCH];
#pragma unroll
  for (int k = 0; k < NCH; ++k) {
    for (int e = 0; e < 8; ++e) { dgam[k][e] = 0.f; dbet[k][e] = 0.f; }
    const int c0 = (k * T + (int)threadIdx.x) * 8;
    graw[k] = make_uint4(0, 0, 0, 0); pq[k] = graw[k]; px[k] = graw[k];
    if (c0 < H) {
      graw[k] = *reinterpret_cast<const uint4*>(g + base + c0);
      if (cid < rows) {
        pq[k] = *reinterpret_cast<const uint4*>(dy + cid * C + base + c0);
        px[k] = *reinterpret_cast<const uint4*>(xs + cid * C + base + c0);
      }
    }
  }
  float2* peer_slot = cluster.map_shared_rank(slot, rank ^ 1);
  int parity = 0;
  for (i64 r = cid; r < rows; r += ncl, parity ^= 1) {
    uint4 gq[NCH], xq[NCH];
#pragma unroll
    for (int k = 0; k < NCH; ++k) { gq[k] = pq[k]; xq[k] = px[k]; }
    const i64 rn = r + ncl;
    if (rn < rows) {
#pragma unroll
      for (int k = 0; k < NCH; ++k) {
        const int c0 = (k * T + (int)threadIdx.x) * 8;
        if (c0 < H) { pq[k] = *reinterpret_cast<const uint4*>(dy + rn * C + base + c0); px[k] = *reinterpret_cast<const uint4*>(xs + rn * C + base + c0); }
      }
    }
    const float mu = RMS ? 0.f : mean[r], rs = rstd[r];
    // The row's sums: this CTA's, then the peer's through distributed shared memory.
    auto with_peer = [&](float2 mine) {
      if (threadIdx.x == 0) slot[parity] = mine;
      cluster.sync();
      const float2 other = peer_slot[parity];
      return make_float2(mine.x + other.x, mine.y + other.y);
    };
    row_math<C, T, NCH, RMS, true, H>(gq, xq, graw, g, mu, rs, r, dx, dgam, dbet, sm, base, with_peer);
  }
  cluster.sync();  // the peer's last read of this CTA's slot is done before it exits
#pragma unroll
  for (int k = 0; k < NCH; ++k) {
    const int c0 = (k * T + (int)threadIdx.x) * 8;
    if (c0 < H) {
      for (int half = 0; half < 2; ++half) {
        const bool own = half == rank;
        float* rowg = pg + (i64)blockIdx.x * C + half * H + c0;
        float* rowb = pb + (i64)blockIdx.x * C + half * H + c0;
        for (int e = 0; e < 8; ++e) {
          rowg[e] = own ? dgam[k][e] : 0.f;
          if (!RMS) rowb[e] = own ? dbet[k][e] : 0.f;
        }
      }
    }
  }
}

template <typename K>
static void run(const char* name, K kern, int C, int T, size_t smem, const Bufs& B, const char* norm, int cluster = 1) {
  if (smem > 48 * 1024) CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  int dev; cudaGetDevice(&dev); cudaDeviceProp p; cudaGetDeviceProperties(&p, dev);
  int occ = 0; CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kern, T, smem));
  if (occ == 0) { printf("%-10s %-22s cols %5d: does not fit\n", norm, name, C); return; }
  cudaFuncAttributes fa; cudaFuncGetAttributes(&fa, kern);
  const i64 grid = std::min<i64>(B.rows * cluster, (i64)p.multiProcessorCount * occ) / cluster * cluster;
  auto launch = [&] { kern<<<(unsigned)grid, T, smem>>>(B.dy, B.xs, B.mean, B.rstd, B.dx, B.rows, B.g, B.pg, B.pb); };
  for (int i = 0; i < 20; ++i) launch();
  CK(cudaGetLastError()); CK(cudaDeviceSynchronize());
  std::vector<cudaEvent_t> ev(202); for (auto& e : ev) cudaEventCreate(&e);
  for (int i = 0; i < 101; ++i) { cudaEventRecord(ev[2 * i]); launch(); cudaEventRecord(ev[2 * i + 1]); }
  CK(cudaDeviceSynchronize());
  std::vector<float> t; for (int i = 0; i < 101; ++i) { float ms; cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]); t.push_back(ms); }
  std::sort(t.begin(), t.end());
  const double ms = t[50], bytes = 3.0 * B.rows * C * 2;
  // A checksum of dx and the partials' first row (every variant must agree).
  std::vector<u16> o((size_t)B.rows * C);
  CK(cudaMemcpy(o.data(), B.dx, o.size() * 2, cudaMemcpyDeviceToHost));
  double sum = 0; for (size_t i = 0; i < o.size(); i += 97) { unsigned u = (unsigned)o[i] << 16; float f; memcpy(&f, &u, 4); sum += f; }
  std::vector<float> pgh((size_t)grid * C);
  CK(cudaMemcpy(pgh.data(), B.pg, pgh.size() * 4, cudaMemcpyDeviceToHost));
  double dg = 0; for (float v : pgh) dg += v;  // the whole dgamma, summed: the same for any grid
  printf("%-10s %-22s cols %5d grid %5lld occ %2d regs %3d smem %6zu  %7.2f us  %5.1f %% copy  chk %.6g %.6g\n", norm, name, C, grid, occ,
         fa.numRegs, smem, ms * 1e3, 100.0 * bytes / (ms * 1e-3) / 1e9 / g_copy, sum, dg);
  for (auto& e : ev) cudaEventDestroy(e);
}

template <int C>
static void sweep() {
  const i64 rows = 8192ll * 4096 / C;
  Bufs B; B.rows = rows;
  const size_t n = (size_t)rows * C;
  CK(cudaMalloc(&B.dy, n * 2)); CK(cudaMalloc(&B.xs, n * 2)); CK(cudaMalloc(&B.dx, n * 2)); CK(cudaMalloc(&B.g, C * 2));
  CK(cudaMalloc(&B.mean, rows * 4)); CK(cudaMalloc(&B.rstd, rows * 4));
  CK(cudaMalloc(&B.pg, (size_t)132 * 32 * C * 4)); CK(cudaMalloc(&B.pb, (size_t)132 * 32 * C * 4));
  {
    std::vector<u16> h(n); unsigned s = 12345u;
    for (auto& v : h) { s = s * 1664525u + 1013904223u; v = (u16)(0x3f00 + ((s >> 16) & 0xff)); if (s & 0x80000000u) v |= 0x8000; }
    CK(cudaMemcpy(B.dy, h.data(), n * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(B.xs, h.data(), n * 2, cudaMemcpyHostToDevice));
    std::vector<float> m(rows, 0.01f), r(rows, 1.3f);
    CK(cudaMemcpy(B.mean, m.data(), rows * 4, cudaMemcpyHostToDevice)); CK(cudaMemcpy(B.rstd, r.data(), rows * 4, cudaMemcpyHostToDevice));
    std::vector<u16> gh(C, 0x3f80); CK(cudaMemcpy(B.g, gh.data(), C * 2, cudaMemcpyHostToDevice));
  }
  constexpr int CH = C / 8;
  // The generated geometry: threads = chunks / per_thread rounded up to warps; LN 2 chunks, RMS 4.
  constexpr int T2 = std::min(1024, std::max(32, ((CH + 1) / 2 + 31) / 32 * 32)), N2 = (CH + T2 - 1) / T2;
  constexpr int T4 = std::min(1024, std::max(32, ((CH + 3) / 4 + 31) / 32 * 32)), N4 = (CH + T4 - 1) / T4;
  for (int rms = 0; rms < 2; ++rms) {
    const char* norm = rms ? "rmsnorm" : "layernorm";
#define VARIANTS(R)                                                                                                  \
    run("reg 2ch", k_reg<C, T2, N2, R, false>, C, T2, 0, B, norm);                                                  \
    run("reg 4ch", k_reg<C, T4, N4, R, false>, C, T4, 0, B, norm);                                                  \
    run("reg 4ch +g", k_reg<C, T4, N4, R, true>, C, T4, 0, B, norm);                                                \
    run("cp2 2ch", k_cp<C, T2, N2, R, false, 2>, C, T2, (size_t)2 * 2 * N2 * T2 * 16, B, norm);                     \
    run("cp2 4ch", k_cp<C, T4, N4, R, false, 2>, C, T4, (size_t)2 * 2 * N4 * T4 * 16, B, norm);                     \
    run("cp2 4ch +g", k_cp<C, T4, N4, R, true, 2>, C, T4, (size_t)2 * 2 * N4 * T4 * 16, B, norm);                   \
    run("cp3 2ch", k_cp<C, T2, N2, R, false, 3>, C, T2, (size_t)3 * 2 * N2 * T2 * 16, B, norm);                     \
    run("cp3 4ch", k_cp<C, T4, N4, R, false, 3>, C, T4, (size_t)3 * 2 * N4 * T4 * 16, B, norm);                     \
    run("cp3 4ch +g", k_cp<C, T4, N4, R, true, 3>, C, T4, (size_t)3 * 2 * N4 * T4 * 16, B, norm);                   \
    run("cp4 4ch", k_cp<C, T4, N4, R, false, 4>, C, T4, (size_t)4 * 2 * N4 * T4 * 16, B, norm);                     \
    run("sacc1 4ch", k_sacc<C, T4, N4, R, 1>, C, T4, (size_t)1 * C * 4 * (R ? 1 : 2), B, norm);                    \
    if constexpr (2 * T4 <= 1024)                                                                                  \
      run("sacc2 4ch", k_sacc<C, T4, N4, R, 2>, C, 2 * T4, (size_t)2 * C * 4 * (R ? 1 : 2), B, norm);              \
    run("sacc1 2ch", k_sacc<C, T2, N2, R, 1>, C, T2, (size_t)1 * C * 4 * (R ? 1 : 2), B, norm);                    \
    if constexpr (2 * T2 <= 1024)                                                                                  \
      run("sacc2 2ch", k_sacc<C, T2, N2, R, 2>, C, 2 * T2, (size_t)2 * C * 4 * (R ? 1 : 2), B, norm);
    if (rms) { VARIANTS(true) } else { VARIANTS(false) }
#undef VARIANTS
    if constexpr (C >= 8192) {  // a cluster of 2 CTAs per row: half the columns each
      constexpr int HC = C / 16, TC = std::min(1024, ((HC + 3) / 4 + 31) / 32 * 32), NC = (HC + TC - 1) / TC;
      constexpr int NQ = (HC + 255) / 256;  // Quack's 256 threads
      if (rms) {
        run("cl2 4ch +g", k_cl2<C, TC, NC, true>, C, TC, 0, B, norm, 2);
        run("cl2 256t +g", k_cl2<C, 256, NQ, true>, C, 256, 0, B, norm, 2);
      } else {
        run("cl2 4ch +g", k_cl2<C, TC, NC, false>, C, TC, 0, B, norm, 2);
        run("cl2 256t +g", k_cl2<C, 256, NQ, false>, C, 256, 0, B, norm, 2);
      }
    }
  }
  cudaFree(B.dy); cudaFree(B.xs); cudaFree(B.dx); cudaFree(B.g); cudaFree(B.mean); cudaFree(B.rstd); cudaFree(B.pg); cudaFree(B.pb);
}

int main() {
  cudaDeviceProp p; cudaGetDeviceProperties(&p, 0);
  g_copy = copy_gbs();
  printf("%s, %d SMs, copy %.0f GB/s (1 GiB DtoD, read+write)\n", p.name, p.multiProcessorCount, g_copy);
  sweep<4096>();
  sweep<1024>();
  sweep<2048>();
  sweep<8192>();
  sweep<12288>();
  return 0;
}
