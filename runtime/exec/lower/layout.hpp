// Laying a Program out for a device: each kernel step's grid (persistent kernels take the blocks that fit
// at once, from each variant's occupancy), the partial-sum buffers those grids size, and the memory
// layout (the saved block, one arena per pass packed by lifetime). make_program lays out with estimated
// occupancies (what explain prints); prepare lays out again with the loaded kernels' real ones, into the
// Prepared (the Program is never written again).
#pragma once
#include <cstddef>
#include <functional>
#include <vector>

#include "exec/ir/program.hpp"

namespace jitfuse::exec {

struct Layout {
  std::vector<Buffer> buffers;              // the program's buffers, partials sized and every block placed
  std::vector<Launches> forward, backward;  // by step index (GEMM steps: unused)
  size_t fwd_arena = 0, bwd_arena = 0, saved_bytes = 0;
  const Buffer& buffer(int id) const { return buffers.at(static_cast<size_t>(id)); }
};

// Resident blocks per SM of a kernel step's loaded variants; 0: that variant is not loaded (its launch is
// then sized from an estimate, and a vector-capable step loaded without its scalar variant sizes its
// partials for the vector one alone: late_scalar_launch fits the scalar one in later).
struct Occupancy {
  int vec = 0, scalar = 0;
};
using OccupancyOf = std::function<Occupancy(bool forward, size_t step)>;

// Grids, partial-sum sizes, offsets and block sizes of `p` on `dev`; `loaded` empty: nothing loaded.
Layout lay_out(const Program& p, const DeviceModel& dev, const OccupancyOf& loaded = {});

// The launch of a step's scalar variant loaded after prepare (by the first call that selects it), from its
// occupancy `blocks_per_sm`: its persistent grid clamped to the partial-sum buffers of `layout`, so the
// arena a host allocated from jf_sequence_info still fits (a persistent kernel's blocks loop over rows:
// fewer blocks cost speed, never correctness). Throws rather than return a grid that writes past a buffer.
KernelLaunch late_scalar_launch(const Layout& layout, const KernelStep& k, int sm_count, int blocks_per_sm);

}  // namespace jitfuse::exec
