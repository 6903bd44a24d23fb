// Context and Sequence: rule loading (built-ins, JITFUSE_RULE_PATH, API), plan caching per shape.
#include "api/context.hpp"

#include <algorithm>
#include <vector>

#include "common/env.hpp"
#include "common/error.hpp"
#include "common/log.hpp"
#include "common/text.hpp"
#include "cuda/driver.hpp"
#include "api/arg_check.hpp"
#include "exec/lower/compile.hpp"

namespace jitfuse::api {

Context::Context() : rules_(rules::RuleSet::with_builtins()) {
  if (auto path = env::get("JITFUSE_RULE_PATH"))
    for (const auto& dir : env::split_path(*path)) {
      for (const auto& e : rules_.load_path(dir)) log().warn("rule skipped: {}", e.to_string());
    }
  sync_templates();
  cache_ = std::make_unique<cache::KernelCache>(cache::config_from_env());
  kernels_ = std::make_unique<exec::KernelLibrary>(*cache_, templates_);
  runtime_.kernels = kernels_.get();
  // A deployment that must never compile during a call loads every variant at prepare (docs/environment.md).
  if (env::flag("JITFUSE_ALL_VARIANTS")) runtime_.variants = exec::Variants::all;
  if (env::flag("JITFUSE_VERIFY")) {
    verify_ = std::make_unique<exec::VerifyLog>();
    runtime_.verify = verify_.get();
    log().info("JITFUSE_VERIFY: every fused group is compared with the unfused ops on the GPU (slow)");
  }
}

Context::~Context() = default;

void Context::sync_templates() {
  for (const auto& [name, text] : rules_.user_templates()) templates_.add(name, text);
}

std::vector<rules::LoadError> Context::load_rules(const std::string& path) {
  std::lock_guard<std::mutex> lock(mu_);
  auto errors = rules_.load_path(path);
  for (const auto& e : errors) log().warn("rule skipped: {}", e.to_string());
  sync_templates();
  return errors;
}

rules::RuleSet Context::rules_snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  return rules_;
}

uint64_t Context::rules_generation() const {
  std::lock_guard<std::mutex> lock(mu_);
  return rules_.generation();
}

exec::Runtime& Context::runtime() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!blas_) {
    cuda::driver();  // a clear "no GPU" error before cuBLASLt's own
    blas_ = std::make_unique<cuda::Blas>();
    runtime_.blas = blas_.get();
  }
  return runtime_;
}

void Context::set_allocator(const exec::Allocator& a) {
  std::lock_guard<std::mutex> lock(mu_);
  runtime_.allocator = a;
}

Sequence::Sequence(Context& c, ops::SequenceDef d, ops::Recipe r)
    : ctx(c), def(std::move(d)), recipe(r), wiring(ops::wiring_json(def).dump()) {}

Sequence::~Sequence() = default;

ops::DType Sequence::output_dtype() const {
  return exec::fp8::output_dtype(recipe, def.ops.empty() ? std::string_view() : std::string_view(def.ops.back().kind));
}

exec::fp8::RecipeState& Sequence::fp8_state(CUstream stream) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& slot = fp8_[cuda::current_ordinal()];  // makes the primary context current if none is
  if (!slot) slot = std::make_unique<exec::fp8::RecipeState>(def, recipe, stream);
  return *slot;
}

std::shared_ptr<const std::vector<ops::Op>> Sequence::ops_for(const ops::Shape& input) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = ops_.find(input);
    if (it != ops_.end()) return it->second;
  }
  auto ops = std::make_shared<const std::vector<ops::Op>>(ops::infer(def, input, parallel()));
  std::lock_guard<std::mutex> lock(mu_);
  if (ops_.size() >= 4096) ops_.clear();  // a host feeding endless shapes does not grow this without bound
  return ops_.emplace(input, ops).first->second;
}

void Sequence::set_comm(const std::string& group, std::shared_ptr<cuda::Communicator> comm) {
  std::lock_guard<std::mutex> lock(mu_);
  if (def.group.empty())
    fail(Status::invalid_argument, "sequence '{}' has no comm op and no parallel linear: it needs no communicator",
         def.name);
  if (group != def.group)
    fail(Status::invalid_argument, "sequence '{}' runs on group '{}', not '{}'", def.name, def.group,
         text::shorten(group));
  if (!programs_.empty() || !ops_.empty())
    fail(Status::invalid_argument, "sequence '{}': the communicator is set before the first prepare or call (shapes "
         "and programs depend on its world size); create another sequence for another communicator", def.name);
  comm_ = std::move(comm);
}

ops::Parallel Sequence::parallel() const {
  std::lock_guard<std::mutex> lock(mu_);
  ops::Parallel p;
  if (comm_) {
    p.world_size = comm_->world_size();
    p.rank = comm_->rank();
  }
  return p;
}

void Sequence::keep_shadow(const void* saved, std::shared_ptr<exec::Shadow> shadow) {
  std::lock_guard<std::mutex> lock(mu_);
  shadows_[saved] = std::move(shadow);
}

std::shared_ptr<exec::Shadow> Sequence::take_shadow(const void* saved) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = shadows_.find(saved);
  if (it == shadows_.end()) return nullptr;
  auto s = std::move(it->second);
  shadows_.erase(it);
  return s;
}

namespace {
jf_tensor_info tensor_info(ProgramInfo& pi, std::string name, int op, ops::DType dt, const ops::Shape& shape,
                           size_t bytes, size_t offset) {
  jf_tensor_info t{};
  pi.names.push_back(std::move(name));
  t.name = pi.names.back().c_str();
  t.op_index = op;
  t.dtype = dl_dtype(dt);
  t.ndim = static_cast<int>(std::min(shape.size(), size_t{JF_MAX_DIMS}));
  for (int i = 0; i < t.ndim; ++i) t.shape[i] = shape[static_cast<size_t>(i)];
  t.bytes = bytes;
  t.offset = offset;
  return t;
}
}  // namespace

const jf_program_info& Sequence::info(const std::shared_ptr<const exec::Prepared>& pp) {
  return program_info(pp).info;
}

const ProgramInfo& Sequence::program_info(const std::shared_ptr<const exec::Prepared>& pp) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& slot = infos_[pp.get()];
  if (slot) return *slot;
  auto pi = std::make_unique<ProgramInfo>();
  const exec::Program& p = *pp->program;
  const exec::Layout& L = pp->layout;
  const ops::DType dt = recipe.dtype;
  const auto& last = p.ops.back();
  pi->outputs.push_back(tensor_info(*pi, "output", -1, output_dtype(), last.out,
                                    p.buffer(p.output).bytes, 0));
  for (const auto& op : p.ops) {
    if (op.family == ops::Family::make_extra_output && op.extra_slot >= 0)  // a hidden channel is not an output
      pi->outputs.push_back(tensor_info(*pi, fmt::format("extra_output {}", op.extra_slot), op.index, dt, op.in,
                                        static_cast<size_t>(ops::numel(op.in)) * ops::dtype_bytes(dt), 0));
    for (const auto& prm : op.params)
      pi->params.push_back(tensor_info(*pi, prm.name, op.index, dt, prm.shape,
                                       static_cast<size_t>(ops::numel(prm.shape)) * ops::dtype_bytes(dt), 0));
  }
  if (p.training)
    for (const auto& b : L.buffers) {
      if (b.storage != exec::Storage::saved_block || b.first < 0) continue;
      ops::Shape shape = b.rows > 0 ? ops::Shape{b.rows, b.cols} : ops::Shape{static_cast<int64_t>(b.bytes)};
      pi->saved.push_back(tensor_info(*pi, b.name, b.op, b.dtype, shape, b.bytes, b.offset));
    }
  if (p.training)
    for (const auto& ga : p.grad_aliases) {
      const exec::Buffer& g = p.buffer(ga.grad);
      const exec::Buffer& sv = L.buffers.at(static_cast<size_t>(ga.saved));
      const bool input = g.role == exec::BufferRole::grad_input;
      pi->names.push_back(input ? std::string("grad_input") : g.key);
      pi->grad_aliases.push_back(jf_grad_alias{input ? -1 : g.op, pi->names.back().c_str(), sv.offset, sv.bytes});
    }
  jf_program_info& info = pi->info;
  info.n_outputs = static_cast<int>(pi->outputs.size());
  info.outputs = pi->outputs.data();
  info.n_params = static_cast<int>(pi->params.size());
  info.params = pi->params.data();
  info.n_saved = static_cast<int>(pi->saved.size());
  info.saved = pi->saved.data();
  info.saved_bytes = p.training ? L.saved_bytes : 0;
  info.forward_workspace_bytes = L.fwd_arena;
  info.backward_workspace_bytes = p.training ? L.bwd_arena : 0;
  info.alignment = exec::kArenaAlignment;
  info.uses_rng = p.rng >= 0 ? 1 : 0;
  info.rng_offset_advance = p.rng >= 0 ? 1 : 0;
  slot = std::move(pi);
  return *slot;
}

std::shared_ptr<const exec::Program> Sequence::compile(std::vector<ops::Op> ops, bool training, int arch,
                                                      bool disable_fusion) const {
  exec::CompileOptions o;
  o.arch = arch;
  o.training = training;
  o.disable_fusion = disable_fusion;
  return exec::compile(std::move(ops), def.name, recipe, o, ctx.rules_snapshot());
}

std::shared_ptr<const exec::Prepared> Sequence::prepared_for(const ops::Shape& input, bool training, CUstream stream) {
  if (!def.group.empty()) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!comm_)
      fail(Status::invalid_argument, "sequence '{}' runs collectives on group '{}' but has no communicator: hand it "
           "one first (jf_sequence_set_comm; Python: jitfuse.torch.set_process_group)", def.name, def.group);
  }
  // Programs hold loaded kernels, which belong to the device of the current context.
  const bool no_fusion = env::flag("JITFUSE_DISABLE_FUSION");
  ProgramKey key{input, training, ctx.rules_generation(), no_fusion, cuda::current_ordinal()};
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = programs_.find(key);
    if (it != programs_.end()) return it->second;
  }
  refuse_inside_capture(stream, input, training);
  exec::Runtime& rt = ctx.runtime();
  const int arch = cuda::current_device().arch_number();
  auto program = compile(ops::infer(def, input, parallel()), training, arch, no_fusion);
  for (const auto& d : program->plan.decisions)
    log().debug("[{}] {} ops [{}, {}) priority {}: {}", rules::pass_name(d.pass), d.rule.empty() ? "-" : d.rule,
                d.begin, d.end, d.priority, d.taken ? "taken" : "not taken: " + d.reason);
  exec::PrepareWith with;
  const auto& plan = program->plan;
  const bool fused = std::any_of(plan.forward.begin(), plan.forward.end(), [](auto& g) { return !g.rule.empty(); }) ||
                     std::any_of(plan.backward.begin(), plan.backward.end(), [](auto& g) { return !g.rule.empty(); });
  {
    std::lock_guard<std::mutex> lock(mu_);
    with.comm = comm_;
  }
  if (rt.verify && fused) {  // the same ops, one group each: what every fused group is compared with
    exec::PrepareWith ref;
    ref.comm = with.comm;
    with.reference = exec::prepare(compile(program->ops, training, arch, true), rt, std::move(ref));
  }
  // The FP8 state and weight copies are allocated here, never in a call.
  if (recipe.is_fp8()) with.sequence_state = fp8_state(stream).bind(*program);
  auto pp = exec::prepare(std::move(program), rt, std::move(with));
  std::lock_guard<std::mutex> lock(mu_);
  auto [it, inserted] = programs_.emplace(key, pp);  // another thread may have prepared it meanwhile
  return it->second;
}

void Sequence::refuse_inside_capture(CUstream stream, const ops::Shape& input, bool training) const {
  CUresult r = CUDA_SUCCESS;
  const bool capturing = cuda::stream_capturing(stream, &r);
  cuda::check(r, "cuStreamIsCapturing");
  if (capturing)
    fail(Status::not_prepared, "sequence '{}': input shape {} ({}) is not prepared and the stream is capturing a "
         "CUDA graph, where jitfuse cannot compile or load kernels: call jf_sequence_prepare(seq, shape, {}, stream) "
         "before the capture", def.name, ops::shape_str(input), training ? "training" : "inference", training ? 1 : 0);
}

}  // namespace jitfuse::api
