// `jitfuse rules list` and `jitfuse rules validate`: exit codes, file:line:col errors, --json for scripts.
#include <algorithm>

#include "common/json_util.hpp"
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
  CHECK_THAT(r.out, Catch::Contains("48 rules"));

  r = run_cli("rules list --json --rules '" + jf_test::src("docs/examples/softplus") + "'", "", true);
  REQUIRE(r.status == 0);
  auto j = nlohmann::json::parse(r.out);
  CHECK(j.at("errors").empty());
  CHECK(j.at("rules").size() == 50);
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
  CHECK_THAT(r.out, Catch::Contains("48 rules (1 replacing a rule loaded before them"));
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

// Issue 26, item 11: the checkout's rules files, and copies of them being edited, validate as the files they
// are; a name declared twice among the validated files is still an error; --without-builtins.
namespace {

std::vector<std::string> builtin_rule_files() {
  std::vector<std::string> files;
  for (const auto& e : std::filesystem::directory_iterator(jf_test::src("fusion_rules")))
    if (e.path().extension() == ".json" && e.path().filename() != "schema.json") files.push_back(e.path().string());
  std::sort(files.begin(), files.end());
  return files;
}

const std::string kRule = R"J({"name": "linear_bias", "math": "y = x W^T + b", "pass": "forward", "priority": 27,
   "pattern": ["linear", "bias"], "impl": {"kind": "cublaslt", "epilogue": "BIAS", "epilogue_ops": 2}})J";

}  // namespace

TEST_CASE("rules validate: every built-in rules file of the checkout validates with zero errors", "[rules][cli]") {
  const auto files = builtin_rule_files();
  REQUIRE(files.size() >= 6);
  for (const auto& path : files) {
    for (const char* flags : {"", "--without-builtins "}) {
      auto r = run_cli(std::string("rules validate ") + flags + "'" + path + "'");
      INFO(flags << path << "\n" << r.out);
      CHECK(r.status == 0);
      CHECK_THAT(r.out, Catch::Contains(path + ": ok ("));
      CHECK_THAT(r.out, !Catch::Contains("error") && !Catch::Contains("already declared"));
    }
  }
  // All of them at once (the directory), and the optional ones on top.
  const size_t n = jitfuse::rules::RuleSet::with_builtins().rules().size();
  const std::string dir = jf_test::src("fusion_rules");
  auto r = run_cli("rules validate '" + dir + "' '" + dir + "/optional'");
  INFO(r.out);
  CHECK(r.status == 0);
  CHECK_THAT(r.out, Catch::Contains(dir + ": ok (" + std::to_string(n) + " rules, 0 ops)"));
  CHECK_THAT(r.out, Catch::Contains(dir + "/optional: ok ("));
  r = run_cli("rules validate --json --without-builtins '" + dir + "'", "", true);
  auto j = nlohmann::json::parse(r.out);
  CHECK(j.at("valid") == true);
  CHECK(j.at("paths")[0].at("rules") == n);
}

TEST_CASE("rules validate: an edited copy of a built-in file is validated as the edit", "[rules][cli]") {
  jf_test::TempDir dir;
  // forward_gemm.json with one rule's priority changed, and with one rule broken.
  auto doc = nlohmann::json::parse(jitfuse::json_util::read_file(jf_test::src("fusion_rules/forward_gemm.json")));
  for (auto& rule : doc.at("rules"))
    if (rule.at("name") == "linear_bias") rule["priority"] = 26;
  const std::string edited = dir.write("mine/forward_gemm.json", doc.dump(2));
  auto r = run_cli("rules validate '" + edited + "'");
  INFO(r.out);
  CHECK(r.status == 0);
  CHECK_THAT(r.out, Catch::Contains(edited + ": ok (" + std::to_string(doc.at("rules").size()) + " rules, 0 ops)"));

  for (auto& rule : doc.at("rules"))
    if (rule.at("name") == "linear_bias") rule["pattern"] = {"linear", "bais"};
  const std::string text = doc.dump(2);
  const std::string bad = dir.write("bad/forward_gemm.json", text);
  r = run_cli("rules validate '" + bad + "'");
  INFO(r.out);
  CHECK(r.status == 1);
  CHECK_THAT(r.out, Catch::Contains(jf_test::loc(bad, text, "\"bais\"") + ": rule 'linear_bias': "));
  CHECK_THAT(r.out, Catch::Contains(bad + ": 1 error(s)"));
  // The same bad edit as a single rule: the error names its file:line:col too.
  const std::string one_text = "{\"format\": \"jitfuse.rules/1\", \"rules\": [\n  " + kRule + "]}\n";
  std::string prio_text = one_text;
  prio_text.replace(prio_text.find("27"), 2, "\"27\"");
  const std::string prio = dir.write("prio/rules.json", prio_text);
  r = run_cli("rules validate --no-compile '" + prio + "'");
  CHECK(r.status == 1);
  CHECK_THAT(r.out, Catch::Contains(jf_test::loc(prio, prio_text, "\"27\"") +
                                    ": rule 'linear_bias': \"priority\" must be an integer"));
}

TEST_CASE("rules validate: a rule name declared twice among the validated files is an error naming both",
          "[rules][cli]") {
  jf_test::TempDir dir;
  const std::string text = "{\"format\": \"jitfuse.rules/1\", \"rules\": [\n  " + kRule + "]}\n";
  const std::string a = dir.write("a/rules.json", text), b = dir.write("b/rules.json", text);
  // Each alone replaces the built-in linear_bias; both together clash with each other.
  CHECK(run_cli("rules validate --no-compile '" + a + "'").status == 0);
  auto r = run_cli("rules validate --no-compile '" + a + "' '" + b + "'");
  INFO(r.out);
  CHECK(r.status == 1);
  CHECK_THAT(r.out, Catch::Contains(jf_test::loc(b, text, "\"linear_bias\"") +
                                    ": rule 'linear_bias': rule 'linear_bias' is already declared at " +
                                    jf_test::loc(a, text, "@{\"name\"")));
  CHECK_THAT(r.out, Catch::Contains(a + ": ok (1 rules, 0 ops)"));
  r = run_cli("rules validate --no-compile --without-builtins '" + a + "' '" + b + "'");
  CHECK(r.status == 1);
  CHECK_THAT(r.out, Catch::Contains("is already declared at " + jf_test::loc(a, text, "@{\"name\"")));

  // One file declaring a name twice.
  const std::string twice_text = "{\"format\": \"jitfuse.rules/1\", \"rules\": [\n  " + kRule + ",\n  " + kRule + "]}\n";
  const std::string twice = dir.write("twice/rules.json", twice_text);
  for (const char* flags : {"", "--without-builtins "}) {
    r = run_cli(std::string("rules validate --no-compile ") + flags + "'" + twice + "'");
    INFO(flags << "\n" << r.out);
    CHECK(r.status == 1);
    // At the second declaration's name, naming the first declaration.
    CHECK_THAT(r.out, Catch::Contains(jf_test::loc(twice, twice_text, ",\n  {\"name\": @\"linear_bias\"") +
                                      ": rule 'linear_bias': rule 'linear_bias' is declared twice in this file "
                                      "(first at " + jf_test::loc(twice, twice_text, "@{\"name\"") + ")"));
  }
}

TEST_CASE("rules validate --without-builtins: the files against the built-in ops alone", "[rules][cli]") {
  jf_test::TempDir dir;
  // A rule named as one in JITFUSE_RULE_PATH: a clash, unless the rule path is left out too.
  const std::string text = "{\"format\": \"jitfuse.rules/1\", \"rules\": [\n"
                           "  {\"name\": \"bias_relu_mine\", \"math\": \"y = relu(x + b)\", \"pass\": \"forward\", "
                           "\"pattern\": [\"bias\", \"relu\"], \"impl\": {\"kind\": \"generated\", \"skeleton\": "
                           "\"elementwise\"}}]}\n";
  dir.write("path/rules.json", text);
  const std::string mine = dir.write("mine/rules.json", text);
  const std::string env = "JITFUSE_RULE_PATH='" + dir.path() + "/path'";
  auto r = run_cli("rules validate --no-compile '" + mine + "'", env);
  INFO(r.out);
  CHECK(r.status == 1);
  CHECK_THAT(r.out, Catch::Contains("is already declared at " + dir.path() + "/path/rules.json"));
  r = run_cli("rules validate --no-compile --without-builtins '" + mine + "'", env);
  INFO(r.out);
  CHECK(r.status == 0);
  // Built-in ops still resolve; an unknown op is still an error.
  std::string unknown = text;
  unknown.replace(unknown.find("\"relu\"]"), 6, "\"reluu\"");
  const std::string bad = dir.write("bad/rules.json", unknown);
  r = run_cli("rules validate --no-compile --without-builtins '" + bad + "'");
  CHECK(r.status == 1);
  CHECK_THAT(r.out, Catch::Contains(jf_test::loc(bad, unknown, "\"reluu\"") + ": rule 'bias_relu_mine': "));
  // "overrides": true of a built-in rule is valid in both modes (every context loads the built-ins); of a
  // rule nobody declares, in neither.
  std::string ovr_text = "{\"format\": \"jitfuse.rules/1\", \"rules\": [\n  " + kRule + "]}\n";
  ovr_text.replace(ovr_text.find("{\"name\""), 1, "{\"overrides\": true, ");
  const std::string ovr = dir.write("ovr/rules.json", ovr_text);
  std::string typo_text = ovr_text;
  typo_text.replace(typo_text.find("\"linear_bias\""), 13, "\"linear_bais\"");
  const std::string typo = dir.write("typo/rules.json", typo_text);
  for (const char* flags : {"", "--without-builtins "}) {
    r = run_cli(std::string("rules validate --no-compile ") + flags + "'" + ovr + "'");
    INFO(flags << "\n" << r.out);
    CHECK(r.status == 0);
    r = run_cli(std::string("rules validate --no-compile ") + flags + "'" + typo + "'");
    INFO(flags << "\n" << r.out);
    CHECK(r.status == 1);
    CHECK_THAT(r.out, Catch::Contains("no rule of that name was loaded before it"));
  }
}
