// Dropout's device side: Philox4x32-10 (Random123's constants), bit-exact with runtime/reference.
// Element i of a tensor uses word i % 4 of philox({lo(i/4), hi(i/4), lo(offset), hi(offset)}, seed).
#pragma once

__device__ __forceinline__ uint4 jf_philox(jf_u64 c4, jf_u64 offset, jf_u64 seed) {
  jf_u32 c0 = (jf_u32)c4, c1 = (jf_u32)(c4 >> 32), c2 = (jf_u32)offset, c3 = (jf_u32)(offset >> 32);
  jf_u32 k0 = (jf_u32)seed, k1 = (jf_u32)(seed >> 32);
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    const jf_u32 hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
    const jf_u32 hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return make_uint4(c0, c1, c2, c3);
}

__device__ __forceinline__ jf_u32 jf_philox_word(uint4 r, int w) {
  return w == 0 ? r.x : w == 1 ? r.y : w == 2 ? r.z : r.w;
}

// Keep bits for flat elements i0 .. i0+7 (bit e = element i0+e); elements at or past `n` get 0.
__device__ __forceinline__ jf_u32 jf_dropout_bits8(jf_i64 i0, int n, jf_u64 seed, jf_u64 offset, jf_u32 thresh) {
  jf_u32 bits = 0;
  if ((i0 & 3) == 0) {
    const uint4 a = jf_philox((jf_u64)i0 >> 2, offset, seed);
    const uint4 b = jf_philox(((jf_u64)i0 >> 2) + 1, offset, seed);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const jf_u32 w = jf_philox_word(e < 4 ? a : b, e & 3);
      if (e < n && w < thresh) bits |= 1u << e;
    }
  } else {
#pragma unroll 1
    for (int e = 0; e < 8; ++e) {
      const jf_i64 i = i0 + e;
      if (e < n && jf_philox_word(jf_philox((jf_u64)i >> 2, offset, seed), (int)(i & 3)) < thresh) bits |= 1u << e;
    }
  }
  return bits;
}
