// Launch shapes, partial-sum sizes and the memory layout of a program on a device (layout.hpp).
#include "exec/lower/layout.hpp"

#include <algorithm>

#include "common/error.hpp"

namespace jitfuse::exec {
namespace {

size_t round_up(size_t x) { return (x + kArenaAlignment - 1) / kArenaAlignment * kArenaAlignment; }

KernelLaunch launch_for(const codegen::Launch& L, codegen::Skeleton sk, int64_t rows, int sm_count,
                        int blocks_per_sm) {
  KernelLaunch k;
  k.bx = static_cast<unsigned>(L.bx);
  k.by = static_cast<unsigned>(L.by);
  // Persistent kernels (per-block partials) get the blocks that fit on the device at once; the others one
  // block per row slab (see codegen::Launch::persistent).
  const int64_t resident = static_cast<int64_t>(sm_count) * std::max(1, blocks_per_sm);
  if (sk == codegen::Skeleton::cross_entropy || sk == codegen::Skeleton::moe) {  // one block per row, or a fixed grid
    k.gx = static_cast<unsigned>(L.grid_x > 0 ? L.grid_x : std::clamp<int64_t>(rows, 1, 0x7fffffff));
    return k;
  }
  if (sk == codegen::Skeleton::rownorm) {
    int64_t cap = L.persistent ? resident : int64_t{0x7fffffff};
    // A capped grid (blocks that wait for each other's twins on other ranks): at most one block per SM.
    if (L.max_grid > 0) cap = std::min<int64_t>({cap, L.max_grid, std::max(1, sm_count)});
    k.gx = static_cast<unsigned>(std::clamp<int64_t>(rows, 1, cap));
    k.parts = static_cast<int>(k.gx);
  } else {
    k.gx = static_cast<unsigned>(L.grid_x);
    const int64_t slab = static_cast<int64_t>(L.by) * L.rows_per_thread_iter;
    const int64_t want = (rows + slab - 1) / slab;
    const int64_t cap = L.persistent ? std::max<int64_t>(1, resident / std::max<int64_t>(1, L.grid_x)) : 65535;
    k.gy = static_cast<unsigned>(std::clamp<int64_t>(want, 1, std::min<int64_t>(cap, 65535)));
    k.parts = static_cast<int>(k.gy);
  }
  return k;
}

int estimated_blocks_per_sm(const codegen::Launch& L) { return std::clamp(2048 / std::max(1, L.bx * L.by), 1, 32); }

// Fits `k`'s launch `l` to at most `parts` partial rows and `blocks` blocks (the amax partials): fewer
// blocks of a persistent kernel, which loop over the rows. A non-persistent grid (one block per row slab)
// does not depend on occupancy, so it already fits; if it did not, shrinking it would drop rows.
void clamp_launch(KernelLaunch& l, const KernelStep& k, int parts, int blocks) {
  const bool rownorm = k.spec.skeleton == codegen::Skeleton::rownorm;
  const int64_t per_part = rownorm ? 1 : static_cast<int64_t>(l.gx);  // blocks in one partial row
  int64_t n = rownorm ? l.gx : l.gy;
  const int64_t cap = std::max<int64_t>(1, std::min<int64_t>(k.finalize.empty() ? n : parts,
                                                            k.amax_partials < 0 ? n : blocks / per_part));
  if (n <= cap) return;
  if (!k.gen.launch.persistent)
    fail(Status::internal, "kernel {}: the scalar variant's grid ({} partial rows) does not fit the buffers sized "
         "for the vector variant ({})", k.gen.kernel, n, cap);
  n = cap;
  (rownorm ? l.gx : l.gy) = static_cast<unsigned>(n);
  l.parts = static_cast<int>(n);
}

// Packs the buffers of one arena: each at the lowest aligned offset free during its lifetime.
size_t pack(std::vector<Buffer>& buffers, Storage arena) {
  std::vector<Buffer*> list;
  for (auto& b : buffers)
    if (b.storage == arena && b.first >= 0) list.push_back(&b);
  std::stable_sort(list.begin(), list.end(), [](const Buffer* x, const Buffer* y) { return x->bytes > y->bytes; });
  std::vector<Buffer*> placed;
  size_t total = 0;
  for (Buffer* b : list) {
    std::vector<std::pair<size_t, size_t>> busy;
    for (const Buffer* o : placed)
      if (o->first <= b->last && b->first <= o->last) busy.emplace_back(o->offset, o->offset + round_up(o->bytes));
    std::sort(busy.begin(), busy.end());
    size_t at = 0;
    for (const auto& [lo, hi] : busy) {
      if (at + round_up(b->bytes) <= lo) break;
      at = std::max(at, hi);
    }
    b->offset = at;
    total = std::max(total, at + round_up(b->bytes));
    placed.push_back(b);
  }
  return total;
}

// One kernel step's launches on `dev`, sizing its partial-sum buffers in `buffers`. Both variants come
// from one source, with one launch shape (their occupancy may differ). A scalar variant that was not loaded
// with a vector one is launched only after a late load, within the buffers sized here for the vector one
// (late_scalar_launch).
Launches launch_step(const KernelStep& k, const DeviceModel& dev, const Occupancy& occ, std::vector<Buffer>& buffers) {
  const auto& spec = k.spec;
  const codegen::Launch& L = k.gen.launch;
  auto blocks_per_sm = [&](int loaded) { return loaded > 0 ? loaded : estimated_blocks_per_sm(L); };
  Launches out;
  const bool late = spec.vec && occ.scalar == 0 && occ.vec > 0;
  if (spec.vec) out.vec = launch_for(L, spec.skeleton, k.rows, dev.sm_count, blocks_per_sm(occ.vec));
  out.scalar = launch_for(L, spec.skeleton, k.rows, dev.sm_count, blocks_per_sm(occ.scalar));
  const int parts = std::max(spec.vec ? out.vec.parts : 0, late ? 0 : out.scalar.parts);
  const int blocks = static_cast<int>(std::max(spec.vec ? out.vec.gx * out.vec.gy : 0u,
                                               late ? 0u : out.scalar.gx * out.scalar.gy));
  if (late) clamp_launch(out.scalar, k, parts, blocks);
  for (const auto& f : k.finalize) {
    auto& b = buffers.at(static_cast<size_t>(f.partials));
    b.rows = parts;
    b.bytes = static_cast<size_t>(parts) * static_cast<size_t>(f.cols) * 4;
  }
  if (k.amax_partials >= 0) {
    auto& b = buffers.at(static_cast<size_t>(k.amax_partials));
    b.rows = blocks;
    b.bytes = static_cast<size_t>(blocks) * 4;
  }
  return out;
}

}  // namespace

KernelLaunch late_scalar_launch(const Layout& layout, const KernelStep& k, int sm_count, int blocks_per_sm) {
  KernelLaunch l = launch_for(k.gen.launch, k.spec.skeleton, k.rows, sm_count, blocks_per_sm);
  int parts = 0, blocks = 0;
  for (const auto& f : k.finalize) parts = static_cast<int>(layout.buffer(f.partials).rows);
  if (k.amax_partials >= 0) blocks = static_cast<int>(layout.buffer(k.amax_partials).rows);
  clamp_launch(l, k, parts, blocks);
  return l;
}

Layout lay_out(const Program& p, const DeviceModel& dev, const OccupancyOf& loaded) {
  Layout out;
  out.buffers = p.buffers;
  for (const bool fwd : {true, false}) {
    const auto& steps = fwd ? p.forward : p.backward;
    auto& launches = fwd ? out.forward : out.backward;
    launches.resize(steps.size());
    for (size_t i = 0; i < steps.size(); ++i)
      if (steps[i].kind == Step::Kind::kernel)
        launches[i] = launch_step(*steps[i].kernel, dev, loaded ? loaded(fwd, i) : Occupancy{}, out.buffers);
  }
  size_t saved = 0;
  for (auto& b : out.buffers)
    if (b.storage == Storage::saved_block) {
      b.offset = saved;
      saved += round_up(b.bytes);
    }
  out.saved_bytes = saved;
  out.fwd_arena = pack(out.buffers, Storage::fwd_arena);
  out.bwd_arena = pack(out.buffers, Storage::bwd_arena);
  return out;
}

}  // namespace jitfuse::exec
