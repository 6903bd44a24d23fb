// The cast_transpose skeleton's tile: 64 columns x 64 rows of FP8 codes staged in shared memory, so that
// the transposed codes ([cols, rows]) leave the block as 16-byte stores of 16 rows of one column.
#pragma once

// Byte offset of (column c, row r) in a 4096-byte tile. Column c's 64 rows are four 16-byte slots of 16
// rows; slot k of column c lies at 16-byte position 4 * (c ^ bit 5 of c) + (k ^ bits 3-4 of c). The XOR
// puts in distinct banks both what a warp writes at once (8 columns 8 apart, the same 8 rows: 16-bit
// stores) and what 8 threads read at once (2 adjacent columns x 4 slots: 16-byte loads).
__device__ __forceinline__ int jf_ct_offset(int c, int r) {
  return ((((c ^ ((c >> 5) & 1)) << 2) | ((r >> 4) ^ ((c >> 3) & 3))) << 4) | (r & 15);
}

// Stages the codes of one thread's 8 columns c .. c + 7 for the rows r (even) and r + 1: lo and hi hold the
// codes of the two rows (element e in byte e % 4 of word e / 4); each column's pair is one 16-bit store.
__device__ __forceinline__ void jf_ct_stage(unsigned char* tile, int c, int r, const jf_u32 (&lo)[2], const jf_u32 (&hi)[2]) {
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const jf_u32 pair = __byte_perm(lo[e >> 2], hi[e >> 2], (e & 3) | ((4 + (e & 3)) << 4));
    *reinterpret_cast<jf_u16*>(tile + jf_ct_offset(c + e, r)) = (jf_u16)pair;
  }
}

// Stores slot k (rows 16k .. 16k + 15) of tile column c to p (the transposed tensor at that column and the
// slot's first row). VEC: p is 16-byte aligned and the 16 rows exist (rows % 16 == 0): one 16-byte store;
// else byte by byte, the first n rows.
template <bool VEC>
__device__ __forceinline__ void jf_ct_store16(unsigned char* __restrict__ p, const unsigned char* tile, int c, int k, int n = 16) {
  const uint4 v = *reinterpret_cast<const uint4*>(tile + jf_ct_offset(c, 16 * k));
  if (VEC) {
    *reinterpret_cast<uint4*>(p) = v;
  } else {
    const jf_u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 16; ++i)
      if (i < n) p[i] = (unsigned char)(w[i >> 2] >> (8 * (i & 3)));
  }
}

// Loads the 8 codes p[0 .. 7] into q (element e in byte e % 4 of word e / 4, as jf_ct_stage takes them).
// VEC: p is 8-byte aligned and the 8 codes exist; else byte by byte, the first n (the rest stay 0).
template <bool VEC>
__device__ __forceinline__ void jf_ct_load8(const unsigned char* __restrict__ p, jf_u32 (&q)[2], int n = 8) {
  if (VEC) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    q[0] = v.x;
    q[1] = v.y;
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i)
      if (i < n) q[i >> 2] |= (jf_u32)p[i] << (8 * (i & 3));
  }
}
