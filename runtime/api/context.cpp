// Context and Sequence: rule loading (built-ins, JITFUSE_RULE_PATH, API), plan caching per shape.
#include "api/context.hpp"

#include "common/env.hpp"
#include "common/error.hpp"
#include "common/log.hpp"
#include "exec/lowering.hpp"

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

fuser::Plan Sequence::plan_only(const std::vector<ops::Op>& ops, bool training, int arch) const {
  fuser::PlanInputs in;
  in.recipe = ops::recipe_name(recipe.kind);
  in.dtype = ops::dtype_name(recipe.dtype);
  in.arch = arch;
  in.training = training;
  in.disable_fusion = env::flag("JITFUSE_DISABLE_FUSION");
  rules::RuleSet rs = ctx.rules_snapshot();
  return fuser::plan(ops, in, rs, exec::legality());
}

std::shared_ptr<const exec::CompiledPlan> Sequence::plan_for(const ops::Shape& input, bool training) {
  // Plans hold loaded kernels, which belong to the device of the current context.
  std::string key = fmt::format("{}|{}|{}|{}|dev{}", ops::shape_str(input), training, ctx.rules_generation(),
                                env::flag("JITFUSE_DISABLE_FUSION"), cuda::current_ordinal());
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = plans_.find(key);
    if (it != plans_.end()) return it->second;
  }
  exec::Runtime& rt = ctx.runtime();
  std::vector<ops::Op> ops = ops::infer(def, input);
  auto dev = cuda::current_device();
  fuser::Plan plan = plan_only(ops, training, dev.arch_number());
  for (const auto& d : plan.decisions)
    log().debug("[{}] {} ops [{}, {}) priority {}: {}", rules::pass_name(d.pass), d.rule.empty() ? "-" : d.rule,
                d.begin, d.end, d.priority, d.taken ? "taken" : "not taken: " + d.reason);
  auto cp = exec::compile_plan(std::move(ops), std::move(plan), recipe, training, def.name, rt);
  std::lock_guard<std::mutex> lock(mu_);
  plans_[key] = cp;
  return cp;
}

}  // namespace jitfuse::api
