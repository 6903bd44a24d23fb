// One-shot all-reduce through buffers every rank of a group maps from every other (CUDA IPC over NVLink;
// never multicast): the input of an all_reduce + residual + norm kernel (docs/parallel.md). Each rank's
// workspace (runtime/cuda/peers.cpp) holds its flags, its staging buffer and, for its own use, its epoch
// counters and this table. A kernel block b
//   1. copies its rows of this rank's input into this rank's staging buffer,
//   2. meets block b of every rank (jf_peer_barrier, phase 0): their rows are staged,
//   3. reads the rows of every rank's staging buffer, summed in rank order (so every rank computes the
//      same bits), and runs the rest of the kernel on them,
//   4. meets block b of every rank again (phase 1): nobody reads this rank's staging buffer any more, so
//      the next call may overwrite it.
// The epochs live in device memory and advance in the kernel, so a CUDA graph replays it as it is.
#pragma once

#define JF_PEER_MAX_RANKS 8
#define JF_PEER_MAX_BLOCKS 128

struct jf_peers {
  void* data[JF_PEER_MAX_RANKS];        // each rank's staging buffer, as this process maps it
  unsigned* flags[JF_PEER_MAX_RANKS];   // each rank's flags [2 phases][JF_PEER_MAX_BLOCKS][JF_PEER_MAX_RANKS]
  unsigned* epochs;                     // this rank's [2 phases][JF_PEER_MAX_BLOCKS]
  int rank, world;
};

__device__ __forceinline__ void jf_peer_store_release(unsigned* p, unsigned v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ unsigned jf_peer_load_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Block blockIdx.x of every rank meets here. Thread t < W raises this rank's flag at rank t and waits for
// rank t's flag here. A rank that never comes (ranks that called different sequences) ends the wait after
// about 100 s with a message and a trap: the context reports an error instead of hanging the host.
template <int W>
__device__ __forceinline__ void jf_peer_barrier(const jf_peers* __restrict__ p, int phase) {
  __shared__ unsigned jf_epoch;
  __threadfence_system();  // this block's stores (the staged rows) before the flags that announce them
  __syncthreads();
  unsigned* counter = p->epochs + phase * JF_PEER_MAX_BLOCKS + blockIdx.x;
  if (threadIdx.x == 0) jf_epoch = *counter + 1u;
  __syncthreads();
  const unsigned e = jf_epoch;
  if (threadIdx.x < W) {
    const int slot = (phase * JF_PEER_MAX_BLOCKS + (int)blockIdx.x) * JF_PEER_MAX_RANKS;
    jf_peer_store_release(p->flags[threadIdx.x] + slot + p->rank, e);
    const unsigned* mine = p->flags[p->rank] + slot + threadIdx.x;
    unsigned long long t0 = 0;
    for (unsigned spin = 0; (int)(jf_peer_load_acquire(mine) - e) < 0; ++spin) {
      if ((spin & 1023u) != 0) continue;
      unsigned long long now;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
      if (t0 == 0) t0 = now;
      if (now - t0 > 100000000000ull) {
        printf("jitfuse: all-reduce over peers: rank %d waited 100 s for rank %d (block %d, phase %d): did every "
               "rank call the same sequences in the same order?\n", p->rank, (int)threadIdx.x, (int)blockIdx.x, phase);
        __trap();
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) *counter = e;
}
