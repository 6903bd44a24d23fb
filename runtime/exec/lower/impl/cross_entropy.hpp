// Lowering the cross_entropy op (docs/ops.md#cross_entropy) into its generated kernels: unfused groups of the op alone
// lower here, and the joint strategy chunked_linear_cross_entropy builds its kernels from the same spec.
#pragma once
#include "exec/lower/builder.hpp"

namespace jitfuse::exec {

// A kernel of the cross_entropy skeleton for op `i` (its attributes, V = its input's columns, the recipe's dtype), in
// the builder's direction.
codegen::KernelSpec cross_entropy_spec(const Builder& b, int i, codegen::CrossEntropySpec::Kernel kernel);

// The builder's current group is cross_entropy op `i` alone. Forward: one block per row writes the per-row loss (and,
// training, the fp32 lse), then, for "mean" / "sum", one block reduces them into the output (and saves the backward's
// scale); the op saves its input, the logits. Backward: one block per row writes dlogits from the saved logits and lse.
void lower_cross_entropy(Builder& b, int i);

}  // namespace jitfuse::exec
