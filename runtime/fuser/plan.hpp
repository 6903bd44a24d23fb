// The fuser's output: fused forward and backward groups, each a contiguous run of basic ops, plus
// every decision taken or refused on the way (what `jitfuse explain` prints).
#pragma once
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "ops/op.hpp"
#include "rules/rule.hpp"

namespace jitfuse::fuser {

struct Group {
  int begin = 0, end = 0;  // ops [begin, end)
  std::string rule;        // empty: unfused single op
  int priority = 0;
  rules::Impl impl;        // kind unfused for single ops
  bool joint = false;      // owned by a joint rule: same group in both directions
};

// Which pattern element covered which ops of a window ("@pointwise+" covered ops [3, 6)).
struct ElemMatch {
  std::string element;
  int begin = 0, end = 0;
};

struct Decision {
  rules::Pass pass;
  std::string rule;
  int begin = 0, end = 0;
  int priority = 0;
  bool taken = false;
  std::string reason;  // why not taken, e.g. "condition cols % 8 == 0 failed: cols = 4098"
  std::vector<ElemMatch> match;  // filled when the rule has a class or repeated element (what explain shows)
};

struct Plan {
  std::vector<Group> forward, backward;
  std::vector<Decision> decisions;
};

struct PlanInputs {
  std::string recipe;  // "bf16"
  std::string dtype;   // "bf16"
  int arch = 0;        // 90 for sm_90; 0: unknown (arch conditions then fail with that reason)
  bool training = true;
  bool disable_fusion = false;  // JITFUSE_DISABLE_FUSION
};

// The one legality predicate (implemented by exec/, which knows what can be lowered): nullopt when
// `rule` can implement ops[begin, end) in `pass`, else the reason it cannot.
using LegalityFn = std::function<std::optional<std::string>(const rules::Rule& rule, const std::vector<ops::Op>& ops,
                                                            int begin, int end, rules::Pass pass)>;

// Joint pass over the basic ops, then forward and backward passes over its result. Throws
// Error(internal) if a pass breaks the contiguous-run invariant.
Plan plan(const std::vector<ops::Op>& ops, const PlanInputs& in, const rules::RuleSet& rules, const LegalityFn& legal);

// "groups expand, in order, to exactly the basic ops"
void check_contiguous(const std::vector<Group>& groups, int n_ops, const char* pass);

}  // namespace jitfuse::fuser
