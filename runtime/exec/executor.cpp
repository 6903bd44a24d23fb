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
  } else if (impl.kind == K::joint && impl.strategy == "relu_bitmask") {
    ge.gemm_ops = g.end - g.begin;  // two GEMMs forward, four backward, all on cuBLASLt (run.cpp)
  } else if (impl.kind == K::joint && impl.strategy == "recompute_linear_output") {
    ge.gemm_ops = 1;
    opt.training = false;  // the forward saves nothing of the pointwise op: the backward recomputes it
  } else if (ops[b].family == ops::Family::linear) {
    ge.gemm_ops = 1;  // unfused linear
  }
  if (impl.kind == K::joint && impl.strategy == "regenerate_dropout_mask") opt.regenerate_dropout = true;
  if (recipe.is_fp8() && forward) {
    codegen::Fp8Spec q;
    q.delayed = recipe.kind == ops::RecipeKind::fp8_delayed;
    q.margin = recipe.margin;
    opt.fp8 = q;
  }
  int kb = b + ge.gemm_ops;
  if (kb < g.end) {
    opt.vec = chain_vectorizable(ops, kb, g.end);
    ge.kernel = std::make_unique<KernelStep>();
    ge.kernel->spec = chain_spec(ops, kb, g.end, opt);
    ge.kernel->meta = kernel_meta(ops, g, kb, recipe, seq, forward ? "forward" : "backward");
    if (ge.kernel->spec.fp8 && !ge.kernel->spec.fp8->delayed) {
      // Current scaling needs amax(output) before the first byte is cast: a first pass reduces it.
      ge.amax_pass = std::make_unique<KernelStep>(*ge.kernel);
      auto& spec = ge.amax_pass->spec;
      spec.fp8->amax_only = true;
      // The cast pass saves the group's context; this one only reads.
      if (spec.norm) spec.norm->save_stats = spec.norm->save_input = false;
      if (spec.gated) spec.gated->save_input = false;
      for (auto* stages : {&spec.pre, &spec.post})
        for (auto& st : *stages) st.save_input = st.save_output = st.dropout_save_mask = false;
      ge.amax_pass->spec.label += "_amax";
      ge.amax_pass->meta["pass"] = "forward (amax)";
    }
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
      for (auto* ks : ge.steps()) out.emplace_back(ks->spec, ks->meta);
    }
  };
  add(plan.forward, true);
  if (training) add(plan.backward, false);
  return out;
}

std::vector<KernelStep*> GroupExec::steps() const {
  std::vector<KernelStep*> out;
  if (amax_pass) out.push_back(amax_pass.get());
  if (kernel) out.push_back(kernel.get());
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
      for (auto* ks : ge.steps()) specs.emplace_back(ks->spec, ks->meta);
  rt.kernels->prefetch(specs, cp->target, std::max(1u, std::min(8u, std::thread::hardware_concurrency())));
  for (auto* list : {&cp->fwd, &cp->bwd})
    for (auto& ge : *list)
      for (auto* ks : ge.steps()) {
        const LoadedKernel& lk = rt.kernels->load(ks->spec, cp->target, ks->meta);
        (ks->spec.vec ? ks->vec : ks->scalar) = &lk;
      }
  return cp;
}

}  // namespace jitfuse::exec
