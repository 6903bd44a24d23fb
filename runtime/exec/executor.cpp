// Building the executable plan: each fused group becomes cuBLASLt calls and/or one generated kernel;
// the kernels' vector variants are compiled and loaded up front, scalar ones when first needed.
#include "exec/executor.hpp"

#include <algorithm>
#include <thread>

#include "common/error.hpp"
#include "common/log.hpp"
#include "exec/lowering.hpp"

namespace jitfuse::exec {

namespace {

using K = rules::Impl::Kind;

nlohmann::json kernel_meta(const std::vector<ops::Op>& ops, const fuser::Group& g, int b, const ops::Recipe& recipe,
                           const std::string& seq, const char* dir) {
  nlohmann::json kinds = nlohmann::json::array();
  for (int i = b; i < g.end; ++i) kinds.push_back(ops[i].kind);
  return {{"rule", g.rule.empty() ? "(unfused)" : g.rule},
          {"ops", kinds},
          {"recipe", ops::recipe_name(recipe.kind)},
          {"shape", "?x" + std::to_string(ops::cols_of(ops[b].in))},
          {"sequence", seq},
          {"pass", dir}};
}

GroupExec lower_group(const std::vector<ops::Op>& ops, const fuser::Group& g, bool forward, const ops::Recipe& recipe,
                      bool training, const std::string& seq) {
  GroupExec ge;
  ge.group = g;
  const auto& impl = g.impl;
  ChainOptions opt;
  opt.dir = forward ? codegen::Direction::forward : codegen::Direction::backward;
  opt.training = training;
  opt.dtype = ops::dtype_name(recipe.dtype);
  opt.rule = g.rule;
  int b = g.begin;
  if (impl.kind == K::cublaslt) {
    ge.gemm_ops = impl.epilogue_ops;
  } else if (impl.kind == K::joint && impl.strategy == "recompute_linear_output") {
    ge.gemm_ops = 1;
    opt.training = false;  // the forward saves nothing of the pointwise op: the backward recomputes it
  } else if (ops[b].family == ops::Family::linear) {
    ge.gemm_ops = 1;  // unfused linear
  }
  if (impl.kind == K::joint && impl.strategy == "regenerate_dropout_mask") opt.regenerate_dropout = true;
  int kb = b + ge.gemm_ops;
  if (kb < g.end) {
    opt.vec = chain_vectorizable(ops, kb, g.end);
    ge.kernel = std::make_unique<KernelStep>();
    ge.kernel->spec = chain_spec(ops, kb, g.end, opt);
    ge.kernel->meta = kernel_meta(ops, g, kb, recipe, seq, forward ? "forward" : "backward");
  }
  return ge;
}

}  // namespace

std::vector<std::pair<codegen::KernelSpec, nlohmann::json>> plan_kernel_specs(const std::vector<ops::Op>& ops,
                                                                              const fuser::Plan& plan,
                                                                              const ops::Recipe& recipe, bool training,
                                                                              const std::string& seq) {
  std::vector<std::pair<codegen::KernelSpec, nlohmann::json>> out;
  auto add = [&](const std::vector<fuser::Group>& groups, bool fwd) {
    for (auto& g : groups) {
      GroupExec ge = lower_group(ops, g, fwd, recipe, training, seq);
      if (ge.kernel) out.emplace_back(ge.kernel->spec, ge.kernel->meta);
    }
  };
  add(plan.forward, true);
  if (training) add(plan.backward, false);
  return out;
}

std::shared_ptr<CompiledPlan> compile_plan(std::vector<ops::Op> ops, fuser::Plan plan, const ops::Recipe& recipe,
                                           bool training, const std::string& seq, Runtime& rt) {
  auto cp = std::make_shared<CompiledPlan>();
  cp->ops = std::move(ops);
  cp->plan = std::move(plan);
  cp->recipe = recipe;
  cp->training = training;
  cp->device = cuda::current_device();
  cp->target = target_for_arch(cp->device.arch());
  for (auto& g : cp->plan.forward) cp->fwd.push_back(lower_group(cp->ops, g, true, recipe, training, seq));
  if (training)
    for (auto& g : cp->plan.backward) cp->bwd.push_back(lower_group(cp->ops, g, false, recipe, training, seq));
  // Compile the plan's kernels in parallel first (the cache dedupes across threads and processes),
  // then load them one by one.
  std::vector<std::pair<codegen::KernelSpec, nlohmann::json>> specs;
  for (auto* list : {&cp->fwd, &cp->bwd})
    for (auto& ge : *list)
      if (ge.kernel) specs.emplace_back(ge.kernel->spec, ge.kernel->meta);
  rt.kernels->prefetch(specs, cp->target, std::max(1u, std::min(8u, std::thread::hardware_concurrency())));
  for (auto* list : {&cp->fwd, &cp->bwd})
    for (auto& ge : *list)
      if (ge.kernel) {
        auto& ks = *ge.kernel;
        auto spec = ks.spec;
        spec.vec = ks.spec.vec;
        const LoadedKernel& lk = rt.kernels->load(spec, cp->target, ks.meta);
        (spec.vec ? ks.vec : ks.scalar) = &lk;
      }
  return cp;
}

}  // namespace jitfuse::exec
