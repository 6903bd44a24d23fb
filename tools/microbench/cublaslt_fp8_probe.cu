// Which cuBLASLt FP8 configurations run on this GPU: one TN E4M3 GEMM per variant (scale pointers, fast
// accumulation, alignment preferences, small and large shapes, FP8 output with C elsewhere or null, and a
// scale pointer 4 bytes off a 16-byte boundary), printing the heuristic's count and each matmul's status.
// Found on an H100 (cuBLASLt 13.1, 2026-11-24): everything returns 0 except the misaligned scale pointer
// (status 15, NOT_SUPPORTED) -- the cause of jitfuse's first FP8 GEMM failures (docs/ops.md).
//   nvcc -O1 -std=c++17 -arch=sm_90a -o cublaslt_fp8_probe tools/microbench/cublaslt_fp8_probe.cu -lcublasLt
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdint>
#define S(x) do { auto s_ = (x); if (s_ != CUBLAS_STATUS_SUCCESS) { printf("  %s -> %d\n", #x, (int)s_); return (int)s_; } } while (0)
static cublasLtHandle_t h;
static void *A, *B, *D, *Dbf, *ws, *sc, *amax;
int run(const char* name, cudaDataType_t dt, bool scales, bool fast, bool dscale, bool c_null, int64_t m, int64_t n, int64_t k, bool pref_align) {
  printf("%s (m=%ld n=%ld k=%ld):\n", name, (long)m, (long)n, (long)k);
  cublasLtMatmulDesc_t op; S(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t T = CUBLAS_OP_T, N = CUBLAS_OP_N;
  S(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &T, sizeof(T)));
  S(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &N, sizeof(N)));
  if (scales) {
    S(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sc, sizeof(sc)));
    S(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sc, sizeof(sc)));
  }
  if (dscale) {
    S(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_D_SCALE_POINTER, &sc, sizeof(sc)));
    S(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_AMAX_D_POINTER, &amax, sizeof(amax)));
  }
  int8_t f = fast ? 1 : 0;
  S(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &f, sizeof(f)));
  cublasLtMatrixLayout_t la, lb, lc, ld;
  S(cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, k, m, k));
  S(cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, k, n, k));
  cudaDataType_t ct = (dt == CUDA_R_8F_E4M3) ? CUDA_R_16BF : dt;
  S(cublasLtMatrixLayoutCreate(&lc, ct, m, n, m));
  S(cublasLtMatrixLayoutCreate(&ld, dt, m, n, m));
  cublasLtMatmulPreference_t pref; S(cublasLtMatmulPreferenceCreate(&pref));
  size_t wsb = 32u << 20;
  S(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof(wsb)));
  if (pref_align) {
    uint32_t al = 256;
    S(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al, sizeof(al)));
    S(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al, sizeof(al)));
    S(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al, sizeof(al)));
    S(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al, sizeof(al)));
  }
  cublasLtMatmulHeuristicResult_t r[8]; int found = 0;
  S(cublasLtMatmulAlgoGetHeuristic(h, op, la, lb, lc, ld, pref, 8, r, &found));
  printf("  heuristic found %d\n", found);
  float alpha = 1.f, beta = 0.f;
  void* d = dt == CUDA_R_8F_E4M3 ? D : Dbf;
  const void* c = c_null ? nullptr : (dt == CUDA_R_8F_E4M3 ? Dbf : d);
  for (int i = 0; i < found && i < 3; ++i) {
    auto s = cublasLtMatmul(h, op, &alpha, A, la, B, lb, &beta, c, lc, d, ld, &r[i].algo, ws, wsb, 0);
    printf("  algo %d: status %d (ws %zu)\n", i, (int)s, r[i].workspaceSize);
  }
  auto s = cublasLtMatmul(h, op, &alpha, A, la, B, lb, &beta, c, lc, d, ld, nullptr, ws, wsb, 0);
  printf("  no algo: status %d; sync %d\n", (int)s, (int)cudaDeviceSynchronize());
  return 0;
}
int main() {
  S(cublasLtCreate(&h));
  printf("cublasLt version %zu\n", cublasLtGetVersion());
  size_t big = 64u << 20;
  cudaMalloc(&A, big); cudaMalloc(&B, big); cudaMalloc(&D, big); cudaMalloc(&Dbf, big); cudaMalloc(&ws, 32u << 20);
  cudaMalloc(&sc, 256); cudaMalloc(&amax, 256);
  cudaMemset(A, 0x38, big); cudaMemset(B, 0x38, big);
  float one = 1.f; cudaMemcpy(sc, &one, 4, cudaMemcpyHostToDevice);
  run("bf16 out, no scales, no fast", CUDA_R_16BF, false, false, false, false, 64, 64, 64, false);
  run("bf16 out, scales", CUDA_R_16BF, true, false, false, false, 64, 64, 64, false);
  run("bf16 out, scales, fast", CUDA_R_16BF, true, true, false, false, 64, 64, 64, false);
  run("bf16 out, scales, fast, pref align", CUDA_R_16BF, true, true, false, false, 64, 64, 64, true);
  run("bf16 out, scales, fast, n=1 (jitfuse m=1)", CUDA_R_16BF, true, true, false, false, 16, 1, 16, false);
  run("bf16 out, scales, fast, big", CUDA_R_16BF, true, true, false, false, 16384, 8192, 4096, false);
  run("fp32 out, scales", CUDA_R_32F, true, false, false, false, 64, 64, 64, false);
  run("e4m3 out, dscale, C bf16 other buf", CUDA_R_8F_E4M3, true, true, true, false, 64, 64, 64, false);
  run("e4m3 out, dscale, C null", CUDA_R_8F_E4M3, true, true, true, true, 64, 64, 64, false);
  sc = (char*)sc + 4;
  run("bf16 out, scales at a 4-byte offset", CUDA_R_16BF, true, true, false, false, 64, 64, 64, false);
  return 0;
}
