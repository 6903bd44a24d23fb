// Row-major linear on column-major cuBLASLt: every product is computed transposed (D^T = op(A) op(B)),
// so row-major buffers are passed as they are. RAII holders own every descriptor.
#include "cuda/cublaslt.hpp"

#include <cublasLt.h>

#include <algorithm>
#include <unordered_map>

#include "common/error.hpp"
#include "cuda/driver.hpp"

namespace jitfuse::cuda {
namespace {

void check_blas(cublasStatus_t s, const char* call) {
  if (s != CUBLAS_STATUS_SUCCESS)
    fail(Status::cuda_error, "{} failed: {} ({})", call, cublasLtGetStatusName(s), cublasLtGetStatusString(s));
}

cudaDataType_t data_type(ops::DType d) {
  switch (d) {
    case ops::DType::f32: return CUDA_R_32F;
    case ops::DType::f16: return CUDA_R_16F;
    case ops::DType::bf16: return CUDA_R_16BF;
    default: fail(Status::unsupported, "cuBLASLt path: dtype {} not supported yet", ops::dtype_name(d));
  }
}

struct MatmulDesc {
  cublasLtMatmulDesc_t d = nullptr;
  ~MatmulDesc() { if (d) cublasLtMatmulDescDestroy(d); }
};
struct Layout {
  cublasLtMatrixLayout_t l = nullptr;
  ~Layout() { if (l) cublasLtMatrixLayoutDestroy(l); }
};
struct Pref {
  cublasLtMatmulPreference_t p = nullptr;
  ~Pref() { if (p) cublasLtMatmulPreferenceDestroy(p); }
};

uint32_t alignment(const void* p) {
  auto v = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 16;
  while (a > 1 && (v % a)) a >>= 1;
  return a;
}

}  // namespace

std::string epilogue_name(Epilogue e) {
  switch (e) {
    case Epilogue::none: return "DEFAULT";
    case Epilogue::bias: return "BIAS";
    case Epilogue::gelu_bias: return "GELU_BIAS";
    case Epilogue::gelu_aux_bias: return "GELU_AUX_BIAS";
    case Epilogue::relu_bias: return "RELU_BIAS";
    case Epilogue::dgelu_bgrad: return "DGELU_BGRAD";
    case Epilogue::relu_aux_bias: return "RELU_AUX_BIAS";
    case Epilogue::drelu_bgrad: return "DRELU_BGRAD";
    case Epilogue::bgradb: return "BGRADB";
    case Epilogue::gelu: return "GELU";
    case Epilogue::gelu_aux: return "GELU_AUX";
    case Epilogue::relu: return "RELU";
  }
  return "?";
}

struct Blas::Impl {
  cublasLtHandle_t handle = nullptr;
  mutable std::mutex mu;
  std::unordered_map<std::string, cublasLtMatmulAlgo_t> algos;
};

Blas::Blas() : impl_(std::make_unique<Impl>()) { check_blas(cublasLtCreate(&impl_->handle), "cublasLtCreate"); }

Blas::~Blas() { cublasLtDestroy(impl_->handle); }

std::string Blas::version() {
  size_t v = cublasLtGetVersion();
  return std::to_string(v / 10000) + "." + std::to_string((v / 100) % 100) + "." + std::to_string(v % 100);
}

size_t Blas::heuristic_cache_size() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->algos.size();
}

bool Blas::prepare(const GemmCall& call, CUstream tune_stream) {
  try {
    run(call, tune_stream, false, tune_stream != nullptr);
    return true;
  } catch (const Error& e) {
    if (e.status() != Status::unsupported) throw;
    return false;
  }
}

void Blas::gemm(const GemmCall& g, CUstream stream) {
  if (!g.workspace) fail(Status::internal, "cuBLASLt GEMM without a workspace");
  run(g, stream, true, false);
}

void Blas::run(const GemmCall& g, CUstream stream, bool launch, bool tune) {
  // Column-major view of the transposed product (see file comment).
  uint64_t m = 0, n = 0, k = 0, lda = 0, ldb = 0, ldd = 0;
  cublasOperation_t ta = CUBLAS_OP_N, tb = CUBLAS_OP_N;
  uint64_t a_rows = 0, a_cols = 0, b_rows = 0, b_cols = 0;
  const void* A = nullptr;
  const void* B = nullptr;
  switch (g.kind) {
    case GemmKind::fwd:  // y^T[n,m] = W(kxn col-major)^T * x^T(kxm)
      m = g.n; n = g.m; k = g.k;
      A = g.b; ta = CUBLAS_OP_T; a_rows = g.k; a_cols = g.n; lda = g.k;
      B = g.a; tb = CUBLAS_OP_N; b_rows = g.k; b_cols = g.m; ldb = g.k;
      ldd = g.n;
      break;
    case GemmKind::dgrad:  // dx^T[k,m] = W^T(kxn) * dy^T(nxm)
      m = g.k; n = g.m; k = g.n;
      A = g.b; ta = CUBLAS_OP_N; a_rows = g.k; a_cols = g.n; lda = g.k;
      B = g.a; tb = CUBLAS_OP_N; b_rows = g.n; b_cols = g.m; ldb = g.n;
      ldd = g.k;
      break;
    case GemmKind::wgrad:  // dW^T[k,n] = x^T(kxm) * dy(mxn)
      m = g.k; n = g.n; k = g.m;
      A = g.b; ta = CUBLAS_OP_N; a_rows = g.k; a_cols = g.m; lda = g.k;
      B = g.a; tb = CUBLAS_OP_T; b_rows = g.n; b_cols = g.m; ldb = g.n;
      ldd = g.k;
      break;
  }
  cudaDataType_t dt = data_type(g.dtype);
  MatmulDesc op;
  check_blas(cublasLtMatmulDescCreate(&op.d, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  check_blas(cublasLtMatmulDescSetAttribute(op.d, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)), "set TRANSA");
  check_blas(cublasLtMatmulDescSetAttribute(op.d, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)), "set TRANSB");
  cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_DEFAULT;
  switch (g.epilogue) {
    case Epilogue::none: break;
    case Epilogue::bias: epi = CUBLASLT_EPILOGUE_BIAS; break;
    case Epilogue::gelu_bias: epi = CUBLASLT_EPILOGUE_GELU_BIAS; break;
    case Epilogue::gelu_aux_bias: epi = CUBLASLT_EPILOGUE_GELU_AUX_BIAS; break;
    case Epilogue::gelu: epi = CUBLASLT_EPILOGUE_GELU; break;
    case Epilogue::gelu_aux: epi = CUBLASLT_EPILOGUE_GELU_AUX; break;
    case Epilogue::relu: epi = CUBLASLT_EPILOGUE_RELU; break;
    case Epilogue::relu_bias: epi = CUBLASLT_EPILOGUE_RELU_BIAS; break;
    // dgrad's D is dx^T [k, m]: DGELU_BGRAD's bias gradient has one entry per row of D (k features).
    case Epilogue::dgelu_bgrad: epi = CUBLASLT_EPILOGUE_DGELU_BGRAD; break;
    case Epilogue::relu_aux_bias: epi = CUBLASLT_EPILOGUE_RELU_AUX_BIAS; break;
    case Epilogue::drelu_bgrad: epi = CUBLASLT_EPILOGUE_DRELU_BGRAD; break;
    // wgrad's B is dy (m x n after the transpose): BGRADB sums it over GEMM-k (the m tokens), n entries.
    case Epilogue::bgradb: epi = CUBLASLT_EPILOGUE_BGRADB; break;
  }
  const GemmKind epi_kind = g.epilogue == Epilogue::dgelu_bgrad || g.epilogue == Epilogue::drelu_bgrad ? GemmKind::dgrad
                            : g.epilogue == Epilogue::bgradb    ? GemmKind::wgrad
                                                                : GemmKind::fwd;
  if (g.epilogue != Epilogue::none && g.kind != epi_kind)
    fail(Status::internal, "cuBLASLt epilogue {} requested on the wrong GEMM", epilogue_name(g.epilogue));
  check_blas(cublasLtMatmulDescSetAttribute(op.d, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)), "set EPILOGUE");
  if (g.bias)
    check_blas(cublasLtMatmulDescSetAttribute(op.d, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g.bias, sizeof(g.bias)),
               "set BIAS_POINTER");
  const bool relu_mask = g.epilogue == Epilogue::relu_aux_bias || g.epilogue == Epilogue::drelu_bgrad;
  if (g.epilogue == Epilogue::gelu_aux_bias || g.epilogue == Epilogue::gelu_aux || g.epilogue == Epilogue::dgelu_bgrad ||
      relu_mask) {
    check_blas(cublasLtMatmulDescSetAttribute(op.d, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &g.aux, sizeof(g.aux)),
               "set EPILOGUE_AUX_POINTER");
    // The pre-activation has D's layout; the ReLU mask is one bit per value, ld in bits.
    int64_t ld = relu_mask ? relu_mask_ld(static_cast<int64_t>(m)) : static_cast<int64_t>(ldd);
    check_blas(cublasLtMatmulDescSetAttribute(op.d, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld, sizeof(ld)),
               "set EPILOGUE_AUX_LD");
  }
  Layout la, lb, lc, ld;
  check_blas(cublasLtMatrixLayoutCreate(&la.l, dt, a_rows, a_cols, lda), "cublasLtMatrixLayoutCreate(A)");
  check_blas(cublasLtMatrixLayoutCreate(&lb.l, dt, b_rows, b_cols, ldb), "cublasLtMatrixLayoutCreate(B)");
  check_blas(cublasLtMatrixLayoutCreate(&lc.l, dt, m, n, ldd), "cublasLtMatrixLayoutCreate(C)");
  check_blas(cublasLtMatrixLayoutCreate(&ld.l, dt, m, n, ldd), "cublasLtMatrixLayoutCreate(D)");

  const void* C = g.beta != 0.f ? (g.c ? g.c : g.d) : g.d;
  uint32_t al_a = alignment(A), al_b = alignment(B), al_c = alignment(C), al_d = alignment(g.d);
  std::string key = fmt::format("{}:{}x{}x{}:{}:{}:{}:{}:{}:{}:{}:{}", static_cast<int>(g.kind), g.m, g.n, g.k,
                                static_cast<int>(dt), static_cast<int>(epi), g.beta != 0.f, al_a, al_b, al_c, al_d,
                                g.aux ? alignment(g.aux) : 0);

  cublasLtMatmulAlgo_t algo;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    auto it = impl_->algos.find(key);
    if (it == impl_->algos.end()) {
      Pref pref;
      check_blas(cublasLtMatmulPreferenceCreate(&pref.p), "cublasLtMatmulPreferenceCreate");
      size_t wsz = kGemmWorkspace;
      cublasLtMatmulPreferenceSetAttribute(pref.p, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsz, sizeof(wsz));
      cublasLtMatmulPreferenceSetAttribute(pref.p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof(al_a));
      cublasLtMatmulPreferenceSetAttribute(pref.p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof(al_b));
      cublasLtMatmulPreferenceSetAttribute(pref.p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c, sizeof(al_c));
      cublasLtMatmulPreferenceSetAttribute(pref.p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_d, sizeof(al_d));
      constexpr int kCandidates = 8;
      cublasLtMatmulHeuristicResult_t res[kCandidates] = {};
      int found = 0;
      check_blas(cublasLtMatmulAlgoGetHeuristic(impl_->handle, op.d, la.l, lb.l, lc.l, ld.l, pref.p,
                                                tune ? kCandidates : 1, res, &found),
                 "cublasLtMatmulAlgoGetHeuristic");
      if (found == 0)
        fail(Status::unsupported, "cuBLASLt has no algorithm for {} GEMM m={} n={} k={} dtype {} epilogue {}",
             g.kind == GemmKind::fwd ? "forward" : g.kind == GemmKind::dgrad ? "dgrad" : "wgrad", g.m, g.n, g.k,
             ops::dtype_name(g.dtype), epilogue_name(g.epilogue));
      int best = 0;
      if (tune && found > 1) {
        // Prepare-time tuning on the caller's scratch operands: the heuristic's first choice is not always
        // the fastest (small-M problems especially); each candidate is timed, the median of a few runs.
        const auto& d = driver();
        CUevent e0 = nullptr, e1 = nullptr;
        check(d.cuEventCreate(&e0, CU_EVENT_DEFAULT), "cuEventCreate");
        check(d.cuEventCreate(&e1, CU_EVENT_DEFAULT), "cuEventCreate");
        float best_ms = 3.0e38f;  // a candidate that fails to run is never chosen
        for (int i = 0; i < found; ++i) {
          float t[3];
          bool ok = true;
          for (int r = 0; r < 4 && ok; ++r) {
            check(d.cuEventRecord(e0, stream), "cuEventRecord");
            ok = cublasLtMatmul(impl_->handle, op.d, &g.alpha, A, la.l, B, lb.l, &g.beta, C, lc.l, g.d, ld.l,
                                &res[i].algo, g.workspace, kGemmWorkspace,
                                reinterpret_cast<cudaStream_t>(stream)) == CUBLAS_STATUS_SUCCESS;
            check(d.cuEventRecord(e1, stream), "cuEventRecord");
            check(d.cuEventSynchronize(e1), "cuEventSynchronize");
            if (r > 0) check(d.cuEventElapsedTime(&t[r - 1], e0, e1), "cuEventElapsedTime");
          }
          if (!ok) continue;
          std::sort(t, t + 3);
          if (t[1] < best_ms) {
            best_ms = t[1];
            best = i;
          }
        }
        d.cuEventDestroy(e0);
        d.cuEventDestroy(e1);
      }
      it = impl_->algos.emplace(key, res[best].algo).first;
    }
    algo = it->second;
  }
  if (!launch) return;
  check_blas(cublasLtMatmul(impl_->handle, op.d, &g.alpha, A, la.l, B, lb.l, &g.beta, C, lc.l, g.d, ld.l, &algo,
                            g.workspace, kGemmWorkspace, reinterpret_cast<cudaStream_t>(stream)),
             "cublasLtMatmul");
}

int64_t relu_mask_ld(int64_t features) { return (features + 127) / 128 * 128; }
size_t relu_mask_bytes(int64_t features, int64_t rows) {
  return static_cast<size_t>(relu_mask_ld(features) / 8) * static_cast<size_t>(rows);
}

void Blas::column_sums(ops::DType dtype, int64_t m, int64_t n, const void* x, const void* ones, void* out,
                       void* workspace, CUstream stream) {
  GemmCall c;
  c.kind = GemmKind::wgrad;
  c.m = m;
  c.n = n;
  c.k = 1;
  c.dtype = dtype;
  c.a = x;
  c.b = ones;
  c.d = out;
  c.workspace = workspace;
  gemm(c, stream);
}

}  // namespace jitfuse::cuda
