// Lowering: how a group of ops becomes kernels. Holds the one legality predicate for fusion (what the
// skeletons and cuBLASLt epilogues can implement) and turns chains of non-GEMM ops into KernelSpecs.
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "fuser/plan.hpp"
#include "jitfuse/codegen/kernel_spec.hpp"

namespace jitfuse::exec {

// The legality predicate used by the fuser. A rule may implement ops [b, e) in a pass when:
//  - generated: no linear op; reshape only alone; at most one anchor (a norm or a gated op);
//    the rule's skeleton is the one the anchor implies (rownorm / gated / elementwise);
//    rownorm groups hold no bias and no gated op; gated groups hold no dropout before the gate;
//  - cublaslt: the window starts with the op pattern its epilogue implements (BIAS: linear bias;
//    GELU_AUX_BIAS: linear bias gelu(tanh); RELU_BIAS: linear bias relu; RESIDUAL: linear
//    [bias|scale] add_extra_input; DGRAD_ACCUMULATE (backward): make_extra_output linear;
//    SCALED (backward): linear scale; DGELU_BGRAD (backward): bias gelu(tanh) linear [bias];
//    BGRADB (backward): linear bias), and any tail after it is a legal elementwise chain;
//  - joint regenerate_dropout_mask: an elementwise chain holding an active dropout;
//    joint recompute_linear_output: linear followed by one pointwise op that saves its input;
//    joint relu_bitmask: linear bias relu linear [bias] with a hidden width that is a multiple of 8.
fuser::LegalityFn legality();
std::optional<std::string> check_legal(const rules::Rule& rule, const std::vector<ops::Op>& ops, int b, int e,
                                       rules::Pass pass);

// Is ops [b, e) a chain that one generated kernel can run? nullopt if yes, else why not.
std::optional<std::string> chain_problem(const std::vector<ops::Op>& ops, int b, int e, codegen::Skeleton* skeleton);

struct ChainOptions {
  codegen::Direction dir = codegen::Direction::forward;
  bool training = true;
  std::string dtype = "fp32";
  bool vec = true;
  std::string rule;
  bool regenerate_dropout = false;  // joint: forward saves no mask, backward regenerates it
  // FP8 recipes: a forward chain ending in quantize casts its output (fp8.op is filled in by chain_spec).
  std::optional<codegen::Fp8Spec> fp8;
  // Saved values the forward must write because they are internal to the group. Values at group
  // boundaries are materialized anyway and are aliased instead.
};

codegen::KernelSpec chain_spec(const std::vector<ops::Op>& ops, int b, int e, const ChainOptions& opt);

// True if every pointer a chain touches can use 16-byte vectors for its shape (cols % 8 == 0).
bool chain_vectorizable(const std::vector<ops::Op>& ops, int b, int e);

}  // namespace jitfuse::exec
