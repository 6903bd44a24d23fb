// Building a Program: each group through its implementation, then laid out for an estimated device
// (layout.hpp).
#include "exec/program.hpp"

#include <algorithm>
#include <map>
#include <set>

#include "common/error.hpp"
#include "exec/builder.hpp"
#include "exec/impl/implementation.hpp"
#include "exec/layout.hpp"
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
    case BufferRole::saved_context: return "saved";
    case BufferRole::fp8: return "fp8";
    case BufferRole::temp: return "temp";
  }
  return "?";
}

std::string storage_name(Storage s) {
  switch (s) {
    case Storage::caller: return "caller";
    case Storage::saved_block: return "saved";
    case Storage::fwd_arena: return "fwd arena";
    case Storage::bwd_arena: return "bwd arena";
    case Storage::persistent: return "persistent";
  }
  return "?";
}

namespace {
constexpr int GemmStep::*kOperandField[kGemmOperands] = {
    &GemmStep::a,           &GemmStep::b,       &GemmStep::c,         &GemmStep::d,         &GemmStep::bias,
    &GemmStep::aux,         &GemmStep::a_scale_inv, &GemmStep::b_scale_inv, &GemmStep::d_scale, &GemmStep::d_amax,
    &GemmStep::d_history,   &GemmStep::d_scale_inv, &GemmStep::workspace, &GemmStep::ones};
constexpr const char* kOperandName[kGemmOperands] = {"a",      "b",         "c",           "d",
                                                     "bias",   "aux",       "a_scale_inv", "b_scale_inv",
                                                     "d_scale", "d_amax",   "d_history",   "d_scale_inv",
                                                     "workspace", "ones"};
}  // namespace

int GemmStep::operand(GemmOperand o) const { return this->*kOperandField[static_cast<int>(o)]; }

const char* gemm_operand_name(GemmOperand o) { return kOperandName[static_cast<int>(o)]; }

void set_operand(cuda::GemmCall& c, GemmOperand o, void* ptr) {
  switch (o) {
    case GemmOperand::a: c.a = ptr; break;
    case GemmOperand::b: c.b = ptr; break;
    case GemmOperand::c: c.c = ptr; break;
    case GemmOperand::d: c.d = ptr; break;
    case GemmOperand::bias: c.bias = ptr; break;
    case GemmOperand::aux: c.aux = ptr; break;
    case GemmOperand::workspace: c.workspace = ptr; break;
    case GemmOperand::a_scale_inv: if (c.fp8) c.fp8->a_scale_inv = static_cast<const float*>(ptr); break;
    case GemmOperand::b_scale_inv: if (c.fp8) c.fp8->b_scale_inv = static_cast<const float*>(ptr); break;
    case GemmOperand::d_scale: if (c.fp8) c.fp8->d_scale = static_cast<const float*>(ptr); break;
    case GemmOperand::d_amax: if (c.fp8) c.fp8->d_amax = static_cast<float*>(ptr); break;
    case GemmOperand::d_history:
    case GemmOperand::d_scale_inv:
    case GemmOperand::ones: break;
  }
}

std::vector<int> Program::saved_set() const {
  std::vector<int> out;
  if (!training) return out;
  // Buffers the backward reads that the forward produced or was given (a saved input aliases the caller's).
  std::vector<bool> bwd(buffers.size(), false);
  for (const auto& s : backward) {
    auto mark = [&](int id) {
      if (id >= 0) bwd[static_cast<size_t>(id)] = true;
    };
    if (s.kind == Step::Kind::gemm) {
      for (int i = 0; i < kGemmOperands; ++i) mark(s.gemm.operand(static_cast<GemmOperand>(i)));
    } else if (s.kind == Step::Kind::comm) {
      mark(s.comm.send);
      mark(s.comm.recv);
    } else {
      for (const auto& a : s.kernel->args) mark(a.buffer);
    }
  }
  for (const auto& b : buffers) {
    const bool fwd_side = b.storage == Storage::saved_block || b.role == BufferRole::input ||
                          b.role == BufferRole::output ||
                          b.role == BufferRole::extra_in || b.role == BufferRole::extra_out;
    if (fwd_side && bwd[static_cast<size_t>(b.id)]) out.push_back(b.id);
  }
  return out;
}

bool Program::has_comm() const {
  for (const auto* steps : {&forward, &backward})
    for (const auto& s : *steps)
      if (s.kind == Step::Kind::comm) return true;
  return false;
}

const char* collective_name(Collective c) {
  switch (c) {
    case Collective::all_gather: return "all_gather";
    case Collective::reduce_scatter: return "reduce_scatter";
    case Collective::all_reduce: return "all_reduce";
    case Collective::broadcast: return "broadcast";
    case Collective::reduce: return "reduce";
  }
  return "?";
}

int64_t CommStep::wire_bytes(int world_size) const {
  const int64_t w = world_size, bytes = count * static_cast<int64_t>(ops::dtype_bytes(dtype));
  if (w <= 1) return 0;
  switch (op) {
    case Collective::all_gather:                                 // (W-1)/W of the gathered W * count
    case Collective::reduce_scatter: return bytes * (w - 1);     // (W-1)/W of the input W * count
    case Collective::all_reduce: return 2 * (bytes / w) * (w - 1);
    case Collective::broadcast:
    case Collective::reduce: return bytes;  // a pipelined ring moves the chunk once over each link
  }
  return 0;
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

int param_slot(const std::vector<ops::Op>& ops, int op, const std::string& name) {
  if (op < 0 || static_cast<size_t>(op) >= ops.size()) return -1;
  int base = 0;
  for (int o = 0; o < op; ++o) base += static_cast<int>(ops[static_cast<size_t>(o)].params.size());
  const auto& params = ops[static_cast<size_t>(op)].params;
  for (size_t j = 0; j < params.size(); ++j)
    if (params[j].name == name) return base + static_cast<int>(j);
  return -1;
}

size_t param_slot_count(const std::vector<ops::Op>& ops) {
  size_t n = 0;
  for (const auto& op : ops) n += op.params.size();
  return n;
}

}  // namespace jitfuse::exec
