// Context and Sequence: rule loading (built-ins, JITFUSE_RULE_PATH, API), plan caching per shape.
#include "api/context.hpp"

#include <algorithm>
#include <vector>

#include "common/env.hpp"
#include "common/error.hpp"
#include "common/log.hpp"
#include "cuda/driver.hpp"
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
    for (auto& [dev, states] : fp8_)
      for (auto& [op, st] : states) d->cuMemFree(reinterpret_cast<CUdeviceptr>(st.scale));  // one block each
}

ops::DType Sequence::output_dtype() const {
  return recipe.is_fp8() && !def.ops.empty() && def.ops.back().kind == "quantize" ? ops::DType::e4m3 : recipe.dtype;
}

const std::map<int, exec::Fp8State>& Sequence::fp8_state() {
  std::lock_guard<std::mutex> lock(mu_);
  const int dev = cuda::current_ordinal();  // makes the primary context current if none is
  auto it = fp8_.find(dev);
  if (it != fp8_.end()) return it->second;
  auto& states = fp8_[dev];
  const auto& d = cuda::driver();
  for (const auto& op : def.ops) {
    if (op.kind != "quantize") continue;
    // One allocation: [scale, scale_inv, history...]; a one-time setup like the cuBLASLt workspace.
    const int len = std::max(1, recipe.amax_history);
    std::vector<float> init(2 + static_cast<size_t>(len), 0.f);
    init[0] = init[1] = 1.f;
    CUdeviceptr p = 0;
    cuda::check(d.cuMemAlloc(&p, init.size() * sizeof(float)), "cuMemAlloc(FP8 recipe state)");
    cuda::check(d.cuMemcpyHtoD(p, init.data(), init.size() * sizeof(float)), "cuMemcpyHtoD(FP8 recipe state)");
    exec::Fp8State st;
    st.scale = reinterpret_cast<float*>(p);
    st.scale_inv = st.scale + 1;
    st.history = st.scale + 2;
    st.len = len;
    states[op.index] = st;
  }
  return states;
}

fuser::Plan Sequence::plan_only(const std::vector<ops::Op>& ops, bool training, int arch) const {
  exec::PlanOptions o;
  o.arch = arch;
  o.training = training;
  o.disable_fusion = env::flag("JITFUSE_DISABLE_FUSION");
  rules::RuleSet rs = ctx.rules_snapshot();
  return exec::make_plan(ops, recipe, o, rs);
}

std::shared_ptr<const exec::Prepared> Sequence::prepared_for(const ops::Shape& input, bool training) {
  // Programs hold loaded kernels, which belong to the device of the current context.
  std::string key = fmt::format("{}|{}|{}|{}|dev{}", ops::shape_str(input), training, ctx.rules_generation(),
                                env::flag("JITFUSE_DISABLE_FUSION"), cuda::current_ordinal());
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = programs_.find(key);
    if (it != programs_.end()) return it->second;
  }
  exec::Runtime& rt = ctx.runtime();
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
  std::lock_guard<std::mutex> lock(mu_);
  programs_[key] = pp;
  return prepared;
}

}  // namespace jitfuse::api
