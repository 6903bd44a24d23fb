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

// Vocab-parallel op `i` (CrossEntropySpec::vocab_parallel): the stats kernel over rows [c0, c0 + rows) of the
// logits `in` (row stride ld; 0: the columns) into `stats` [rows, 4], the all_gather of every rank's into
// `gathered` [world x rows, 4], which the next rows_fwd / fused kernel of op i reads as its saved `stats`
// (forget_saved after it). Returns `gathered`.
int gather_row_stats(Builder& b, int i, int in, int64_t rows, int64_t c0, int64_t ld, int stats, int gathered,
                     const nlohmann::json& meta, const std::string& who);

}  // namespace jitfuse::exec
