// One-shot all-reduce through buffers every rank of a group maps from every other (CUDA IPC over NVLink;
// never multicast): the input of an all_reduce + residual + norm kernel (docs/parallel.md). Each rank's
// workspace (runtime/cuda/peers.cpp) holds its flags, its epoch counters and its staging buffer; the kernel
// takes the table of every rank's (jf_peers) by value. A kernel block b
//   1. pushes its rows of this rank's input into slot (b, epoch parity, this rank) of EVERY rank's staging
//      buffer (stores over NVLink: posted, no round trip), the block's j-th row at j * cols,
//   2. meets block b of every rank (jf_peer_barrier: a flag per rank, released after the block's stores),
//   3. reads slots (b, parity, 0..W-1) of its own staging buffer — local memory — summed in rank order (so
//      every rank computes the same bits), and runs the rest of the kernel on them.
// No second meeting: the next call of block b writes the other parity's slots, and the one after that rewrites
// these only after block b of every rank raised its flag once more, which each does after its kernel (and its
// reads of these slots) ended. The epochs live in device memory and advance in the kernel, so a CUDA graph
// replays it as it is.
#pragma once

#define JF_PEER_MAX_RANKS 8
#define JF_PEER_MAX_BLOCKS 128
#define JF_PEER_BLOCK_BYTES 32768

struct jf_peers {
  void* data[JF_PEER_MAX_RANKS];        // each rank's staging buffer, as this process maps it
  unsigned* flags[JF_PEER_MAX_RANKS];   // each rank's flags [JF_PEER_MAX_BLOCKS][JF_PEER_MAX_RANKS]
  unsigned* epochs;                     // this rank's [JF_PEER_MAX_BLOCKS][JF_PEER_MAX_RANKS], one per waiting thread
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

// The parity of this block's coming meeting (read before it).
__device__ __forceinline__ unsigned jf_peer_parity(const jf_peers& p) {
  return (p.epochs[blockIdx.x * JF_PEER_MAX_RANKS] + 1u) & 1u;
}
// The byte offset of slot (this block, parity, src) in a staging buffer of a W-rank group.
template <int W>
__device__ __forceinline__ size_t jf_peer_slot(unsigned parity, int src) {
  return (((size_t)blockIdx.x * 2 + parity) * W + src) * JF_PEER_BLOCK_BYTES;
}
// This block's j-th row (of `cols` elements of type ST) in slot (this block, parity, src) of rank dst's staging
// buffer: where a block pushes its rows (dst: every rank, src: this one) and reads every rank's (dst: this rank).
template <int W, class ST>
__device__ __forceinline__ ST* jf_peer_row(const jf_peers& p, int dst, unsigned parity, int src, long long j,
                                           int cols) {
  return (ST*)((char*)p.data[dst] + jf_peer_slot<W>(parity, src)) + j * cols;
}

// Block blockIdx.x of every rank meets here. Thread t < W advances its epoch, raises this rank's flag at rank
// t (a release at system scope after the block's barrier: the block's pushed rows before it) and waits for
// rank t's flag here (an acquire). A rank that never comes (ranks that called different sequences) ends the
// wait after about 100 s with a message and a trap: the context reports an error instead of hanging the host.
template <int W>
__device__ __forceinline__ void jf_peer_barrier(const jf_peers& p) {
  __syncthreads();
  if (threadIdx.x < W) {
    const int slot = (int)blockIdx.x * JF_PEER_MAX_RANKS;
    unsigned* counter = p.epochs + slot + threadIdx.x;
    const unsigned e = *counter + 1u;
    *counter = e;
    jf_peer_store_release(p.flags[threadIdx.x] + slot + p.rank, e);
    const unsigned* mine = p.flags[p.rank] + slot + threadIdx.x;
    unsigned long long t0 = 0;
    for (unsigned spin = 0; (int)(jf_peer_load_acquire(mine) - e) < 0; ++spin) {
      if ((spin & 1023u) != 0) continue;
      unsigned long long now;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
      if (t0 == 0) t0 = now;
      if (now - t0 > 100000000000ull) {
        printf("jitfuse: all-reduce over peers: rank %d waited 100 s for rank %d (block %d): did every rank call "
               "the same sequences in the same order?\n", p.rank, (int)threadIdx.x, (int)blockIdx.x);
        __trap();
      }
    }
  }
  __syncthreads();
}
