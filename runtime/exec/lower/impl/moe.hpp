// Lowering the moe ops (moe_permute, moe_unpermute; docs/ops.md#mixture-of-experts) into the moe skeleton's kernels.
// Unfused groups of one moe op lower here.
#pragma once
#include "exec/lower/builder.hpp"

namespace jitfuse::exec {

// The builder's current group is moe op `i` alone. moe_permute forward: the routing (count, scan, scatter into one
// int32 buffer: saved in training, the forward's arena in inference) and the permutation; backward: the gradient's
// rows summed back per token. moe_unpermute forward: the weighted combine (saves its input); backward: the rows'
// gradients and the probabilities' (the fp32 gradient of its extra input).
void lower_moe(Builder& b, int i);

}  // namespace jitfuse::exec
