// The three passes in order (joint over the basic ops; forward and backward, independently, over its
// result) and the contiguous-run invariant checked after each one.
#include "fuser/plan.hpp"

#include <fmt/format.h>

#include "common/error.hpp"
#include "common/log.hpp"
#include "fuser/window.hpp"

namespace jitfuse::fuser {
namespace {

std::vector<Group> singles(int n) {
  std::vector<Group> out;
  for (int i = 0; i < n; ++i) out.push_back({i, i + 1, "", 0, rules::Impl{}, false});
  return out;
}

void note(Plan& p, rules::Pass pass, int n, const char* reason) {
  p.decisions.push_back({pass, "", 0, n, 0, false, reason});
  log().debug("{} pass: {}", rules::pass_name(pass), reason);
}

}  // namespace

void check_contiguous(const std::vector<Group>& groups, int n_ops, const char* pass) {
  int next = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    const Group& grp = groups[g];
    if (grp.begin != next || grp.end <= grp.begin || grp.end > n_ops)
      fail(Status::internal,
           "internal error after the {} pass: group {} ({}) covers ops [{}, {}) but the groups must expand, in order, "
           "to exactly the basic ops [0, {}) (expected a group starting at op {}); please report this with the "
           "output of `jitfuse explain`",
           pass, g, grp.rule.empty() ? "unfused" : "rule " + grp.rule, grp.begin, grp.end, n_ops, next);
    next = grp.end;
  }
  if (next != n_ops)
    fail(Status::internal,
         "internal error after the {} pass: the groups cover ops [0, {}) but the sequence has {} ops; please report "
         "this with the output of `jitfuse explain`",
         pass, next, n_ops);
}

Plan plan(const std::vector<ops::Op>& ops, const PlanInputs& in, const rules::RuleSet& rules, const LegalityFn& legal) {
  const int n = static_cast<int>(ops.size());
  Plan p;
  if (in.disable_fusion) {
    for (auto pass : {rules::Pass::joint, rules::Pass::forward, rules::Pass::backward})
      note(p, pass, n, "fusion disabled by JITFUSE_DISABLE_FUSION");
    p.forward = p.backward = singles(n);
    check_contiguous(p.forward, n, "forward");
    check_contiguous(p.backward, n, "backward");
    return p;
  }
  std::vector<Group> joint = detail::run_pass(rules::Pass::joint, ops, singles(n), in, rules, legal, p.decisions);
  check_contiguous(joint, n, "joint");
  p.forward = detail::run_pass(rules::Pass::forward, ops, joint, in, rules, legal, p.decisions);
  check_contiguous(p.forward, n, "forward");
  if (in.training) {
    p.backward = detail::run_pass(rules::Pass::backward, ops, joint, in, rules, legal, p.decisions);
  } else {
    // Inference runs no backward: keep the joint result so both lists still cover the ops.
    note(p, rules::Pass::backward, n, "skipped: planning for inference (training = false)");
    p.backward = joint;
  }
  check_contiguous(p.backward, n, "backward");
  log().debug("plan: {} ops -> {} forward groups, {} backward groups", n, p.forward.size(), p.backward.size());
  return p;
}

}  // namespace jitfuse::fuser
