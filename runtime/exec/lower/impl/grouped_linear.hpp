// Lowering grouped_linear (docs/ops.md#grouped_linear): one cuBLASLt GEMM per group over its rows, in both passes.
#pragma once
#include "exec/lower/builder.hpp"

namespace jitfuse::exec {

// Grouped_linear op `i` of the builder's current group. Forward: y_g = x_g W_g^T for each of the G groups of rows
// (GEMMs over row and weight offsets; saves x unless `save_input` is false: a joint strategy that recomputes it).
// Backward: dx_g = dy_g W_g and dW_g = dy_g^T x_g, reading x as saved context (op i, input).
void lower_grouped_linear(Builder& b, int i, bool save_input = true);

}  // namespace jitfuse::exec
