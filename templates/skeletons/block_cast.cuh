// The block-scaled FP8 cast of fp8_block (issue 44): one block of 16 x 32 threads per 128 x 128 tile of a
// [rows, cols] tensor. Thread (x, y) holds columns 8x .. 8x + 7 of the tile for its rows 4y .. 4y + 3, in
// registers, and writes from one read of the tensor:
//   - the row-major E4M3 codes, scaled per 1x128 block (one tile row: 16 lanes of one half-warp) for an
//     activation or gradient, or per 128x128 block (the whole tile) for a weight;
//   - with COLWISE, the transposed codes [cols, rows], scaled per 128x1 block (one tile column: the GEMM
//     that contracts over the rows reads them along its K) or per tile, staged in shared memory so that they
//     leave as 16-byte stores of 16 rows of one column;
//   - each block's 1 / scale, where cuBLASLt's block-scale modes read them (cuda::Fp8Scaling):
//       1x128 row scales   si_row[(c / 128) * rows + r]          (VEC128_32F, the K-block outer)
//       128x1 col scales   si_col[(r / 128) * cols + c]          (VEC128_32F of the transposed tensor)
//       128x128 scales     si_row[(r / 128) * KB4 + c / 128], si_col the transpose of that
//                          ((c / 128) * RB4 + r / 128)  (BLK128x128_32F), KB4 = cols / 128 and RB4 =
//                          ceil(rows / 128) each rounded up to a multiple of 4: cuBLASLt reads the block
//                          scales with that leading dimension (H100, cuBLASLt 13.1: unpadded, every
//                          weight with more than one 128-row block and fewer than 4 K-blocks read wrong
//                          scales, session 38 run 11)
// Scales are powers of two (TransformerEngine's Float8BlockScaling default): 2^floor(log2(448 / amax)),
// 1 for a block of zeros or a non-finite amax, at most 2^126 so that 1 / scale stays a normal float; the
// codes are RNE + saturation of x * scale, exactly as runtime/reference's block quantisation computes them.
#pragma once

// The tile's shared memory: per warp the column maxima of its two row groups, the tile's column scales,
// and the transposed codes (column c's 128 rows as 8 chunks of 16 bytes, chunk k at position k ^ (c / 8 % 8),
// so that a quarter-warp reading one column's 8 chunks hits 8 distinct bank groups).
struct JfBlockSmem {
  float cmax[16][128];
  float cscale[128];
  jf_u32 tile[128 * 32];
};

__device__ __forceinline__ float jf_bc_scale(float amax) {
  if (!(amax > 0.f) || !(amax < 3.0e38f)) return 1.f;
  const float s = fminf(JF_E4M3_MAX / amax, 0x1p126f);
  return __uint_as_float(__float_as_uint(s) & 0x7f800000u);  // 2^floor(log2 s)
}

// Two E4M3 codes, `lo` in the low byte.
__device__ __forceinline__ jf_u32 jf_bc_e4m3x2(float lo, float hi) {
#if __CUDA_ARCH__ >= 890
  unsigned short r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return (jf_u32)r;
#else
  return (jf_u32)jf_to_e4m3(lo) | ((jf_u32)jf_to_e4m3(hi) << 8);
#endif
}

__device__ __forceinline__ int jf_bc_slot(int c, int k) { return c * 32 + ((k ^ ((c >> 3) & 7)) << 2); }

// The tile at rows r0 .. r0 + 127 and columns cb * 128 .. + 127; x: the thread's values (rows past `rows`
// hold 0). WEIGHT: one scale per tile. Every thread of the block calls it (it holds three barriers).
template <bool VEC, bool WEIGHT, bool COLWISE>
__device__ __forceinline__ void jf_block_cast_tile(float (&x)[4][8], unsigned char* __restrict__ out,
                                                   unsigned char* __restrict__ colw, float* __restrict__ si_row,
                                                   float* __restrict__ si_col, jf_i64 rows, jf_i64 cols, jf_i64 r0,
                                                   int cb, JfBlockSmem& sm) {
  const int tx = threadIdx.x, ty = threadIdx.y, warp = ty >> 1;
  const int c0 = cb * 128 + tx * 8;
  float ram[4];
#pragma unroll
  for (int u = 0; u < 4; ++u) {  // each row's amax over the tile's 128 columns (the 16 lanes of a half-warp)
    float a = 0.f;
    jf_amax8(a, x[u]);
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
    ram[u] = a;
  }
  if (WEIGHT) {
    float a = fmaxf(fmaxf(ram[0], ram[1]), fmaxf(ram[2], ram[3]));
    a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 16));
    if ((tx | (ty & 1)) == 0) sm.cmax[warp][0] = a;
  } else if (COLWISE) {
    float cm[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      cm[e] = fmaxf(fmaxf(fabsf(x[0][e]), fabsf(x[1][e])), fmaxf(fabsf(x[2][e]), fabsf(x[3][e])));
      cm[e] = fmaxf(cm[e], __shfl_xor_sync(0xffffffffu, cm[e], 16));
    }
    if ((ty & 1) == 0) {
#pragma unroll
      for (int e = 0; e < 8; ++e) sm.cmax[warp][tx * 8 + e] = cm[e];
    }
  }
  __syncthreads();
  const int t = ty * 16 + tx;
  const jf_i64 rb = r0 / 128;
  if (WEIGHT) {
    if (t == 0) {
      float a = 0.f;
      for (int w = 0; w < 16; ++w) a = fmaxf(a, sm.cmax[w][0]);
      const float s = jf_bc_scale(a);
      sm.cscale[0] = s;
      si_row[rb * ((cols / 128 + 3) / 4 * 4) + cb] = 1.f / s;
      if (COLWISE) si_col[(jf_i64)cb * ((rows + 511) / 512 * 4) + rb] = 1.f / s;
    }
  } else if (COLWISE && t < 128) {
    float a = 0.f;
#pragma unroll
    for (int w = 0; w < 16; ++w) a = fmaxf(a, sm.cmax[w][t]);
    const float s = jf_bc_scale(a);
    sm.cscale[t] = s;
    si_col[rb * cols + cb * 128 + t] = 1.f / s;
  }
  __syncthreads();
  const float ts = WEIGHT ? sm.cscale[0] : 1.f;
#pragma unroll
  for (int u = 0; u < 4; ++u) {  // the row-major codes, 8 bytes per thread and row
    const jf_i64 r = r0 + ty * 4 + u;
    if (r < rows) {
      const float s = WEIGHT ? ts : jf_bc_scale(ram[u]);
      jf_store8_e4m3<VEC>(out + r * cols + c0, x[u], s);
      if (!WEIGHT && tx == 0) si_row[(jf_i64)cb * rows + r] = 1.f / s;
    }
  }
  if (!COLWISE) return;
#pragma unroll
  for (int e = 0; e < 8; ++e) {  // the thread's 4 rows of column c as one word of chunk ty / 4
    const int c = tx * 8 + e;
    const float s = WEIGHT ? ts : sm.cscale[c];
    const jf_u32 w = jf_bc_e4m3x2(x[0][e] * s, x[1][e] * s) | (jf_bc_e4m3x2(x[2][e] * s, x[3][e] * s) << 16);
    sm.tile[jf_bc_slot(c, ty >> 2) + (ty & 3)] = w;
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < 2; ++i) {  // 1024 chunks of 16 rows: column idx / 8, chunk idx % 8
    const int idx = t + i * 512, c = idx >> 3, k = idx & 7;
    const jf_i64 r = r0 + k * 16;
    if (r >= rows) continue;
    const uint4 v = *reinterpret_cast<const uint4*>(&sm.tile[jf_bc_slot(c, k)]);
    unsigned char* p = colw + ((jf_i64)cb * 128 + c) * rows + r;
    if (VEC) {
      *reinterpret_cast<uint4*>(p) = v;
    } else {
      const jf_u32 wd[4] = {v.x, v.y, v.z, v.w};
      const int n = (int)min((jf_i64)16, rows - r);
      for (int j = 0; j < n; ++j) p[j] = (unsigned char)(wd[j >> 2] >> (8 * (j & 3)));
    }
  }
}
