// One-shot all-reduce through buffers every rank of a group maps from every other (CUDA IPC over NVLink;
// never multicast): the input of an all_reduce + residual + norm kernel (docs/parallel.md). Each rank's
// workspace (runtime/cuda/peers.cpp) holds its per-block call state and its staging buffer; the kernel takes
// the table of every rank's (jf_peers) by value. No flags and no meeting: every word a block reads tells by
// itself whether it arrived (the Lamport way of TensorRT-LLM's one-shot kernels). Staging words nobody wrote hold
// JF_PEER_UNSET, and no pushed value has those bits (jf_peer_store8 writes +0 for them). A kernel block b
//   1. pushes its rows of this rank's input into slot (b, buffer c, this rank) of EVERY rank's staging buffer
//      (stores over NVLink: posted, no round trip), the block's j-th row at j * cols; c cycles 0, 1, 2 per call
//      of block b;
//   2. sets back to JF_PEER_UNSET the slots (b, c - 1, *) of its own staging buffer, which it read in its previous
//      call (jf_peer_end: their size was recorded then), and records (c + 1, this call's size);
//   3. reads slots (b, c, 0..W-1) of its own staging buffer — local memory — until none of the words it needs is
//      unset, and sums them in rank order (every rank computes the same bits); the rest of the kernel runs on
//      the sums.
// Three buffers, because a peer's block b writes buffer c + 3 = c only in its call after next, which needs this
// rank's rows of the next call, which this block pushes only after its kernel (and step 2) ended; with two, a
// peer could write buffer c + 2 = c while this block still clears it. The state lives in device memory and
// advances in the kernel, so a CUDA graph replays it as it is.
#pragma once

#define JF_PEER_MAX_RANKS 8
#define JF_PEER_MAX_BLOCKS 128
#define JF_PEER_BLOCK_BYTES 32768
#define JF_PEER_BUFFERS 3
// An unwritten 32-bit staging word: -0.0 in each half for 16-bit dtypes, a negative subnormal for fp32.
#define JF_PEER_UNSET 0x80008000u

struct jf_peers {
  void* data[JF_PEER_MAX_RANKS];  // each rank's staging buffer, as this process maps it
  unsigned* state;                // this rank's [JF_PEER_MAX_BLOCKS][2]: per block, its buffer and last call's bytes
  int rank, world;
};
// What block blockIdx.x's call uses: its buffer, and the bytes per slot its previous call wrote.
struct jf_peer_call {
  unsigned buf, prev_bytes;
};

__device__ __forceinline__ jf_peer_call jf_peer_begin(const jf_peers& p) {
  const unsigned* s = p.state + 2 * blockIdx.x;
  return jf_peer_call{s[0], s[1]};
}
// The byte offset of slot (this block, buffer, src) in a staging buffer of a W-rank group.
template <int W>
__device__ __forceinline__ size_t jf_peer_slot(unsigned buf, int src) {
  return (((size_t)blockIdx.x * JF_PEER_BUFFERS + buf) * W + src) * JF_PEER_BLOCK_BYTES;
}
// This block's j-th row (of `cols` elements of type ST) in slot (this block, buffer, src) of rank dst's staging
// buffer: where a block pushes its rows (dst: every rank, src: this one) and reads every rank's (dst: this rank).
template <int W, class ST>
__device__ __forceinline__ ST* jf_peer_row(const jf_peers& p, int dst, unsigned buf, int src, long long j, int cols) {
  return (ST*)((char*)p.data[dst] + jf_peer_slot<W>(buf, src)) + j * cols;
}

template <class S>
__device__ __forceinline__ bool jf_peer_unset(S h) {
  if constexpr (sizeof(S) == 2)
    return h == (S)0x8000u;
  else
    return __float_as_uint(h) == JF_PEER_UNSET;
}
// jf_store8 for a staging row: a value whose bits read as unset is pushed as +0 (bf16/fp16 -0.0; the fp32
// subnormal -4.6e-41).
template <class DT, bool VEC>
__device__ __forceinline__ void jf_peer_store8(typename DT::storage* p, const float (&v)[8], int n) {
  typedef typename DT::storage S;
  S h[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    h[e] = DT::store(v[e]);
    if (jf_peer_unset(h[e])) h[e] = (S)0;
  }
  if (VEC) {
    if constexpr (sizeof(S) == 2) {
      uint4 q;
      q.x = (jf_u32)h[0] | ((jf_u32)h[1] << 16); q.y = (jf_u32)h[2] | ((jf_u32)h[3] << 16);
      q.z = (jf_u32)h[4] | ((jf_u32)h[5] << 16); q.w = (jf_u32)h[6] | ((jf_u32)h[7] << 16);
      *reinterpret_cast<uint4*>(p) = q;
    } else {
      reinterpret_cast<float4*>(p)[0] = make_float4(h[0], h[1], h[2], h[3]);
      reinterpret_cast<float4*>(p)[1] = make_float4(h[4], h[5], h[6], h[7]);
    }
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e)
      if (e < n) p[e] = h[e];
  }
}

__device__ __forceinline__ uint4 jf_peer_ld4(const void* p) {
  uint4 q;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(q.x), "=r"(q.y), "=r"(q.z), "=r"(q.w) : "l"(p));
  return q;
}
// The 8 staged values at p as floats; false while one of the first n is still unset. Volatile loads: each try
// reads memory again.
template <class DT, bool VEC>
__device__ __forceinline__ bool jf_peer_try8(const typename DT::storage* p, float (&t)[8], int n) {
  typedef typename DT::storage S;
  S h[8];
  if (VEC) {
    if constexpr (sizeof(S) == 2) {
      const uint4 q = jf_peer_ld4(p);
      const jf_u32 w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) { h[2 * i] = (S)(w[i] & 0xffffu); h[2 * i + 1] = (S)(w[i] >> 16); }
    } else {
      const uint4 a = jf_peer_ld4(p), b = jf_peer_ld4(p + 4);
      h[0] = __uint_as_float(a.x); h[1] = __uint_as_float(a.y); h[2] = __uint_as_float(a.z); h[3] = __uint_as_float(a.w);
      h[4] = __uint_as_float(b.x); h[5] = __uint_as_float(b.y); h[6] = __uint_as_float(b.z); h[7] = __uint_as_float(b.w);
    }
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      h[e] = (S)0;
      if (e < n) {
        if constexpr (sizeof(S) == 2)
          asm volatile("ld.volatile.global.u16 %0, [%1];" : "=h"(h[e]) : "l"(p + e));
        else
          asm volatile("ld.volatile.global.f32 %0, [%1];" : "=f"(h[e]) : "l"(p + e));
      }
    }
  }
  bool ok = true;
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    if (e < n && jf_peer_unset(h[e])) ok = false;
    t[e] = e < n ? DT::load(h[e]) : 0.f;
  }
  return ok;
}

// x = the sum over the W ranks, in rank order, of the 8 values at column c0 of this block's j-th staged row:
// every rank's slot read (all loads in flight) until none of the words is unset. A rank that never pushes (ranks
// that called different sequences) ends the wait after about 100 s with a message and a trap: the context
// reports an error instead of hanging the host.
template <int W, class DT, bool VEC>
__device__ __forceinline__ void jf_peer_sum8(const jf_peers& p, unsigned buf, long long j, int cols, int c0,
                                             float (&x)[8], int n) {
  typedef typename DT::storage S;
  float t[W][8];
  unsigned long long t0 = 0;
  for (unsigned spin = 0;; ++spin) {
    bool ok = true;
#pragma unroll
    for (int w = 0; w < W; ++w) ok &= jf_peer_try8<DT, VEC>(jf_peer_row<W, S>(p, p.rank, buf, w, j, cols) + c0, t[w], n);
    if (ok) break;
    if ((spin & 1023u) != 1023u) continue;
    unsigned long long now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (t0 == 0) t0 = now;
    if (now - t0 > 100000000000ull) {
      printf("jitfuse: all-reduce over peers: rank %d waited 100 s for its peers' rows (block %d): did every rank "
             "call the same sequences in the same order?\n", p.rank, (int)blockIdx.x);
      __trap();
    }
  }
#pragma unroll
  for (int e = 0; e < 8; ++e) x[e] = 0.f;
#pragma unroll
  for (int w = 0; w < W; ++w)
#pragma unroll
    for (int e = 0; e < 8; ++e) x[e] += t[w][e];
}

// Step 2 after this block pushed its rows: the slots its previous call read are set back to unset, then (after
// every thread of the block read the call state) the next call's buffer and this call's bytes per slot recorded.
template <int W>
__device__ __forceinline__ void jf_peer_end(const jf_peers& p, jf_peer_call c, long long rows, int row_bytes) {
  const unsigned prev = (c.buf + JF_PEER_BUFFERS - 1) % JF_PEER_BUFFERS;
  const unsigned quads = (c.prev_bytes + 15u) / 16u;
  const uint4 unset = make_uint4(JF_PEER_UNSET, JF_PEER_UNSET, JF_PEER_UNSET, JF_PEER_UNSET);
#pragma unroll
  for (int w = 0; w < W; ++w) {
    uint4* s = (uint4*)((char*)p.data[p.rank] + jf_peer_slot<W>(prev, w));
    for (unsigned i = threadIdx.x; i < quads; i += blockDim.x) s[i] = unset;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    const long long mine = rows > (long long)blockIdx.x ? (rows - 1 - (long long)blockIdx.x) / gridDim.x + 1 : 0;
    p.state[2 * blockIdx.x] = (c.buf + 1) % JF_PEER_BUFFERS;
    p.state[2 * blockIdx.x + 1] = (unsigned)(mine * row_bytes);
  }
}
