// Context and Sequence: rule loading (built-ins, JITFUSE_RULE_PATH, API), plan caching per shape.
#include "api/context.hpp"

#include <algorithm>
#include <vector>

#include "common/env.hpp"
#include "common/error.hpp"
#include "common/log.hpp"
#include "cuda/driver.hpp"
#include "api/arg_check.hpp"
#include "exec/program.hpp"

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

Sequence::Sequence(Context& c, ops::SequenceDef d, ops::Recipe r) : ctx(c), def(std::move(d)), recipe(r) {}

Sequence::~Sequence() {
  if (auto* d = cuda::try_driver())
  {
    for (auto& [dev, states] : fp8_)
      for (auto& [op, st] : states) d->cuMemFree(reinterpret_cast<CUdeviceptr>(st.scale));  // one block each
    for (auto& [dev, pers] : persistent_)
      for (auto& [key, ptr] : pers.buffers) d->cuMemFree(reinterpret_cast<CUdeviceptr>(ptr));
  }
}

ops::DType Sequence::output_dtype() const {
  return recipe.is_fp8() && !def.ops.empty() && def.ops.back().kind == "quantize" ? ops::DType::e4m3 : recipe.dtype;
}

const exec::Fp8StateMap& Sequence::fp8_state(CUstream stream) {
  std::lock_guard<std::mutex> lock(mu_);
  const int dev = cuda::current_ordinal();  // makes the primary context current if none is
  auto it = fp8_.find(dev);
  if (it != fp8_.end()) return it->second;
  auto& states = fp8_[dev];
  const auto& d = cuda::driver();
  auto make = [&](int op, const std::string& tensor) {
    // One allocation: [scale, scale_inv, history...]; a one-time setup done by prepare.
    const int len = std::max(1, recipe.amax_history);
    std::vector<float> init(2 + static_cast<size_t>(len), 0.f);
    init[0] = init[1] = 1.f;
    CUdeviceptr p = 0;
    cuda::check(d.cuMemAlloc(&p, init.size() * sizeof(float)), "cuMemAlloc(FP8 recipe state)");
    // Ordered with the stream and complete before we return: a synchronous cuMemcpyHtoD from pageable
    // memory may still be in flight when a kernel on a non-blocking stream reads the state.
    cuda::check(d.cuMemcpyHtoDAsync(p, init.data(), init.size() * sizeof(float), stream),
                "cuMemcpyHtoDAsync(FP8 recipe state)");
    cuda::check(d.cuStreamSynchronize(stream), "cuStreamSynchronize(FP8 recipe state)");
    exec::Fp8State st;
    st.scale = reinterpret_cast<float*>(p);
    st.scale_inv = st.scale + 1;
    st.history = st.scale + 2;
    st.len = len;
    states[{op, tensor}] = st;
  };
  for (const auto& op : def.ops) {
    if (op.kind == "quantize") make(op.index, "");
    if (op.kind == "linear")
      for (const char* t : {"input", "weight", "grad_output"}) make(op.index, t);
  }
  return states;
}

void Sequence::persistent_for(const exec::Program& p) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& pers = persistent_[cuda::current_ordinal()];
  const auto& d = cuda::driver();
  for (const auto& b : p.buffers) {
    if (b.storage != exec::Storage::persistent) continue;
    const exec::Key key{b.op, b.key};
    if (auto it = pers.bytes.find(key); it != pers.bytes.end()) {
      // Weights have one shape per sequence, so every program asks for the same size.
      if (it->second != b.bytes)
        fail(Status::internal, "persistent buffer op{}.{}: {} bytes, earlier {}", b.op, b.key, b.bytes, it->second);
      continue;
    }
    CUdeviceptr ptr = 0;
    cuda::check(d.cuMemAlloc(&ptr, std::max<size_t>(b.bytes, 16)), "cuMemAlloc(FP8 weight copy)");
    pers.buffers[key] = reinterpret_cast<void*>(ptr);
    pers.bytes[key] = b.bytes;
  }
}

exec::PersistentMap Sequence::persistent() {
  std::lock_guard<std::mutex> lock(mu_);
  return persistent_[cuda::current_ordinal()].buffers;
}

bool Sequence::weights_unchanged(const exec::Program& p, const std::vector<const void*>& params, bool host_says) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& cast_from = persistent_[cuda::current_ordinal()].cast_from;
  auto source = [&](const exec::Buffer& b) -> const void* {
    const int slot = exec::param_slot(p.ops, b.op, "weight");
    return slot >= 0 && static_cast<size_t>(slot) < params.size() ? params[static_cast<size_t>(slot)] : nullptr;
  };
  // Skipped only if every copy this program reads was cast, by an earlier forward, from the same pointer
  // (a copy never written has no entry).
  bool ok = host_says;
  for (const auto& b : p.buffers) {
    if (!ok) break;
    if (b.storage != exec::Storage::persistent) continue;
    auto it = cast_from.find({b.op, b.key});
    ok = it != cast_from.end() && it->second == source(b);
  }
  if (ok) {
    log().debug("sequence '{}': weights unchanged: the FP8 weight casts are skipped", def.name);
    return true;
  }
  for (const auto& b : p.buffers)  // this forward casts: its copies now come from these pointers
    if (b.storage == exec::Storage::persistent) cast_from[{b.op, b.key}] = source(b);
  return false;
}

std::shared_ptr<const std::vector<ops::Op>> Sequence::ops_for(const ops::Shape& input) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = ops_.find(input);
    if (it != ops_.end()) return it->second;
  }
  auto ops = std::make_shared<const std::vector<ops::Op>>(ops::infer(def, input));
  std::lock_guard<std::mutex> lock(mu_);
  if (ops_.size() >= 4096) ops_.clear();  // a host feeding endless shapes does not grow this without bound
  return ops_.emplace(input, ops).first->second;
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
  std::lock_guard<std::mutex> lock(mu_);
  auto& slot = infos_[pp.get()];
  if (slot) return slot->info;
  auto pi = std::make_unique<ProgramInfo>();
  const exec::Program& p = *pp->program;
  const ops::DType dt = recipe.dtype;
  const auto& last = p.ops.back();
  pi->outputs.push_back(tensor_info(*pi, "output", -1, output_dtype(), last.out,
                                    p.buffer(p.output).bytes, 0));
  for (const auto& op : p.ops) {
    if (op.family == ops::Family::make_extra_output)
      pi->outputs.push_back(tensor_info(*pi, fmt::format("extra_output {}", op.extra_slot), op.index, dt, op.in,
                                        static_cast<size_t>(ops::numel(op.in)) * ops::dtype_bytes(dt), 0));
    for (const auto& prm : op.params)
      pi->params.push_back(tensor_info(*pi, prm.name, op.index, dt, prm.shape,
                                       static_cast<size_t>(ops::numel(prm.shape)) * ops::dtype_bytes(dt), 0));
  }
  if (p.training)
    for (const auto& b : p.buffers) {
      if (b.storage != exec::Storage::saved || b.first < 0) continue;
      ops::Shape shape = b.rows > 0 ? ops::Shape{b.rows, b.cols} : ops::Shape{static_cast<int64_t>(b.bytes)};
      pi->saved.push_back(tensor_info(*pi, b.name, b.op, b.dtype, shape, b.bytes, b.offset));
    }
  jf_program_info& info = pi->info;
  info.n_outputs = static_cast<int>(pi->outputs.size());
  info.outputs = pi->outputs.data();
  info.n_params = static_cast<int>(pi->params.size());
  info.params = pi->params.data();
  info.n_saved = static_cast<int>(pi->saved.size());
  info.saved = pi->saved.data();
  info.saved_bytes = p.training ? p.saved_bytes : 0;
  info.forward_workspace_bytes = p.fwd_arena;
  info.backward_workspace_bytes = p.training ? p.bwd_arena : 0;
  info.alignment = exec::kArenaAlignment;
  info.uses_rng = p.rng >= 0 ? 1 : 0;
  info.rng_offset_advance = p.rng >= 0 ? 1 : 0;
  slot = std::move(pi);
  return slot->info;
}

fuser::Plan Sequence::plan_only(const std::vector<ops::Op>& ops, bool training, int arch) const {
  exec::PlanOptions o;
  o.arch = arch;
  o.training = training;
  o.disable_fusion = env::flag("JITFUSE_DISABLE_FUSION");
  rules::RuleSet rs = ctx.rules_snapshot();
  return exec::make_plan(ops, recipe, o, rs);
}

std::shared_ptr<const exec::Prepared> Sequence::prepared_for(const ops::Shape& input, bool training, CUstream stream) {
  // Programs hold loaded kernels, which belong to the device of the current context.
  ProgramKey key{input, training, ctx.rules_generation(), env::flag("JITFUSE_DISABLE_FUSION"), cuda::current_ordinal()};
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = programs_.find(key);
    if (it != programs_.end()) return it->second;
  }
  CUstreamCaptureStatus capture = CU_STREAM_CAPTURE_STATUS_NONE;
  const CUresult r = cuda::driver().cuStreamIsCapturing(stream, &capture);
  // The legacy stream answers "implicit capture" while another stream captures in global mode.
  if (r != CUDA_ERROR_STREAM_CAPTURE_IMPLICIT) cuda::check(r, "cuStreamIsCapturing");
  if (r == CUDA_ERROR_STREAM_CAPTURE_IMPLICIT || capture != CU_STREAM_CAPTURE_STATUS_NONE)
    fail(Status::not_prepared, "sequence '{}': input shape {} ({}) is not prepared and the stream is capturing a "
         "CUDA graph, where jitfuse cannot compile or load kernels: call jf_sequence_prepare(seq, shape, {}, stream) "
         "before the capture", def.name, ops::shape_str(input), training ? "training" : "inference", training ? 1 : 0);
  exec::Runtime& rt = ctx.runtime();
  if (recipe.is_fp8()) fp8_state(stream);  // the recipe state is allocated here, never in a call
  std::vector<ops::Op> ops = ops::infer(def, input);
  auto dev = cuda::current_device();
  fuser::Plan plan = plan_only(ops, training, dev.arch_number());
  for (const auto& d : plan.decisions)
    log().debug("[{}] {} ops [{}, {}) priority {}: {}", rules::pass_name(d.pass), d.rule.empty() ? "-" : d.rule,
                d.begin, d.end, d.priority, d.taken ? "taken" : "not taken: " + d.reason);
  exec::DeviceModel model;
  model.arch = dev.arch();
  model.sm_count = dev.sm_count;
  std::shared_ptr<const exec::Prepared> reference;
  const bool fused = std::any_of(plan.forward.begin(), plan.forward.end(), [](auto& g) { return !g.rule.empty(); }) ||
                     std::any_of(plan.backward.begin(), plan.backward.end(), [](auto& g) { return !g.rule.empty(); });
  if (rt.verify && fused) {
    // The same ops, one group each: what every fused group is compared with.
    exec::PlanOptions o;
    o.arch = dev.arch_number();
    o.training = training;
    o.disable_fusion = true;
    rules::RuleSet rs = ctx.rules_snapshot();
    auto unfused = exec::make_plan(ops, recipe, o, rs);
    reference = exec::prepare_program(exec::make_program(ops, std::move(unfused), recipe, training, def.name, model), rt);
  }
  auto prepared = exec::prepare_program(
      exec::make_program(std::move(ops), std::move(plan), recipe, training, def.name, model), rt);
  auto pp = std::const_pointer_cast<exec::Prepared>(prepared);
  pp->reference = reference;
  if (recipe.is_fp8()) {
    persistent_for(*pp->program);  // the FP8 weight copies, allocated here too
    exec::bind_sequence_state(*pp, fp8_state(), persistent());
  } else {
    exec::bind_sequence_state(*pp, {}, {});
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto [it, inserted] = programs_.emplace(key, pp);  // another thread may have prepared it meanwhile
  return it->second;
}

}  // namespace jitfuse::api
