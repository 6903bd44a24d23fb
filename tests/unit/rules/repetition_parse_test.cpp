// Pattern repetition ("gelu+", "@pointwise*", {"op": [...], "repeat": "+"}) and op classes ("@activation"):
// what loads, what it means, and hostile spellings refused with file:line:col and what to write instead.
#include "unit/rules/rules_test_util.hpp"

using jf_test::find_rule;
using jf_test::loc;
using jitfuse::rules::kMaxRepeat;
using jitfuse::rules::RuleSet;

namespace {

std::string file_with_pattern(const std::string& pattern, const std::string& skeleton = "elementwise") {
  return "{\n  \"format\": \"jitfuse.rules/1\",\n  \"rules\": [\n    {\"name\": \"r\", \"math\": \"y = f(x)\", "
         "\"pass\": \"forward\",\n     \"pattern\": " +
         pattern + ",\n     \"impl\": {\"kind\": \"generated\", \"skeleton\": \"" + skeleton + "\"}}\n  ]\n}\n";
}

// Loads a one-rule file; expects exactly one error at `needle` saying `what`.
void expect_refused(const std::string& pattern, const std::string& needle, const std::string& what) {
  std::string text = file_with_pattern(pattern);
  RuleSet rs;
  auto errs = rs.load_text(text, "t.json", "");
  INFO(text);
  REQUIRE(errs.size() == 1);
  INFO(errs[0].to_string());
  CHECK(errs[0].where == loc("t.json", text, needle));
  CHECK(errs[0].rule == "r");
  CHECK_THAT(errs[0].message, Catch::Contains(what));
  CHECK(rs.rules().empty());
}

const jitfuse::rules::Rule& load_one(const std::string& pattern, RuleSet& rs,
                                     const std::string& skeleton = "elementwise") {
  auto errs = rs.load_text(file_with_pattern(pattern, skeleton), "t.json", "");
  for (const auto& e : errs) UNSCOPED_INFO(e.to_string());
  REQUIRE(errs.empty());
  REQUIRE(find_rule(rs, "r") != nullptr);
  return *find_rule(rs, "r");
}

}  // namespace

TEST_CASE("repetition suffixes and classes parse into counted, class-matched elements", "[rules][repetition]") {
  RuleSet rs;
  const auto& r = load_one(R"(["@pointwise+", "gelu*", "silu?", {"op": ["@activation", "dropout"], "repeat": "+"}, "@norm"])", rs,
                            "rownorm");
  REQUIRE(r.pattern.size() == 5);
  CHECK(r.pattern[0].classes == std::vector<std::string>{"pointwise"});
  CHECK(r.pattern[0].min == 1);
  CHECK(r.pattern[0].max == kMaxRepeat);
  CHECK(r.pattern[0].text == "@pointwise+");
  CHECK_FALSE(r.pattern[0].optional);
  // The class's members at load time (what the implementability check expands); user ops join at plan time.
  for (const char* k : {"gelu", "relu", "silu", "qgelu", "srelu", "scale", "identity", "quantize", "reshape"})
    CHECK(std::find(r.pattern[0].kinds.begin(), r.pattern[0].kinds.end(), k) != r.pattern[0].kinds.end());
  CHECK(std::find(r.pattern[0].kinds.begin(), r.pattern[0].kinds.end(), "bias") == r.pattern[0].kinds.end());
  CHECK(r.pattern[1].kinds == std::vector<std::string>{"gelu"});
  CHECK(r.pattern[1].min == 0);
  CHECK(r.pattern[1].max == kMaxRepeat);
  CHECK(r.pattern[1].optional);
  CHECK(r.pattern[2].min == 0);
  CHECK(r.pattern[2].max == 1);
  CHECK(r.pattern[2].optional);
  CHECK(r.pattern[3].classes == std::vector<std::string>{"activation"});
  CHECK(std::find(r.pattern[3].kinds.begin(), r.pattern[3].kinds.end(), "dropout") != r.pattern[3].kinds.end());
  CHECK(std::find(r.pattern[3].kinds.begin(), r.pattern[3].kinds.end(), "scale") == r.pattern[3].kinds.end());
  CHECK(r.pattern[3].text == "(@activation|dropout)+");
  CHECK(r.pattern[3].max == kMaxRepeat);
  CHECK(r.pattern[4].classes == std::vector<std::string>{"norm"});
  CHECK(r.pattern[4].min == 1);
  CHECK(r.pattern[4].max == 1);
}

TEST_CASE("classes come from each op's declared family", "[rules][repetition]") {
  jitfuse::ops::Registry reg;
  auto in = [&](const char* cls, const char* kind) { return jitfuse::rules::in_class(cls, *reg.find(kind)); };
  CHECK(in("pointwise", "scale"));
  CHECK(in("pointwise", "gelu"));
  CHECK_FALSE(in("pointwise", "bias"));
  CHECK_FALSE(in("pointwise", "swiglu"));
  CHECK(in("activation", "srelu"));
  CHECK_FALSE(in("activation", "scale"));
  CHECK(in("elementwise", "bias"));
  CHECK(in("elementwise", "dropout"));
  CHECK_FALSE(in("elementwise", "layernorm"));
  CHECK(in("gated", "geglu"));
  CHECK(in("norm", "rmsnorm"));
  CHECK_FALSE(in("norm", "linear"));
  jitfuse::ops::OpKind user;
  user.name = "softplus";
  user.family = jitfuse::ops::Family::pointwise;
  user.user_declared = true;
  CHECK(jitfuse::rules::in_class("pointwise", user));
  CHECK(jitfuse::rules::in_class("activation", user));
}

TEST_CASE("hostile repetition and class spellings are refused with where and what to write", "[rules][repetition]") {
  expect_refused(R"(["bias", "+"])", "@\"+\"", "nothing to repeat; write an op kind or a class before it");
  expect_refused(R"(["@"])", "@\"@\"", "\"@\" needs a class name: one of @activation, @elementwise");
  expect_refused(R"(["@nope"])", "@\"@nope\"", "unknown op class '@nope'; known classes: @activation");
  expect_refused(R"(["gelu++"])", "@\"gelu++\"", "more than one repetition suffix");
  expect_refused(R"(["gelu+*"])", "@\"gelu+*\"", "more than one repetition suffix");
  expect_refused(R"(["gelu", ""])", "@\"\"]", "empty pattern element");
  expect_refused(R"(["bias", ["gelu+", "relu"]])", "@\"gelu+\"", "write {\"op\": [...], \"repeat\": \"+\"}");
  expect_refused(R"([{"op": "gelu+", "optional": true}])", "@true", "\"optional\": true together with the suffix");
  expect_refused(R"([{"op": "gelu", "repeat": "++"}])", "@\"++\"", "\"repeat\" is \"?\" (0 or 1 op)");
  expect_refused(R"([{"op": "gelu", "repeat": 1000}])", "@1000", "\"repeat\" is \"?\"");
  expect_refused(R"([{"op": "gelu*", "repeat": "+"}])", "@\"+\"}", "already has a suffix");
  expect_refused(R"([{"op": "@activation", "attrs": {"approximate": "tanh"}}])", "@{\"approximate\"",
                 "attribute constraints need named op kinds, and '@activation' is a class");
  expect_refused(R"(["@pointwise*", "scale?"])", "@[\"@pointwise*\"",
                 "every element of the pattern is optional");
  expect_refused(R"(["gelu{1000}"])", "@\"gelu{1000}\"", "unknown op");
  expect_refused(R"(["@pointwise", "@pointwise", "@pointwise", "@pointwise", "@pointwise", "@pointwise", "@pointwise", "@pointwise", "@pointwise+"])",
                 "@[\"@pointwise\"", "\"pattern\" must be an array of 1 to 8 elements");
  expect_refused(R"([{"op": ["@norm", "@norm"]}])", "@\"@norm\"]", "listed twice");
}

TEST_CASE("a repeated element may not be among the ops a cuBLASLt epilogue covers", "[rules][repetition]") {
  std::string text = R"J({"format": "jitfuse.rules/1", "rules": [{"name": "g", "math": "y = x W^T + b", "pass": "forward", "pattern": ["linear", "bias+"], "impl": {"kind": "cublaslt", "epilogue": "BIAS", "epilogue_ops": 2}}]})J";
  RuleSet rs;
  auto errs = rs.load_text(text, "g.json", "");
  REQUIRE(errs.size() == 1);
  CHECK(errs[0].where == loc("g.json", text, "\"epilogue_ops\": @2"));
  CHECK_THAT(errs[0].message, Catch::Contains("repetition is allowed only in the generated tail"));
}

TEST_CASE("a class rule no implementation can run is refused at load, checking representative expansions",
          "[rules][repetition]") {
  // rownorm needs a norm; a chain of pointwise ops never has one, at any length.
  std::string text = R"J({"format": "jitfuse.rules/1", "rules": [{"name": "n", "math": "y = f(x)", "pass": "forward", "pattern": ["@pointwise+"], "impl": {"kind": "generated", "skeleton": "rownorm"}}]})J";
  RuleSet rs;
  auto errs = rs.load_text(text, "n.json", "");
  REQUIRE(errs.size() == 1);
  CHECK_THAT(errs[0].message, Catch::Contains("rownorm cannot run any window this pattern matches"));
  // Eight repeated classes: the check stays bounded and still finds an implementable expansion.
  RuleSet ok;
  load_one(R"(["@elementwise*", "@elementwise*", "@elementwise*", "@elementwise*", "@elementwise*", "@elementwise*", "@elementwise*", "@pointwise+"])",
           ok);
}

TEST_CASE("rules list shows classes and repetition as written", "[rules][repetition][cli]") {
  jf_test::TempDir d;
  d.write("r.json", file_with_pattern(R"(["bias", "@activation", "@pointwise*"])"));
  auto r = jf_test::run_cli("rules list --rules '" + d.path() + "/r.json'");
  INFO(r.out);
  CHECK_THAT(r.out, Catch::Contains("bias @activation @pointwise*"));
}
