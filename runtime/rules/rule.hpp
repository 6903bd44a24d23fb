// Fusion rules (format "jitfuse.rules/1"): a pattern over a window of consecutive ops, conditions,
// a pass, a priority and an implementation. A RuleSet also carries user-declared pointwise ops and
// the template files they bring. Loading never throws for a broken rule: it records a LoadError.
#pragma once
#include <map>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

#include "ops/op.hpp"

namespace jitfuse::rules {

enum class Pass { joint, forward, backward };
std::string pass_name(Pass p);

// An op class ("@pointwise"): a named set of op kinds, derived from each kind's declared family, so a user op
// declared in a rules file joins its class with no rule edited. Defined once, in rules/op_class.cpp.
std::vector<std::string> class_names();
bool class_exists(const std::string& cls);
bool in_class(const std::string& cls, const ops::OpKind& kind);
std::string class_members_text(const std::string& cls);  // for messages and docs: "gelu, relu, ... and user ops"

// Repetition bound: a "+" or "*" element matches at most this many consecutive ops, so a window stays short,
// matching stays linear in the sequence and the load-time implementability check stays finite.
inline constexpr int kMaxRepeat = 16;

struct PatternElem {
  std::vector<std::string> kinds;    // op kinds; any of them matches (with the members of `classes` when loaded)
  std::vector<std::string> classes;  // "pointwise" for "@pointwise": matched by class at plan time (user ops too)
  nlohmann::json attrs = nlohmann::json::object();  // attribute constraints: exact values
  bool optional = false;           // may match no op (min == 0)
  int min = 1, max = 1;            // how many consecutive ops it matches: "?" 0..1, "+" 1..kMaxRepeat, "*" 0..kMaxRepeat
  std::string text;                // as written, for explain ("@pointwise+", "gelu"); kinds joined by "|" for lists
  bool accepts(const ops::OpKind* kind, const std::string& name) const;
  bool repeats() const { return max > 1; }
};

struct Divisibility {
  // "cols" / "hidden" (last dim of the window's input), "rows", "out_cols" (last dim of the window's output)
  std::string dim;
  int64_t multiple_of = 1;
};

struct Conditions {
  std::vector<std::string> recipes;  // empty: any
  std::vector<std::string> dtypes;   // empty: any
  int min_arch = 0, max_arch = 0;    // e.g. 80, 90; 0: unbounded
  std::vector<Divisibility> divisible;
  std::optional<bool> training;      // only when training (forward saves context) / only inference
};

// How a matched group is lowered. Identifiers only (validated on load); never pasted into source.
struct Impl {
  enum class Kind { unfused, generated, cublaslt, joint } kind = Kind::unfused;
  // The implementation's name; each one is a class in runtime/exec/lower/impl/ that says what it covers (the
  // loader asks it: rules/implementable.hpp). Never pasted into source.
  std::string skeleton;  // generated: a skeleton ("elementwise", ...)
  std::string epilogue;  // cublaslt: an epilogue ("BIAS", ...)
  int epilogue_ops = 0;  // how many leading ops of the window the GEMM + epilogue covers; rest: generated tail
  std::string tail;      // skeleton of the generated tail, if any
  std::string strategy;  // joint: a strategy ("regenerate_dropout_mask", ...)
  std::vector<std::string> saves;  // joint: what the forward saves (documentation + explain)
};

struct Rule {
  std::string name;
  std::string math;  // one line: "y = gelu_tanh(x + b)"
  Pass pass = Pass::forward;
  int priority = 0;
  std::vector<PatternElem> pattern;
  Conditions conditions;
  Impl impl;
  std::string file;   // where it was declared ("<builtin>/bias_act.json" for built-ins)
  std::string where;  // file:line:col of the rule object
  size_t order = 0;   // load order, for deterministic tie-breaking
  bool overrides = false;  // "overrides": true: replaces a rule of the same name loaded before (a built-in)
  std::string overridden;  // where the replaced rule was declared; empty if this rule replaced none
};

struct LoadError {
  std::string where;  // file:line:col
  std::string rule;   // may be empty (file-level error)
  std::string message;
  std::string to_string() const;
};

class RuleSet {
 public:
  // Built-in rules (embedded at build time) and built-in ops.
  static RuleSet with_builtins();

  // Load one file or every *.json in a directory. Returns the errors found (also kept in errors()).
  std::vector<LoadError> load_path(const std::string& path);
  std::vector<LoadError> load_text(const std::string& text, const std::string& file, const std::string& dir);

  const std::vector<Rule>& rules() const { return rules_; }
  const std::vector<LoadError>& errors() const { return errors_; }
  const ops::Registry& registry() const { return registry_; }
  // Template files brought by user rule directories, keyed as codegen includes them ("user/softplus.cuh").
  const std::map<std::string, std::string>& user_templates() const { return user_templates_; }
  uint64_t generation() const { return generation_; }  // bumps on every change (plan caches key on it)
  // For `jitfuse rules validate` only; a context uses neither, so a clash there is always an error.
  // A loaded rule named as a built-in one replaces it without "overrides": true (a copy of a built-in file,
  // or an edited copy, validates as the file it is).
  void set_builtins_replaceable(bool on) { builtins_replaceable_ = on; }
  // --without-builtins: removes the built-in rules (the built-in ops stay). A rule loaded later that says
  // "overrides": true of one of them is still valid, as it is wherever a context loads it.
  void drop_builtin_rules();

 private:
  struct Loading;  // one file's load (rule_set.cpp); nested, so it fills the tables below

  std::vector<Rule> rules_;
  std::vector<LoadError> errors_;
  ops::Registry registry_;
  std::map<std::string, std::string> user_templates_;
  std::unordered_map<std::string, size_t> rule_index_;  // name -> index in rules_ (keeps loading linear)
  size_t next_order_ = 0;
  uint64_t generation_ = 0;
  bool builtins_replaceable_ = false;
  std::set<std::string> dropped_builtins_;  // names of the built-in rules drop_builtin_rules() removed
};

}  // namespace jitfuse::rules
