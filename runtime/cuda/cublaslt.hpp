// cuBLASLt GEMMs for linear in row-major terms (y = x W^T, dx = dy W, dW = dy^T x), with native
// epilogues (Epilogue below) and a C operand for residual accumulation. Heuristic results are cached per
// problem and can be looked up ahead (prepare); the workspace is the caller's (a program's arena), so a
// GEMM call allocates nothing and may be captured in a CUDA graph.
#pragma once
#include <cuda.h>

#include <cstdint>
#include <map>
#include <memory>
#include <vector>
#include <mutex>
#include <optional>
#include <string>

#include "ops/recipe.hpp"

namespace jitfuse::cuda {

enum class GemmKind { fwd, dgrad, wgrad };
// Forward: bias, gelu_bias, gelu_aux_bias (writes the pre-activation to aux), relu_bias, relu_aux_bias
// (writes cuBLASLt's 1-bit ReLU mask to aux). dgrad: dgelu_bgrad (d = gelu'(aux) * (dy W), bias = its
// column sums), drelu_bgrad (the same with the ReLU mask). wgrad: bgradb (bias = column sums of dy).
// Without bias: gelu, gelu_aux (pre-activation to aux), relu.
enum class Epilogue {
  none, bias, gelu_bias, gelu_aux_bias, relu_bias, relu_aux_bias, gelu, gelu_aux, relu, dgelu_bgrad, drelu_bgrad, bgradb
};

// cuBLASLt's ReLU bit-mask for `features` x `rows` values: its leading dimension (bits, a multiple of 128)
// and its size in bytes.
int64_t relu_mask_ld(int64_t features);
size_t relu_mask_bytes(int64_t features, int64_t rows);
std::string epilogue_name(Epilogue e);

// FP8 operands (issue 13). cuBLASLt takes FP8 on Ada and Hopper only in the "TN" layout, so an FP8 GEMM is
// one primitive, written in row-major terms with both operands contiguous along K:
//
//   D[m,n] = alpha * (a_scale_inv * A[m,k]) . (b_scale_inv * B[n,k])^T  (+ bias[n])   (fp32 accumulation)
//
// It is GemmKind::fwd with A = x and B = W: the forward y = x W^T as it is. The backward GEMMs contract
// along the other dimension of an operand and must be called as this primitive on transposed FP8 copies
// (producing those copies, fused with the cast, is a later piece of issue 13):
//   dgrad dx[m,k] = dy[m,n] W[n,k]    ->  A = dy [m,n] (rowwise), B = W^T [k,n]   (m, n, k) = (m, k, n)
//   wgrad dW[n,k] = dy^T[n,m] x[m,k]  ->  A = dy^T [n,m], B = x^T [k,m]           (m, n, k) = (n, k, m)
// GemmKind::dgrad / wgrad with FP8 operands are refused for that reason.
//
// GemmCall::dtype is then D's dtype: bf16, fp16, fp32, or E4M3/E5M2 (FP8 output: d_scale is required,
// D = fp8(d_scale * result), and d_amax, if given, receives max|result| before d_scale). Legal
// combinations (cuBLASLt's FP8 table): E4M3 x E4M3, E4M3 x E5M2, E5M2 x E4M3, never E5M2 x E5M2; the bias
// is bf16 except with fp16 output, where cuBLASLt requires it to be fp16. Epilogues: none and bias.
// Sizes (FP8 tensor-core requirements): k and n multiples of 16 (the leading dimensions of A, B and D),
// m any, A, B, C and D 16-byte aligned. check_gemm_call throws invalid_argument otherwise.
// How an FP8 operand's scale_inv is laid out (cuBLASLt's scale modes, Hopper, cuBLASLt 12.9+). For an
// operand [rows, K] (K-contiguous, as both operands of the primitive are):
//   tensor    one float (SCALAR_32F)
//   row128    one float per 1x128 block along K: s[(k / 128) * rows + r] (VEC128_32F; the K-block outer)
//   block128  one float per 128x128 block: s[(r / 128) * KB4 + k / 128] (BLK128x128_32F), KB4 = ceil(K / 128)
//             rounded up to a multiple of 4 (cuBLASLt's leading dimension of block scales)
// Layouts measured against a float32 reference of the dequantised operands on an H100 (cuBLASLt 13.1,
// tools/microbench/cublaslt_block_fp8_probe.cu). cuBLASLt runs tensor x tensor, row128 x row128 and
// row128 x block128 (either side), not block128 x block128; block scales need k % 128 == 0 here, no FP8
// output and no fast accumulation.
enum class Fp8Scaling { tensor, row128, block128 };
const char* fp8_scaling_name(Fp8Scaling s);  // "tensor", "1x128", "128x128"

struct Fp8Gemm {
  ops::DType a = ops::DType::e4m3, b = ops::DType::e4m3;  // operand formats
  ops::DType bias = ops::DType::bf16;                     // the bias vector's dtype (Epilogue::bias)
  const float* a_scale_inv = nullptr;  // device, one float each: A's values are code * a_scale_inv
  const float* b_scale_inv = nullptr;
  const float* d_scale = nullptr;      // FP8 output only (required there)
  float* d_amax = nullptr;             // FP8 output only (optional): max |D| before d_scale, overwritten
  // CUBLASLT_MATMUL_DESC_FAST_ACCUM: accumulate in the tensor cores' reduced-precision accumulator without
  // periodic promotion to fp32. TransformerEngine: on for the forward, off for dgrad and wgrad.
  bool fast_accum = true;
  // How a_scale_inv and b_scale_inv are laid out (fp8_block: whole tensors of block scales). Last, so that
  // aggregate initialisers of the fields above stay as they were.
  Fp8Scaling a_scaling = Fp8Scaling::tensor, b_scaling = Fp8Scaling::tensor;
  bool block_scaled() const { return a_scaling != Fp8Scaling::tensor || b_scaling != Fp8Scaling::tensor; }
};

struct GemmCall {
  GemmKind kind = GemmKind::fwd;
  int64_t m = 0, n = 0, k = 0;  // linear dims: x [m,k], W [n,k], y [m,n]
  ops::DType dtype = ops::DType::f32;  // every operand's dtype; with fp8 set, D's (and C's) dtype
  Epilogue epilogue = Epilogue::none;
  float alpha = 1.f, beta = 0.f;
  const void* a = nullptr;  // fwd: x, dgrad: dy, wgrad: dy
  const void* b = nullptr;  // fwd: W, dgrad: W, wgrad: x
  const void* c = nullptr;  // beta != 0: C operand (may equal d)
  void* d = nullptr;        // output
  const void* bias = nullptr;  // forward epilogues: bias in; dgelu_bgrad / bgradb: the bias gradient out
  void* aux = nullptr;      // gelu_aux_bias: pre-activation out; dgelu_bgrad: pre-activation in;
                            // relu_aux_bias: ReLU bit-mask out; drelu_bgrad: ReLU bit-mask in
  void* workspace = nullptr;  // kGemmWorkspace bytes, 256-byte aligned
  std::optional<Fp8Gemm> fp8;  // set: A and B are FP8 (see Fp8Gemm); kept last for aggregate initialisers
  // Row stride (elements) of the [m, n] matrix: fwd's y (D, and C), dgrad's and wgrad's dy; 0: n. Larger
  // than n pads the rows (the chunked LM head's logits at an odd vocabulary: 16-byte aligned rows). After
  // fp8, which aggregate initialisers stop before.
  int64_t ldy = 0;
  // Strided batch (equal groups of a grouped linear: G experts of C rows each): `batch` GEMMs of these dims in
  // one cuBLASLt call, GEMM i's a, b and d at i x stride_a, stride_b, stride_d elements (C with d's).
  int64_t batch = 1;
  int64_t stride_a = 0, stride_b = 0, stride_d = 0;
  // The weight is stored [k, n] ("in_out": GPT-2's Conv1D, a transposed nn.Linear weight) instead of [n, k]:
  // fwd y = x W, dgrad dx = dy W^T, wgrad dW[k,n] = x^T dy (BGRADB's bias gradient becomes BGRADA's, the same
  // sums over the m rows). Plain GEMMs only: FP8 operands take the TN layout (check_gemm_call refuses it).
  bool weight_t = false;
};

// Throws invalid_argument (naming the problem's dims and what to change) when `call` breaks a rule of
// the FP8 primitive above; plain calls are not checked here (as before). Blas::gemm and prepare call it;
// it needs no GPU.
void check_gemm_call(const GemmCall& call);

// The alignment in bytes (1 to 16) that every column of a column-major matrix at `p` with leading
// dimension `ld` elements of `elem_bytes` starts at (ld 0: `p` alone). What Blas passes as cuBLASLt's
// MIN_ALIGNMENT preferences: with an odd K, a 256-byte aligned bf16 x [m, K] has rows at 2-byte offsets.
uint32_t operand_alignment(const void* p, int64_t ld, size_t elem_bytes);

// The cuBLASLt workspace every GEMM call gets (what cuBLAS recommends for Hopper).
constexpr size_t kGemmWorkspace = 32u << 20;

// What Blas caches per problem (dims, dtypes, epilogue, beta != 0, the operands' alignments, the FP8
// options): the chosen algorithm. Immutable once made, so any number of threads may use one; a GemmStep
// keeps the one prepare made (Blas::plan), and a call whose problem is another (a less aligned tensor)
// looks its own up.
struct GemmPlan;

// One group of Blas::gemm_grouped: its rows and operands (a, b, d as GemmCall's for the call's kind).
struct GroupedOperands {
  int64_t m = 0;
  const void* a = nullptr;
  const void* b = nullptr;
  void* d = nullptr;
};
// `call` over group `g`'s rows and operands.
inline GemmCall group_call(GemmCall call, const GroupedOperands& g) {
  call.m = g.m;
  call.a = g.a;
  call.b = g.b;
  call.d = g.d;
  return call;
}

class Blas {
 public:
  Blas();
  ~Blas();
  Blas(const Blas&) = delete;
  Blas& operator=(const Blas&) = delete;
  // `plan` (optional): what plan() returned for this step; used when the call's problem is that plan's
  // (a comparison of a small struct), else the cache is searched as without it.
  void gemm(const GemmCall& call, CUstream stream, const GemmPlan* plan = nullptr);
  // A call whose m changes from call to call (a dropless grouped linear's groups): the algorithm chosen for m
  // rounded up to a power of two (one heuristic per bucket, not per m); m's own where cuBLASLt refuses that one.
  void gemm_rows(const GemmCall& call, CUstream stream);
  // One GEMM per group, each `call`'s kind, dtype, n and k over its own m rows and pointers (a dropless grouped
  // linear's experts), in one cuBLAS grouped call (cublasGemmGroupedBatchedEx); its pointer arrays are written to
  // the start of call.workspace (stream-ordered), the rest is cuBLAS's workspace. Plain calls only (no FP8, no
  // epilogue, alpha 1, beta 0).
  void gemm_grouped(const GemmCall& call, const std::vector<GroupedOperands>& groups, CUstream stream);
  // Looks up (and caches) the algorithm for `call`; false if cuBLASLt has none for the problem. Without a
  // stream nothing runs and the pointers only say which operands exist and how they are aligned. With
  // one, they are scratch operands of the call's sizes and the workspace: the heuristic's top candidates
  // are timed there (synchronising that stream) and the fastest is kept.
  bool prepare(const GemmCall& call, CUstream tune_stream = nullptr);
  // prepare, returning the cached entry (null where prepare returns false).
  std::shared_ptr<const GemmPlan> plan(const GemmCall& call, CUstream tune_stream = nullptr);
  // out[n] = sum over the m rows of x [m, n] (row-major), given a column of m ones: the wgrad GEMM of a
  // linear with one input feature (dW^T [1, n] = ones^T [1, m] x [m, n]). The fallback when BGRADB has no
  // algorithm for a problem.
  void column_sums(ops::DType dtype, int64_t m, int64_t n, const void* x, const void* ones, void* out,
                   void* workspace, CUstream stream);
  size_t heuristic_cache_size() const;
  static std::string version();

 private:
  // launch false: only the algorithm lookup (timing candidates on `stream` when tune is set). Returns the
  // plan the call used (`hint` when it matched, else the cache's entry).
  const GemmPlan* run(const GemmCall& call, CUstream stream, bool launch, bool tune, const GemmPlan* hint,
                      std::shared_ptr<const GemmPlan>* found);
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace jitfuse::cuda
