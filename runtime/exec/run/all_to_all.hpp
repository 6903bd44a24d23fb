// Expert parallelism's exchange (CommStep::AllToAll; docs/parallel.md#expert-parallelism): the rows of each expert
// between the rank that routed them (its permuted rows) and the rank that owns the expert, by NCCL send/recv in
// one group, straight into the expert-major order the owner's grouped linears read (no sort kernel).
#pragma once
#include <cuda.h>

#include <vector>

#include "cuda/nccl.hpp"
#include "exec/ir/program.hpp"
#include "exec/run/routes.hpp"

namespace jitfuse::exec {

// One all_to_all step on `stream`: reads every rank's rows per expert on the host (after all-gathering them in the
// dispatch's forward), checks that every rank's experts fit their bound (the same check on every rank: all fail
// together rather than leave a peer waiting), puts this rank's experts' routing into `routes` (and, in the
// dispatch's forward, into its routing buffer), exchanges the rows and zeroes the receiving side past them.
// Refused while the stream captures a CUDA graph (the counts are read on the host), except after a padded
// moe_permute (CommStep::AllToAll::counts -1): every (rank, expert) pair then sends `capacity` rows, fixed counts
// that nothing reads, so the exchange captures and replays.
void run_all_to_all(const cuda::Communicator& comm, const CommStep& c, const std::vector<void*>& ptr,
                    CUstream stream, HostRoutes& routes);

}  // namespace jitfuse::exec
