// `jitfuse rules list` and `jitfuse rules validate`: exit codes, file:line:col errors, --json for scripts.
#include "unit/rules/rules_test_util.hpp"

using jf_test::run_cli;

TEST_CASE("rules validate: exit 0 when all valid, 1 otherwise, errors with file:line:col", "[rules][cli]") {
  jf_test::TempDir dir;
  std::string good = dir.write("good/rules.json", R"J({"format": "jitfuse.rules/1", "rules": [
  {"name": "bias_silu_only", "math": "y = silu(x + b)", "pass": "forward", "pattern": ["bias", "silu"], "impl": {"kind": "generated", "skeleton": "elementwise"}}]})J");
  std::string text =
      "{\"format\": \"jitfuse.rules/1\", \"rules\": [\n"
      "  {\"name\": \"ok_rule\", \"math\": \"y = x\", \"pass\": \"forward\", \"pattern\": [\"bias\", \"relu\"], \"impl\": {\"kind\": \"generated\", \"skeleton\": \"elementwise\"}},\n"
      "  {\"name\": \"bad_rule\", \"math\": \"y = x\", \"pass\": \"forward\", \"priority\": \"high\", \"pattern\": [\"bias\"], \"impl\": {\"kind\": \"generated\", \"skeleton\": \"elementwise\"}}\n"
      "]}\n";
  std::string bad = dir.write("bad/rules.json", text);

  auto r = run_cli("rules validate '" + good + "'");
  CHECK(r.status == 0);
  CHECK_THAT(r.out, Catch::Contains(good + ": ok (1 rules, 0 ops)"));

  r = run_cli("rules validate '" + dir.path() + "/good' '" + dir.path() + "/bad'");
  INFO(r.out);
  CHECK(r.status == 1);
  CHECK_THAT(r.out, Catch::Contains(jf_test::loc(bad, text, "\"high\"") +
                                    ": rule 'bad_rule': \"priority\" must be an integer"));
  CHECK_THAT(r.out, Catch::Contains(dir.path() + "/bad: 1 error(s); the other 1 rules and 0 ops load"));

  r = run_cli("rules validate --json '" + bad + "'", "", true);
  CHECK(r.status == 1);
  auto j = nlohmann::json::parse(r.out);
  CHECK(j.at("valid") == false);
  REQUIRE(j.at("paths").size() == 1);
  CHECK(j.at("paths")[0].at("errors")[0].at("rule") == "bad_rule");
  CHECK(j.at("paths")[0].at("errors")[0].at("where") == jf_test::loc(bad, text, "\"high\""));

  r = run_cli("rules validate '" + dir.path() + "/missing.json'");
  CHECK(r.status == 1);
  CHECK_THAT(r.out, Catch::Contains("no such file or directory"));
  r = run_cli("rules validate");
  CHECK(r.status != 0);  // FILE is required
}

TEST_CASE("rules list shows built-ins and extra rules, also as JSON", "[rules][cli]") {
  auto r = run_cli("rules list");
  INFO(r.out);
  REQUIRE(r.status == 0);
  CHECK_THAT(r.out, Catch::Contains("NAME"));
  CHECK_THAT(r.out, Catch::Contains("linear_bias_gelu"));
  CHECK_THAT(r.out, Catch::Contains("linear bias gelu{approximate=tanh}"));
  CHECK_THAT(r.out, Catch::Contains("cublaslt GELU_AUX_BIAS (3 ops)"));
  CHECK_THAT(r.out, Catch::Contains("<builtin>/joint.json"));
  CHECK_THAT(r.out, Catch::Contains("39 rules"));

  r = run_cli("rules list --json --rules '" + jf_test::src("docs/examples/softplus") + "'", "", true);
  REQUIRE(r.status == 0);
  auto j = nlohmann::json::parse(r.out);
  CHECK(j.at("errors").empty());
  CHECK(j.at("rules").size() == 41);
  bool found = false;
  for (const auto& rule : j.at("rules"))
    if (rule.at("name") == "bias_softplus") {
      found = true;
      CHECK(rule.at("pass") == "forward");
      CHECK(rule.at("impl") == nlohmann::json{{"kind", "generated"}, {"skeleton", "elementwise"}});
      CHECK(rule.at("pattern")[1].at("op") == nlohmann::json{"softplus"});
    }
  CHECK(found);
  CHECK(j.at("rules")[0].at("pass") == "joint");  // listed in the order the passes run
}

TEST_CASE("rules list --ops lists built-in and user ops with file and family, also as JSON", "[rules][cli]") {
  std::string softplus = jf_test::src("docs/examples/softplus");
  auto r = run_cli("rules list --ops --rules '" + softplus + "'");
  INFO(r.out);
  REQUIRE(r.status == 0);
  CHECK_THAT(r.out, Catch::Contains("OP") && Catch::Contains("FAMILY") && Catch::Contains("DECLARED IN"));
  CHECK_THAT(r.out, Catch::Matches("(.|\n)*layernorm +norm +builtin +- +<builtin>(.|\n)*"));
  CHECK_THAT(r.out, Catch::Matches("(.|\n)*softplus +pointwise +user +user/softplus.cuh +" + softplus +
                                   "/rules.json:[0-9]+:[0-9]+(.|\n)*"));
  CHECK_THAT(r.out, Catch::Contains("(1 user-declared)") || Catch::Contains(", 1 user-declared)"));

  r = run_cli("rules list --ops --json --rules '" + softplus + "'", "", true);
  REQUIRE(r.status == 0);
  auto j = nlohmann::json::parse(r.out);
  bool user = false, builtin = false;
  for (const auto& op : j.at("ops")) {
    if (op.at("name") == "softplus") {
      user = true;
      CHECK(op.at("kind") == "user");
      CHECK(op.at("family") == "pointwise");
      CHECK(op.at("functor") == "jf_op_softplus");
      CHECK_THAT(op.at("file").get<std::string>(), Catch::StartsWith(softplus + "/rules.json:"));
    }
    if (op.at("name") == "dropout") {
      builtin = true;
      CHECK(op.at("kind") == "builtin");
      CHECK(op.at("file") == "<builtin>");
    }
  }
  CHECK(user);
  CHECK(builtin);
}

TEST_CASE("rules list marks a rule that overrides a built-in", "[rules][cli]") {
  jf_test::TempDir dir;
  std::string file = dir.write("o/rules.json", R"J({"format": "jitfuse.rules/1", "rules": [
  {"name": "bias_act", "overrides": true, "math": "y = relu(x + b)", "pass": "forward", "pattern": ["bias", "relu"], "impl": {"kind": "generated", "skeleton": "elementwise"}}]})J");
  auto r = run_cli("rules list --rules '" + file + "'");
  INFO(r.out);
  REQUIRE(r.status == 0);
  CHECK_THAT(r.out, Catch::Contains(file + ":2:3 (overrides <builtin>/forward_pointwise.json:") ||
                        Catch::Contains(file + " (overrides <builtin>/forward_pointwise.json:"));
  CHECK_THAT(r.out, Catch::Contains("39 rules (1 replacing a rule loaded before them"));
  r = run_cli("rules list --json --rules '" + file + "'", "", true);
  auto j = nlohmann::json::parse(r.out);
  for (const auto& rule : j.at("rules"))
    if (rule.at("name") == "bias_act") CHECK_THAT(rule.at("overrides").get<std::string>(), Catch::StartsWith("<builtin>/"));
    else CHECK(rule.at("overrides").is_null());
}

TEST_CASE("rules validate compiles user ops: a broken template is not ok", "[rules][cli]") {
  jf_test::TempDir dir;
  dir.write("b/broken.cuh", "struct jf_op_b {\n  static __device__ float fwd(float x) { return x; }\n"
                            "  static __device__ float bwd(float x, float dy) { return dy + undefined_thing; }\n};\n");
  std::string file = dir.write("b/rules.json", R"J({"format": "jitfuse.rules/1", "ops": [
  {"name": "b", "math": "y = x", "template": "broken.cuh", "functor": "jf_op_b"}]})J");
  auto r = run_cli("rules validate '" + dir.path() + "/b'");
  INFO(r.out);
  CHECK(r.status == 1);
  CHECK_THAT(r.out, Catch::Contains(file + ":2:3: op 'b': functor jf_op_b does not compile"));
  CHECK_THAT(r.out, Catch::Contains("broken.cuh:3: error"));
  CHECK_THAT(r.out, Catch::Contains("    3 |   static __device__ float bwd(float x, float dy) { return dy + undefined_thing; }"));
  r = run_cli("rules validate --no-compile '" + dir.path() + "/b'");
  CHECK(r.status == 0);
}

TEST_CASE("rules validate: a built-in file, or an edited copy, validates against the built-ins it replaces",
          "[rules][cli]") {
  // Every built-in file as it is in the checkout: its rules replace the built-ins of the same names.
  for (const char* f : {"backward.json", "forward_gemm.json", "forward_norm.json", "forward_pointwise.json",
                        "fp8.json", "joint.json"}) {
    const std::string path = jf_test::src(std::string("fusion_rules/") + f);
    auto r = run_cli("rules validate --no-compile '" + path + "'");
    INFO(r.out);
    CHECK(r.status == 0);
    CHECK_THAT(r.out, Catch::Contains(path + ": ok ("));
    CHECK_THAT(r.out, !Catch::Contains("already declared"));
    r = run_cli("rules validate --no-compile --without-builtins '" + path + "'");
    INFO(r.out);
    CHECK(r.status == 0);
  }
  // An edited copy (another priority) is validated as the edit.
  jf_test::TempDir dir;
  const std::string edited = dir.write("mine/forward_gemm.json", R"J({"format": "jitfuse.rules/1", "rules": [
  {"name": "linear_bias", "math": "y = x W^T + b", "pass": "forward", "priority": 26, "pattern": ["linear", "bias"],
   "impl": {"kind": "cublaslt", "epilogue": "BIAS", "epilogue_ops": 2}}]})J");
  auto r = run_cli("rules validate --no-compile '" + edited + "'");
  INFO(r.out);
  CHECK(r.status == 0);
  CHECK_THAT(r.out, Catch::Contains(edited + ": ok (1 rules, 0 ops)"));
  // A bad edit is still reported with its location.
  const std::string text = "{\"format\": \"jitfuse.rules/1\", \"rules\": [\n"
                           "  {\"name\": \"linear_bias\", \"math\": \"y = x\", \"pass\": \"forward\", \"priority\": "
                           "\"26\", \"pattern\": [\"linear\", \"bias\"], \"impl\": {\"kind\": \"cublaslt\", "
                           "\"epilogue\": \"BIAS\", \"epilogue_ops\": 2}}]}\n";
  const std::string bad = dir.write("bad/forward_gemm.json", text);
  r = run_cli("rules validate --no-compile '" + bad + "'");
  CHECK(r.status == 1);
  CHECK_THAT(r.out, Catch::Contains(jf_test::loc(bad, text, "\"26\"") + ": rule 'linear_bias': \"priority\" must be an integer"));
  // Two validated files declaring one rule name: still a conflict, naming the first.
  const std::string twin = dir.write("twin/forward_gemm.json", R"J({"format": "jitfuse.rules/1", "rules": [
  {"name": "linear_bias", "math": "y = x W^T + b", "pass": "forward", "priority": 27, "pattern": ["linear", "bias"],
   "impl": {"kind": "cublaslt", "epilogue": "BIAS", "epilogue_ops": 2}}]})J");
  r = run_cli("rules validate --no-compile '" + edited + "' '" + twin + "'");
  INFO(r.out);
  CHECK(r.status == 1);
  CHECK_THAT(r.out, Catch::Contains("rule 'linear_bias' is already declared at " + edited));
  // One file declaring a name twice: an error, as before.
  const std::string dup = dir.write("dup/rules.json", R"J({"format": "jitfuse.rules/1", "rules": [
  {"name": "r1", "math": "y = x", "pass": "forward", "pattern": ["bias", "relu"], "impl": {"kind": "generated", "skeleton": "elementwise"}},
  {"name": "r1", "math": "y = x", "pass": "forward", "pattern": ["bias", "silu"], "impl": {"kind": "generated", "skeleton": "elementwise"}}]})J");
  r = run_cli("rules validate --no-compile '" + dup + "'");
  CHECK(r.status == 1);
  CHECK_THAT(r.out, Catch::Contains("is declared twice in this file"));
  // --without-builtins: "overrides" of a rule nobody loaded is an error there.
  const std::string ovr = dir.write("ovr/rules.json", R"J({"format": "jitfuse.rules/1", "rules": [
  {"name": "linear_bias", "overrides": true, "math": "y = x W^T + b", "pass": "forward", "pattern": ["linear", "bias"],
   "impl": {"kind": "cublaslt", "epilogue": "BIAS", "epilogue_ops": 2}}]})J");
  r = run_cli("rules validate --no-compile '" + ovr + "'");
  CHECK(r.status == 0);
  r = run_cli("rules validate --no-compile --without-builtins '" + ovr + "'");
  CHECK(r.status == 1);
  CHECK_THAT(r.out, Catch::Contains("no rule of that name was loaded before it"));
}
