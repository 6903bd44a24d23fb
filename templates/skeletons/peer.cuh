// One-shot all-reduce through buffers every rank of a group maps from every other (CUDA IPC over NVLink;
// never multicast): the input of an all_reduce + residual + norm kernel (docs/parallel.md). Each rank's
// workspace (runtime/cuda/peers.cpp) holds its epoch counters and its staging buffer; the kernel takes the
// table of every rank's buffer (jf_peers) by value. Block b of a call with epoch e (this block's count of
// calls, kept in device memory, so a CUDA graph replays the kernel as it is):
//   1. pushes its rows of this rank's input into slot (b, e & 1, this rank) of EVERY rank's staging buffer,
//      as NCCL's LL protocol does: each 32-bit word of data travels with the epoch beside it in one 8-byte
//      half of a 16-byte store, so no fence, flag or barrier is needed;
//   2. reads slots (b, e & 1, 0..W-1) of its own staging buffer — local memory — spinning on each word until
//      its epoch is e, sums them in rank order (every rank computes the same bits) and runs the rest of the
//      kernel on them.
// The slot of parity e & 1 is written again at epoch e + 2 only after this rank's block b read every rank's
// words of epoch e + 1, which each rank wrote after its kernel of epoch e (and its reads) ended. A rank that
// never comes (ranks that called different sequences) ends the wait after about 100 s with a message and a
// trap: the context reports an error instead of hanging the host.
#pragma once

#define JF_PEER_MAX_RANKS 8
#define JF_PEER_MAX_BLOCKS 128
#define JF_PEER_BLOCK_BYTES 32768

struct jf_peers {
  void* data[JF_PEER_MAX_RANKS];  // each rank's staging buffer, as this process maps it
  unsigned* epochs;               // this rank's [JF_PEER_MAX_BLOCKS]
  int rank, world;
};

// The epoch of this block's call (read before the kernel ends; jf_peer_done stores it).
__device__ __forceinline__ unsigned jf_peer_epoch(const jf_peers& p) { return p.epochs[blockIdx.x] + 1u; }
__device__ __forceinline__ void jf_peer_done(const jf_peers& p, unsigned epoch) {
  __syncthreads();  // every thread read the old epoch
  if (threadIdx.x == 0) p.epochs[blockIdx.x] = epoch;
}

// The 16-byte words of 8 elements of DT in a slot: 4 (16-bit) or 8 (fp32) data words, each beside its epoch.
template <typename DT>
struct jf_peer_words {
  static constexpr int N = sizeof(typename DT::storage) == 2 ? 4 : 8;
};
// Chunk c0 / 8 of row j of slot (this block, epoch & 1, src) in the staging buffer at `base`, for rows of `cols`.
template <int W, typename DT>
__device__ __forceinline__ unsigned* jf_peer_chunk(void* base, unsigned epoch, int src, long long j, int c0, int cols) {
  const size_t slot = (((size_t)blockIdx.x * 2 + (epoch & 1u)) * W + src) * JF_PEER_BLOCK_BYTES;
  const size_t chunk = (size_t)j * ((cols + 7) / 8) + c0 / 8;
  return (unsigned*)((char*)base + slot + chunk * jf_peer_words<DT>::N * 8);
}

template <typename DT>
__device__ __forceinline__ void jf_peer_put8(unsigned* dst, const float (&v)[8], int n, unsigned epoch) {
  constexpr int N = jf_peer_words<DT>::N;
  unsigned w[N];
#pragma unroll
  for (int i = 0; i < N; ++i) {
    if (N == 4) {
      const unsigned lo = 2 * i < n ? (unsigned)DT::store(v[2 * i]) : 0u;
      const unsigned hi = 2 * i + 1 < n ? (unsigned)DT::store(v[2 * i + 1]) : 0u;
      w[i] = (lo & 0xffffu) | (hi << 16);
    } else {
      w[i] = i < n ? __float_as_uint(v[i]) : 0u;
    }
  }
#pragma unroll
  for (int i = 0; i < N; i += 2)
    asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(dst + 2 * i), "r"(w[i]), "r"(epoch),
                 "r"(w[i + 1]), "r"(epoch) : "memory");
}

__device__ __noinline__ void jf_peer_timeout(const jf_peers& p, int src) {
  printf("jitfuse: all-reduce over peers: rank %d waited 100 s for rank %d (block %d): did every rank call the same "
         "sequences in the same order?\n", p.rank, src, (int)blockIdx.x);
  __trap();
}

template <typename DT>
__device__ __forceinline__ void jf_peer_get8(const jf_peers& p, int src, const unsigned* from, float (&v)[8],
                                             unsigned epoch) {
  constexpr int N = jf_peer_words<DT>::N;
  unsigned w[N];
#pragma unroll
  for (int i = 0; i < N; i += 2) {
    unsigned d0, f0, d1, f1;
    unsigned long long t0 = 0;
    for (unsigned spin = 0;; ++spin) {
      asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(d0), "=r"(f0), "=r"(d1), "=r"(f1) : "l"(from + 2 * i) : "memory");
      if (f0 == epoch && f1 == epoch) break;
      if ((spin & 0xffffu) != 0xffffu) continue;
      unsigned long long now;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
      if (t0 == 0) t0 = now;
      if (now - t0 > 100000000000ull) jf_peer_timeout(p, src);
    }
    w[i] = d0;
    w[i + 1] = d1;
  }
#pragma unroll
  for (int i = 0; i < N; ++i) {
    if (N == 4) {
      v[2 * i] = DT::load((jf_u16)(w[i] & 0xffffu));
      v[2 * i + 1] = DT::load((jf_u16)(w[i] >> 16));
    } else {
      v[i] = __uint_as_float(w[i]);
    }
  }
}
