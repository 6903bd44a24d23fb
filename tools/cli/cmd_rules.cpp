// `jitfuse rules list` (every loaded rule: built-ins, JITFUSE_RULE_PATH, --rules) and `jitfuse rules validate
// FILE...` (exit 0 when all valid, 1 otherwise; errors as file:line:col: rule 'x': message; a validated rule
// replaces the built-in of its name). --json for scripts.
#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>
#include <memory>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli_common.hpp"
#include "commands.hpp"
#include "fuser/explain.hpp"
#include "common/env.hpp"
#include "common/error.hpp"
#include "common/log.hpp"
#include "rules/rule.hpp"
#include "rules/template_check.hpp"

namespace jitfuse::cli {
namespace {

using nlohmann::json;

// These commands print every load error themselves; the library's warnings would say each one twice.
void quiet_library_log() {
  if (!env::get("JITFUSE_LOG_LEVEL")) log().set_level(spdlog::level::err);
}

std::string pattern_text(const rules::Rule& r) {
  std::string out;
  for (const auto& e : r.pattern) {
    std::string el;
    if (!e.classes.empty()) {  // as written ("@pointwise+"): a class element has no attribute constraints
      out += (out.empty() ? "" : " ") + e.text;
      continue;
    }
    for (const auto& k : e.kinds) el += (el.empty() ? "" : "|") + k;
    if (e.kinds.size() > 1) el = "(" + el + ")";
    if (!e.attrs.empty()) {
      std::string a;
      for (const auto& [k, v] : e.attrs.items()) a += (a.empty() ? "" : ",") + k + "=" + (v.is_string() ? v.get<std::string>() : v.dump());
      el += "{" + a + "}";
    }
    el += e.repeats() ? (e.min == 0 ? "*" : "+") : e.optional ? "?" : "";
    out += (out.empty() ? "" : " ") + el;
  }
  return out;
}

json impl_json(const rules::Impl& i) {
  json j;
  switch (i.kind) {
    case rules::Impl::Kind::unfused: j["kind"] = "unfused"; break;
    case rules::Impl::Kind::generated: j = {{"kind", "generated"}, {"skeleton", i.skeleton}}; break;
    case rules::Impl::Kind::cublaslt:
      j = {{"kind", "cublaslt"}, {"epilogue", i.epilogue}, {"epilogue_ops", i.epilogue_ops}};
      if (!i.tail.empty()) j["tail"] = i.tail;
      break;
    case rules::Impl::Kind::joint: j = {{"kind", "joint"}, {"strategy", i.strategy}, {"saves", i.saves}}; break;
  }
  return j;
}

json rule_json(const rules::Rule& r) {
  json pattern = json::array();
  for (const auto& e : r.pattern) {
    json el = {{"op", e.kinds}, {"attrs", e.attrs}, {"optional", e.optional}};
    if (!e.classes.empty()) el["classes"] = e.classes;  // "op" then lists their members at load time
    if (e.repeats()) el["repeat"] = {{"min", e.min}, {"max", e.max}};
    pattern.push_back(el);
  }
  json cond = json::object();
  const auto& c = r.conditions;
  if (!c.recipes.empty()) cond["recipes"] = c.recipes;
  if (!c.dtypes.empty()) cond["dtypes"] = c.dtypes;
  if (c.min_arch) cond["min_arch"] = c.min_arch;
  if (c.max_arch) cond["max_arch"] = c.max_arch;
  for (const auto& d : c.divisible) cond["divisible"].push_back({{"dim", d.dim}, {"multiple_of", d.multiple_of}});
  if (c.training) cond["training"] = *c.training;
  return {{"name", r.name},       {"pass", rules::pass_name(r.pass)}, {"priority", r.priority},
          {"pattern", pattern},   {"conditions", cond},               {"impl", impl_json(r.impl)},
          {"math", r.math},       {"file", r.file},                   {"where", r.where},
          {"overrides", r.overridden.empty() ? json(nullptr) : json(r.overridden)}};
}

json error_json(const rules::LoadError& e) {
  return {{"where", e.where}, {"rule", e.rule}, {"message", e.message}, {"text", e.to_string()}};
}

void list_rules(const std::vector<std::string>& extra, bool as_json) {
  quiet_library_log();
  rules::RuleSet rs = load_rules(extra);  // built-ins, JITFUSE_RULE_PATH, --rules; errors go to stderr
  std::vector<const rules::Rule*> sorted;
  for (const auto& r : rs.rules()) sorted.push_back(&r);
  // Grouped by pass in the order the passes run, then in tie-breaking (load) order.
  std::stable_sort(sorted.begin(), sorted.end(), [](const rules::Rule* a, const rules::Rule* b) {
    if (a->pass != b->pass) return static_cast<int>(a->pass) < static_cast<int>(b->pass);
    return a->order < b->order;
  });
  if (as_json) {
    json out = {{"rules", json::array()}, {"errors", json::array()}};
    for (const auto* r : sorted) out["rules"].push_back(rule_json(*r));
    for (const auto& e : rs.errors()) out["errors"].push_back(error_json(e));
    std::printf("%s\n", out.dump(2, ' ', false, json::error_handler_t::replace).c_str());
    return;
  }
  std::vector<std::array<std::string, 6>> rows = {{"NAME", "PASS", "PRIORITY", "PATTERN", "IMPL", "FILE"}};
  for (const auto* r : sorted)
    rows.push_back({r->name, rules::pass_name(r->pass), std::to_string(r->priority), pattern_text(*r),
                    fuser::impl_text(r->impl),
                    r->overridden.empty() ? r->file : r->file + " (overrides " + r->overridden + ")"});
  std::array<size_t, 6> width{};
  for (const auto& row : rows)
    for (size_t c = 0; c < row.size(); ++c) width[c] = std::max(width[c], row[c].size());
  for (const auto& row : rows) {
    std::string line;
    for (size_t c = 0; c < row.size(); ++c)
      line += c + 1 < row.size() ? fmt::format("{:<{}}  ", row[c], width[c]) : row[c];
    std::printf("%s\n", line.c_str());
  }
  size_t overrides = std::count_if(sorted.begin(), sorted.end(), [](const rules::Rule* r) { return !r->overridden.empty(); });
  std::printf("\n%zu rules", sorted.size());
  if (overrides) std::printf(" (%zu replacing a rule loaded before them: \"overrides\": true)", overrides);
  std::printf("\n");
}

// `rules list --ops`: every op kind a sequence may use, built in or declared by a rules file.
void list_ops(const std::vector<std::string>& extra, bool as_json) {
  quiet_library_log();
  rules::RuleSet rs = load_rules(extra);
  const auto& reg = rs.registry();
  std::vector<std::string> names = reg.names();  // sorted (std::map)
  if (as_json) {
    json out = {{"ops", json::array()}, {"errors", json::array()}};
    for (const auto& n : names) {
      const ops::OpKind* k = reg.find(n);
      json attrs = json::array();
      for (const auto& a : k->attrs) attrs.push_back(a.name);
      out["ops"].push_back({{"name", k->name},
                            {"family", ops::family_name(k->family)},
                            {"kind", k->user_declared ? "user" : "builtin"},
                            {"math", k->math},
                            {"attrs", attrs},
                            {"functor", k->functor},
                            {"template", k->template_file},
                            {"file", k->user_declared ? k->declared_in : "<builtin>"}});
    }
    for (const auto& e : rs.errors()) out["errors"].push_back(error_json(e));
    std::printf("%s\n", out.dump(2, ' ', false, json::error_handler_t::replace).c_str());
    return;
  }
  std::vector<std::array<std::string, 5>> rows = {{"OP", "FAMILY", "KIND", "TEMPLATE", "DECLARED IN"}};
  size_t user = 0;
  for (const auto& n : names) {
    const ops::OpKind* k = reg.find(n);
    user += k->user_declared;
    rows.push_back({k->name, ops::family_name(k->family), k->user_declared ? "user" : "builtin",
                    k->template_file.empty() ? "-" : k->template_file, k->user_declared ? k->declared_in : "<builtin>"});
  }
  std::array<size_t, 5> width{};
  for (const auto& row : rows)
    for (size_t c = 0; c < row.size(); ++c) width[c] = std::max(width[c], row[c].size());
  for (const auto& row : rows) {
    std::string line;
    for (size_t c = 0; c < row.size(); ++c)
      line += c + 1 < row.size() ? fmt::format("{:<{}}  ", row[c], width[c]) : row[c];
    std::printf("%s\n", line.c_str());
  }
  std::printf("\n%zu ops (%zu built in, %zu user-declared)\n", names.size(), names.size() - user, user);
}

// Whether a rule's file came from `path` (the file itself, or a *.json directly inside the directory).
bool under(const std::string& file, const std::string& path) {
  namespace fs = std::filesystem;
  auto norm = [](const fs::path& p) {
    fs::path n = p.lexically_normal();
    return n.has_filename() ? n : n.parent_path();
  };
  return norm(file) == norm(path) || norm(fs::path(file).parent_path()) == norm(path);
}

int validate(const std::vector<std::string>& paths, bool as_json, bool compile, bool without_builtins) {
  quiet_library_log();
  // Validated on top of what a context would have loaded before them (JITFUSE_RULE_PATH errors go to stderr
  // and do not count against the files validated here), or of the built-in ops alone (--without-builtins).
  rules::RuleSet rs = without_builtins ? rules::RuleSet::with_builtins() : load_rules({});
  if (without_builtins) rs.drop_builtin_rules();
  // A validated file's rule named as a built-in one replaces it (a copy of a built-in file being edited, or
  // the checkout's rules before a rebuild); a clash with any other file's rule is still an error.
  rs.set_builtins_replaceable(true);
  json out = {{"valid", true}, {"paths", json::array()}};
  bool all_ok = true;
  for (const auto& path : paths) {
    // Later paths may use ops declared by earlier ones, as they would when loaded in this order.
    std::vector<rules::LoadError> errs = rs.load_path(path);
    // "ok" must mean usable: the functors of the ops this path declares must compile (NVRTC, no GPU needed).
    if (compile) {
      auto cerrs = rules::compile_user_ops(rs, "sm_90a", [&](const std::string& f) { return under(f, path); });
      errs.insert(errs.end(), cerrs.begin(), cerrs.end());
    }
    size_t n_rules = 0, n_ops = 0;
    for (const auto& r : rs.rules()) n_rules += under(r.file, path);
    for (const auto& name : rs.registry().names()) {
      const ops::OpKind* k = rs.registry().find(name);
      std::string file = k->declared_in.substr(0, k->declared_in.find(':'));
      n_ops += k->user_declared && under(file, path);
    }
    all_ok &= errs.empty();
    json p = {{"path", path}, {"valid", errs.empty()}, {"rules", n_rules}, {"ops", n_ops}, {"errors", json::array()}};
    for (const auto& e : errs) p["errors"].push_back(error_json(e));
    out["paths"].push_back(p);
    if (!as_json) {
      for (const auto& e : errs) std::printf("%s\n", e.to_string().c_str());
      if (errs.empty())
        std::printf("%s: ok (%zu rules, %zu ops)\n", path.c_str(), n_rules, n_ops);
      else
        std::printf("%s: %zu error(s); the other %zu rules and %zu ops load\n", path.c_str(), errs.size(), n_rules, n_ops);
    }
  }
  out["valid"] = all_ok;
  if (as_json) std::printf("%s\n", out.dump(2, ' ', false, json::error_handler_t::replace).c_str());
  return all_ok ? 0 : 1;
}

}  // namespace

void add_rules_commands(CLI::App& app) {
  CLI::App* rules_cmd = app.add_subcommand("rules", "Inspect and validate fusion rules");
  rules_cmd->require_subcommand(1);

  struct ListOpts {
    std::vector<std::string> rules;
    bool json = false;
    bool ops = false;
  };
  auto list_opts = std::make_shared<ListOpts>();
  CLI::App* list = rules_cmd->add_subcommand("list", "List loaded rules: built-ins, JITFUSE_RULE_PATH, then --rules");
  list->add_option("--rules", list_opts->rules, "Extra rule file or directory (repeatable)");
  list->add_flag("--json", list_opts->json, "Machine-readable output");
  list->add_flag("--ops", list_opts->ops, "List the declared ops (built-in and user) instead of the rules");
  list->callback([list_opts] {
    if (list_opts->ops)
      list_ops(list_opts->rules, list_opts->json);
    else
      list_rules(list_opts->rules, list_opts->json);  // errors: main() prints them and exits 2
  });

  struct ValidateOpts {
    std::vector<std::string> files;
    bool json = false;
    bool no_compile = false;
    bool without_builtins = false;
  };
  auto val_opts = std::make_shared<ValidateOpts>();
  CLI::App* val = rules_cmd->add_subcommand(
      "validate", "Validate rule files or directories (exit 0 when all are valid, 1 otherwise)");
  val->add_option("FILE", val_opts->files, "Rules file or directory of *.json")->required();
  val->add_flag("--json", val_opts->json, "Machine-readable output");
  val->add_flag("--no-compile", val_opts->no_compile, "Skip compiling the user ops' functors with NVRTC");
  val->add_flag("--without-builtins", val_opts->without_builtins,
                "Validate the files against the built-in ops only: no built-in rules, no JITFUSE_RULE_PATH");
  val->callback([val_opts] {
    int rc = validate(val_opts->files, val_opts->json, !val_opts->no_compile, val_opts->without_builtins);  // 1: a file is invalid; errors: main(), exit 2
    if (rc != 0) throw CLI::RuntimeError(rc);
  });
}

}  // namespace jitfuse::cli
