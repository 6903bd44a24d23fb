// Lowering helpers shared by the implementations: chains of non-GEMM ops become KernelSpecs (and kernel
// steps), linear ops become cuBLASLt GEMM steps. What may fuse is decided by the implementations
// (exec/lower/impl/implementation.hpp: legality()), through the one legality predicate each declares.
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "exec/lower/builder.hpp"
#include "fuser/plan.hpp"
#include "jitfuse/codegen/kernel_spec.hpp"

namespace jitfuse::exec {

struct ChainOptions {
  codegen::Direction dir = codegen::Direction::forward;
  bool training = true;
  std::string dtype = "fp32";
  bool vec = true;
  std::string rule;
  bool regenerate_dropout = false;  // joint: forward saves no mask, backward regenerates it
  // FP8 recipes: a forward chain ending in quantize casts its output (fp8.op is filled in by chain_spec).
  std::optional<codegen::Fp8Spec> fp8;
  // A comm op's identity half where it cannot alias (exec/lower/impl/comm.cpp): one copy kernel of that op alone,
  // which no rule may generate (chain_problem refuses collectives).
  bool comm_identity = false;
};

codegen::KernelSpec chain_spec(const std::vector<ops::Op>& ops, int b, int e, const ChainOptions& opt);

// True if every pointer a chain touches can use 16-byte vectors for its shape (cols % 8 == 0).
bool chain_vectorizable(const std::vector<ops::Op>& ops, int b, int e);

// The chain options of the builder's current group (direction, recipe, rule).
ChainOptions chain_options(const Builder& b);
// The generated kernel(s) of ops [kb, e) in the builder's direction over `rows` rows: forward reads `in`
// (default act(kb)) and writes act(e), with an amax pass first under current FP8 scaling; backward reads
// `in` (default grad_of(e)) and writes `out` (default grad_of(kb)).
void lower_chain(Builder& b, int kb, int e, const ChainOptions& opt, int64_t rows, int in = -1, int out = -1);

// A kernel spec as it is (with an amax pass first under current FP8 scaling).
void lower_spec(Builder& b, const codegen::KernelSpec& spec, const nlohmann::json& meta, int in, int out, int64_t rows,
                const std::string& what);

// FP8 recipes (exec/lower/fp8/linear.cpp). The cast of linear `lin`'s `operand` into its FP8 copies (Builder::fp8_operand): a kernel over `rows` rows of `src` running
// ops [b, e) first (forward or backward, by the builder's direction; b == e: a plain cast), writing the
// row-major codes and, in training, the transposed ones, with the operand's amax and scale_inv. The
// weight's cast is marked as a weight cast. A norm chain writes the row-major codes only (plus a
// separate cast of its bf16 output in training).
void fp8_cast_operand(Builder& b, int lin, fp8::Operand operand, int src, int bgn, int e);
// Whether linear `lin` under the builder's FP8 recipe has the sizes FP8 GEMMs need; throws unsupported,
// naming the op and what to change, otherwise.
void check_fp8_linear(const Builder& b, int lin);

// y = x W^T of linear op `lin` with an epilogue; the caller fills operands. Under an FP8 recipe the GEMM
// reads the FP8 copies of x and W (cast here unless a kernel of the group already wrote them).
GemmStep linear_forward(Builder& b, int lin, int x, int y, cuda::Epilogue epi = cuda::Epilogue::none);

// The backward of linear op `lin`: dx = alpha dy W (+ c), dW (+)= alpha dy^T x. `bias_grad`: the bias op right
// after the linear whose gradient the wgrad GEMM takes (BGRADB) — its column sums of dy.
struct LinearBackward {
  int dy = -1, dx = -1;
  float alpha = 1.f;
  int accumulate = -1;  // dgrad adds this buffer (beta = 1)
  cuda::Epilogue dgrad_epilogue = cuda::Epilogue::none;
  int dgrad_aux = -1, dgrad_bias = -1;
  int bias_grad_op = -1;
  int input = -1;  // the linear's saved input (default: saved_context(lin, Key::input))
};
void linear_backward(Builder& b, int lin, const LinearBackward& lb);
// FP8 recipes: linear_backward's two GEMMs, built but not added (a strategy places them: row blocks of the dgrad,
// the wgrad beside a collective), after the cast of dy into its FP8 copies (unless a kernel already wrote them),
// with what explain says of each.
struct Fp8BackwardGemms {
  GemmStep dgrad, wgrad;
  std::string dgrad_what, wgrad_what;
};
Fp8BackwardGemms fp8_backward_gemms(Builder& b, int lin, const LinearBackward& lb);

}  // namespace jitfuse::exec
