// Lowering grouped_linear (docs/ops.md#grouped_linear): one cuBLASLt GEMM per group over its rows, in both passes.
#pragma once
#include "exec/lower/builder.hpp"

namespace jitfuse::exec {

// The builder's current group is grouped_linear op `i` alone. Forward: y_g = x_g W_g^T for each of the G groups
// of rows (GEMMs over row and weight offsets; saves x). Backward: dx_g = dy_g W_g and dW_g = dy_g^T x_g.
void lower_grouped_linear(Builder& b, int i);

}  // namespace jitfuse::exec
