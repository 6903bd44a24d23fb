// Internal to fuser/: the one sliding-window loop, shared by the joint, forward and backward passes, and the
// per-window checks it applies (pattern, attributes, conditions, legality) in that order.
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "fuser/plan.hpp"

namespace jitfuse::fuser::detail {

// Runs every rule of `pass` at every start over `ops`. `fixed` is the previous pass's result: its joint
// groups are kept as they are and no window may overlap them. Appends what was tried to `decisions` and
// returns the pass's groups, in op order, covering every op.
std::vector<Group> run_pass(rules::Pass pass, const std::vector<ops::Op>& ops, const std::vector<Group>& fixed,
                            const PlanInputs& in, const rules::RuleSet& rules, const LegalityFn& legal,
                            std::vector<Decision>& decisions);

// nullopt when the rule's conditions hold for ops[begin, end), else why not ("arch sm_80 < min_arch 90").
std::optional<std::string> check_conditions(const rules::Conditions& c, const std::vector<ops::Op>& ops, int begin,
                                            int end, const PlanInputs& in);

}  // namespace jitfuse::fuser::detail
