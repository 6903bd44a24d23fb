// Lowering a comm op (all_gather, reduce_scatter, all_reduce, moe_dispatch, moe_combine) into comm steps: its forward and backward
// collectives on the program's communicator (docs/parallel.md). Unfused groups of one comm op lower here.
#pragma once
#include "exec/lower/builder.hpp"

namespace jitfuse::exec {

// The builder's current group is comm op `i` alone: its collective in the builder's direction, or nothing
// where that direction is the identity (the value or gradient passes through).
void lower_comm(Builder& b, int i);

}  // namespace jitfuse::exec
