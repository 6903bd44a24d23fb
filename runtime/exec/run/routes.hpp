// A pass's routings on the host: the rows each expert got this call, which a dropless grouped linear's GEMMs
// (GemmStep::route) take as their dims. One copy and one stream synchronisation per routing and pass; an
// expert-parallel exchange (exec/run/all_to_all.hpp) puts what it computed on the host instead.
#pragma once
#include <cuda.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "exec/ir/program.hpp"

namespace jitfuse::exec {

class HostRoutes {
 public:
  // splits [E] then starts [E + 1] of `g`'s routing, read by the pass's first step that needs them (after the
  // kernels that wrote them, in stream order). Refused while the stream captures a CUDA graph.
  const int32_t* get(const GemmStep& g, const std::vector<void*>& ptr, CUstream stream);
  // The routing in buffer `route`, known on the host already (splits [E], starts [E + 1]).
  void put(int route, std::vector<int32_t> splits_starts);
  // The routing of buffer `route` if this pass has it on the host already, else null.
  const std::vector<int32_t>* find(int route) const;

 private:
  std::vector<std::pair<int, std::vector<int32_t>>> read_;
};

}  // namespace jitfuse::exec
