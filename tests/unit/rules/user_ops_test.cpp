// User-declared pointwise ops: every broken declaration is reported with file:line:col and skipped; a good one
// joins the registry with its template, functor and constants. Follows docs/rules.md's softplus walk-through.
#include "exec/lower/impl/implementation.hpp"
#include "fuser/plan.hpp"
#include "unit/rules/rules_test_util.hpp"

using jf_test::find_rule;
using jf_test::loc;
using jitfuse::rules::RuleSet;

namespace {

const char* kGoodOp =
    R"J({"name": "softish", "math": "y = x / (1 + |x|)", "template": "softish.cuh", "functor": "jf_op_softish", "attrs": [{"name": "k", "type": "number", "default": 1.0}]})J";
const char* kGoodRule =
    R"J({"name": "bias_softish", "math": "y = softish(x + b)", "pass": "forward", "pattern": ["bias", "softish"], "impl": {"kind": "generated", "skeleton": "elementwise"}})J";
const char* kTemplate =
    "struct jf_op_softish {\n"
    "  static __device__ __forceinline__ float fwd(float x, float k) { return x / (1.f + fabsf(k * x)); }\n"
    "  static __device__ __forceinline__ float bwd(float x, float dy, float k) {\n"
    "    const float d = 1.f + fabsf(k * x);\n"
    "    return dy / (d * d);\n"
    "  }\n"
    "};\n";

std::string file_with(const std::string& bad_op) {
  return "{\n  \"format\": \"jitfuse.rules/1\",\n  \"ops\": [\n    " + std::string(kGoodOp) + ",\n    " + bad_op +
         "\n  ],\n  \"rules\": [\n    " + kGoodRule + "\n  ]\n}\n";
}

void expect_op_error(const std::string& bad_op, const std::string& needle, const std::string& what) {
  jf_test::TempDir dir;
  dir.write("softish.cuh", kTemplate);
  dir.write("other.cuh", "// declares nothing useful\n");
  std::string text = file_with(bad_op);
  std::string file = dir.write("rules.json", text);
  RuleSet rs;
  auto errs = rs.load_path(dir.path());
  INFO(text);
  REQUIRE(errs.size() == 1);
  INFO(errs[0].to_string());
  CHECK(errs[0].where == loc(file, text, needle));
  CHECK(errs[0].rule.empty());
  CHECK_THAT(errs[0].message, Catch::StartsWith("op '") && Catch::Contains(what));
  // The good op and the rule that uses it still load.
  CHECK(rs.registry().find("softish") != nullptr);
  CHECK(find_rule(rs, "bias_softish") != nullptr);
}

}  // namespace

TEST_CASE("broken user op declarations are reported and skipped", "[rules]") {
  SECTION("template path with ..") {
    expect_op_error(R"J({"name": "bad", "math": "y = x", "template": "../softish.cuh", "functor": "jf_op_softish"})J",
                    "\"../softish.cuh\"", "contains \"..\"");
  }
  SECTION("absolute template path") {
    expect_op_error(R"J({"name": "bad", "math": "y = x", "template": "/etc/passwd", "functor": "root"})J",
                    "\"/etc/passwd\"", "is absolute");
  }
  SECTION("missing template") {
    expect_op_error(R"J({"name": "bad", "math": "y = x", "template": "missing.cuh", "functor": "jf_op_missing"})J",
                    "\"missing.cuh\"", "template 'missing.cuh' not found");
  }
  SECTION("functor not in the template") {
    expect_op_error(R"J({"name": "bad", "math": "y = x", "template": "other.cuh", "functor": "jf_op_other"})J",
                    "\"jf_op_other\"", "functor 'jf_op_other' does not appear in template 'other.cuh'");
  }
  SECTION("functor only as part of a longer name") {
    expect_op_error(R"J({"name": "bad", "math": "y = x", "template": "softish.cuh", "functor": "jf_op_soft"})J",
                    "\"jf_op_soft\"", "does not appear in template");
  }
  SECTION("functor that is not a C identifier") {
    expect_op_error(R"J({"name": "bad", "math": "y = x", "template": "softish.cuh", "functor": "jf_op_softish; int x"})J",
                    "\"jf_op_softish; int x\"", "must be a C identifier");
  }
  SECTION("arity 2") {
    expect_op_error(R"J({"name": "bad", "math": "y = x", "template": "softish.cuh", "functor": "jf_op_softish", "arity": 2})J",
                    "2}", "arity 2 is not supported");
  }
  SECTION("non-number attribute") {
    expect_op_error(
        R"J({"name": "bad", "math": "y = x", "template": "softish.cuh", "functor": "jf_op_softish", "attrs": [{"name": "mode", "type": "string"}]})J",
        "\"string\"", "attribute type 'string' is not supported");
  }
  SECTION("built-in op name") {
    expect_op_error(R"J({"name": "gelu", "math": "y = x", "template": "softish.cuh", "functor": "jf_op_softish"})J",
                    "\"gelu\"", "op 'gelu' is built in and cannot be redeclared");
  }
  SECTION("missing math") {
    expect_op_error(R"J({"name": "bad", "template": "softish.cuh", "functor": "jf_op_softish"})J",
                    "{\"name\": \"bad\"", "missing \"math\"");
  }
  SECTION("bad saves") {
    expect_op_error(R"J({"name": "bad", "math": "y = x", "template": "softish.cuh", "functor": "jf_op_softish", "saves": "both"})J",
                    "\"both\"", "\"saves\" must be \"input\" or \"output\"");
  }
}

TEST_CASE("a rule using a broken op fails with unknown op, and templates need a directory", "[rules]") {
  RuleSet rs;
  std::string text = "{\"format\": \"jitfuse.rules/1\", \"ops\": [" + std::string(kGoodOp) + "], \"rules\": [" +
                     kGoodRule + "]}";
  auto errs = rs.load_text(text, "api.json", "");
  REQUIRE(errs.size() == 2);
  CHECK_THAT(errs[0].message, Catch::Contains("loaded without a directory"));
  CHECK(errs[1].rule == "bias_softish");
  CHECK_THAT(errs[1].message, Catch::Contains("unknown op 'softish'"));
  CHECK(rs.registry().find("softish") == nullptr);
}

TEST_CASE("one template file name, one content", "[rules]") {
  jf_test::TempDir a, b;
  a.write("softish.cuh", kTemplate);
  a.write("rules.json", "{\"format\": \"jitfuse.rules/1\", \"ops\": [" + std::string(kGoodOp) + "]}");
  b.write("softish.cuh", std::string(kTemplate) + "struct jf_op_other {};\n");
  b.write("rules.json", R"J({"format": "jitfuse.rules/1", "ops": [{"name": "other", "math": "y = x", "template": "softish.cuh", "functor": "jf_op_other"}]})J");
  RuleSet rs;
  CHECK(rs.load_path(a.path()).empty());
  auto errs = rs.load_path(b.path());
  REQUIRE(errs.size() == 1);
  CHECK_THAT(errs[0].message, Catch::Contains("template user/softish.cuh is already used by op 'softish'"));
  CHECK(rs.user_templates().at("user/softish.cuh") == kTemplate);
  // Redeclaring the same op (same name) from another file is a conflict, not a silent replacement: the first
  // declaration and its template stay.
  b.write("rules.json", "{\"format\": \"jitfuse.rules/1\", \"ops\": [" + std::string(kGoodOp) + "]}");
  errs = rs.load_path(b.path());
  REQUIRE(errs.size() == 1);
  CHECK_THAT(errs[0].message, Catch::Contains("op 'softish' is already declared at"));
  CHECK(rs.user_templates().at("user/softish.cuh") == kTemplate);
}

TEST_CASE("docs walk-through: softplus declared and fused with bias, without recompiling", "[rules]") {
  RuleSet rs = RuleSet::with_builtins();
  auto gen = rs.generation();
  auto errs = rs.load_path(jf_test::src("docs/examples/softplus"));
  for (const auto& e : errs) UNSCOPED_INFO(e.to_string());
  REQUIRE(errs.empty());
  CHECK(rs.generation() > gen);

  const jitfuse::ops::OpKind* k = rs.registry().find("softplus");
  REQUIRE(k != nullptr);
  CHECK(k->user_declared);
  CHECK(k->family == jitfuse::ops::Family::pointwise);
  CHECK(k->template_file == "user/softplus.cuh");
  CHECK(k->functor == "jf_op_softplus");
  CHECK(k->const_attrs == std::vector<std::string>{"beta"});
  CHECK(k->saves == jitfuse::ops::SavedKind::input);
  CHECK_THAT(k->declared_in, Catch::StartsWith(jf_test::src("docs/examples/softplus/rules.json") + ":"));
  REQUIRE(rs.user_templates().count("user/softplus.cuh") == 1);
  CHECK_THAT(rs.user_templates().at("user/softplus.cuh"), Catch::Contains("struct jf_op_softplus"));

  const auto* fwd = find_rule(rs, "bias_softplus");
  REQUIRE(fwd != nullptr);
  CHECK(fwd->pattern.size() == 2);
  CHECK(fwd->pattern[1].kinds == std::vector<std::string>{"softplus"});

  // The sequence of the walk-through: constants come from the op's attributes, in declaration order.
  auto def = jitfuse::ops::parse_sequence_file(jf_test::src("docs/examples/bias_softplus.json"), rs.registry());
  auto ops = jitfuse::ops::infer(def, {64, 256});
  REQUIRE(ops.size() == 2);
  CHECK(ops[1].functor == "jf_op_softplus");
  CHECK(ops[1].template_file == "user/softplus.cuh");
  CHECK(ops[1].consts == std::vector<double>{2.0});

  jitfuse::fuser::PlanInputs in;
  in.recipe = in.dtype = "bf16";
  in.arch = 90;
  auto plan = jitfuse::fuser::plan(ops, in, rs, jitfuse::exec::legality());
  REQUIRE(plan.forward.size() == 1);
  CHECK(plan.forward[0].rule == "bias_softplus");
  CHECK(plan.forward[0].begin == 0);
  CHECK(plan.forward[0].end == 2);
  REQUIRE(plan.backward.size() == 1);
  CHECK(plan.backward[0].rule == "softplus_dbias");

  // And the CLI steps of the walk-through.
  auto v = jf_test::run_cli("rules validate '" + jf_test::src("docs/examples/softplus") + "'");
  CHECK(v.status == 0);
  CHECK_THAT(v.out, Catch::Contains("ok (2 rules, 1 ops)"));
  auto x = jf_test::run_cli("explain '" + jf_test::src("docs/examples/bias_softplus.json") +
                            "' --recipe bf16 --shape 64x256", "JITFUSE_RULE_PATH='" + jf_test::src("docs/examples/softplus") + "'");
  INFO(x.out);
  CHECK(x.status == 0);
  CHECK_THAT(x.out, Catch::Contains("bias_softplus") && Catch::Contains("taken"));
  CHECK_THAT(x.out, Catch::Contains("[0, 2)     bias softplus"));
}
