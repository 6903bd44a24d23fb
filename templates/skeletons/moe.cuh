// Mixture-of-experts routing and row permutations (issue 43), without a host synchronisation: the number
// of rows each expert gets stays on the device (splits / starts), every grid is sized from the static
// bound T k, and rows past the kept ones are zero. The routing buffer of a moe_permute (int32) holds, for
// T tokens and top-k of E experts (n = T k entries (t, j), C = ceil(n / 1024) chunks of entries):
//   dest [n]     (t, j) -> its row in the permuted tensor, -1 when dropped (capacity, or an id outside [0, E))
//   src  [n]     permuted row -> its token (rows >= starts[E] unused)
//   splits [E]   rows kept per expert
//   starts [E+1] exclusive scan of splits; starts[E] = the rows kept
//   counts [C E] entries of chunk c routed to expert e
//   base   [C E] how many entries of earlier chunks route to e (the rank of chunk c's first one)
// Rows are expert-contiguous and stable: within an expert, by token, then slot; with a capacity, an expert
// keeps its first `capacity` entries in that order (runtime/reference moe_route is the same order).
#pragma once

#define JF_MOE_CHUNK 1024

struct JfMoeRoute {
  int *dest, *src, *splits, *starts, *counts, *base;
  jf_i64 n, chunks;
};

// src_rows: the permuted tensor's rows (T k packed; E x capacity padded), what src holds one int for.
__device__ __forceinline__ JfMoeRoute jf_moe_route(int* r, jf_i64 tokens, int topk, int experts, jf_i64 src_rows) {
  JfMoeRoute rt;
  rt.n = tokens * topk;
  rt.chunks = (rt.n + JF_MOE_CHUNK - 1) / JF_MOE_CHUNK;
  rt.dest = r;
  rt.src = r + rt.n;
  rt.splits = r + rt.n + src_rows;
  rt.starts = rt.splits + experts;
  rt.counts = rt.starts + experts + 1;
  rt.base = rt.counts + rt.chunks * experts;
  return rt;
}

template <typename IT>
__device__ __forceinline__ int jf_moe_expert(const IT* __restrict__ idx, jf_i64 i, int experts) {
  const long long e = (long long)idx[i];
  return (e >= 0 && e < experts) ? (int)e : -1;
}

// Chunk c's count per expert, through a shared histogram (the whole block; it ends with the counts stored).
template <typename IT>
__device__ void jf_moe_count_chunk(const IT* __restrict__ idx, JfMoeRoute rt, int experts, int* hist, jf_i64 c) {
  for (int e = threadIdx.x; e < experts; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  const jf_i64 i0 = c * JF_MOE_CHUNK;
  for (int l = threadIdx.x; l < JF_MOE_CHUNK && i0 + l < rt.n; l += blockDim.x) {
    const int e = jf_moe_expert(idx, i0 + l, experts);
    if (e >= 0) atomicAdd(&hist[e], 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < experts; e += blockDim.x) rt.counts[c * experts + e] = hist[e];
}

// One block of 1024 threads: thread e walks the chunks for expert e (the rank base of each), caps the
// expert's rows at the capacity, then the block scans the kept rows into starts.
// padded: expert e's rows start at e x capacity (the capacity layout), not at the scan of the kept rows.
__device__ void jf_moe_scan(JfMoeRoute rt, int experts, jf_i64 capacity, bool padded) {
  for (int e0 = 0; e0 < experts; e0 += blockDim.x) {
    const int e = e0 + threadIdx.x;
    if (e < experts) {
      int run = 0;
      for (jf_i64 c = 0; c < rt.chunks; ++c) {
        rt.base[c * experts + e] = run;
        run += rt.counts[c * experts + e];
      }
      rt.splits[e] = capacity >= 0 && run > capacity ? (int)capacity : run;
    }
  }
  __syncthreads();
  // starts: a serial scan by thread 0 (E is at most a few thousand ints, once per call).
  if (threadIdx.x == 0) {
    int run = 0;
    for (int e = 0; e < experts; ++e) {
      rt.starts[e] = padded ? (int)(e * capacity) : run;
      run += rt.splits[e];
    }
    rt.starts[experts] = padded ? (int)(experts * capacity) : run;
  }
}

// Chunk c (the whole block): each entry's rank among the entries of its expert (the earlier chunks' base
// plus the earlier entries of this chunk with the same expert), its row and the row's token.
template <typename IT>
__device__ void jf_moe_scatter_chunk(const IT* __restrict__ idx, JfMoeRoute rt, int topk, int experts,
                                     jf_i64 capacity, int* ids, jf_i64 c) {
  const jf_i64 i0 = c * JF_MOE_CHUNK;
  const int m = (int)min((jf_i64)JF_MOE_CHUNK, rt.n - i0);
  for (int l = threadIdx.x; l < m; l += blockDim.x) ids[l] = jf_moe_expert(idx, i0 + l, experts);
  __syncthreads();
  for (int l = threadIdx.x; l < m; l += blockDim.x) {
    const int e = ids[l];
    int row = -1;
    if (e >= 0) {
      int rank = rt.base[c * experts + e];
      for (int j = 0; j < l; ++j) rank += ids[j] == e;
      if (capacity < 0 || rank < capacity) {
        row = rt.starts[e] + rank;
        rt.src[row] = (int)((i0 + l) / topk);
      }
    }
    rt.dest[i0 + l] = row;
  }
}
