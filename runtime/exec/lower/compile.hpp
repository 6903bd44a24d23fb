// Stages 1-3 (Sequence -> Plan -> Program; docs/architecture.md) in one call: a sequence's ops with shapes
// inferred for an input, planned with a rule set (the three passes), lowered into a Program. The one way
// the C ABI, the CLI and the tests make a Program. Needs no GPU.
#pragma once
#include <memory>

#include "exec/ir/program.hpp"
#include "fuser/plan.hpp"
#include "ops/sequence.hpp"
#include "rules/rule.hpp"

namespace jitfuse::exec {

struct PlanOptions {
  int arch = 0;  // 90 for sm_90; 0: unknown (arch conditions then fail with that reason)
  bool training = true;
  bool disable_fusion = false;  // JITFUSE_DISABLE_FUSION
};
// The one way a plan is made (context, CLI and tests): the three passes over `ops` with the rules of `rs`,
// legality answered by the implementations.
fuser::Plan make_plan(const std::vector<ops::Op>& ops, const ops::Recipe& recipe, const PlanOptions& o,
                      const rules::RuleSet& rs);

// Lowers every group of `plan` through its implementation into steps over buffers, laid out for `dev` with
// estimated occupancies (lay_out, layout.hpp). Needs no GPU. The one place a Program is written.
std::shared_ptr<const Program> make_program(std::vector<ops::Op> ops, fuser::Plan plan, const ops::Recipe& recipe,
                                            bool training, const std::string& sequence_name, const DeviceModel& dev);

struct CompileOptions {
  int arch = 0;           // SM version (90 for sm_90); 0: unknown (arch conditions then fail with that reason)
  bool training = true;
  bool disable_fusion = false;  // JITFUSE_DISABLE_FUSION: one group per op
  int sm_count = 132;     // of the device the estimated layout is for
};

std::shared_ptr<const Program> compile(const ops::SequenceDef& def, const ops::Recipe& recipe,
                                       const ops::Shape& input, const CompileOptions& o, const rules::RuleSet& rs);
// The same from ops whose shapes are already inferred (ops::infer(def, input)).
std::shared_ptr<const Program> compile(std::vector<ops::Op> ops, const std::string& sequence_name,
                                       const ops::Recipe& recipe, const CompileOptions& o, const rules::RuleSet& rs);

}  // namespace jitfuse::exec
