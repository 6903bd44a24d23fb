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
  CHECK_THAT(r.out, Catch::Contains("27 rules"));

  r = run_cli("rules list --json --rules '" + jf_test::src("docs/examples/softplus") + "'", "", true);
  REQUIRE(r.status == 0);
  auto j = nlohmann::json::parse(r.out);
  CHECK(j.at("errors").empty());
  CHECK(j.at("rules").size() == 29);
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
