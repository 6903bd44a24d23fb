// Device code of the cross_entropy skeleton (codegen/src/cross_entropy.cpp emits the kernels that call it):
// one block per row of logits, streamed once with an online max and sum of exponentials (16-byte loads from
// the row's first 16-byte boundary on, scalar head and tail: any V), the loss by thread 0, dlogits in a
// second pass over the row. z = cap tanh(x / cap) with soft-capping (CAP), else z = x.
#pragma once

// One thread's (or, merged, the row's) statistics: running max m, sum of exp(z - m), sum of z.
struct JfCeStat {
  float m, s, z;
};

__device__ __forceinline__ JfCeStat jf_ce_empty() {
  JfCeStat st;
  st.m = -3.402823466e38f;  // finite: exp(-FLT_MAX - m) is 0 where exp(-inf - -inf) would be NaN
  st.s = 0.f;
  st.z = 0.f;
  return st;
}

template <bool CAP>
__device__ __forceinline__ float jf_ce_z(float x, float cap) {
  return CAP ? cap * tanhf(x / cap) : x;
}

// The first n of z[8] into st: one rescale per chunk, not per element.
__device__ __forceinline__ void jf_ce_add8(JfCeStat& st, const float (&z)[8], int n) {
  float cm = st.m;
#pragma unroll
  for (int e = 0; e < 8; ++e)
    if (e < n) cm = fmaxf(cm, z[e]);
  if (cm > st.m) {
    st.s *= __expf(st.m - cm);
    st.m = cm;
  }
#pragma unroll
  for (int e = 0; e < 8; ++e)
    if (e < n) {
      st.s += __expf(z[e] - st.m);
      st.z += z[e];
    }
}

__device__ __forceinline__ void jf_ce_merge(JfCeStat& a, const JfCeStat& b) {
  const float m = fmaxf(a.m, b.m);
  a.s = a.s * __expf(a.m - m) + b.s * __expf(b.m - m);
  a.m = m;
  a.z += b.z;
}

__device__ __forceinline__ void jf_ce_warp_merge(JfCeStat& st) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    JfCeStat b;
    b.m = __shfl_xor_sync(0xffffffffu, st.m, o);
    b.s = __shfl_xor_sync(0xffffffffu, st.s, o);
    b.z = __shfl_xor_sync(0xffffffffu, st.z, o);
    jf_ce_merge(st, b);
  }
}

// The row's statistics in every thread, merged in a fixed order (deterministic). `smem`: 96 floats.
__device__ __forceinline__ JfCeStat jf_ce_block_merge(JfCeStat st, float* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  jf_ce_warp_merge(st);
  __syncthreads();  // smem may still be read by a previous merge
  if (lane == 0) {
    smem[warp] = st.m;
    smem[32 + warp] = st.s;
    smem[64 + warp] = st.z;
  }
  __syncthreads();
  JfCeStat t = jf_ce_empty();
  if (lane < nwarps) {
    t.m = smem[lane];
    t.s = smem[32 + lane];
    t.z = smem[64 + lane];
  }
  jf_ce_warp_merge(t);
  return t;
}

// Elements [0, head) of a row at p are loaded one by one, so that p + head is 16-byte aligned (VEC); the
// whole chunks of 8 after it with 16-byte loads; the rest one by one. Without VEC: all one by one.
template <typename DT, bool VEC>
__device__ __forceinline__ int jf_ce_head(const typename DT::storage* p, int v) {
  if (!VEC) return v;
  const int esz = (int)sizeof(typename DT::storage);
  const int mis = (int)(((jf_u64)p) & 15u);  // a multiple of esz: the tensor is element-aligned
  const int h = mis ? (16 - mis) / esz : 0;
  return h < v ? h : v;
}

// This thread's share of the row's statistics. Chunk loads go 4 at a time (4 x 16 bytes in flight).
template <typename DT, bool VEC, bool CAP>
__device__ __forceinline__ JfCeStat jf_ce_row_stats(const typename DT::storage* __restrict__ row, int v, float cap) {
  JfCeStat st = jf_ce_empty();
  const int T = blockDim.x, t = threadIdx.x;
  const int head = jf_ce_head<DT, VEC>(row, v);
  const int nch = (v - head) >> 3, tail = head + (nch << 3);
  for (int j = t; j < head; j += T) {  // VEC: fewer than 8 elements; scalar: the whole row
    float z[8];
    z[0] = jf_ce_z<CAP>(DT::load(row[j]), cap);
    jf_ce_add8(st, z, 1);
  }
  const typename DT::storage* body = row + head;
  for (int c0 = t; c0 < nch; c0 += 4 * T) {
    float z[4][8];
#pragma unroll
    for (int u = 0; u < 4; ++u)
      if (c0 + u * T < nch) jf_load8<DT, true>(body + ((c0 + u * T) << 3), z[u]);
#pragma unroll
    for (int u = 0; u < 4; ++u)
      if (c0 + u * T < nch) {
#pragma unroll
        for (int e = 0; e < 8; ++e) z[u][e] = jf_ce_z<CAP>(z[u][e], cap);
        jf_ce_add8(st, z[u], 8);
      }
  }
  if (tail + t < v) {  // fewer than 8 elements
    float z[8];
    z[0] = jf_ce_z<CAP>(DT::load(row[tail + t]), cap);
    jf_ce_add8(st, z, 1);
  }
  return st;
}

// loss = lse - (1 - eps) z_y - (eps / V) sum z + zl lse^2 of a row whose merged statistics are `st`.
__device__ __forceinline__ float jf_ce_loss(const JfCeStat& st, float lse, float zy, float inv_v, float eps, float zl) {
  return lse - (1.f - eps) * zy - eps * inv_v * st.z + zl * lse * lse;
}

// dx_j = (a p_j - c - [j == y] b) (1 - (z_j / cap)^2 with CAP), p_j = exp(z_j - lse): the row's gradient,
// written to dx (which may be x itself: each element is read before it is written, by the same thread).
template <typename DT, bool VEC, bool CAP>
__device__ __forceinline__ void jf_ce_grad_row(const typename DT::storage* x, typename DT::storage* dx, int v,
                                               float lse, float a, float b, float c, jf_i64 y, float cap) {
  const int T = blockDim.x, t = threadIdx.x;
  const int head = jf_ce_head<DT, VEC>(x, v);
  const int nch = (v - head) >> 3, tail = head + (nch << 3);
  const float inv_cap = CAP ? 1.f / cap : 0.f;
  auto one = [&](float xv, int j) {
    const float z = jf_ce_z<CAP>(xv, cap);
    float d = a * __expf(z - lse) - c - (j == y ? b : 0.f);
    if (CAP) {
      const float tz = z * inv_cap;
      d *= 1.f - tz * tz;
    }
    return d;
  };
  for (int j = t; j < head; j += T) dx[j] = DT::store(one(DT::load(x[j]), j));
  for (int c0 = t; c0 < nch; c0 += 4 * T) {
    float z[4][8];
#pragma unroll
    for (int u = 0; u < 4; ++u)
      if (c0 + u * T < nch) jf_load8<DT, true>(x + head + ((c0 + u * T) << 3), z[u]);
#pragma unroll
    for (int u = 0; u < 4; ++u)
      if (c0 + u * T < nch) {
        const int j0 = head + ((c0 + u * T) << 3);
#pragma unroll
        for (int e = 0; e < 8; ++e) z[u][e] = one(z[u][e], j0 + e);
        jf_store8<DT, true>(dx + j0, z[u]);
      }
  }
  if (tail + t < v) dx[tail + t] = DT::store(one(DT::load(x[tail + t]), tail + t));
}

// dx = 0 over a row (an ignored label: no gradient).
template <typename DT, bool VEC>
__device__ __forceinline__ void jf_ce_zero_row(typename DT::storage* dx, int v) {
  const int T = blockDim.x, t = threadIdx.x;
  const int head = jf_ce_head<DT, VEC>(dx, v);
  const int nch = (v - head) >> 3, tail = head + (nch << 3);
  const float zero[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (int j = t; j < head; j += T) dx[j] = DT::store(0.f);
  for (int c = t; c < nch; c += T) jf_store8<DT, true>(dx + head + (c << 3), zero);
  if (tail + t < v) dx[tail + t] = DT::store(0.f);
}

// A block's sum of `s` and of `n` (fixed order: deterministic); every thread gets both.
__device__ __forceinline__ void jf_ce_block_sum(float s, int n, float* smem, float* sum, int* count) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    s += __shfl_xor_sync(0xffffffffu, s, o);
    n += __shfl_xor_sync(0xffffffffu, n, o);
  }
  int* smem_n = reinterpret_cast<int*>(smem + 32);
  if (lane == 0) {
    smem[warp] = s;
    smem_n[warp] = n;
  }
  __syncthreads();
  s = lane < nwarps ? smem[lane] : 0.f;
  n = lane < nwarps ? smem_n[lane] : 0;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    s += __shfl_xor_sync(0xffffffffu, s, o);
    n += __shfl_xor_sync(0xffffffffu, n, o);
  }
  *sum = s;
  *count = n;
}

// Sum of the rows' losses (loss: null for the count alone) and count of rows not ignored, over one block.
template <typename LT>
__device__ __forceinline__ void jf_ce_reduce(const float* __restrict__ loss, const LT* __restrict__ labels, jf_i64 rows,
                                             jf_i64 ignore, float* smem, float* sum, int* count) {
  float s = 0.f;
  int n = 0;
  for (jf_i64 r = threadIdx.x; r < rows; r += blockDim.x)
    if ((jf_i64)labels[r] != ignore) {
      if (loss) s += loss[r];
      ++n;
    }
  jf_ce_block_sum(s, n, smem, sum, count);
}
