// Shared planning helpers of the CLI.
#include "cli_common.hpp"

#include <cstdio>

#include "common/env.hpp"
#include "common/error.hpp"
#include "cuda/driver.hpp"
#include "exec/lower/compile.hpp"

namespace jitfuse::cli {

rules::RuleSet load_rules(const std::vector<std::string>& extra) {
  rules::RuleSet rs = rules::RuleSet::with_builtins();
  if (auto path = env::get("JITFUSE_RULE_PATH"))
    for (const auto& dir : env::split_path(*path))
      for (const auto& e : rs.load_path(dir)) std::fprintf(stderr, "jitfuse: rule skipped: %s\n", e.to_string().c_str());
  for (const auto& dir : extra)
    for (const auto& e : rs.load_path(dir)) std::fprintf(stderr, "jitfuse: rule skipped: %s\n", e.to_string().c_str());
  return rs;
}

int parse_arch(const std::string& text) {
  std::string s = text;
  for (const char* prefix : {"sm_", "compute_"})
    if (s.rfind(prefix, 0) == 0) s = s.substr(std::string(prefix).size());
  if (!s.empty() && (s.back() == 'a' || s.back() == 'f')) s.pop_back();
  bool digits = !s.empty() && s.size() <= 4 && s.find_first_not_of("0123456789") == std::string::npos;
  if (!digits) fail(Status::invalid_argument, "bad --arch '{}': expected an SM version such as sm_80, sm_90 or 90", text);
  return std::stoi(s);
}

std::string default_arch(const std::string& given) {
  if (!given.empty()) return cuda::arch_name(parse_arch(given));
  if (cuda::try_driver()) return cuda::current_device().arch();
  std::fprintf(stderr, "jitfuse: no GPU present and no --arch: planning for sm_90a\n");
  return "sm_90a";
}

Planned plan_file(const rules::RuleSet& rs, const std::string& file, const std::string& recipe,
                  const std::string& shape, int arch, bool training, const ops::Parallel& par) {
  Planned p;
  p.def = ops::parse_sequence_file(file, rs.registry());
  p.recipe = ops::parse_recipe(recipe);
  ops::apply_recipe(p.def, p.recipe);
  p.ops = ops::infer(p.def, ops::parse_shape(shape), par);
  exec::CompileOptions o;
  o.arch = arch;
  o.training = training;
  o.disable_fusion = env::flag("JITFUSE_DISABLE_FUSION");
  p.program = exec::compile(p.ops, p.def.name, p.recipe, o, rs);
  p.plan = p.program->plan;
  return p;
}

exec::TemplateStore templates_for(const rules::RuleSet& rs) {
  exec::TemplateStore t;
  for (const auto& [name, text] : rs.user_templates()) t.add(name, text);
  return t;
}

}  // namespace jitfuse::cli
