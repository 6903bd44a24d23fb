// Helpers every planning command shares: loading rules as a context does, arch parsing, and the
// planning of one sequence file for a recipe and shape without a GPU.
#pragma once
#include <string>
#include <vector>

#include "exec/run/kernels.hpp"
#include "exec/ir/program.hpp"
#include "fuser/plan.hpp"
#include "ops/recipe.hpp"
#include "ops/sequence.hpp"
#include "rules/rule.hpp"

namespace jitfuse::cli {

// Loading order as in a context: built-ins, then JITFUSE_RULE_PATH, then the command line's --rules.
rules::RuleSet load_rules(const std::vector<std::string>& extra);
// "sm_90", "sm_90a", "compute_90" or "90" -> 90.
int parse_arch(const std::string& text);
// --arch if given, else the current GPU's, else sm_90 (with a note on stderr).
std::string default_arch(const std::string& given);

struct Planned {
  ops::SequenceDef def;
  ops::Recipe recipe;
  std::vector<ops::Op> ops;
  fuser::Plan plan;
  std::shared_ptr<const exec::Program> program;  // laid out for the arch planned for (occupancy estimated)
};
Planned plan_file(const rules::RuleSet& rs, const std::string& file, const std::string& recipe,
                  const std::string& shape, int arch, bool training, const ops::Parallel& par = {});

// A template store with the user templates of `rs` added.
exec::TemplateStore templates_for(const rules::RuleSet& rs);

}  // namespace jitfuse::cli
