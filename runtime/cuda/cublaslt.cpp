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

// Operands and outputs of FP8 GEMMs (check_gemm_call has vetted the combination).
cudaDataType_t fp8_data_type(ops::DType d) {
  switch (d) {
    case ops::DType::e4m3: return CUDA_R_8F_E4M3;
    case ops::DType::e5m2: return CUDA_R_8F_E5M2;
    default: return data_type(d);
  }
}

template <class T>
void set_attr(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr, const T& v, const char* what) {
  check_blas(cublasLtMatmulDescSetAttribute(d, attr, &v, sizeof(v)), what);
}

const char* kind_name(GemmKind k) { return k == GemmKind::fwd ? "forward" : k == GemmKind::dgrad ? "dgrad" : "wgrad"; }

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

namespace {

// The rules of the FP8 primitive (cublaslt.hpp), from cuBLASLt's FP8 requirements:
// - A and B are E4M3 or E5M2, not both E5M2; D is bf16, fp16, fp32, or E4M3 / E5M2 (E5M2 output only when
//   an operand is E5M2), FP8 D with a d_scale and no C operand;
// - the TN layout: GemmKind::fwd only (dgrad and wgrad go through transposed copies);
// - k and n multiples of 16, A, B, C and D 16-byte aligned (FP8 tensor-core kernels);
// - epilogues none and bias; the bias is fp16 with fp16 output and bf16 otherwise;
// - launching needs both scale-inverse pointers (and d_scale for FP8 output).
void check_fp8(const GemmCall& g, bool launching) {
  const Fp8Gemm& f = *g.fp8;
  auto bad = [&](const std::string& why) {
    fail(Status::invalid_argument, "FP8 GEMM m={} n={} k={} ({} x {} -> {}): {}", g.m, g.n, g.k, ops::dtype_name(f.a),
         ops::dtype_name(f.b), ops::dtype_name(g.dtype), why);
  };
  if (!ops::is_fp8(f.a) || !ops::is_fp8(f.b))
    bad("both operands must be e4m3 or e5m2 (cuBLASLt has no FP8 x 16-bit GEMM: cast the other operand too)");
  if (f.a == ops::DType::e5m2 && f.b == ops::DType::e5m2)
    bad("E5M2 x E5M2 is not supported by cuBLASLt; one operand must be E4M3 (the HYBRID recipe pairs E5M2 "
        "gradients with E4M3 activations and weights)");
  if (g.kind != GemmKind::fwd)
    bad(fmt::format("FP8 GEMMs take the TN layout only: a {} GEMM must be called as the primitive D = A B^T "
                    "(GemmKind::fwd) on transposed FP8 copies (cublaslt.hpp)", kind_name(g.kind)));
  if (g.m <= 0 || g.n <= 0 || g.k <= 0) bad("every dimension must be positive");
  if (g.k % 16)
    bad("k must be a multiple of 16 (the leading dimension of both FP8 operands); pad K with zeros");
  if (g.n % 16) bad("n must be a multiple of 16 (the leading dimension of D and the row count of B)");
  const bool fp8_out = ops::is_fp8(g.dtype);
  if (fp8_out) {
    if (g.dtype == ops::DType::e5m2 && f.a == ops::DType::e4m3 && f.b == ops::DType::e4m3)
      bad("cuBLASLt writes E5M2 output only when an operand is E5M2; use e4m3 (or bf16) output");
    if (g.beta != 0.f) bad("FP8 output with a C operand (beta != 0) is not supported");
    if (launching && !f.d_scale) bad("FP8 output needs d_scale (the device scale D is multiplied by before the cast)");
  } else if (f.d_scale || f.d_amax) {
    bad("d_scale and d_amax apply to FP8 output only");
  }
  if (launching && (!f.a_scale_inv || !f.b_scale_inv))
    bad("a_scale_inv and b_scale_inv are required (per-tensor device floats; pass a 1.0f for an unscaled operand)");
  if (g.epilogue != Epilogue::none && g.epilogue != Epilogue::bias)
    bad(fmt::format("epilogue {} is not supported with FP8 operands here (none and BIAS are)", epilogue_name(g.epilogue)));
  if (g.epilogue == Epilogue::bias) {
    const ops::DType want = g.dtype == ops::DType::f16 ? ops::DType::f16 : ops::DType::bf16;
    if (f.bias != want)
      bad(fmt::format("cuBLASLt takes a {} bias with {} output and FP8 operands, not {}", ops::dtype_name(want),
                      ops::dtype_name(g.dtype), ops::dtype_name(f.bias)));
    if (launching && !g.bias) bad("Epilogue::bias without a bias pointer");
  }
  if (g.aux) bad("FP8 GEMMs take no aux operand");
  // Every matrix and every scale or amax pointer 16-byte aligned: FP8 tensor-core kernels need it of the
  // matrices, and a scale pointer off a 16-byte boundary makes cublasLtMatmul return NOT_SUPPORTED after
  // the heuristic accepted the problem (H100, cuBLASLt 13.1, 2026-11-24 device runs #11 and #13).
  const void* c = g.beta != 0.f ? (g.c ? g.c : g.d) : nullptr;
  for (auto [p, name] : {std::pair{g.a, "A"}, {g.b, "B"}, {c, "C"}, {static_cast<const void*>(g.d), "D"},
                         {static_cast<const void*>(f.a_scale_inv), "a_scale_inv"},
                         {static_cast<const void*>(f.b_scale_inv), "b_scale_inv"},
                         {static_cast<const void*>(f.d_scale), "d_scale"}, {static_cast<const void*>(f.d_amax), "d_amax"}})
    if (reinterpret_cast<uintptr_t>(p) % 16)
      bad(fmt::format("{} must be 16-byte aligned (cuBLASLt's FP8 GEMMs refuse it otherwise); it is at 0x{:x}", name,
                      reinterpret_cast<uintptr_t>(p)));
}

}  // namespace

void check_gemm_call(const GemmCall& call) {
  if (call.fp8) check_fp8(call, true);
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
  if (g.fp8) check_fp8(g, launch || tune);
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
  // Plain GEMMs: every matrix has g.dtype. FP8: cuBLASLt's A is our B (W) and its B our A (x); C has D's
  // type, bf16 when D is FP8 (cuBLASLt's table; C is never read then, beta being 0).
  const cudaDataType_t dt = g.fp8 ? fp8_data_type(g.dtype) : data_type(g.dtype);
  const cudaDataType_t at = g.fp8 ? fp8_data_type(g.fp8->b) : dt, bt = g.fp8 ? fp8_data_type(g.fp8->a) : dt;
  const cudaDataType_t ct = g.fp8 && ops::is_fp8(g.dtype) ? CUDA_R_16BF : dt;
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
  if (g.fp8) {
    const Fp8Gemm& f = *g.fp8;
    set_attr(op.d, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, f.b_scale_inv, "set A_SCALE_POINTER");
    set_attr(op.d, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, f.a_scale_inv, "set B_SCALE_POINTER");
    if (ops::is_fp8(g.dtype)) {
      set_attr(op.d, CUBLASLT_MATMUL_DESC_D_SCALE_POINTER, f.d_scale, "set D_SCALE_POINTER");
      if (f.d_amax) set_attr(op.d, CUBLASLT_MATMUL_DESC_AMAX_D_POINTER, f.d_amax, "set AMAX_D_POINTER");
    }
    set_attr(op.d, CUBLASLT_MATMUL_DESC_FAST_ACCUM, static_cast<int8_t>(f.fast_accum ? 1 : 0), "set FAST_ACCUM");
    if (g.epilogue == Epilogue::bias)
      set_attr(op.d, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, data_type(f.bias), "set BIAS_DATA_TYPE");
  }
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
  check_blas(cublasLtMatrixLayoutCreate(&la.l, at, a_rows, a_cols, lda), "cublasLtMatrixLayoutCreate(A)");
  check_blas(cublasLtMatrixLayoutCreate(&lb.l, bt, b_rows, b_cols, ldb), "cublasLtMatrixLayoutCreate(B)");
  check_blas(cublasLtMatrixLayoutCreate(&lc.l, ct, m, n, ldd), "cublasLtMatrixLayoutCreate(C)");
  check_blas(cublasLtMatrixLayoutCreate(&ld.l, dt, m, n, ldd), "cublasLtMatrixLayoutCreate(D)");

  // C = D when beta is 0 (nothing is read), except for FP8 output: C's layout is bf16 there, and cuBLASLt
  // refuses an in-place call whose C and D layouts differ (INVALID_VALUE, H100 run #14), so C is null.
  const void* C = g.beta != 0.f ? (g.c ? g.c : g.d) : (g.fp8 && ops::is_fp8(g.dtype) ? nullptr : g.d);
  uint32_t al_a = alignment(A), al_b = alignment(B), al_c = alignment(C), al_d = alignment(g.d);
  std::string key = fmt::format("{}:{}x{}x{}:{}:{}:{}:{}:{}:{}:{}:{}", static_cast<int>(g.kind), g.m, g.n, g.k,
                                static_cast<int>(dt), static_cast<int>(epi), g.beta != 0.f, al_a, al_b, al_c, al_d,
                                g.aux ? alignment(g.aux) : 0);
  if (g.fp8)  // plain keys stay as they were
    key += fmt::format(":fp8:{}:{}:{}:{}:{}", static_cast<int>(at), static_cast<int>(bt),
                       g.epilogue == Epilogue::bias ? static_cast<int>(data_type(g.fp8->bias)) : -1,
                       g.fp8->fast_accum, g.fp8->d_amax != nullptr);

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
        fail(Status::unsupported, "cuBLASLt has no algorithm for {} GEMM m={} n={} k={} dtype {}{} epilogue {}",
             kind_name(g.kind), g.m, g.n, g.k, ops::dtype_name(g.dtype),
             g.fp8 ? fmt::format(" (FP8 {} x {}, fast accumulation {})", ops::dtype_name(g.fp8->a),
                                 ops::dtype_name(g.fp8->b), g.fp8->fast_accum ? "on" : "off")
                   : std::string(),
             epilogue_name(g.epilogue));
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
