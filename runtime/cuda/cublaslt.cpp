// Row-major linear on column-major cuBLASLt: every product is computed transposed (D^T = op(A) op(B)),
// so row-major buffers are passed as they are. The descriptor and layouts of a call are initialised in
// its own (stack) storage; only the algorithm is cached, per problem (GemmKey).
#include "cuda/cublaslt.hpp"

#include <cublasLt.h>
#include <cublas_v2.h>

#include <algorithm>
#include <map>
#include <tuple>

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

struct Pref {
  cublasLtMatmulPreference_t p = nullptr;
  ~Pref() { if (p) cublasLtMatmulPreferenceDestroy(p); }
};

// Bytes of `t`'s elements (the types problem_of uses; FP8 included).
size_t type_bytes(cudaDataType_t t) {
  switch (t) {
    case CUDA_R_32F: return 4;
    case CUDA_R_16F:
    case CUDA_R_16BF: return 2;
    default: return 1;  // E4M3, E5M2
  }
}

}  // namespace

uint32_t operand_alignment(const void* p, int64_t ld, size_t elem_bytes) {
  uint64_t v = reinterpret_cast<uintptr_t>(p);
  if (ld > 0) v |= static_cast<uint64_t>(ld) * elem_bytes;  // column i (a row-major row) starts at p + i ld
  uint32_t a = 16;
  while (a > 1 && (v % a)) a >>= 1;
  return a;
}

namespace {

uint32_t alignment(const void* p) { return operand_alignment(p, 0, 1); }

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

const char* fp8_scaling_name(Fp8Scaling s) {
  switch (s) {
    case Fp8Scaling::tensor: return "tensor";
    case Fp8Scaling::row128: return "1x128";
    case Fp8Scaling::block128: return "128x128";
  }
  return "?";
}

namespace {

int32_t scale_mode(Fp8Scaling s) {
  switch (s) {
    case Fp8Scaling::row128: return CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    case Fp8Scaling::block128: return CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    case Fp8Scaling::tensor: break;
  }
  return CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
}

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
  if (g.weight_t)
    bad("FP8 GEMMs take the TN layout only: a weight stored [in, out] (weight_t) has no FP8 form; store it [out, in]");
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
  if (f.block_scaled()) {
    if ((f.a_scaling == Fp8Scaling::tensor) != (f.b_scaling == Fp8Scaling::tensor))
      bad("block scales on one operand need block scales on the other (cuBLASLt has no per-tensor x block GEMM)");
    if (f.a_scaling == Fp8Scaling::block128 && f.b_scaling == Fp8Scaling::block128)
      bad("128x128 x 128x128 block scales are not supported by cuBLASLt; scale one operand per 1x128 block");
    if (g.k % 128) bad("block scales need k to be a multiple of 128 (whole blocks along K)");
    if (fp8_out) bad("FP8 output is not supported with block scales (write bf16 and cast)");
    if (f.fast_accum) bad("fast accumulation is not supported with block scales");
    if (g.epilogue != Epilogue::none) bad("block-scaled GEMMs take no epilogue here");
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

namespace {
// A strided batch runs plain GEMMs only.
void check_batch(const GemmCall& call) {
  if (call.batch < 1 || (call.batch > 1 && (call.fp8 || call.epilogue != Epilogue::none || call.weight_t)))
    fail(Status::internal, "a batched GEMM ({} GEMMs) is plain: no FP8, no epilogue, weights [n, k]", call.batch);
}
}  // namespace

void check_gemm_call(const GemmCall& call) {
  if (call.fp8) check_fp8(call, true);
  check_batch(call);
}

// The cache key: everything the heuristic's answer depends on (what the formatted string key of earlier
// versions held, field for field), compared as a struct.
struct GemmKey {
  int kind = 0;
  int64_t m = 0, n = 0, k = 0, ldy = 0;
  int dt = 0, epi = 0;
  bool beta = false;
  // A, B, C, D: the alignment of every column start (pointer and leading dimension: operand_alignment);
  // aux and bias: of the pointer, from which the heuristic infers what it may assume (cublasLt.h).
  uint32_t al_a = 0, al_b = 0, al_c = 0, al_d = 0, al_aux = 0, al_bias = 0;
  bool fp8 = false;  // plain keys leave the FP8 fields below at their defaults
  int at = 0, bt = 0, bias_dt = -1;
  bool fast_accum = false, amax = false;
  int a_scaling = 0, b_scaling = 0;
  int64_t batch = 1, stride_a = 0, stride_b = 0, stride_d = 0;
  bool weight_t = false;
  auto tie() const {
    return std::tie(kind, m, n, k, ldy, dt, epi, beta, al_a, al_b, al_c, al_d, al_aux, al_bias, fp8, at, bt, bias_dt,
                    fast_accum, amax, a_scaling, b_scaling, batch, stride_a, stride_b, stride_d, weight_t);
  }
  bool operator<(const GemmKey& o) const { return tie() < o.tie(); }
  bool operator==(const GemmKey& o) const { return tie() == o.tie(); }
};

struct GemmPlan {
  GemmKey key;
  cublasLtMatmulAlgo_t algo{};
};

namespace {

// A call in cuBLASLt's column-major terms (see file comment): what the descriptor and layouts are made of.
struct Problem {
  uint64_t m = 0, n = 0, k = 0, lda = 0, ldb = 0, ldd = 0;
  uint64_t a_rows = 0, a_cols = 0, b_rows = 0, b_cols = 0;
  cublasOperation_t ta = CUBLAS_OP_N, tb = CUBLAS_OP_N;
  const void* A = nullptr;
  const void* B = nullptr;
  const void* C = nullptr;
  cudaDataType_t dt{}, at{}, bt{}, ct{};
  cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_DEFAULT;
};

// Dtypes, epilogue and C of a call, whichever way its operands lie.
void finish_problem(const GemmCall& g, Problem& p) {
  // Plain GEMMs: every matrix has g.dtype. FP8: cuBLASLt's A is our B (W) and its B our A (x); C has D's
  // type, bf16 when D is FP8 (cuBLASLt's table; C is never read then, beta being 0).
  p.dt = g.fp8 ? fp8_data_type(g.dtype) : data_type(g.dtype);
  p.at = g.fp8 ? fp8_data_type(g.fp8->b) : p.dt;
  p.bt = g.fp8 ? fp8_data_type(g.fp8->a) : p.dt;
  p.ct = g.fp8 && ops::is_fp8(g.dtype) ? CUDA_R_16BF : p.dt;
  switch (g.epilogue) {
    case Epilogue::none: break;
    case Epilogue::bias: p.epi = CUBLASLT_EPILOGUE_BIAS; break;
    case Epilogue::gelu_bias: p.epi = CUBLASLT_EPILOGUE_GELU_BIAS; break;
    case Epilogue::gelu_aux_bias: p.epi = CUBLASLT_EPILOGUE_GELU_AUX_BIAS; break;
    case Epilogue::gelu: p.epi = CUBLASLT_EPILOGUE_GELU; break;
    case Epilogue::gelu_aux: p.epi = CUBLASLT_EPILOGUE_GELU_AUX; break;
    case Epilogue::relu: p.epi = CUBLASLT_EPILOGUE_RELU; break;
    case Epilogue::relu_bias: p.epi = CUBLASLT_EPILOGUE_RELU_BIAS; break;
    // dgrad's D is dx^T [k, m]: DGELU_BGRAD's bias gradient has one entry per row of D (k features).
    case Epilogue::dgelu_bgrad: p.epi = CUBLASLT_EPILOGUE_DGELU_BGRAD; break;
    case Epilogue::relu_aux_bias: p.epi = CUBLASLT_EPILOGUE_RELU_AUX_BIAS; break;
    case Epilogue::drelu_bgrad: p.epi = CUBLASLT_EPILOGUE_DRELU_BGRAD; break;
    // wgrad's B is dy (m x n after the transpose): BGRADB sums it over GEMM-k (the m tokens), n entries.
    case Epilogue::bgradb: p.epi = g.weight_t ? CUBLASLT_EPILOGUE_BGRADA : CUBLASLT_EPILOGUE_BGRADB; break;
  }
  const GemmKind epi_kind = g.epilogue == Epilogue::dgelu_bgrad || g.epilogue == Epilogue::drelu_bgrad ? GemmKind::dgrad
                            : g.epilogue == Epilogue::bgradb    ? GemmKind::wgrad
                                                                : GemmKind::fwd;
  if (g.epilogue != Epilogue::none && g.kind != epi_kind)
    fail(Status::internal, "cuBLASLt epilogue {} requested on the wrong GEMM", epilogue_name(g.epilogue));
  // C = D when beta is 0 (nothing is read), except for FP8 output: C's layout is bf16 there, and cuBLASLt
  // refuses an in-place call whose C and D layouts differ (INVALID_VALUE, H100 run #14), so C is null.
  p.C = g.beta != 0.f ? (g.c ? g.c : g.d) : (g.fp8 && ops::is_fp8(g.dtype) ? nullptr : g.d);
}

// The weight stored [k, n] (GemmCall::weight_t): in column-major terms W is [n, k] with leading dimension n.
Problem problem_of_weight_t(const GemmCall& g, uint64_t ldy) {
  Problem p;
  switch (g.kind) {
    case GemmKind::fwd:  // y^T[n,m] = W(nxk col-major) * x^T(kxm)
      p.m = g.n; p.n = g.m; p.k = g.k;
      p.A = g.b; p.ta = CUBLAS_OP_N; p.a_rows = g.n; p.a_cols = g.k; p.lda = g.n;
      p.B = g.a; p.tb = CUBLAS_OP_N; p.b_rows = g.k; p.b_cols = g.m; p.ldb = g.k;
      p.ldd = ldy;
      break;
    case GemmKind::dgrad:  // dx^T[k,m] = W(nxk col-major)^T * dy^T(nxm)
      p.m = g.k; p.n = g.m; p.k = g.n;
      p.A = g.b; p.ta = CUBLAS_OP_T; p.a_rows = g.n; p.a_cols = g.k; p.lda = g.n;
      p.B = g.a; p.tb = CUBLAS_OP_N; p.b_rows = g.n; p.b_cols = g.m; p.ldb = ldy;
      p.ldd = g.k;
      break;
    case GemmKind::wgrad:  // dW(nxk col-major)[n,k] = dy^T(nxm) * x(kxm col-major)^T; BGRADA sums A over the m rows
      p.m = g.n; p.n = g.k; p.k = g.m;
      p.A = g.a; p.ta = CUBLAS_OP_N; p.a_rows = g.n; p.a_cols = g.m; p.lda = ldy;
      p.B = g.b; p.tb = CUBLAS_OP_T; p.b_rows = g.k; p.b_cols = g.m; p.ldb = g.k;
      p.ldd = g.n;
      break;
  }
  finish_problem(g, p);
  return p;
}

Problem problem_of(const GemmCall& g) {
  Problem p;
  const uint64_t ldy = static_cast<uint64_t>(g.ldy > g.n ? g.ldy : g.n);
  if (g.weight_t) return problem_of_weight_t(g, ldy);
  switch (g.kind) {
    case GemmKind::fwd:  // y^T[n,m] = W(kxn col-major)^T * x^T(kxm)
      p.m = g.n; p.n = g.m; p.k = g.k;
      p.A = g.b; p.ta = CUBLAS_OP_T; p.a_rows = g.k; p.a_cols = g.n; p.lda = g.k;
      p.B = g.a; p.tb = CUBLAS_OP_N; p.b_rows = g.k; p.b_cols = g.m; p.ldb = g.k;
      p.ldd = ldy;
      break;
    case GemmKind::dgrad:  // dx^T[k,m] = W^T(kxn) * dy^T(nxm)
      p.m = g.k; p.n = g.m; p.k = g.n;
      p.A = g.b; p.ta = CUBLAS_OP_N; p.a_rows = g.k; p.a_cols = g.n; p.lda = g.k;
      p.B = g.a; p.tb = CUBLAS_OP_N; p.b_rows = g.n; p.b_cols = g.m; p.ldb = ldy;
      p.ldd = g.k;
      break;
    case GemmKind::wgrad:  // dW^T[k,n] = x^T(kxm) * dy(mxn)
      p.m = g.k; p.n = g.n; p.k = g.m;
      p.A = g.b; p.ta = CUBLAS_OP_N; p.a_rows = g.k; p.a_cols = g.m; p.lda = g.k;
      p.B = g.a; p.tb = CUBLAS_OP_T; p.b_rows = g.n; p.b_cols = g.m; p.ldb = ldy;
      p.ldd = g.k;
      break;
  }
  finish_problem(g, p);
  return p;
}

GemmKey key_of(const GemmCall& g, const Problem& p) {
  GemmKey k;
  k.kind = static_cast<int>(g.kind);
  k.m = g.m;
  k.n = g.n;
  k.k = g.k;
  k.ldy = g.ldy > g.n ? g.ldy : 0;
  k.dt = static_cast<int>(p.dt);
  k.epi = static_cast<int>(p.epi);
  k.beta = g.beta != 0.f;
  k.batch = g.batch;
  k.stride_a = g.stride_a;
  k.stride_b = g.stride_b;
  k.stride_d = g.stride_d;
  k.weight_t = g.weight_t;
  // An odd K (or N) leaves the columns of a matrix whose pointer is 256-byte aligned at 2- or 4-byte
  // offsets: the MIN_ALIGNMENT preferences below say so, so the heuristic offers only algorithms that load
  // such columns (cuBLASLt sees the layouts too; the preferences do not rely on it).
  k.al_a = operand_alignment(p.A, static_cast<int64_t>(p.lda), type_bytes(p.at));
  k.al_b = operand_alignment(p.B, static_cast<int64_t>(p.ldb), type_bytes(p.bt));
  k.al_c = operand_alignment(p.C, static_cast<int64_t>(p.ldd), type_bytes(p.ct));
  k.al_d = operand_alignment(g.d, static_cast<int64_t>(p.ldd), type_bytes(p.dt));
  k.al_aux = g.aux ? alignment(g.aux) : 0;
  // The heuristic takes the bias pointer's alignment from the descriptor (prepare passes 256-byte aligned
  // stand-ins): a call with a less aligned bias, or bias gradient, must not reuse that plan.
  k.al_bias = g.bias ? alignment(g.bias) : 0;
  if (g.fp8) {
    k.fp8 = true;
    k.at = static_cast<int>(p.at);
    k.bt = static_cast<int>(p.bt);
    k.bias_dt = g.epilogue == Epilogue::bias ? static_cast<int>(data_type(g.fp8->bias)) : -1;
    k.fast_accum = g.fp8->fast_accum;
    k.amax = g.fp8->d_amax != nullptr;
    k.a_scaling = static_cast<int>(g.fp8->a_scaling);
    k.b_scaling = static_cast<int>(g.fp8->b_scaling);
  }
  return k;
}

// The call's descriptor and layouts, initialised in the caller's storage (cublasLt*Init: no allocation,
// nothing to destroy): per call, so that the pointer attributes of concurrent calls never share one.
struct Descriptors {
  cublasLtMatmulDescOpaque_t op_storage;
  cublasLtMatrixLayoutOpaque_t la_storage, lb_storage, lc_storage, ld_storage;
  cublasLtMatmulDesc_t op = &op_storage;
  cublasLtMatrixLayout_t la = &la_storage, lb = &lb_storage, lc = &lc_storage, ld = &ld_storage;

  Descriptors(const GemmCall& g, const Problem& p) {
    check_blas(cublasLtMatmulDescInit(op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescInit");
    set_attr(op, CUBLASLT_MATMUL_DESC_TRANSA, p.ta, "set TRANSA");
    set_attr(op, CUBLASLT_MATMUL_DESC_TRANSB, p.tb, "set TRANSB");
    set_attr(op, CUBLASLT_MATMUL_DESC_EPILOGUE, p.epi, "set EPILOGUE");
    if (g.bias) set_attr(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, g.bias, "set BIAS_POINTER");
    if (g.fp8) {
      const Fp8Gemm& f = *g.fp8;
      set_attr(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, f.b_scale_inv, "set A_SCALE_POINTER");
      set_attr(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, f.a_scale_inv, "set B_SCALE_POINTER");
      if (ops::is_fp8(g.dtype)) {
        set_attr(op, CUBLASLT_MATMUL_DESC_D_SCALE_POINTER, f.d_scale, "set D_SCALE_POINTER");
        if (f.d_amax) set_attr(op, CUBLASLT_MATMUL_DESC_AMAX_D_POINTER, f.d_amax, "set AMAX_D_POINTER");
      }
      set_attr(op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, static_cast<int8_t>(f.fast_accum ? 1 : 0), "set FAST_ACCUM");
      if (f.block_scaled()) {
        // cuBLASLt's A is our B (the weight in the forward) and its B our A, as the scale pointers above.
        set_attr(op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, scale_mode(f.b_scaling), "set A_SCALE_MODE");
        set_attr(op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, scale_mode(f.a_scaling), "set B_SCALE_MODE");
      }
      if (g.epilogue == Epilogue::bias)
        set_attr(op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, data_type(f.bias), "set BIAS_DATA_TYPE");
    }
    const bool relu_mask = g.epilogue == Epilogue::relu_aux_bias || g.epilogue == Epilogue::drelu_bgrad;
    if (g.epilogue == Epilogue::gelu_aux_bias || g.epilogue == Epilogue::gelu_aux ||
        g.epilogue == Epilogue::dgelu_bgrad || relu_mask) {
      set_attr(op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, g.aux, "set EPILOGUE_AUX_POINTER");
      // The pre-activation has D's layout; the ReLU mask is one bit per value, ld in bits.
      int64_t aux_ld = relu_mask ? relu_mask_ld(static_cast<int64_t>(p.m)) : static_cast<int64_t>(p.ldd);
      set_attr(op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, aux_ld, "set EPILOGUE_AUX_LD");
    }
    check_blas(cublasLtMatrixLayoutInit(la, p.at, p.a_rows, p.a_cols, static_cast<int64_t>(p.lda)),
               "cublasLtMatrixLayoutInit(A)");
    check_blas(cublasLtMatrixLayoutInit(lb, p.bt, p.b_rows, p.b_cols, static_cast<int64_t>(p.ldb)),
               "cublasLtMatrixLayoutInit(B)");
    check_blas(cublasLtMatrixLayoutInit(lc, p.ct, p.m, p.n, static_cast<int64_t>(p.ldd)), "cublasLtMatrixLayoutInit(C)");
    check_blas(cublasLtMatrixLayoutInit(ld, p.dt, p.m, p.n, static_cast<int64_t>(p.ldd)), "cublasLtMatrixLayoutInit(D)");
    if (g.batch > 1) {  // cuBLASLt's A is our b, its B our a (problem_of)
      const int32_t count = static_cast<int32_t>(g.batch);
      const std::pair<cublasLtMatrixLayout_t, int64_t> strided[] = {
          {la, g.stride_b}, {lb, g.stride_a}, {lc, g.stride_d}, {ld, g.stride_d}};
      for (const auto& [layout, stride] : strided) {
        check_blas(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)),
                   "set BATCH_COUNT");
        check_blas(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                                    sizeof(stride)),
                   "set STRIDED_BATCH_OFFSET");
      }
    }
  }
  Descriptors(const Descriptors&) = delete;
  Descriptors& operator=(const Descriptors&) = delete;
};

// cublasLtMatmul of `g` (problem `p`, descriptors `ds`) with `algo` on `stream`.
cublasStatus_t matmul(cublasLtHandle_t h, const GemmCall& g, const Problem& p, const Descriptors& ds,
                      const cublasLtMatmulAlgo_t& algo, CUstream stream) {
  return cublasLtMatmul(h, ds.op, &g.alpha, p.A, ds.la, p.B, ds.lb, &g.beta, p.C, ds.lc, g.d, ds.ld, &algo,
                        g.workspace, kGemmWorkspace, reinterpret_cast<cudaStream_t>(stream));
}

}  // namespace

struct Blas::Impl {
  cublasLtHandle_t handle = nullptr;
  mutable std::mutex mu;
  std::map<GemmKey, std::shared_ptr<const GemmPlan>> algos;
  // cuBLAS (not Lt) for the grouped GEMMs: made on first use; its stream and workspace are per call, under `grouped_mu`.
  cublasHandle_t grouped = nullptr;
  std::mutex grouped_mu;
};

Blas::Blas() : impl_(std::make_unique<Impl>()) { check_blas(cublasLtCreate(&impl_->handle), "cublasLtCreate"); }

Blas::~Blas() {
  if (impl_->grouped) cublasDestroy(impl_->grouped);
  cublasLtDestroy(impl_->handle);
}

void Blas::gemm_grouped(const GemmCall& g, const std::vector<GroupedOperands>& groups, CUstream stream) {
  if (groups.empty()) return;
  if (g.fp8 || g.epilogue != Epilogue::none || g.alpha != 1.f || g.beta != 0.f || g.ldy > g.n)
    fail(Status::internal, "cuBLAS grouped GEMM: plain calls only");
  if (!g.workspace) fail(Status::internal, "cuBLAS grouped GEMM without a workspace");
  const size_t n_groups = groups.size();
  const size_t arrays = (3 * n_groups * sizeof(void*) + 255) / 256 * 256;
  if (arrays + (1u << 20) > kGemmWorkspace)
    fail(Status::unsupported, "cuBLAS grouped GEMM: {} groups do not fit the workspace", n_groups);
  // Per group, in cuBLAS's column-major terms (problem_of): A, B, C pointers and the dims.
  std::vector<const void*> ptrs(3 * n_groups);
  std::vector<int> m(n_groups), n(n_groups), k(n_groups), lda(n_groups), ldb(n_groups), ldc(n_groups);
  std::vector<cublasOperation_t> ta(n_groups), tb(n_groups);
  std::vector<float> alpha(n_groups, 1.f), beta(n_groups, 0.f);
  std::vector<int> size(n_groups, 1);
  for (size_t i = 0; i < n_groups; ++i) {
    const GemmCall one = group_call(g, groups[i]);
    const Problem p = problem_of(one);
    if (p.m > INT32_MAX || p.n > INT32_MAX || p.k > INT32_MAX)
      fail(Status::unsupported, "cuBLAS grouped GEMM: a group's dims exceed 32 bits");
    m[i] = static_cast<int>(p.m);
    n[i] = static_cast<int>(p.n);
    k[i] = static_cast<int>(p.k);
    lda[i] = static_cast<int>(p.lda);
    ldb[i] = static_cast<int>(p.ldb);
    ldc[i] = static_cast<int>(p.ldd);
    ta[i] = p.ta;
    tb[i] = p.tb;
    ptrs[i] = p.A;
    ptrs[n_groups + i] = p.B;
    ptrs[2 * n_groups + i] = one.d;
  }
  const auto& d = driver();
  const auto dev = reinterpret_cast<CUdeviceptr>(g.workspace);
  check(d.cuMemcpyHtoDAsync(dev, ptrs.data(), ptrs.size() * sizeof(void*), stream), "cuMemcpyHtoDAsync(grouped GEMM pointers)");
  const auto* arr = reinterpret_cast<const void* const*>(g.workspace);
  const cudaDataType_t dt = data_type(g.dtype);
  std::lock_guard<std::mutex> lock(impl_->grouped_mu);
  if (!impl_->grouped) check_blas(cublasCreate(&impl_->grouped), "cublasCreate");
  check_blas(cublasSetStream(impl_->grouped, reinterpret_cast<cudaStream_t>(stream)), "cublasSetStream");
  check_blas(cublasSetWorkspace(impl_->grouped, static_cast<char*>(g.workspace) + arrays, kGemmWorkspace - arrays),
             "cublasSetWorkspace");
  check_blas(cublasGemmGroupedBatchedEx(impl_->grouped, ta.data(), tb.data(), m.data(), n.data(), k.data(),
                                        alpha.data(), arr, dt, lda.data(), arr + n_groups, dt, ldb.data(), beta.data(),
                                        const_cast<void* const*>(arr + 2 * n_groups), dt, ldc.data(),
                                        static_cast<int>(n_groups), size.data(), CUBLAS_COMPUTE_32F),
             "cublasGemmGroupedBatchedEx");
}

std::string Blas::version() {
  size_t v = cublasLtGetVersion();
  return std::to_string(v / 10000) + "." + std::to_string((v / 100) % 100) + "." + std::to_string(v % 100);
}

size_t Blas::heuristic_cache_size() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->algos.size();
}

bool Blas::prepare(const GemmCall& call, CUstream tune_stream) { return plan(call, tune_stream) != nullptr; }

std::shared_ptr<const GemmPlan> Blas::plan(const GemmCall& call, CUstream tune_stream) {
  try {
    std::shared_ptr<const GemmPlan> found;
    run(call, tune_stream, false, tune_stream != nullptr, nullptr, &found);
    return found;
  } catch (const Error& e) {
    if (e.status() != Status::unsupported) throw;
    return nullptr;
  }
}

void Blas::gemm(const GemmCall& g, CUstream stream, const GemmPlan* plan) {
  if (!g.workspace) fail(Status::internal, "cuBLASLt GEMM without a workspace");
  run(g, stream, true, false, plan, nullptr);
}

void Blas::gemm_rows(const GemmCall& g, CUstream stream) {
  if (!g.workspace) fail(Status::internal, "cuBLASLt GEMM without a workspace");
  if (g.fp8) return gemm(g, stream);
  GemmCall bucket = g;
  bucket.m = 16;
  while (bucket.m < g.m) bucket.m *= 2;
  const GemmPlan* plan = run(bucket, nullptr, false, false, nullptr, nullptr);
  const Problem p = problem_of(g);
  if (matmul(impl_->handle, g, p, Descriptors(g, p), plan->algo, stream) == CUBLAS_STATUS_SUCCESS) return;
  run(g, stream, true, false, nullptr, nullptr);
}

const GemmPlan* Blas::run(const GemmCall& g, CUstream stream, bool launch, bool tune, const GemmPlan* hint,
                          std::shared_ptr<const GemmPlan>* found) {
  if (g.fp8) check_fp8(g, launch || tune);
  check_batch(g);
  const Problem p = problem_of(g);
  const GemmKey key = key_of(g, p);
  const GemmPlan* plan = hint && hint->key == key ? hint : nullptr;
  if (!plan) {
    std::lock_guard<std::mutex> lock(impl_->mu);
    auto it = impl_->algos.find(key);
    if (it == impl_->algos.end()) {
      Descriptors ds(g, p);
      Pref pref;
      check_blas(cublasLtMatmulPreferenceCreate(&pref.p), "cublasLtMatmulPreferenceCreate");
      size_t wsz = kGemmWorkspace;
      cublasLtMatmulPreferenceSetAttribute(pref.p, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsz, sizeof(wsz));
      cublasLtMatmulPreferenceSetAttribute(pref.p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &key.al_a, sizeof(key.al_a));
      cublasLtMatmulPreferenceSetAttribute(pref.p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &key.al_b, sizeof(key.al_b));
      cublasLtMatmulPreferenceSetAttribute(pref.p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &key.al_c, sizeof(key.al_c));
      cublasLtMatmulPreferenceSetAttribute(pref.p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &key.al_d, sizeof(key.al_d));
      constexpr int kCandidates = 8;
      cublasLtMatmulHeuristicResult_t res[kCandidates] = {};
      int n_found = 0;
      check_blas(cublasLtMatmulAlgoGetHeuristic(impl_->handle, ds.op, ds.la, ds.lb, ds.lc, ds.ld, pref.p,
                                                tune ? kCandidates : 1, res, &n_found),
                 "cublasLtMatmulAlgoGetHeuristic");
      if (n_found == 0)
        fail(Status::unsupported, "cuBLASLt has no algorithm for {} GEMM m={} n={} k={} dtype {}{} epilogue {}",
             kind_name(g.kind), g.m, g.n, g.k, ops::dtype_name(g.dtype),
             g.fp8 ? fmt::format(" (FP8 {} x {}, fast accumulation {})", ops::dtype_name(g.fp8->a),
                                 ops::dtype_name(g.fp8->b), g.fp8->fast_accum ? "on" : "off")
                   : std::string(),
             epilogue_name(g.epilogue));
      int best = 0;
      if (tune && n_found > 1) {
        // Prepare-time tuning on the caller's scratch operands: the heuristic's first choice is not always
        // the fastest (small-M problems especially); each candidate is timed, the median of a few runs.
        const auto& d = driver();
        CUevent e0 = nullptr, e1 = nullptr;
        check(d.cuEventCreate(&e0, CU_EVENT_DEFAULT), "cuEventCreate");
        check(d.cuEventCreate(&e1, CU_EVENT_DEFAULT), "cuEventCreate");
        float best_ms = 3.0e38f;  // a candidate that fails to run is never chosen
        for (int i = 0; i < n_found; ++i) {
          float t[3];
          bool ok = true;
          for (int r = 0; r < 4 && ok; ++r) {
            check(d.cuEventRecord(e0, stream), "cuEventRecord");
            ok = matmul(impl_->handle, g, p, ds, res[i].algo, stream) == CUBLAS_STATUS_SUCCESS;
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
      auto made = std::make_shared<GemmPlan>();
      made->key = key;
      made->algo = res[best].algo;
      it = impl_->algos.emplace(key, std::move(made)).first;
    }
    if (found) *found = it->second;
    plan = it->second.get();  // entries are never removed: the plan outlives the lock
  }
  if (!launch) return plan;
  check_blas(matmul(impl_->handle, g, p, Descriptors(g, p), plan->algo, stream), "cublasLtMatmul");
  return plan;
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
