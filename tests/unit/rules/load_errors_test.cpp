// Broken rule files: each mistake is reported with file:line:col, the rule's name and what to do, the broken
// rule or op is skipped, and everything else in the file still loads.
#include <sstream>

#include <spdlog/sinks/ostream_sink.h>

#include "common/error.hpp"
#include "common/log.hpp"
#include "unit/rules/rules_test_util.hpp"

using jf_test::find_rule;
using jf_test::loc;
using jitfuse::rules::LoadError;
using jitfuse::rules::RuleSet;

namespace {

const char* kGood =
    R"J({"name": "good", "math": "y = gelu(x + b)", "pass": "forward", "priority": 10, "pattern": ["bias", "gelu"], "impl": {"kind": "generated", "skeleton": "elementwise"}})J";

std::string file_with(const std::string& bad_rule) {
  return "{\n  \"format\": \"jitfuse.rules/1\",\n  \"rules\": [\n    " + std::string(kGood) + ",\n    " + bad_rule +
         "\n  ]\n}\n";
}

// Loads `text` and checks: exactly one error, at the location of `needle`, for rule `rule`, saying `what`;
// and the good rule loaded anyway.
void expect_one_error(const std::string& text, const std::string& needle, const std::string& rule,
                      const std::string& what) {
  RuleSet rs;
  auto errs = rs.load_text(text, "t.json", "");
  INFO(text);
  REQUIRE(errs.size() == 1);
  INFO(errs[0].to_string());
  CHECK(errs[0].where == loc("t.json", text, needle));
  CHECK(errs[0].rule == rule);
  CHECK_THAT(errs[0].message, Catch::Contains(what));
  CHECK(find_rule(rs, "good") != nullptr);
  CHECK(rs.rules().size() == 1);
  CHECK(rs.errors().size() == 1);
  if (!rule.empty()) CHECK_THAT(errs[0].to_string(), Catch::StartsWith(errs[0].where + ": rule '" + rule + "': "));
}

}  // namespace

TEST_CASE("malformed JSON is reported at its line and column", "[rules]") {
  std::string text = "{\n  \"format\": \"jitfuse.rules/1\",\n  \"rules\": [\n    {\"name\": \"x\",, \"pass\": 1}\n  ]\n}\n";
  RuleSet rs;
  auto errs = rs.load_text(text, "broken.json", "");
  REQUIRE(errs.size() == 1);
  CHECK(errs[0].where == loc("broken.json", text, ", \"pass\""));
  CHECK_THAT(errs[0].message, Catch::StartsWith("invalid JSON: "));
  CHECK(rs.rules().empty());
}

TEST_CASE("a number too large for a double is a load error, not an escaped exception", "[rules]") {
  RuleSet rs;
  auto errs = rs.load_text(R"J({"format": "jitfuse.rules/1", "rules": [], "x": 1e999})J", "big.json", "");
  REQUIRE(errs.size() == 1);
  CHECK(errs[0].where == "big.json");
  CHECK_THAT(errs[0].message, Catch::StartsWith("invalid JSON: ") && Catch::Contains("number overflow"));
  CHECK_THROWS_AS(jitfuse::ops::parse_sequence(R"J({"ops": [{"op": "scale", "value": 1e999}]})J", "seq.json", rs.registry()),
                  jitfuse::Error);
}

TEST_CASE("unknown op kinds name the op and list the known ones", "[rules]") {
  std::string bad =
      R"J({"name": "bad", "math": "y = x", "pass": "forward", "pattern": ["bias", {"op": ["relu", "gelux"]}], "impl": {"kind": "generated", "skeleton": "elementwise"}})J";
  expect_one_error(file_with(bad), "\"gelux\"", "bad", "unknown op 'gelux'; known ops: ");
  RuleSet rs;
  auto errs = rs.load_text(file_with(bad), "t.json", "");
  CHECK_THAT(errs[0].message, Catch::Contains("gelu") && Catch::Contains("layernorm"));
}

TEST_CASE("unknown impl identifiers are errors", "[rules]") {
  expect_one_error(
      file_with(R"J({"name": "bad", "math": "y = x", "pass": "forward", "pattern": ["bias", "gelu"], "impl": {"kind": "generated", "skeleton": "elementwize"}})J"),
      "\"elementwize\"", "bad", "unknown skeleton 'elementwize'");
  expect_one_error(
      file_with(R"J({"name": "bad", "math": "y = x", "pass": "forward", "pattern": ["linear", "bias"], "impl": {"kind": "cublaslt", "epilogue": "BIAS_GELU", "epilogue_ops": 2}})J"),
      "\"BIAS_GELU\"", "bad", "unknown cuBLASLt epilogue 'BIAS_GELU'; known: BGRADB, BIAS, DGELU_BGRAD");
  expect_one_error(
      file_with(R"J({"name": "bad", "math": "y = x", "pass": "forward", "pattern": ["bias", "gelu"], "impl": {"kind": "triton"}})J"),
      "\"triton\"", "bad", "unknown impl kind 'triton'");
  expect_one_error(
      file_with(R"J({"name": "bad", "math": "y = x", "pass": "joint", "pattern": ["dropout"], "impl": {"kind": "joint", "strategy": "magic", "saves": []}})J"),
      "\"magic\"", "bad", "unknown joint strategy 'magic'");
  expect_one_error(
      file_with(R"J({"name": "bad", "math": "y = x", "pass": "joint", "pattern": ["linear", "bias", "linear"], "impl": {"kind": "joint", "strategy": "relu_bitmask", "saves": ["mask"]}})J"),
      "\"relu_bitmask\"", "bad", "relu_bitmask cannot run any window this pattern matches: relu_bitmask implements [linear, bias, relu, linear]");
}

TEST_CASE("impl kinds and epilogues are checked against the pass and the pattern", "[rules]") {
  expect_one_error(
      file_with(R"J({"name": "bad", "math": "y = x", "pass": "forward", "pattern": ["bias", "dropout"], "impl": {"kind": "joint", "strategy": "regenerate_dropout_mask", "saves": ["seed"]}})J"),
      "\"joint\", \"strategy\"", "bad", "impl kind \"joint\" is only allowed in pass \"joint\"");
  expect_one_error(
      file_with(R"J({"name": "bad", "math": "y = x", "pass": "backward", "pattern": ["linear", "bias"], "impl": {"kind": "cublaslt", "epilogue": "BIAS", "epilogue_ops": 2}})J"),
      "\"BIAS\"", "bad", "epilogue BIAS belongs to the forward pass, not backward");
  expect_one_error(
      file_with(R"J({"name": "bad", "math": "y = x", "pass": "forward", "pattern": ["linear", "gelu"], "impl": {"kind": "cublaslt", "epilogue": "BIAS", "epilogue_ops": 2}})J"),
      "\"BIAS\"", "bad", "epilogue BIAS implements [linear bias], the window starts with [linear gelu]");
  expect_one_error(
      file_with(R"J({"name": "bad", "math": "y = x", "pass": "forward", "pattern": ["linear", "bias", "gelu"], "impl": {"kind": "cublaslt", "epilogue": "GELU_AUX_BIAS", "epilogue_ops": 3}})J"),
      "\"GELU_AUX_BIAS\"", "bad", "the gelu needs \"approximate\": \"tanh\"");
  expect_one_error(
      file_with(R"J({"name": "bad", "math": "y = x", "pass": "forward", "pattern": ["linear", "bias", "gelu"], "impl": {"kind": "cublaslt", "epilogue": "BIAS", "epilogue_ops": 2}})J"),
      "\"gelu\"], \"impl\": @{\"kind\": \"cublaslt\"", "bad", "give a generated \"tail\"");
  expect_one_error(
      file_with(R"J({"name": "bad", "math": "y = x", "pass": "forward", "pattern": ["linear", "bias"], "impl": {"kind": "generated", "skeleton": "elementwise"}})J"),
      "[\"linear\", \"bias\"], \"impl\": {\"kind\": \"generated\", \"skeleton\": @\"elementwise\"", "bad", "a generated kernel cannot run linear");
  expect_one_error(
      file_with(R"J({"name": "bad", "math": "y = x", "pass": "forward", "pattern": ["bias", "layernorm"], "impl": {"kind": "generated", "skeleton": "elementwise"}})J"),
      "\"layernorm\"], \"impl\": {\"kind\": \"generated\", \"skeleton\": @\"elementwise\"", "bad", "elementwise cannot run any window this pattern matches: a rownorm kernel holds no bias stage");
}

TEST_CASE("priority must be an integer", "[rules]") {
  expect_one_error(
      file_with(R"J({"name": "bad", "math": "y = x", "pass": "forward", "priority": "high", "pattern": ["bias", "gelu"], "impl": {"kind": "generated", "skeleton": "elementwise"}})J"),
      "\"high\"", "bad", "\"priority\" must be an integer in [-1000000, 1000000], got 'high'");
  expect_one_error(
      file_with(R"J({"name": "bad", "math": "y = x", "pass": "forward", "priority": 2.5, "pattern": ["bias", "gelu"], "impl": {"kind": "generated", "skeleton": "elementwise"}})J"),
      "2.5", "bad", "\"priority\" must be an integer");
}

TEST_CASE("every rule needs a one-line math comment", "[rules]") {
  std::string bad =
      R"J({"name": "nomath", "pass": "forward", "pattern": ["bias", "gelu"], "impl": {"kind": "generated", "skeleton": "elementwise"}})J";
  expect_one_error(file_with(bad), "{\"name\": \"nomath\"", "nomath", "missing \"math\"");
  expect_one_error(
      file_with(R"J({"name": "twolines", "math": "y = x\nz = y", "pass": "forward", "pattern": ["bias", "gelu"], "impl": {"kind": "generated", "skeleton": "elementwise"}})J"),
      "\"y = x\\n", "twolines", "single line");
}

TEST_CASE("typos in keys, conditions and attribute constraints are caught", "[rules]") {
  expect_one_error(
      file_with(R"J({"name": "bad", "math": "y = x", "pass": "forward", "priorty": 3, "pattern": ["bias", "gelu"], "impl": {"kind": "generated", "skeleton": "elementwise"}})J"),
      "3,", "bad", "unknown key 'priorty' in rule; known keys: name, pass, priority");
  expect_one_error(
      file_with(R"J({"name": "bad", "math": "y = x", "pass": "forwards", "pattern": ["bias", "gelu"], "impl": {"kind": "generated", "skeleton": "elementwise"}})J"),
      "\"forwards\"", "bad", "unknown pass 'forwards'");
  expect_one_error(
      file_with(R"J({"name": "bad", "math": "y = x", "pass": "forward", "pattern": ["bias", {"op": "relu", "attrs": {"approximate": "tanh"}}], "impl": {"kind": "generated", "skeleton": "elementwise"}})J"),
      "\"tanh\"", "bad", "op 'relu' has no attribute 'approximate'");
  expect_one_error(
      file_with(R"J({"name": "bad", "math": "y = x", "pass": "forward", "pattern": ["bias", {"op": "gelu", "attrs": {"approximate": "fast"}}], "impl": {"kind": "generated", "skeleton": "elementwise"}})J"),
      "\"fast\"", "bad", "one of tanh|none");
  expect_one_error(
      file_with(R"J({"name": "bad", "math": "y = x", "pass": "forward", "pattern": ["bias", "gelu"], "conditions": {"divisible": [{"dim": "width", "multiple_of": 8}]}, "impl": {"kind": "generated", "skeleton": "elementwise"}})J"),
      "\"width\"", "bad", "unknown dim 'width'");
  expect_one_error(
      file_with(R"J({"name": "bad", "math": "y = x", "pass": "forward", "pattern": ["bias", "gelu"], "conditions": {"recipes": ["bf32"]}, "impl": {"kind": "generated", "skeleton": "elementwise"}})J"),
      "\"bf32\"", "bad", "unknown recipes entry 'bf32'; known: fp32, fp16, bf16, fp8_delayed, fp8_current");
  expect_one_error(
      file_with(R"J({"name": "bad", "math": "y = x", "pass": "forward", "pattern": ["bias", "gelu"], "conditions": {"min_arch": 90, "max_arch": 80}, "impl": {"kind": "generated", "skeleton": "elementwise"}})J"),
      "80}", "bad", "max_arch 80 is below min_arch 90");
  expect_one_error(
      file_with(R"J({"name": "bad", "math": "y = x", "pass": "forward", "pattern": [{"op": "bias", "optional": true}], "impl": {"kind": "generated", "skeleton": "elementwise"}})J"),
      "[{\"op\": \"bias\", \"optional\"", "bad", "at least one must be required");
  expect_one_error(
      file_with(R"J({"name": "bad-name", "math": "y = x", "pass": "forward", "pattern": ["bias", "gelu"], "impl": {"kind": "generated", "skeleton": "elementwise"}})J"),
      "\"bad-name\"", "bad-name", "must be an identifier");
}

TEST_CASE("file-level problems: format, top-level keys, non-array rules", "[rules]") {
  RuleSet rs;
  auto errs = rs.load_text(R"J({"rules": []})J", "a.json", "");
  REQUIRE(errs.size() == 1);
  CHECK(errs[0].where == "a.json:1:1");
  CHECK_THAT(errs[0].message, Catch::Contains("missing \"format\": \"jitfuse.rules/1\""));

  std::string v2 = "{\"format\": \"jitfuse.rules/2\", \"rules\": []}";
  errs = rs.load_text(v2, "b.json", "");
  REQUIRE(errs.size() == 1);
  CHECK(errs[0].where == loc("b.json", v2, "\"jitfuse.rules/2\""));
  CHECK_THAT(errs[0].message, Catch::Contains("unsupported format 'jitfuse.rules/2'"));

  std::string extra = "{\"format\": \"jitfuse.rules/1\",\n \"rule\": [], \"rules\": [" + std::string(kGood) + "]}";
  errs = rs.load_text(extra, "c.json", "");
  REQUIRE(errs.size() == 1);
  CHECK(errs[0].where == loc("c.json", extra, "[], \"rules\""));
  CHECK_THAT(errs[0].message, Catch::Contains("unknown top-level key 'rule'"));
  CHECK(find_rule(rs, "good") != nullptr);  // the rest of the file still loaded

  errs = rs.load_text(R"J({"format": "jitfuse.rules/1", "rules": {}})J", "d.json", "");
  REQUIRE(errs.size() == 1);
  CHECK_THAT(errs[0].message, Catch::Contains("\"rules\" must be an array"));
  errs = rs.load_text("[1, 2]", "e.json", "");
  REQUIRE(errs.size() == 1);
  CHECK_THAT(errs[0].message, Catch::Contains("a rules file is a JSON object"));
  CHECK(rs.errors().size() == 5);
}

TEST_CASE("a rule with \"overrides\": true replaces an earlier one of its name, and the log says so", "[rules]") {
  std::ostringstream captured;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(captured);
  auto& logger = jitfuse::log();
  auto old_level = logger.level();
  logger.sinks().push_back(sink);
  logger.set_level(spdlog::level::info);

  RuleSet rs = RuleSet::with_builtins();
  const auto* builtin = find_rule(rs, "bias_act");
  REQUIRE(builtin != nullptr);
  size_t order = builtin->order, count = rs.rules().size();
  auto gen = rs.generation();
  std::string text = "{\"format\": \"jitfuse.rules/1\", \"rules\": [\n" + std::string(kGood) + ",\n" +
                     R"J({"name": "bias_act", "overrides": true, "math": "y = relu(x + b)", "pass": "forward", "priority": 99, "pattern": ["bias", "relu"], "impl": {"kind": "generated", "skeleton": "elementwise"}})J" +
                     "\n]}";
  auto errs = rs.load_text(text, "user.json", "");
  logger.sinks().pop_back();
  logger.set_level(old_level);

  CHECK(errs.empty());
  CHECK(rs.rules().size() == count + 1);  // bias_act replaced in place, "good" added once
  const auto* over = find_rule(rs, "bias_act");
  REQUIRE(over != nullptr);
  CHECK(over->priority == 99);
  CHECK(over->order == order);  // takes the place (and tie-breaking order) of the rule it replaces
  CHECK(over->file == "user.json");
  CHECK_THAT(over->overridden, Catch::StartsWith("<builtin>/forward_pointwise.json:"));
  CHECK(find_rule(rs, "good")->overridden.empty());
  CHECK(rs.generation() > gen);
  std::string log = captured.str();
  CHECK_THAT(log, Catch::Contains("rule bias_act from user.json:3:1 overrides the one from <builtin>/forward_pointwise.json:"));
}

TEST_CASE("a broken override leaves the earlier rule in place", "[rules]") {
  RuleSet rs = RuleSet::with_builtins();
  auto gen = rs.generation();
  auto errs = rs.load_text(
      R"J({"format": "jitfuse.rules/1", "rules": [{"name": "bias_act", "overrides": true, "math": "y = x", "pass": "forward", "pattern": ["bias", "nope"], "impl": {"kind": "generated", "skeleton": "elementwise"}}]})J",
      "user.json", "");
  CHECK(errs.size() == 1);
  CHECK(find_rule(rs, "bias_act")->file == "<builtin>/forward_pointwise.json");
  CHECK(rs.generation() == gen);  // nothing changed
}

TEST_CASE("load_path: missing paths, directories in sorted order, schema.json skipped", "[rules]") {
  jf_test::TempDir dir;
  RuleSet rs;
  auto errs = rs.load_path(dir.path() + "/nope");
  REQUIRE(errs.size() == 1);
  CHECK_THAT(errs[0].message, Catch::Contains("no such file or directory"));

  auto rule = [](const char* name, int prio, bool overrides = false) {
    return std::string(R"J({"format": "jitfuse.rules/1", "rules": [{"name": ")J") + name +
           (overrides ? "\", \"overrides\": true" : "\"") + R"J(, "math": "y = gelu(x + b)", "pass": "forward", "priority": )J" + std::to_string(prio) +
           R"J(, "pattern": ["bias", "gelu"], "impl": {"kind": "generated", "skeleton": "elementwise"}}]})J";
  };
  dir.write("b.json", rule("shared", 2, true));
  dir.write("a.json", rule("shared", 1));
  dir.write("c.json", rule("only_c", 3));
  dir.write("notes.txt", "not json");
  dir.write("schema.json", R"J({"$schema": "https://json-schema.org/draft/2020-12/schema"})J");
  RuleSet rs2;
  errs = rs2.load_path(dir.path());
  CHECK(errs.empty());
  REQUIRE(rs2.rules().size() == 2);
  CHECK(find_rule(rs2, "shared")->priority == 2);  // b.json loads after a.json and overrides it (explicitly)
  CHECK(find_rule(rs2, "shared")->file == dir.path() + "/b.json");
  CHECK(find_rule(rs2, "only_c") != nullptr);

  // A file given directly is loaded whatever its name.
  RuleSet rs3;
  errs = rs3.load_path(dir.path() + "/notes.txt");
  REQUIRE(errs.size() == 1);
  CHECK_THAT(errs[0].to_string(), Catch::StartsWith(dir.path() + "/notes.txt:1:"));
}
