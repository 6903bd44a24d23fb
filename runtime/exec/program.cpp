// Building a Program: each group through its implementation, then the launch shapes, partial-sum sizes and
// the memory layout (saved block, one arena per pass packed by lifetime).
#include "exec/program.hpp"

#include <algorithm>
#include <map>
#include <set>

#include "common/error.hpp"
#include "exec/builder.hpp"
#include "exec/impl/implementation.hpp"
#include "exec/kernels.hpp"
#include "exec/lowering.hpp"

namespace jitfuse::exec {

std::string role_name(BufferRole r) {
  switch (r) {
    case BufferRole::input: return "input";
    case BufferRole::output: return "output";
    case BufferRole::extra_in: return "extra_in";
    case BufferRole::extra_out: return "extra_out";
    case BufferRole::grad_output: return "grad_output";
    case BufferRole::grad_input: return "grad_input";
    case BufferRole::grad_extra_out: return "grad_extra_out";
    case BufferRole::grad_extra_in: return "grad_extra_in";
    case BufferRole::param: return "param";
    case BufferRole::grad: return "grad";
    case BufferRole::recipe_state: return "recipe_state";
    case BufferRole::rng_state: return "rng_state";
    case BufferRole::activation: return "activation";
    case BufferRole::gradient: return "gradient";
    case BufferRole::saved: return "saved";
    case BufferRole::fp8: return "fp8";
    case BufferRole::temp: return "temp";
  }
  return "?";
}

std::string storage_name(Storage s) {
  switch (s) {
    case Storage::caller: return "caller";
    case Storage::saved: return "saved";
    case Storage::fwd_arena: return "fwd arena";
    case Storage::bwd_arena: return "bwd arena";
    case Storage::persistent: return "persistent";
  }
  return "?";
}

std::vector<int> Program::saved() const {
  std::vector<int> out;
  if (!training) return out;
  // Buffers the backward reads that the forward produced or was given (a saved input aliases the caller's).
  std::vector<bool> bwd(buffers.size(), false);
  for (const auto& s : backward) {
    auto mark = [&](int id) {
      if (id >= 0) bwd[static_cast<size_t>(id)] = true;
    };
    if (s.kind == Step::Kind::gemm) {
      for (int id : {s.gemm.a, s.gemm.b, s.gemm.c, s.gemm.aux, s.gemm.a_scale_inv, s.gemm.b_scale_inv}) mark(id);
    } else {
      for (const auto& a : s.kernel->args) mark(a.buffer);
    }
  }
  for (const auto& b : buffers) {
    const bool fwd_side = b.storage == Storage::saved || b.role == BufferRole::input || b.role == BufferRole::output ||
                          b.role == BufferRole::extra_in || b.role == BufferRole::extra_out;
    if (fwd_side && bwd[static_cast<size_t>(b.id)]) out.push_back(b.id);
  }
  return out;
}

int Program::find(BufferRole role, int op, const std::string& name) const {
  for (const auto& b : buffers)
    if (b.role == role && b.op == op && (name.empty() || b.name == name)) return b.id;
  return -1;
}

fuser::Plan make_plan(const std::vector<ops::Op>& ops, const ops::Recipe& recipe, const PlanOptions& o,
                      const rules::RuleSet& rs) {
  fuser::PlanInputs in;
  in.recipe = ops::recipe_name(recipe.kind);
  in.dtype = ops::dtype_name(recipe.dtype);
  in.arch = o.arch;
  in.training = o.training;
  in.disable_fusion = o.disable_fusion;
  return fuser::plan(ops, in, rs, legality(recipe.is_fp8()));
}

std::shared_ptr<Program> make_program(std::vector<ops::Op> ops, fuser::Plan plan, const ops::Recipe& recipe,
                                      bool training, const std::string& seq, const DeviceModel& dev) {
  auto p = std::make_shared<Program>();
  p->ops = std::move(ops);
  p->plan = std::move(plan);
  p->recipe = recipe;
  p->training = training;
  p->arch = dev.arch;
  Builder b(*p, seq);
  const int n = static_cast<int>(p->ops.size());
  b.act(0);
  for (size_t gi = 0; gi < p->plan.forward.size(); ++gi) {
    const auto& g = p->plan.forward[gi];
    b.begin_group(true, static_cast<int>(gi), g);
    implementation_for(g.impl).lower(b, g.impl);
  }
  b.end_pass();
  b.act(n);
  if (training) {
    b.begin_group(false, -1, fuser::Group{});
    b.grad_of(n);
    for (size_t gi = p->plan.backward.size(); gi-- > 0;) {
      const auto& g = p->plan.backward[gi];
      b.begin_group(false, static_cast<int>(gi), g);
      implementation_for(g.impl).lower(b, g.impl);
    }
    b.end_pass();
    b.grad_of(0);
  }
  layout_program(*p, dev);
  return p;
}

std::vector<std::pair<codegen::KernelSpec, nlohmann::json>> program_kernels(const Program& p) {
  std::vector<std::pair<codegen::KernelSpec, nlohmann::json>> out;
  // Sources are position independent, so the groups of every layer of a deep model ask for the same few
  // kernels: each distinct source is listed once (same source, same cache key), with the metadata of its
  // first use.
  std::set<std::string> seen;
  auto add = [&](const codegen::KernelSpec& spec, const std::string& source, const nlohmann::json& meta) {
    if (seen.insert(source).second) out.emplace_back(spec, meta);
  };
  for (const auto* steps : {&p.forward, &p.backward})
    for (const auto& s : *steps) {
      if (s.kind != Step::Kind::kernel) continue;
      const KernelStep& k = *s.kernel;
      add(k.spec, k.gen.source, k.meta);
    }
  return out;
}

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
  if (sk == codegen::Skeleton::rownorm) {
    const int64_t cap = L.persistent ? resident : int64_t{0x7fffffff};
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

}  // namespace

const KernelStep::Variant& KernelStep::late_scalar(const std::function<Variant()>& make) const {
  if (const Variant* v = late.ready.load(std::memory_order_acquire)) return *v;
  std::lock_guard<std::mutex> lock(late.mu);
  if (const Variant* v = late.ready.load(std::memory_order_relaxed)) return *v;
  late.owned = std::make_unique<Variant>(make());
  late.ready.store(late.owned.get(), std::memory_order_release);
  return *late.owned;
}

KernelLaunch late_scalar_launch(const Program& p, const KernelStep& k, int sm_count, int blocks_per_sm) {
  KernelLaunch l = launch_for(k.gen.launch, k.spec.skeleton, k.rows, sm_count, blocks_per_sm);
  int parts = 0, blocks = 0;
  for (const auto& f : k.finalize) parts = static_cast<int>(p.buffer(f.partials).rows);
  if (k.amax_partials >= 0) blocks = static_cast<int>(p.buffer(k.amax_partials).rows);
  clamp_launch(l, k, parts, blocks);
  return l;
}

void layout_program(Program& p, const DeviceModel& dev) {
  for (auto* steps : {&p.forward, &p.backward})
    for (auto& s : *steps) {
      if (s.kind != Step::Kind::kernel) continue;
      KernelStep& k = *s.kernel;
      const auto& spec = k.spec;
      auto occupancy = [&](const KernelStep::Variant& v, const codegen::Launch& L) {
        return v.kernel ? v.kernel->blocks_per_sm : estimated_blocks_per_sm(L);
      };
      // Both variants come from one source, with one launch shape (their occupancy may differ). A scalar
      // variant that was not loaded with a vector one is launched only after a late load, within the buffers
      // sized here for the vector one (late_scalar_launch).
      const codegen::Launch& L = k.gen.launch;
      const bool late = spec.vec && !k.scalar.kernel && k.vec.kernel;
      if (spec.vec) k.vec.launch = launch_for(L, spec.skeleton, k.rows, dev.sm_count, occupancy(k.vec, L));
      k.scalar.launch = launch_for(L, spec.skeleton, k.rows, dev.sm_count, occupancy(k.scalar, L));
      const int parts = std::max(spec.vec ? k.vec.launch.parts : 0, late ? 0 : k.scalar.launch.parts);
      const int blocks = static_cast<int>(std::max(spec.vec ? k.vec.launch.gx * k.vec.launch.gy : 0u,
                                                   late ? 0u : k.scalar.launch.gx * k.scalar.launch.gy));
      if (late) clamp_launch(k.scalar.launch, k, parts, blocks);
      for (auto& f : k.finalize) {
        auto& b = p.buffers[static_cast<size_t>(f.partials)];
        b.rows = parts;
        b.bytes = static_cast<size_t>(parts) * static_cast<size_t>(f.cols) * 4;
      }
      if (k.amax_partials >= 0) {
        auto& b = p.buffers[static_cast<size_t>(k.amax_partials)];
        b.rows = blocks;
        b.bytes = static_cast<size_t>(blocks) * 4;
      }
      // Napkin traffic: every buffer argument read or written once.
      k.bytes_read = k.bytes_written = 0;
      k.align_buffers.clear();
      for (size_t i = 0; i < k.args.size(); ++i) {
        const auto& a = k.args[i];
        if (a.kind != KArg::Kind::buffer) continue;
        const auto& b = p.buffers[static_cast<size_t>(a.buffer)];
        (k.gen.args[i].writes || k.gen.args[i].role == codegen::Arg::Role::out ? k.bytes_written : k.bytes_read) +=
            static_cast<int64_t>(b.bytes);
        // A misaligned tensor selects the scalar variant (bit masks and FP8 state are read as scalars).
        if (b.needs_align16 && b.role != BufferRole::recipe_state && b.role != BufferRole::temp)
          k.align_buffers.push_back(b.id);
      }
      std::sort(k.align_buffers.begin(), k.align_buffers.end());
      k.align_buffers.erase(std::unique(k.align_buffers.begin(), k.align_buffers.end()), k.align_buffers.end());
    }
  size_t saved = 0;
  for (auto& b : p.buffers)
    if (b.storage == Storage::saved) {
      b.offset = saved;
      saved += round_up(b.bytes);
    }
  p.saved_bytes = saved;
  p.fwd_arena = pack(p.buffers, Storage::fwd_arena);
  p.bwd_arena = pack(p.buffers, Storage::bwd_arena);
}

}  // namespace jitfuse::exec
