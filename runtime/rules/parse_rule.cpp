// Parsing and validating one rule object of a "jitfuse.rules/1" file: pattern, conditions and impl, plus the
// cross-checks between them (an epilogue must cover the ops it claims, a joint impl only in the joint pass).
#include <algorithm>
#include <set>

#include <fmt/format.h>

#include "ops/recipe.hpp"
#include "rules/implementable.hpp"
#include "rules/parse.hpp"

namespace jitfuse::rules::detail {
namespace {

using nlohmann::json;

Pass parse_pass(const json& j, const std::string& p) {
  std::string s = need_string(j, "pass", p, "\"joint\", \"forward\" or \"backward\"");
  if (s == "joint") return Pass::joint;
  if (s == "forward") return Pass::forward;
  if (s == "backward") return Pass::backward;
  invalid(p + "/pass", fmt::format("unknown pass {}; use \"joint\", \"forward\" or \"backward\"", show(s)));
}

void check_attr_constraint(const std::string& key, const json& v, const std::vector<std::string>& kinds,
                           const std::string& p, const ops::Registry& reg) {
  if (!(v.is_string() || v.is_number() || v.is_boolean()))
    invalid(p, fmt::format("attribute constraint {} must be a string, number or boolean, got {}", show(key), show(v)));
  for (const auto& kind : kinds) {
    const ops::OpKind* info = reg.find(kind);
    const ops::AttrSpec* spec = nullptr;
    std::vector<std::string> names;
    for (const auto& a : info->attrs) {
      names.push_back(a.name);
      if (a.name == key) spec = &a;
    }
    if (!spec)
      invalid(p, fmt::format("op {} has no attribute {} (its attributes: {})", show(kind), show(key),
                             names.empty() ? "none" : join(names)));
    auto expect = [&](const char* what) {
      invalid(p, fmt::format("attribute {} of op {} is {}, got {}", show(key), show(kind), what, show(v)));
    };
    switch (spec->type) {
      case ops::AttrSpec::Type::number:
        if (!v.is_number()) expect("a number");
        break;
      case ops::AttrSpec::Type::integer:
        if (!v.is_number_integer()) expect("an integer");
        break;
      case ops::AttrSpec::Type::boolean:
        if (!v.is_boolean()) expect("true or false");
        break;
      case ops::AttrSpec::Type::string:
        if (!v.is_string()) expect("a string");
        if (!spec->choices.empty() &&
            std::find(spec->choices.begin(), spec->choices.end(), v.get<std::string>()) == spec->choices.end())
          expect(("one of " + join(spec->choices, "|")).c_str());
        break;
      case ops::AttrSpec::Type::shape:
        invalid(p, fmt::format("attribute {} of op {} is a shape; shapes cannot be constrained by a rule",
                               show(key), show(kind)));
    }
  }
}

void set_repeat(char suffix, PatternElem& el) {
  if (suffix == '?') el.min = 0, el.max = 1;
  if (suffix == '+') el.min = 1, el.max = kMaxRepeat;
  if (suffix == '*') el.min = 0, el.max = kMaxRepeat;
}

// One string of a pattern: an op kind or "@class", then at most one of "?" (0 or 1), "+" (1 to kMaxRepeat),
// "*" (0 to kMaxRepeat). In a list of alternatives, kinds and classes without a suffix (the object form's
// "repeat" repeats the whole list).
void parse_token(const std::string& s, const std::string& ptr, bool in_list, PatternElem& el,
                 const ops::Registry& reg) {
  std::string name = s;
  char suffix = 0;
  if (!name.empty() && (name.back() == '+' || name.back() == '*' || name.back() == '?')) {
    suffix = name.back();
    name.pop_back();
  }
  if (!name.empty() && (name.back() == '+' || name.back() == '*' || name.back() == '?'))
    invalid(ptr, fmt::format("pattern element {} has more than one repetition suffix; use one of \"?\" (0 or 1 op), "
                             "\"+\" (1 to {} ops) or \"*\" (0 to {} ops), e.g. \"gelu+\"",
                             show(s), kMaxRepeat, kMaxRepeat));
  if (name.empty())
    invalid(ptr, suffix ? fmt::format("pattern element {} has a repetition suffix but nothing to repeat; write an op "
                                      "kind or a class before it, e.g. \"gelu+\" or \"@pointwise+\"",
                                      show(s))
                        : std::string("empty pattern element; write an op kind such as \"bias\" or a class such as "
                                      "\"@pointwise\""));
  if (in_list && suffix)
    invalid(ptr, fmt::format("{} inside a list of alternatives: a suffix repeats a whole element; write "
                             "{{\"op\": [...], \"repeat\": \"{}\"}}",
                             show(s), suffix));
  set_repeat(suffix, el);
  if (name[0] == '@') {
    std::string cls = name.substr(1);
    if (cls.empty())
      invalid(ptr, fmt::format("\"@\" needs a class name: one of @{}", join(class_names(), ", @")));
    if (!class_exists(cls))
      invalid(ptr, fmt::format("unknown op class {}; known classes: @{}", show("@" + cls), join(class_names(), ", @")));
    if (std::find(el.classes.begin(), el.classes.end(), cls) != el.classes.end())
      invalid(ptr, fmt::format("class {} is listed twice in the same pattern element", show("@" + cls)));
    el.classes.push_back(cls);
    for (const auto& k : reg.names())
      if (const ops::OpKind* info = reg.find(k); info && in_class(cls, *info) &&
                                                 std::find(el.kinds.begin(), el.kinds.end(), k) == el.kinds.end())
        el.kinds.push_back(k);
    return;
  }
  if (!reg.find(name)) invalid(ptr, unknown_op_message(name, reg));
  if (std::find(el.kinds.begin(), el.kinds.end(), name) != el.kinds.end())
    invalid(ptr, fmt::format("op {} is listed twice in the same pattern element", show(name)));
  el.kinds.push_back(name);
}

// "bias" | "gelu+" | "@pointwise*" | ["gelu", "relu"] | {"op": "gelu" or [...], "attrs": {...}, "optional": true}
PatternElem parse_elem(const json& e, const std::string& p, const ops::Registry& reg) {
  PatternElem el;
  const json* kinds = &e;
  std::string kp = p;
  if (e.is_object()) {
    check_keys(e, p, {"op", "attrs", "optional", "repeat"}, "pattern element");
    if (!e.contains("op")) invalid(p, "a pattern element object needs \"op\": an op kind or a list of kinds");
    kinds = &e.at("op");
    kp = p + "/op";
    if (e.contains("optional")) {
      if (!e.at("optional").is_boolean())
        invalid(p + "/optional", fmt::format("\"optional\" must be true or false, got {}", show(e.at("optional"))));
      el.optional = e.at("optional").get<bool>();
    }
  }
  auto add_kind = [&](const json& k, const std::string& ptr, bool in_list) {
    if (!k.is_string()) invalid(ptr, fmt::format("an op kind is a string such as \"gelu\", got {}", show(k)));
    parse_token(k.get<std::string>(), ptr, in_list, el, reg);
  };
  if (kinds->is_string()) {
    add_kind(*kinds, kp, false);
    el.text = kinds->get<std::string>();
  } else if (kinds->is_array()) {
    if (kinds->empty() || kinds->size() > 32)
      invalid(kp, "a list of alternative op kinds needs between 1 and 32 entries");
    std::vector<std::string> written;
    for (size_t i = 0; i < kinds->size(); ++i) {
      add_kind((*kinds)[i], kp + "/" + std::to_string(i), true);
      written.push_back((*kinds)[i].get<std::string>());
    }
    el.text = "(" + join(written, "|") + ")";
  } else {
    invalid(kp, fmt::format("a pattern element is an op kind (\"bias\"), a class (\"@pointwise\"), either with a "
                            "repetition suffix (\"gelu+\", \"@pointwise*\"), a list of kinds ([\"gelu\", \"relu\"]) "
                            "or an object {{\"op\": ..., \"attrs\": ..., \"optional\": ...}}, got {}",
                            show(*kinds)));
  }
  if (e.is_object() && e.contains("repeat")) {
    const json& r = e.at("repeat");
    if (!r.is_string() || (r != "?" && r != "+" && r != "*"))
      invalid(p + "/repeat", fmt::format("\"repeat\" is \"?\" (0 or 1 op), \"+\" (1 to {} ops) or \"*\" (0 to {} "
                                         "ops), got {}",
                                         kMaxRepeat, kMaxRepeat, show(r)));
    if (el.max != 1 || el.min != 1)
      invalid(p + "/repeat", fmt::format("{} already has a suffix; give either the suffix or \"repeat\"",
                                         show(el.text)));
    set_repeat(r.get<std::string>()[0], el);
    el.text += r.get<std::string>();
  }
  if (el.optional) {
    if (el.max != 1 || el.min != 1)
      invalid(p + "/optional", fmt::format("\"optional\": true together with the suffix of {}; drop one of them "
                                           "(\"x?\" is optional, \"x*\" is an optional repetition)",
                                           show(el.text)));
    el.min = 0;
    el.text += "?";
  }
  el.optional = el.min == 0;
  if (e.is_object() && e.contains("attrs")) {
    const json& a = e.at("attrs");
    if (!a.is_object()) invalid(p + "/attrs", "\"attrs\" must be an object of attribute values, e.g. {\"approximate\": \"tanh\"}");
    if (!el.classes.empty() && !a.empty())
      invalid(p + "/attrs", fmt::format("attribute constraints need named op kinds, and {} is a class; list the kinds "
                                        "instead ({{\"op\": \"gelu\", \"attrs\": ...}})",
                                        show("@" + el.classes.front())));
    for (const auto& [key, value] : a.items()) {
      bool plain = key.find_first_of("/~") == std::string::npos;
      check_attr_constraint(key, value, el.kinds, plain ? p + "/attrs/" + key : p + "/attrs", reg);
    }
    el.attrs = a;
  }
  return el;
}

std::vector<PatternElem> parse_pattern(const json& j, const std::string& p, const ops::Registry& reg) {
  if (!j.contains("pattern")) invalid(p, "missing \"pattern\": the list of consecutive ops the rule fuses");
  const json& pat = j.at("pattern");
  std::string pp = p + "/pattern";
  if (!pat.is_array() || pat.empty() || pat.size() > kMaxPattern)
    invalid(pp, fmt::format("\"pattern\" must be an array of 1 to {} elements", kMaxPattern));
  std::vector<PatternElem> out;
  for (size_t i = 0; i < pat.size(); ++i) out.push_back(parse_elem(pat[i], pp + "/" + std::to_string(i), reg));
  // A class of no member (possible only if a class lost its kinds) could never match: say so rather than load it.
  for (size_t i = 0; i < out.size(); ++i)
    if (out[i].kinds.empty())
      invalid(pp + "/" + std::to_string(i), fmt::format("pattern element {} has no op kinds to match", show(out[i].text)));
  if (std::all_of(out.begin(), out.end(), [](const PatternElem& e) { return e.optional; }))
    invalid(pp, "every element of the pattern is optional: at least one must be required");
  return out;
}

std::vector<std::string> string_list(const json& v, const std::string& p, const char* what,
                                     const std::vector<std::string>& known) {
  if (!v.is_array() || v.empty())
    invalid(p, fmt::format("\"{}\" must be a non-empty array of names (known: {})", what, join(known)));
  std::vector<std::string> out;
  for (size_t i = 0; i < v.size(); ++i) {
    const json& s = v[i];
    if (!s.is_string() || std::find(known.begin(), known.end(), s.get<std::string>()) == known.end())
      invalid(p + "/" + std::to_string(i), fmt::format("unknown {} entry {}; known: {}", what, show(s), join(known)));
    out.push_back(s.get<std::string>());
  }
  return out;
}

Conditions parse_conditions(const json& c, const std::string& p) {
  if (!c.is_object()) invalid(p, "\"conditions\" must be an object");
  check_keys(c, p, {"recipes", "dtypes", "min_arch", "max_arch", "divisible", "training"}, "conditions");
  Conditions out;
  using ops::RecipeKind;
  std::vector<std::string> recipes;
  for (auto k : {RecipeKind::fp32, RecipeKind::fp16, RecipeKind::bf16, RecipeKind::fp8_delayed, RecipeKind::fp8_current,
                 RecipeKind::fp8_block})
    recipes.push_back(ops::recipe_name(k));
  std::vector<std::string> dtypes;
  for (auto d : {ops::DType::f32, ops::DType::f16, ops::DType::bf16, ops::DType::e4m3, ops::DType::e5m2})
    dtypes.push_back(ops::dtype_name(d));
  if (c.contains("recipes")) out.recipes = string_list(c.at("recipes"), p + "/recipes", "recipes", recipes);
  if (c.contains("dtypes")) out.dtypes = string_list(c.at("dtypes"), p + "/dtypes", "dtypes", dtypes);
  const char* arch_what = "an SM version such as 80 (sm_80) or 90 (sm_90)";
  if (c.contains("min_arch")) out.min_arch = need_int(c.at("min_arch"), p + "/min_arch", 10, 1000, arch_what);
  if (c.contains("max_arch")) out.max_arch = need_int(c.at("max_arch"), p + "/max_arch", 10, 1000, arch_what);
  if (out.min_arch && out.max_arch && out.min_arch > out.max_arch)
    invalid(p + "/max_arch", fmt::format("max_arch {} is below min_arch {}: the rule could never apply",
                                         out.max_arch, out.min_arch));
  if (c.contains("divisible")) {
    const json& d = c.at("divisible");
    std::string dp = p + "/divisible";
    if (!d.is_array() || d.size() > 8)
      invalid(dp, "\"divisible\" must be an array of at most 8 {\"dim\": ..., \"multiple_of\": ...} objects");
    for (size_t i = 0; i < d.size(); ++i) {
      std::string ep = dp + "/" + std::to_string(i);
      if (!d[i].is_object()) invalid(ep, "a divisibility condition is {\"dim\": \"cols\", \"multiple_of\": 8}");
      check_keys(d[i], ep, {"dim", "multiple_of"}, "divisibility condition");
      Divisibility div;
      div.dim = need_string(d[i], "dim", ep, "\"cols\", \"hidden\", \"rows\" or \"out_cols\"");
      if (div.dim != "cols" && div.dim != "hidden" && div.dim != "rows" && div.dim != "out_cols")
        invalid(ep + "/dim", fmt::format("unknown dim {}; use \"cols\" (or \"hidden\": the last dim of the window's "
                                         "input), \"rows\" or \"out_cols\" (the last dim of its output)",
                                         show(div.dim)));
      if (!d[i].contains("multiple_of")) invalid(ep, "missing \"multiple_of\" (a positive integer)");
      div.multiple_of = need_int(d[i].at("multiple_of"), ep + "/multiple_of", 1, 1 << 20, "\"multiple_of\"");
      out.divisible.push_back(div);
    }
  }
  if (c.contains("training")) {
    if (!c.at("training").is_boolean()) invalid(p + "/training", "\"training\" must be true or false");
    out.training = c.at("training").get<bool>();
  }
  return out;
}

// Syntax of a cuBLASLt impl's tail: present exactly when the pattern continues after the epilogue's ops.
void check_tail(const Impl& impl, const std::vector<PatternElem>& pat, const std::string& p) {
  if (static_cast<size_t>(impl.epilogue_ops) > pat.size())
    invalid(p + "/epilogue_ops", fmt::format("\"epilogue_ops\" is {} but the pattern has only {} elements",
                                             impl.epilogue_ops, pat.size()));
  // "epilogue_ops" counts ops: the elements the GEMM covers must each match exactly one op.
  for (int i = 0; i < impl.epilogue_ops; ++i)
    if (pat[i].repeats())
      invalid(p + "/epilogue_ops", fmt::format("pattern element {} ({}) repeats, but it is among the {} ops the "
                                               "epilogue covers; repetition is allowed only in the generated tail",
                                               i, show(pat[i].text), impl.epilogue_ops));
  size_t rest = pat.size() - static_cast<size_t>(impl.epilogue_ops);
  if (rest > 0 && impl.tail.empty())
    invalid(p, fmt::format("the pattern has {} element(s) after the {} ops of the epilogue: give a generated "
                           "\"tail\": \"elementwise\"",
                           rest, impl.epilogue_ops));
  if (rest == 0 && !impl.tail.empty())
    invalid(p + "/tail", "\"tail\" given, but the pattern has no elements after the epilogue's ops");
}

Impl parse_impl(const json& j, const std::string& p0, Pass pass, const std::vector<PatternElem>& pat,
                const ops::Registry& reg) {
  if (!j.contains("impl")) invalid(p0, "missing \"impl\": how the fused group is implemented");
  const json& v = j.at("impl");
  std::string p = p0 + "/impl";
  if (!v.is_object()) invalid(p, "\"impl\" must be an object with \"kind\": \"generated\", \"cublaslt\" or \"joint\"");
  Impl impl;
  std::string kind = need_string(v, "kind", p, "\"generated\", \"cublaslt\" or \"joint\"");
  if (kind != "generated" && kind != "cublaslt" && kind != "joint")
    invalid(p + "/kind", fmt::format("unknown impl kind {}; use \"generated\", \"cublaslt\" or \"joint\"", show(kind)));
  if ((kind == "joint") != (pass == Pass::joint))
    invalid(p + "/kind", pass == Pass::joint
                             ? fmt::format("a rule in pass \"joint\" needs {{\"kind\": \"joint\", \"strategy\": ...}}, "
                                           "not {}", show(kind))
                             : fmt::format("impl kind \"joint\" is only allowed in pass \"joint\" (this rule is in "
                                           "pass \"{}\")", pass_name(pass)));
  if (kind == "generated") {
    check_keys(v, p, {"kind", "skeleton"}, "generated impl");
    impl.kind = Impl::Kind::generated;
    static const char* const kSkeletons = "\"elementwise\", \"gated\", \"rownorm\", \"fp8_cast\", \"moe\" or "
                                          "\"allreduce_rownorm\"";
    impl.skeleton = need_string(v, "skeleton", p, kSkeletons);
    if (impl.skeleton != "elementwise" && impl.skeleton != "gated" && impl.skeleton != "rownorm" &&
        impl.skeleton != "fp8_cast" && impl.skeleton != "moe" && impl.skeleton != "allreduce_rownorm")
      invalid(p + "/skeleton", fmt::format("unknown skeleton {}; use {}", show(impl.skeleton), kSkeletons));
  } else if (kind == "cublaslt") {
    check_keys(v, p, {"kind", "epilogue", "epilogue_ops", "tail"}, "cublaslt impl");
    impl.kind = Impl::Kind::cublaslt;
    impl.epilogue = need_string(v, "epilogue", p, "a cuBLASLt epilogue such as \"BIAS\"");
    if (!v.contains("epilogue_ops")) invalid(p, "missing \"epilogue_ops\": how many leading ops the GEMM covers");
    impl.epilogue_ops = need_int(v.at("epilogue_ops"), p + "/epilogue_ops", 1, static_cast<int>(kMaxPattern),
                                 "\"epilogue_ops\"");
    if (v.contains("tail")) {
      impl.tail = need_string(v, "tail", p, "the skeleton of the generated tail: \"elementwise\"");
      if (impl.tail != "elementwise")
        invalid(p + "/tail", fmt::format("unknown tail {}; the only tail skeleton is \"elementwise\"", show(impl.tail)));
    }
    check_tail(impl, pat, p);
  } else {
    check_keys(v, p, {"kind", "strategy", "saves"}, "joint impl");
    impl.kind = Impl::Kind::joint;
    impl.strategy = need_string(v, "strategy", p,
                                "\"regenerate_dropout_mask\", \"recompute_linear_output\" or \"relu_bitmask\"");
    if (!v.contains("saves")) invalid(p, "missing \"saves\": what the joint forward keeps for its backward");
    const json& s = v.at("saves");
    if (!s.is_array() || s.size() > 8) invalid(p + "/saves", "\"saves\" must be an array of at most 8 strings");
    for (size_t i = 0; i < s.size(); ++i) {
      std::string sp = p + "/saves/" + std::to_string(i);
      if (!s[i].is_string()) invalid(sp, fmt::format("each entry of \"saves\" is a string, got {}", show(s[i])));
      std::string text = s[i].get<std::string>();
      bool printable = std::all_of(text.begin(), text.end(), [](char c) { return c >= 0x20 && c < 0x7f; });
      if (text.empty() || text.size() > 64 || !printable)
        invalid(sp, "each entry of \"saves\" is 1 to 64 printable ASCII characters, e.g. \"seed\"");
      impl.saves.push_back(text);
    }
  }
  // What the implementation can run: asked of the implementation itself, so the loader and the planner
  // cannot disagree (a rule no window can ever satisfy is refused here, with the implementation's reason).
  if (const Implementability* answer = implementability())
    if (auto no = answer->refuse(impl, pat, pass, reg)) invalid(no->field.empty() ? p : p + "/" + no->field, no->message);
  return impl;
}

}  // namespace

Rule parse_rule(const json& j, const std::string& p, const ops::Registry& reg) {
  if (!j.is_object()) invalid(p, "a rule is an object with \"name\", \"pass\", \"pattern\", \"impl\" and \"math\"");
  check_keys(j, p, {"name", "pass", "priority", "pattern", "conditions", "impl", "math", "comment", "overrides"},
             "rule");
  Rule r;
  r.name = need_string(j, "name", p, "an identifier such as \"bias_gelu\"");
  if (!is_identifier(r.name))
    invalid(p + "/name", fmt::format("rule name {} must be an identifier ([A-Za-z_][A-Za-z0-9_]*, at most {} "
                                     "characters)",
                                     show(r.name), kMaxNameLen));
  r.math = need_math(j, p, "rule");
  if (j.contains("overrides")) {
    if (!j.at("overrides").is_boolean())
      invalid(p + "/overrides", fmt::format("\"overrides\" must be true or false, got {}", show(j.at("overrides"))));
    r.overrides = j.at("overrides").get<bool>();
  }
  r.pass = parse_pass(j, p);
  if (j.contains("priority"))
    r.priority = need_int(j.at("priority"), p + "/priority", -1000000, 1000000, "\"priority\"");
  r.pattern = parse_pattern(j, p, reg);
  if (j.contains("conditions")) r.conditions = parse_conditions(j.at("conditions"), p + "/conditions");
  r.impl = parse_impl(j, p, r.pass, r.pattern, reg);
  return r;
}

}  // namespace jitfuse::rules::detail
