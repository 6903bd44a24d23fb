// Conflicts are errors, not silent overrides: an op declared twice (both places named), duplicate JSON keys,
// two rules of one name in a file; replacing a built-in rule needs "overrides": true.
#include "unit/rules/rules_test_util.hpp"

using jf_test::find_rule;
using jf_test::loc;
using jitfuse::rules::RuleSet;

namespace {

const char* kFunctor =
    "struct jf_op_t {\n"
    "  static __device__ __forceinline__ float fwd(float x) { return x; }\n"
    "  static __device__ __forceinline__ float bwd(float x, float dy) { return dy; }\n"
    "};\n";

std::string op_file(const char* functor_file) {
  return std::string("{\"format\": \"jitfuse.rules/1\", \"ops\": [\n  {\"name\": \"t\", \"math\": \"y = x\", "
                     "\"template\": \"") + functor_file + "\", \"functor\": \"jf_op_t\"}\n]}\n";
}

std::string rule(const std::string& name, const std::string& extra = "") {
  return "{\"name\": \"" + name + "\"" + extra +
         ", \"math\": \"y = relu(x + b)\", \"pass\": \"forward\", \"pattern\": [\"bias\", \"relu\"], \"impl\": "
         "{\"kind\": \"generated\", \"skeleton\": \"elementwise\"}}";
}

}  // namespace

TEST_CASE("an op declared in two files is an error naming both", "[rules][conflicts]") {
  jf_test::TempDir dir;
  dir.write("a/t.cuh", kFunctor);
  dir.write("b/t.cuh", kFunctor);
  std::string a = dir.write("a/rules.json", op_file("t.cuh"));
  std::string text = op_file("t.cuh");
  std::string b = dir.write("b/rules.json", text);
  RuleSet rs;
  CHECK(rs.load_path(dir.path() + "/a").empty());
  auto errs = rs.load_path(dir.path() + "/b");
  REQUIRE(errs.size() == 1);
  CHECK(errs[0].where == loc(b, text, "\"t\""));
  CHECK_THAT(errs[0].message, Catch::Contains("op 't' is already declared at " + a + ":2:3"));
  CHECK(rs.registry().find("t")->declared_in == a + ":2:3");  // the first one stays
}

TEST_CASE("two rules of one name in a file are an error, and the first stays", "[rules][conflicts]") {
  std::string text = "{\"format\": \"jitfuse.rules/1\", \"rules\": [\n" + rule("twice") + ",\n" +
                     rule("twice", ", \"priority\": 5") + "\n]}";
  RuleSet rs;
  auto errs = rs.load_text(text, "f.json", "");
  REQUIRE(errs.size() == 1);
  CHECK(errs[0].where == "f.json:3:10");
  CHECK(errs[0].rule == "twice");
  CHECK_THAT(errs[0].message, Catch::Contains("declared twice in this file (first at f.json:2:1)"));
  REQUIRE(find_rule(rs, "twice") != nullptr);
  CHECK(find_rule(rs, "twice")->priority == 0);
}

TEST_CASE("replacing a rule of another file needs \"overrides\": true, which is validated", "[rules][conflicts]") {
  RuleSet rs = RuleSet::with_builtins();
  std::string text = "{\"format\": \"jitfuse.rules/1\", \"rules\": [\n" + rule("bias_act") + "\n]}";
  auto errs = rs.load_text(text, "u.json", "");
  REQUIRE(errs.size() == 1);
  CHECK(errs[0].where == "u.json:2:10");
  CHECK_THAT(errs[0].message, Catch::Contains("rule 'bias_act' is already declared at <builtin>/forward_pointwise.json:") &&
                                  Catch::Contains("add \"overrides\": true"));
  CHECK(find_rule(rs, "bias_act")->file == "<builtin>/forward_pointwise.json");

  text = "{\"format\": \"jitfuse.rules/1\", \"rules\": [\n" + rule("brand_new", ", \"overrides\": true") + ",\n" +
         rule("other", ", \"overrides\": 1") + "\n]}";
  errs = rs.load_text(text, "v.json", "");
  REQUIRE(errs.size() == 2);
  CHECK(errs[0].where == loc("v.json", text, "@true"));
  CHECK_THAT(errs[0].message, Catch::Contains("no rule of that name was loaded before it"));
  CHECK_THAT(errs[1].message, Catch::Contains("\"overrides\" must be true or false"));

  text = "{\"format\": \"jitfuse.rules/1\", \"rules\": [\n" + rule("bias_act", ", \"overrides\": true") + "\n]}";
  CHECK(rs.load_text(text, "w.json", "").empty());
  CHECK(find_rule(rs, "bias_act")->file == "w.json");
  CHECK_THAT(find_rule(rs, "bias_act")->overridden, Catch::StartsWith("<builtin>/forward_pointwise.json:"));
}

TEST_CASE("duplicate JSON keys in a rules file are an error at the second key", "[rules][conflicts]") {
  std::string text = "{\"format\": \"jitfuse.rules/1\", \"rules\": [\n"
                     "  {\"name\": \"a\", \"math\": \"y = x\", \"pass\": \"forward\", \"pattern\": [\"bias\"], \"impl\": "
                     "{\"kind\": \"generated\", \"skeleton\": \"elementwise\"}, \"priority\": 1, \"priority\": 9}\n]}";
  RuleSet rs;
  auto errs = rs.load_text(text, "d.json", "");
  REQUIRE(errs.size() == 1);
  CHECK(errs[0].where == loc("d.json", text, "\"priority\": 9"));
  CHECK_THAT(errs[0].message, Catch::Contains("duplicate key 'priority' (first at line 2, column"));
  CHECK(rs.rules().empty());  // the file is not loaded: which value was meant is unknown
  // Also at the top level and inside nested objects.
  errs = rs.load_text("{\"format\": \"jitfuse.rules/1\", \"rules\": [], \"rules\": []}", "e.json", "");
  REQUIRE(errs.size() == 1);
  CHECK(errs[0].where == "e.json:1:44");  // the second key's opening quote
}
