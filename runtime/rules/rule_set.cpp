// Loading rule files into a RuleSet: built-ins, then files and directories. A broken rule or op is recorded
// with file:line:col and skipped, so one mistake never takes the rest of a file (or the host) down with it.
#include <algorithm>
#include <filesystem>

#include <fmt/format.h>

#include "common/embedded.hpp"
#include "common/error.hpp"
#include "common/file_read.hpp"
#include "common/json_util.hpp"
#include "common/log.hpp"
#include "rules/parse.hpp"
#include "rules/rule.hpp"

namespace jitfuse::rules {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr const char* kFormat = "jitfuse.rules/1";
constexpr size_t kMaxFileBytes = 16u << 20;  // docs/rules.md, "Limits"
constexpr size_t kMaxRulesPerFile = 100000;
constexpr size_t kMaxOpsPerFile = 1024;
#ifdef JF_FUZZ_STRICT
constexpr bool kRethrowValidatorBugs = true;  // the fuzzer must see validator bugs, not recorded load errors
#else
constexpr bool kRethrowValidatorBugs = false;
#endif

// nlohmann's parse_error gives a byte offset; turn it into the file:line:col every other message uses.
LoadError syntax_error(const std::string& file, const std::string& text, const json::parse_error& e) {
  size_t end = std::min<size_t>(e.byte > 0 ? e.byte - 1 : 0, text.size());
  int line = 1, col = 1;
  for (size_t i = 0; i < end; ++i) {
    if (text[i] == '\n') {
      ++line;
      col = 1;
    } else {
      ++col;
    }
  }
  std::string what = e.what();
  // Drop nlohmann's "[json.exception.parse_error.101] parse error at line L, column C: " prefix: we say where.
  auto at = what.find("parse error");
  if (at != std::string::npos) {
    auto colon = what.find(": ", at);
    what = colon == std::string::npos ? what.substr(at) : what.substr(colon + 2);
  }
  for (char& c : what)
    if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) >= 0x7f) c = '?';
  return {fmt::format("{}:{}:{}", file, line, col), "", "invalid JSON: " + what};
}

// The name to put in an error about a rule that may be too broken to have one.
std::string display_name(const json& j) {
  if (!j.is_object() || !j.contains("name") || !j.at("name").is_string()) return "";
  std::string q = detail::show(j.at("name").get<std::string>());
  return q.substr(1, q.size() - 2);
}

}  // namespace

std::string pass_name(Pass p) {
  switch (p) {
    case Pass::joint: return "joint";
    case Pass::forward: return "forward";
    case Pass::backward: return "backward";
  }
  return "?";
}

std::string LoadError::to_string() const {
  std::string out = where.empty() ? std::string("<rules>") : where;
  out += ": ";
  if (!rule.empty()) out += "rule '" + rule + "': ";
  return out + message;
}

namespace {
constexpr const char* kBuiltinPrefix = "<builtin>/";  // the file name of every embedded rules file
}  // namespace

RuleSet RuleSet::with_builtins() {
  // Parsed once per process; every caller gets its own copy to extend.
  static const RuleSet base = [] {
    RuleSet rs;
    for (const auto& f : embedded::rules) {
      if (f.path == "schema.json") continue;  // the JSON Schema for editors, not a rules file
      std::string name = kBuiltinPrefix + std::string(f.path);
      auto errs = rs.load_text(std::string(f.content), name, "");
      if (!errs.empty())
        fail(Status::internal, "built-in rule file {} is broken ({} error(s), first: {}); this is a bug in jitfuse",
             name, errs.size(), errs.front().to_string());
    }
    return rs;
  }();
  return base;
}

void RuleSet::drop_builtin_rules() {
  std::vector<Rule> kept;
  for (auto& r : rules_) {
    if (r.file.rfind(kBuiltinPrefix, 0) == 0)
      dropped_builtins_.insert(r.name);
    else
      kept.push_back(std::move(r));
  }
  rules_ = std::move(kept);
  rule_index_.clear();
  for (size_t i = 0; i < rules_.size(); ++i) rule_index_.emplace(rules_[i].name, i);
  ++generation_;
}

std::vector<LoadError> RuleSet::load_path(const std::string& path) {
  std::vector<LoadError> errs;
  auto append = [&](std::vector<LoadError> more) { errs.insert(errs.end(), more.begin(), more.end()); };
  auto load_file = [&](const fs::path& file) {
    std::string text;
    try {
      // Only a regular file of bounded size is read, through the one bounded reader (non-blocking open,
      // fstat, cap): "/dev/zero" or a FIFO must not hang or exhaust the host.
      text = files::read_regular(file.string(), kMaxFileBytes, "rules file");
    } catch (const Error& e) {
      LoadError le{file.string(), "", e.what()};
      log().warn("{}", le.to_string());
      errors_.push_back(le);
      errs.push_back(le);
      return;
    }
    std::string dir = file.parent_path().string();
    append(load_text(text, file.string(), dir.empty() ? "." : dir));
  };
  std::error_code ec;
  fs::path p(path);
  if (fs::is_directory(p, ec)) {
    std::vector<fs::path> files;
    for (const auto& entry : fs::directory_iterator(p, ec)) {
      std::error_code fec;
      // schema.json is skipped so a copy of fusion_rules/ (schema included) loads as a rules directory.
      if (entry.is_regular_file(fec) && entry.path().extension() == ".json" && entry.path().filename() != "schema.json")
        files.push_back(entry.path());
    }
    if (ec) {
      LoadError le{path, "", fmt::format("cannot list directory: {}", ec.message())};
      errors_.push_back(le);
      errs.push_back(le);
    }
    std::sort(files.begin(), files.end());  // deterministic load order, hence deterministic overrides
    if (files.empty()) log().info("rules directory {} has no *.json files", path);
    for (const auto& f : files) load_file(f);
  } else if (fs::exists(p, ec)) {
    load_file(p);
  } else {
    LoadError le{path, "", "no such file or directory (rule paths name a rules file or a directory of *.json files)"};
    log().warn("{}", le.to_string());
    errors_.push_back(le);
    errs.push_back(le);
  }
  return errs;
}

namespace {

// The file as JSON, or false with the error in `errs`: too large, not JSON (at file:line:col), or with a
// duplicate key (which the parser would silently resolve).
bool parse_document(const std::string& text, const std::string& file, json& j, std::vector<LoadError>& errs) {
  if (text.size() > kMaxFileBytes) {
    errs.push_back({file, "", fmt::format("file is larger than {} bytes; rule files are small JSON", kMaxFileBytes)});
    return false;
  }
  try {
    j = json::parse(text);
  } catch (const json::parse_error& e) {
    errs.push_back(syntax_error(file, text, e));
    return false;
  } catch (const json::exception& e) {  // e.g. out_of_range 406 for 1e999: no byte offset to point at
    std::string what = e.what();
    auto at = what.find("] ");
    errs.push_back({file, "", "invalid JSON: " + detail::show(at == std::string::npos ? what : what.substr(at + 2))});
    return false;
  }
  try {
    json_util::check_duplicate_keys(text, file);
  } catch (const Error& e) {  // "file:line:col: duplicate key ...": split so the where column is the place
    std::string what = e.what();
    size_t colon = what.find(": duplicate key");
    errs.push_back({colon == std::string::npos ? file : what.substr(0, colon), "",
                    colon == std::string::npos ? what : what.substr(colon + 2) + " (the file was not loaded)"});
    return false;
  }
  return true;
}

}  // namespace

// One file being loaded: its errors, each at the file:line:col of a JSON pointer, and the steps that add its
// ops and rules to the RuleSet (a nested class: it fills the set's private tables).
struct RuleSet::Loading {
  RuleSet& rs;
  const std::string& file;
  const std::string& dir;
  json_util::Locator locator;  // one per text: locating every rule stays linear in the file
  std::vector<LoadError> errs;

  void record(const std::string& ptr, const std::string& rule, const std::string& msg) {
    errs.push_back({locator.where(file, ptr), rule, msg});
  }
  std::vector<LoadError> finish() {
    for (const auto& e : errs) log().warn("{} (skipped)", e.to_string());
    rs.errors_.insert(rs.errors_.end(), errs.begin(), errs.end());
    return errs;
  }
  bool check_top_level(const json& j);
  bool read_ops(const json& ops_j);
  void declare_op(detail::DeclaredOp d, const std::string& ptr);
  bool read_rules(const json& rules_j);
  void add_rule(Rule r, const std::string& ptr);
};

// An object in this build's format; false (the file is not loaded) otherwise. Unknown keys are recorded
// but do not stop the load.
bool RuleSet::Loading::check_top_level(const json& j) {
  if (!j.is_object()) {
    record("", "", "a rules file is a JSON object {\"format\": \"jitfuse.rules/1\", \"rules\": [...], \"ops\": [...]}");
    return false;
  }
  if (!j.contains("format")) {
    record("", "", "missing \"format\": \"jitfuse.rules/1\" (the file was not loaded)");
    return false;
  }
  if (j.at("format") != kFormat) {
    record("/format", "", fmt::format("unsupported format {}; this build reads \"{}\" (the file was not loaded)",
                                      detail::show(j.at("format")), kFormat));
    return false;
  }
  for (const auto& [key, value] : j.items()) {
    if (key != "format" && key != "rules" && key != "ops" && key != "$schema" && key != "comment")
      record(key.find_first_of("/~") == std::string::npos ? "/" + key : "",
             "", fmt::format("unknown top-level key {}; known keys: format, rules, ops, $schema, comment",
                             detail::show(key)));
  }
  return true;
}

// Every op declaration of the file, each one recorded and skipped when broken; false when the file
// declares more ops than a file may (nothing more of it is loaded).
bool RuleSet::Loading::read_ops(const json& ops_j) {
  if (!ops_j.is_array()) record("/ops", "", "\"ops\" must be an array of op declarations");
  if (ops_j.is_array() && ops_j.size() > kMaxOpsPerFile) {
    record("/ops", "", fmt::format("{} op declarations; a rules file may declare at most {} (split the file)",
                                   ops_j.size(), kMaxOpsPerFile));
    return false;
  }
  for (size_t i = 0; ops_j.is_array() && i < ops_j.size(); ++i) {
    std::string ptr = "/ops/" + std::to_string(i);
    std::string name = display_name(ops_j[i]);
    std::string prefix = name.empty() ? "" : "op '" + name + "': ";
    try {
      declare_op(detail::parse_op(ops_j[i], ptr, dir, rs.registry_), ptr);
    } catch (const detail::Invalid& e) {
      record(e.pointer, "", prefix + e.what());
    } catch (const Error& e) {
      record(ptr, "", prefix + e.what());
    } catch (const std::exception& e) {  // a validator bug must not take the host down
      if (kRethrowValidatorBugs) throw;
      record(ptr, "", prefix + "internal error while validating: " + e.what());
    }
  }
  return true;
}

// Registers a parsed op and its template, unless it would change what an earlier declaration means.
void RuleSet::Loading::declare_op(detail::DeclaredOp d, const std::string& ptr) {
  d.kind.declared_in = locator.where(file, ptr);
  // One template file name, one content: another op must not silently change what this one includes.
  auto it = rs.user_templates_.find(d.template_key);
  if (it != rs.user_templates_.end() && it->second != d.template_text) {
    for (const auto& other : rs.registry_.names()) {
      const ops::OpKind* k = rs.registry_.find(other);
      if (k->user_declared && k->template_file == d.template_key && k->name != d.kind.name)
        detail::invalid(ptr + "/template",
                        fmt::format("template {} is already used by op '{}' (declared at {}) with different "
                                    "content; rename one of the files",
                                    d.template_key, k->name, k->declared_in));
    }
  }
  // A second declaration would silently change what the first file's rules run: refuse it.
  if (const ops::OpKind* prev = rs.registry_.find(d.kind.name); prev && prev->user_declared)
    detail::invalid(ptr + "/name", fmt::format("op '{}' is already declared at {}; an op is declared once "
                                               "(rename one of them, or remove one of the files from the rule "
                                               "path)", d.kind.name, prev->declared_in));
  log().debug("op {} declared at {} (functor {}, template {})", d.kind.name, d.kind.declared_in,
              d.kind.functor, d.template_key);
  rs.registry_.add(std::move(d.kind));
  rs.user_templates_[d.template_key] = std::move(d.template_text);
  ++rs.generation_;
}

// Every rule of the file, each one recorded and skipped when broken; false when the file holds more rules
// than a file may.
bool RuleSet::Loading::read_rules(const json& rules_j) {
  if (!rules_j.is_array()) record("/rules", "", "\"rules\" must be an array of rules");
  if (rules_j.is_array() && rules_j.size() > kMaxRulesPerFile) {
    record("/rules", "", fmt::format("{} rules; a rules file may hold at most {} (split the file)", rules_j.size(),
                                     kMaxRulesPerFile));
    return false;
  }
  for (size_t i = 0; rules_j.is_array() && i < rules_j.size(); ++i) {
    std::string ptr = "/rules/" + std::to_string(i);
    std::string name = display_name(rules_j[i]);
    try {
      Rule r = detail::parse_rule(rules_j[i], ptr, rs.registry_);
      r.file = file;
      r.where = locator.where(file, ptr);
      add_rule(std::move(r), ptr);
    } catch (const detail::Invalid& e) {
      record(e.pointer, name, e.what());
    } catch (const std::exception& e) {
      if (kRethrowValidatorBugs) throw;
      record(ptr, name, std::string("internal error while validating: ") + e.what());
    }
  }
  return true;
}

// A new rule takes the next load order; one of a name already loaded replaces that rule, in its place,
// only where that is asked for ("overrides") or allowed (a built-in under `rules validate`).
void RuleSet::Loading::add_rule(Rule r, const std::string& ptr) {
  auto it = rs.rule_index_.find(r.name);
  if (it != rs.rule_index_.end()) {
    Rule& prev = rs.rules_[it->second];
    // Two rules of one name in one file is a mistake; replacing a rule of another file (a built-in)
    // must be asked for with "overrides": true, so it never happens by accident.
    if (prev.file == file)
      detail::invalid(ptr + "/name", fmt::format("rule {} is declared twice in this file (first at {}); "
                                                 "rename one of them", detail::show(r.name), prev.where));
    const bool replaces_builtin = rs.builtins_replaceable_ && prev.file.rfind(kBuiltinPrefix, 0) == 0;
    if (!r.overrides && !replaces_builtin)
      detail::invalid(ptr + "/name", fmt::format("rule {} is already declared at {}; to replace it, add "
                                                 "\"overrides\": true to this rule, or rename it",
                                                 detail::show(r.name), prev.where));
    // The override takes the place (and tie-breaking order) of the rule it replaces.
    log().info("rule {} from {} overrides the one from {}", r.name, r.where, prev.where);
    r.order = prev.order;
    r.overridden = prev.where;
    prev = std::move(r);
  } else {
    if (r.overrides && !rs.dropped_builtins_.count(r.name))
      detail::invalid(ptr + "/overrides", fmt::format("rule {} says \"overrides\": true, but no rule of that "
                                                      "name was loaded before it; remove \"overrides\"",
                                                      detail::show(r.name)));
    r.order = rs.next_order_++;
    log().debug("rule {} loaded from {}", r.name, r.where);
    rs.rule_index_.emplace(r.name, rs.rules_.size());
    rs.rules_.push_back(std::move(r));
  }
  ++rs.generation_;
}

std::vector<LoadError> RuleSet::load_text(const std::string& text, const std::string& file, const std::string& dir) {
  Loading l{*this, file, dir, json_util::Locator(text), {}};
  json j;
  if (!parse_document(text, file, j, l.errs) || !l.check_top_level(j)) return l.finish();
  // Ops first: rules of the same file may use the ops it declares.
  if (j.contains("ops") && !l.read_ops(j.at("ops"))) return l.finish();
  if (j.contains("rules")) l.read_rules(j.at("rules"));
  return l.finish();
}

}  // namespace jitfuse::rules
