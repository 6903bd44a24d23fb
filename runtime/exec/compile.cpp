// compile: infer -> plan -> make_program (compile.hpp).
#include "exec/compile.hpp"

#include "cuda/driver.hpp"

namespace jitfuse::exec {

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
