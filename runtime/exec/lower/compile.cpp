// compile: infer -> plan (make_plan) -> lower (make_program: each group through its implementation, then
// laid out for an estimated device, layout.hpp) (compile.hpp).
#include "exec/lower/compile.hpp"

#include <algorithm>

#include "cuda/driver.hpp"
#include "exec/lower/builder.hpp"
#include "exec/lower/impl/implementation.hpp"
#include "exec/lower/layout.hpp"

namespace jitfuse::exec {

fuser::Plan make_plan(const std::vector<ops::Op>& ops, const ops::Recipe& recipe, const PlanOptions& o,
                      const rules::RuleSet& rs) {
  fuser::PlanInputs in;
  in.recipe = ops::recipe_name(recipe.kind);
  in.dtype = ops::dtype_name(recipe.dtype);
  in.arch = o.arch;
  in.training = o.training;
  in.disable_fusion = o.disable_fusion;
  return fuser::plan(ops, in, rs, legality(recipe.is_fp8(), recipe.is_block()));
}

namespace {

// What explain reports of each kernel step and what a call checks: its napkin traffic (every buffer
// argument read or written once, partials at `buffers`' sizes) and the caller tensors whose misalignment
// selects the scalar variant.
void describe_kernel(KernelStep& k, const std::vector<Buffer>& buffers) {
  k.bytes_read = k.bytes_written = 0;
  k.align_buffers.clear();
  for (size_t i = 0; i < k.args.size(); ++i) {
    const auto& a = k.args[i];
    if (a.kind != KArg::Kind::buffer) continue;
    const auto& b = buffers[static_cast<size_t>(a.buffer)];
    (k.gen.args[i].writes || k.gen.args[i].role == codegen::Arg::Role::out ? k.bytes_written : k.bytes_read) +=
        static_cast<int64_t>(b.bytes);
    // A misaligned tensor selects the scalar variant (bit masks and FP8 state are read as scalars).
    if (b.needs_align16 && b.role != BufferRole::recipe_state && b.role != BufferRole::temp)
      k.align_buffers.push_back(b.id);
  }
  std::sort(k.align_buffers.begin(), k.align_buffers.end());
  k.align_buffers.erase(std::unique(k.align_buffers.begin(), k.align_buffers.end()), k.align_buffers.end());
}

// The estimated layout of `dev`, written into the program being made (its last write).
void apply_estimate(Program& p, const DeviceModel& dev) {
  Layout L = lay_out(p, dev);
  p.buffers = std::move(L.buffers);
  p.saved_bytes = L.saved_bytes;
  p.fwd_arena = L.fwd_arena;
  p.bwd_arena = L.bwd_arena;
  for (const bool fwd : {true, false}) {
    auto& steps = fwd ? p.forward : p.backward;
    const auto& launches = fwd ? L.forward : L.backward;
    for (size_t i = 0; i < steps.size(); ++i)
      if (steps[i].kind == Step::Kind::kernel) {
        steps[i].kernel->launch = launches[i];
        describe_kernel(*steps[i].kernel, p.buffers);
      }
  }
}

}  // namespace

std::shared_ptr<const Program> make_program(std::vector<ops::Op> ops, fuser::Plan plan, const ops::Recipe& recipe,
                                            bool training, const std::string& seq, const DeviceModel& dev) {
  auto p = std::make_shared<Program>();
  p->ops = std::move(ops);
  p->plan = std::move(plan);
  p->recipe = recipe;
  p->training = training;
  p->arch = dev.arch;
  if (!p->ops.empty()) {
    p->world_size = p->ops.front().world_size;
    p->rank = p->ops.front().rank;
  }
  for (const auto& op : p->ops)
    if (op.family == ops::Family::comm) p->group = op.str("group");
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
  apply_estimate(*p, dev);
  return p;
}


std::shared_ptr<const Program> compile(std::vector<ops::Op> ops, const std::string& sequence_name,
                                       const ops::Recipe& recipe, const CompileOptions& o, const rules::RuleSet& rs) {
  PlanOptions po;
  po.arch = o.arch;
  po.training = o.training;
  po.disable_fusion = o.disable_fusion;
  fuser::Plan plan = make_plan(ops, recipe, po, rs);
  DeviceModel dev;
  if (o.arch > 0) dev.arch = cuda::arch_name(o.arch);
  dev.sm_count = o.sm_count;
  return make_program(std::move(ops), std::move(plan), recipe, o.training, sequence_name, dev);
}

std::shared_ptr<const Program> compile(const ops::SequenceDef& def, const ops::Recipe& recipe,
                                       const ops::Shape& input, const CompileOptions& o, const rules::RuleSet& rs) {
  return compile(ops::infer(def, input), def.name, recipe, o, rs);
}

}  // namespace jitfuse::exec
