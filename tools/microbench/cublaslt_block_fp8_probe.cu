// Issue 44 (block-scaled FP8): which cuBLASLt block-scale combinations run on this GPU, in which scale-tensor
// layout, and how fast. One TN E4M3 GEMM D = A B (A [M, K] and B [N, K], both K-contiguous, as jitfuse's FP8
// GEMMs) per combination of A's and B's scale modes (VEC128_32F: one float per 1x128 block along K;
// BLK128x128_32F: one per 128x128 block). Each mode's scales are written in two candidate layouts (the K-block
// index outer, "kb-outer": s[kb * rows + r]; or inner, "kb-inner": s[r * kblocks + kb]) with values that differ
// per block, and the result is compared with a float32 reference computed on the device from the dequantized
// operands: the layout whose error is at FP8 accumulation level is the one cuBLASLt reads. Then the working
// combinations are timed at issue 44's MLP shapes against per-tensor FP8 (scalar scales) and bf16.
// Written in session 37 (compiled here, not yet run on a GPU):
//   nvcc -O2 -std=c++17 -arch=sm_90a -o cublaslt_block_fp8_probe tools/microbench/cublaslt_block_fp8_probe.cu -lcublasLt
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e_)); std::exit(1); } } while (0)
#define S(x) do { cublasStatus_t s_ = (x); if (s_ != CUBLAS_STATUS_SUCCESS) { if (verbose) printf("    %s -> %d\n", #x, (int)s_); return -(int)s_ - 1; } } while (0)

static cublasLtHandle_t g_h;
static bool verbose = true;

enum Mode { SCALAR = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F, VEC128 = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F,
            BLK128 = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F };
static const char* mode_name(int m) { return m == SCALAR ? "scalar" : m == VEC128 ? "1x128" : "128x128"; }

// Random E4M3 codes in [-4, 4] and their float values.
__global__ void fill_fp8(__nv_fp8_e4m3* q, float* v, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    uint32_t s = (uint32_t)i * 2654435761u ^ seed;
    s ^= s >> 13; s *= 0x5bd1e995u; s ^= s >> 15;
    const float f = ((s & 0xffff) / 65535.f - 0.5f) * 8.f;
    q[i] = __nv_fp8_e4m3(f);
    if (v) v[i] = float(q[i]);
  }
}

// The scale of row r, K-block kb of an operand with `rows` rows under `mode` (block values that differ).
__host__ __device__ inline float block_scale(int mode, int64_t r, int64_t kb, uint32_t salt) {
  if (mode == SCALAR) return 0.75f;
  const int64_t rb = mode == BLK128 ? r / 128 : r;
  const uint32_t h = (uint32_t)(rb * 7919 + kb * 104729) ^ salt;
  return std::ldexp(1.0f + (h % 7) / 8.0f, (int)(h % 5) - 2);
}

// D_ref[m, n] = sum_k (A[m,k] sa) (B[n,k] sb), float32 on the device (stored m-fastest, as cuBLASLt's D).
__global__ void reference(const float* a, const float* b, float* d, int64_t M, int64_t N, int64_t K, int ma, int mb) {
  const int64_t m = blockIdx.x * (int64_t)blockDim.x + threadIdx.x, n = blockIdx.y;
  if (m >= M) return;
  float acc = 0.f;
  for (int64_t k = 0; k < K; ++k)
    acc += a[m * K + k] * block_scale(ma, m, k / 128, 0x1234u) * b[n * K + k] * block_scale(mb, n, k / 128, 0x9876u);
  d[n * M + m] = acc;
}

// Scales of an operand with `rows` rows in layout `inner` (kb inner) or not (kb outer).
static std::vector<float> scales(int mode, int64_t rows, int64_t K, bool inner, uint32_t salt) {
  const int64_t kbs = (K + 127) / 128, rbs = mode == BLK128 ? (rows + 127) / 128 : rows;
  if (mode == SCALAR) return {block_scale(SCALAR, 0, 0, salt)};
  std::vector<float> s((size_t)(kbs * rbs));
  for (int64_t r = 0; r < rbs; ++r)
    for (int64_t kb = 0; kb < kbs; ++kb)
      s[(size_t)(inner ? r * kbs + kb : kb * rbs + r)] = block_scale(mode, mode == BLK128 ? r * 128 : r, kb, salt);
  return s;
}

struct Problem {
  int64_t M, N, K;
  __nv_fp8_e4m3 *a, *b;
  float *af = nullptr, *bf = nullptr, *dref = nullptr, *sa, *sb;
  __nv_bfloat16* d;
  void* ws;
  size_t ws_bytes = 64u << 20;
};

// One matmul with A's and B's scale modes; ms > 0 asks for a timing (median of 51).
static int gemm(const Problem& p, int ma, int mb, float* ms) {
  cublasLtMatmulDesc_t op; S(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t T = CUBLAS_OP_T, N = CUBLAS_OP_N;
  S(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &T, sizeof(T)));
  S(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &N, sizeof(N)));
  S(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &p.sa, sizeof(p.sa)));
  S(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &p.sb, sizeof(p.sb)));
  int32_t a_mode = ma, b_mode = mb;
  S(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &a_mode, sizeof(a_mode)));
  S(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &b_mode, sizeof(b_mode)));
  cublasLtMatrixLayout_t la, lb, ld;
  S(cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, p.K, p.M, p.K));
  S(cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, p.K, p.N, p.K));
  S(cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, p.M, p.N, p.M));
  cublasLtMatmulPreference_t pref; S(cublasLtMatmulPreferenceCreate(&pref));
  S(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &p.ws_bytes, sizeof(p.ws_bytes)));
  cublasLtMatmulHeuristicResult_t res[8]; int found = 0;
  S(cublasLtMatmulAlgoGetHeuristic(g_h, op, la, lb, ld, ld, pref, 8, res, &found));
  if (found == 0) { if (verbose) printf("    no algorithm\n"); return -1000; }
  const float alpha = 1.f, beta = 0.f;
  auto run = [&] { return cublasLtMatmul(g_h, op, &alpha, p.a, la, p.b, lb, &beta, p.d, ld, p.d, ld, &res[0].algo, p.ws,
                                         p.ws_bytes, 0); };
  S(run());
  CK(cudaDeviceSynchronize());
  if (ms) {
    for (int i = 0; i < 10; ++i) run();
    std::vector<float> t;
    cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
    for (int i = 0; i < 51; ++i) { cudaEventRecord(e0); run(); cudaEventRecord(e1); cudaEventSynchronize(e1); float x; cudaEventElapsedTime(&x, e0, e1); t.push_back(x); }
    std::sort(t.begin(), t.end());
    *ms = t[25];
  }
  cublasLtMatmulPreferenceDestroy(pref); cublasLtMatrixLayoutDestroy(la); cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(ld); cublasLtMatmulDescDestroy(op);
  return found;
}

static Problem make(int64_t M, int64_t N, int64_t K, bool reference_data) {
  Problem p{M, N, K};
  CK(cudaMalloc(&p.a, M * K)); CK(cudaMalloc(&p.b, N * K)); CK(cudaMalloc(&p.d, M * N * 2)); CK(cudaMalloc(&p.ws, p.ws_bytes));
  const int64_t most = std::max(M, N) * ((K + 127) / 128);
  CK(cudaMalloc(&p.sa, most * 4)); CK(cudaMalloc(&p.sb, most * 4));
  if (reference_data) { CK(cudaMalloc(&p.af, M * K * 4)); CK(cudaMalloc(&p.bf, N * K * 4)); CK(cudaMalloc(&p.dref, M * N * 4)); }
  fill_fp8<<<1024, 256>>>(p.a, p.af, M * K, 17u);
  fill_fp8<<<1024, 256>>>(p.b, p.bf, N * K, 91u);
  CK(cudaDeviceSynchronize());
  return p;
}

static void put_scales(const Problem& p, int ma, int mb, bool ia, bool ib) {
  auto sa = scales(ma, p.M, p.K, ia, 0x1234u), sb = scales(mb, p.N, p.K, ib, 0x9876u);
  CK(cudaMemcpy(p.sa, sa.data(), sa.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(p.sb, sb.data(), sb.size() * 4, cudaMemcpyHostToDevice));
}

int main() {
  cudaDeviceProp prop; CK(cudaGetDeviceProperties(&prop, 0));
  printf("%s, cuBLASLt %zu\n", prop.name, cublasLtGetVersion());
  if (cublasLtCreate(&g_h) != CUBLAS_STATUS_SUCCESS) { printf("cublasLtCreate failed\n"); return 1; }
  const int combos[][2] = {{SCALAR, SCALAR}, {VEC128, BLK128}, {BLK128, VEC128}, {VEC128, VEC128}, {BLK128, BLK128}};
  // Correctness and layout at a small shape (several blocks each way, M != N).
  Problem s = make(384, 256, 512, true);
  printf("\nlayouts (M=%ld N=%ld K=%ld; max |D - ref| / max |ref|; kb-outer = s[kb * rows + r], kb-inner = s[r * kblocks + kb]):\n",
         (long)s.M, (long)s.N, (long)s.K);
  bool ok[5][2][2] = {};
  for (int c = 0; c < 5; ++c) {
    const int ma = combos[c][0], mb = combos[c][1];
    reference<<<dim3((unsigned)((s.M + 127) / 128), (unsigned)s.N), 128>>>(s.af, s.bf, s.dref, s.M, s.N, s.K, ma, mb);
    CK(cudaDeviceSynchronize());
    std::vector<float> ref((size_t)(s.M * s.N)); CK(cudaMemcpy(ref.data(), s.dref, ref.size() * 4, cudaMemcpyDeviceToHost));
    double rmax = 0; for (float v : ref) rmax = std::max(rmax, (double)std::fabs(v));
    for (int ia = 0; ia < 2; ++ia)
      for (int ib = 0; ib < 2; ++ib) {
        if ((ma == SCALAR && ia) || (mb == SCALAR && ib)) continue;
        put_scales(s, ma, mb, ia, ib);
        printf("  A %-7s (%s)  B %-7s (%s): ", mode_name(ma), ia ? "kb-inner" : "kb-outer", mode_name(mb),
               ib ? "kb-inner" : "kb-outer");
        verbose = false;
        const int st = gemm(s, ma, mb, nullptr);
        verbose = true;
        if (st < 0) { printf("not run (status %d)\n", st == -1000 ? -1 : -st - 1); continue; }
        std::vector<__nv_bfloat16> d((size_t)(s.M * s.N)); CK(cudaMemcpy(d.data(), s.d, d.size() * 2, cudaMemcpyDeviceToHost));
        double e = 0; for (size_t i = 0; i < d.size(); ++i) e = std::max(e, std::fabs((double)__bfloat162float(d[i]) - ref[i]));
        ok[c][ia][ib] = e / rmax < 1e-2;
        printf("%d algorithm(s), error %.3g%s\n", st, e / rmax, ok[c][ia][ib] ? "  <- this layout" : "");
      }
  }
  // Speed at issue 44's MLP GEMMs (8192 tokens, 4096 -> 16384 -> 4096): the forward's two and a dgrad shape.
  const int64_t shapes[][3] = {{8192, 16384, 4096}, {8192, 4096, 16384}, {4096, 16384, 8192}};
  printf("\ntimes (median ms, TFLOP/s; the layout found above):\n");
  for (auto& sh : shapes) {
    Problem p = make(sh[0], sh[1], sh[2], false);
    const double flop = 2.0 * sh[0] * sh[1] * sh[2];
    for (int c = 0; c < 5; ++c) {
      int ia = -1, ib = -1;
      for (int x = 0; x < 2 && ia < 0; ++x) for (int y = 0; y < 2; ++y) if (ok[c][x][y]) { ia = x; ib = y; break; }
      if (ia < 0) continue;
      put_scales(p, combos[c][0], combos[c][1], ia, ib);
      float ms = 0;
      if (gemm(p, combos[c][0], combos[c][1], &ms) > 0)
        printf("  M=%5ld N=%5ld K=%5ld  A %-7s B %-7s %8.3f ms  %6.1f TFLOP/s\n", (long)sh[0], (long)sh[1], (long)sh[2],
               mode_name(combos[c][0]), mode_name(combos[c][1]), ms, flop / (ms * 1e-3) / 1e12);
    }
    cudaFree(p.a); cudaFree(p.b); cudaFree(p.d); cudaFree(p.ws); cudaFree(p.sa); cudaFree(p.sb);
  }
  return 0;
}
