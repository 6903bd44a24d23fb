// The passes: matching with optional elements, conditions and their reasons, deterministic conflict resolution,
// joint-then-forward/backward, the kill switch and the contiguous-run invariant.
#include "common/error.hpp"
#include "fuser/plan.hpp"
#include "unit/rules/rules_test_util.hpp"

using jf_test::make_ops;
using jitfuse::fuser::Decision;
using jitfuse::fuser::Group;
using jitfuse::fuser::LegalityFn;
using jitfuse::fuser::Plan;
using jitfuse::fuser::PlanInputs;
using jitfuse::rules::Pass;
using jitfuse::rules::RuleSet;
using nlohmann::json;

namespace {

// A rule set with only the given rules (built-in ops, no built-in rules).
RuleSet rules_of(const std::string& rules_array) {
  RuleSet rs;
  auto errs = rs.load_text("{\"format\": \"jitfuse.rules/1\", \"rules\": " + rules_array + "}", "test.json", "");
  for (const auto& e : errs) UNSCOPED_INFO(e.to_string());
  REQUIRE(errs.empty());
  return rs;
}

std::string rule(const std::string& name, const std::string& pass, int prio, const std::string& pattern,
                 const std::string& extra = "") {
  std::string impl = pass == "joint" ? R"J({"kind": "joint", "strategy": "regenerate_dropout_mask", "saves": ["seed"]})J"
                                     : R"J({"kind": "generated", "skeleton": "elementwise"})J";
  return "{\"name\": \"" + name + "\", \"math\": \"y = f(x)\", \"pass\": \"" + pass + "\", \"priority\": " +
         std::to_string(prio) + ", \"pattern\": " + pattern + ", \"impl\": " + impl + extra + "}";
}

PlanInputs bf16(int arch = 90) {
  PlanInputs in;
  in.recipe = in.dtype = "bf16";
  in.arch = arch;
  return in;
}

std::string spans(const std::vector<Group>& groups) {
  std::string out;
  for (const auto& g : groups)
    out += (out.empty() ? "" : " ") + std::string("[") + std::to_string(g.begin) + "," + std::to_string(g.end) + ")" +
           (g.rule.empty() ? "" : ":" + g.rule);
  return out;
}

const Decision* decision(const Plan& p, Pass pass, const std::string& rule, int b, int e) {
  for (const auto& d : p.decisions)
    if (d.pass == pass && d.rule == rule && d.begin == b && d.end == e) return &d;
  return nullptr;
}

const LegalityFn kAllow;  // empty: every window is legal

}  // namespace

TEST_CASE("optional elements: the longest window that passes every check wins", "[fuser]") {
  RuleSet rs = rules_of("[" +
                        rule("chain", "forward", 10,
                             R"J(["bias", {"op": "gelu", "optional": true}, {"op": ["scale", "relu"], "optional": true}])J") +
                        "]");
  json scale = {{"op", "scale"}, {"value", 2.0}};
  auto ops = make_ops(rs, json::array({{{"op", "bias"}}, {{"op", "gelu"}}, scale, {{"op", "silu"}}}), {4, 8});
  Plan p = jitfuse::fuser::plan(ops, bf16(), rs, kAllow);
  CHECK(spans(p.forward) == "[0,3):chain [3,4)");
  CHECK(spans(p.backward) == "[0,1) [1,2) [2,3) [3,4)");

  // gelu skipped: bias then scale still matches.
  ops = make_ops(rs, json::array({{{"op", "bias"}}, scale}), {4, 8});
  CHECK(spans(jitfuse::fuser::plan(ops, bf16(), rs, kAllow).forward) == "[0,2):chain");

  // The longest window refused (here by legality): the next shorter one is tried and taken.
  LegalityFn no_three = [](const jitfuse::rules::Rule&, const std::vector<jitfuse::ops::Op>&, int b, int e,
                           Pass) -> std::optional<std::string> {
    if (e - b == 3) return std::string("three ops do not fit the skeleton");
    return std::nullopt;
  };
  ops = make_ops(rs, json::array({{{"op", "bias"}}, {{"op", "gelu"}}, scale}), {4, 8});
  p = jitfuse::fuser::plan(ops, bf16(), rs, no_three);
  CHECK(spans(p.forward) == "[0,2):chain [2,3)");
  REQUIRE(decision(p, Pass::forward, "chain", 0, 3) != nullptr);
  CHECK(decision(p, Pass::forward, "chain", 0, 3)->reason == "three ops do not fit the skeleton");
  CHECK(decision(p, Pass::forward, "chain", 0, 2)->taken);
  CHECK(decision(p, Pass::forward, "chain", 0, 1) == nullptr);  // not needed once a window was found
}

TEST_CASE("attribute constraints, also on optional elements", "[fuser]") {
  RuleSet rs = rules_of(
      "[" + rule("tanh_only", "forward", 10, R"J(["bias", {"op": "gelu", "attrs": {"approximate": "tanh"}, "optional": true}])J") +
      "]");
  auto ops = make_ops(rs, json::array({{{"op", "bias"}}, {{"op", "gelu"}, {"approximate", "none"}}}), {4, 8});
  Plan p = jitfuse::fuser::plan(ops, bf16(), rs, kAllow);
  REQUIRE(decision(p, Pass::forward, "tanh_only", 0, 2) != nullptr);
  CHECK(decision(p, Pass::forward, "tanh_only", 0, 2)->reason ==
        "op 1 (gelu) has approximate = \"none\"; the rule needs \"tanh\"");
  CHECK(spans(p.forward) == "[0,1):tanh_only [1,2)");
}

TEST_CASE("conflicts: priority, then longer window, then earlier rule, then earlier start", "[fuser]") {
  json seq = json::array({{{"op", "bias"}}, {{"op", "gelu"}}, {{"op", "scale"}, {"value", 0.5}}});
  SECTION("priority") {
    RuleSet rs = rules_of("[" + rule("a", "forward", 10, R"J(["bias", "gelu"])J") + "," +
                          rule("b", "forward", 20, R"J(["gelu", "scale"])J") + "]");
    Plan p = jitfuse::fuser::plan(make_ops(rs, seq, {4, 8}), bf16(), rs, kAllow);
    CHECK(spans(p.forward) == "[0,1) [1,3):b");
    CHECK(decision(p, Pass::forward, "a", 0, 2)->reason == "overlaps higher-priority rule b at ops [1, 3)");
  }
  SECTION("longer window") {
    RuleSet rs = rules_of("[" + rule("a", "forward", 10, R"J(["bias", "gelu"])J") + "," +
                          rule("b", "forward", 10, R"J(["bias", "gelu", "scale"])J") + "]");
    Plan p = jitfuse::fuser::plan(make_ops(rs, seq, {4, 8}), bf16(), rs, kAllow);
    CHECK(spans(p.forward) == "[0,3):b");
    CHECK(decision(p, Pass::forward, "a", 0, 2)->reason == "overlaps rule b at ops [0, 3) (same priority, longer window)");
  }
  SECTION("earlier rule") {
    RuleSet rs = rules_of("[" + rule("a", "forward", 10, R"J(["bias", "gelu"])J") + "," +
                          rule("b", "forward", 10, R"J(["gelu", "scale"])J") + "]");
    Plan p = jitfuse::fuser::plan(make_ops(rs, seq, {4, 8}), bf16(), rs, kAllow);
    CHECK(spans(p.forward) == "[0,2):a [2,3)");
    CHECK(decision(p, Pass::forward, "b", 1, 3)->reason == "overlaps rule a at ops [0, 2) (same priority, earlier rule)");
    RuleSet swapped = rules_of("[" + rule("b", "forward", 10, R"J(["gelu", "scale"])J") + "," +
                               rule("a", "forward", 10, R"J(["bias", "gelu"])J") + "]");
    CHECK(spans(jitfuse::fuser::plan(make_ops(swapped, seq, {4, 8}), bf16(), swapped, kAllow).forward) ==
          "[0,1) [1,3):b");
  }
  SECTION("earlier start") {
    RuleSet rs = rules_of("[" + rule("pair", "forward", 10, R"J(["gelu", "gelu"])J") + "]");
    Plan p = jitfuse::fuser::plan(make_ops(rs, json::array({{{"op", "gelu"}}, {{"op", "gelu"}}, {{"op", "gelu"}}}), {4, 8}),
                                  bf16(), rs, kAllow);
    CHECK(spans(p.forward) == "[0,2):pair [2,3)");
    CHECK(decision(p, Pass::forward, "pair", 1, 3)->reason ==
          "overlaps rule pair at ops [0, 2) (same priority, earlier start)");
  }
}

TEST_CASE("joint groups are fixed, and forward and backward run independently over them", "[fuser]") {
  RuleSet rs = rules_of(
      "[" + rule("j", "joint", 1, R"J(["bias", "dropout"])J", R"J(, "conditions": {"training": true})J") + "," +
      rule("f_over", "forward", 50, R"J(["dropout", "add_extra_input"])J") + "," +
      rule("f", "forward", 10, R"J(["add_extra_input", "gelu"])J") + "," +
      rule("b", "backward", 10, R"J(["gelu", "scale"])J") + "]");
  json seq = json::array({{{"op", "bias"}}, {{"op", "dropout"}, {"p", 0.1}}, {{"op", "add_extra_input"}},
                          {{"op", "gelu"}}, {{"op", "scale"}, {"value", 2.0}}});
  auto ops = make_ops(rs, seq, {4, 8});
  Plan p = jitfuse::fuser::plan(ops, bf16(), rs, kAllow);
  CHECK(spans(p.forward) == "[0,2):j [2,4):f [4,5)");
  CHECK(spans(p.backward) == "[0,2):j [2,3) [3,5):b");
  CHECK(p.forward[0].joint);
  CHECK(p.backward[0].joint);
  CHECK(p.forward[0].impl.kind == jitfuse::rules::Impl::Kind::joint);
  CHECK(!p.forward[1].joint);
  CHECK(decision(p, Pass::forward, "f_over", 1, 3)->reason == "overlaps joint group j at ops [0, 2)");
  CHECK(decision(p, Pass::joint, "j", 0, 2)->taken);

  SECTION("inference: no joint group (training condition), no backward pass") {
    PlanInputs in = bf16();
    in.training = false;
    Plan q = jitfuse::fuser::plan(ops, in, rs, kAllow);
    CHECK(decision(q, Pass::joint, "j", 0, 2)->reason == "condition training failed: planning for inference (no backward)");
    CHECK(spans(q.forward) == "[0,1) [1,3):f_over [3,4) [4,5)");
    CHECK(spans(q.backward) == "[0,1) [1,2) [2,3) [3,4) [4,5)");
    CHECK(decision(q, Pass::backward, "", 0, 5)->reason == "skipped: planning for inference (training = false)");
  }
}

TEST_CASE("conditions give reasons: divisibility, arch, recipe, dtype, legality", "[fuser]") {
  RuleSet rs = RuleSet::with_builtins();
  auto linear_bias = [&](int in_f, int out_f) {
    json seq = json::array({{{"op", "linear"}, {"in_features", in_f}, {"out_features", out_f}}, {{"op", "bias"}}});
    return make_ops(rs, seq, {16, in_f});
  };
  // The built-in cuBLASLt rules take any in_features and out_features (issue 27).
  Plan p = jitfuse::fuser::plan(linear_bias(4098, 4096), bf16(), rs, kAllow);
  CHECK(spans(p.forward) == "[0,2):linear_bias");
  p = jitfuse::fuser::plan(linear_bias(4096, 4098), bf16(), rs, kAllow);
  CHECK(spans(p.forward) == "[0,2):linear_bias");
  // A rule's own divisibility conditions: cols is the window's input width, out_cols its output's.
  RuleSet div = rules_of(R"J([{"name": "gate", "math": "y = swiglu(x + b)", "pass": "forward", "priority": 1,
      "pattern": ["bias", "swiglu"], "conditions": {"divisible": [{"dim": "cols", "multiple_of": 8},
      {"dim": "out_cols", "multiple_of": 8}]}, "impl": {"kind": "generated", "skeleton": "gated"}}])J");
  auto gate = [&](int64_t cols) {
    auto ops = make_ops(div, json::array({{{"op", "bias"}}, {{"op", "swiglu"}}}), {16, cols});
    return decision(jitfuse::fuser::plan(ops, bf16(), div, kAllow), Pass::forward, "gate", 0, 2)->reason;
  };
  CHECK(gate(4098) == "condition cols % 8 == 0 failed: cols = 4098");
  CHECK(gate(4104) == "condition out_cols % 8 == 0 failed: out_cols = 2052");
  CHECK(gate(4096).empty());
  PlanInputs fp8 = bf16();
  fp8.recipe = "fp8_delayed";
  p = jitfuse::fuser::plan(linear_bias(64, 64), fp8, rs, kAllow);
  CHECK(decision(p, Pass::forward, "linear_bias", 0, 2)->reason ==
        "condition recipe in [fp32, fp16, bf16] failed: recipe = fp8_delayed");
  p = jitfuse::fuser::plan(linear_bias(64, 64), bf16(), rs, kAllow);
  CHECK(spans(p.forward) == "[0,2):linear_bias");

  RuleSet arch = rules_of("[" + rule("hopper", "forward", 1, R"J(["bias", "gelu"])J",
                                     R"J(, "conditions": {"min_arch": 90, "max_arch": 100, "dtypes": ["bf16"], "divisible": [{"dim": "rows", "multiple_of": 4}]})J") +
                          "]");
  auto ops = make_ops(arch, json::array({{{"op", "bias"}}, {{"op", "gelu"}}}), {2, 3, 8});
  auto reason = [&](const PlanInputs& in) {
    return decision(jitfuse::fuser::plan(ops, in, arch, kAllow), Pass::forward, "hopper", 0, 2)->reason;
  };
  CHECK(reason(bf16(80)) == "arch sm_80 < min_arch 90");
  CHECK(reason(bf16(120)) == "arch sm_120 > max_arch 100");
  CHECK(reason(bf16(0)) == "arch unknown; the rule needs min_arch 90: plan with the GPU's arch");
  CHECK(reason(bf16(90)) == "condition rows % 4 == 0 failed: rows = 6");
  PlanInputs f16 = bf16();
  f16.recipe = f16.dtype = "fp16";
  CHECK(reason(f16) == "condition dtype in [bf16] failed: dtype = fp16");
  ops = make_ops(arch, json::array({{{"op", "bias"}}, {{"op", "gelu"}}}), {2, 4, 8});
  CHECK(decision(jitfuse::fuser::plan(ops, bf16(90), arch, kAllow), Pass::forward, "hopper", 0, 2)->taken);

  LegalityFn refuse = [](const jitfuse::rules::Rule& r, const std::vector<jitfuse::ops::Op>&, int, int,
                         Pass) -> std::optional<std::string> { return "no lowering for " + r.name; };
  Plan q = jitfuse::fuser::plan(ops, bf16(90), arch, refuse);
  CHECK(decision(q, Pass::forward, "hopper", 0, 2)->reason == "no lowering for hopper");
  CHECK(spans(q.forward) == "[0,1) [1,2)");
}

TEST_CASE("JITFUSE_DISABLE_FUSION: everything unfused, one decision per pass", "[fuser]") {
  RuleSet rs = RuleSet::with_builtins();
  auto def = jitfuse::ops::parse_sequence_file(jf_test::src("tools/examples/mlp.json"), rs.registry());
  auto ops = jitfuse::ops::infer(def, {64, 4096});
  PlanInputs in = bf16();
  in.disable_fusion = true;
  Plan p = jitfuse::fuser::plan(ops, in, rs, kAllow);
  CHECK(spans(p.forward) == "[0,1) [1,2) [2,3) [3,4) [4,5) [5,6) [6,7)");
  CHECK(spans(p.backward) == spans(p.forward));
  REQUIRE(p.decisions.size() == 3);
  for (const auto& d : p.decisions) {
    CHECK(d.rule.empty());
    CHECK(!d.taken);
    CHECK(d.reason == "fusion disabled by JITFUSE_DISABLE_FUSION");
  }
}

TEST_CASE("the mlp example plans as DESIGN.md expects, deterministically", "[fuser]") {
  RuleSet rs = RuleSet::with_builtins();
  auto def = jitfuse::ops::parse_sequence_file(jf_test::src("tools/examples/mlp.json"), rs.registry());
  auto ops = jitfuse::ops::infer(def, {8192, 4096});
  Plan p = jitfuse::fuser::plan(ops, bf16(), rs, kAllow);
  CHECK(spans(p.forward) == "[0,1) [1,4):linear_bias_gelu [4,7):linear_bias_residual");
  CHECK(spans(p.backward) == "[0,1) [1,3):linear_bias_bwd [3,4) [4,6):linear_bias_bwd [6,7)");
  CHECK(decision(p, Pass::forward, "linear_bias", 1, 3)->reason ==
        "overlaps higher-priority rule linear_bias_gelu at ops [1, 4)");
  Plan again = jitfuse::fuser::plan(ops, bf16(), rs, kAllow);
  REQUIRE(again.decisions.size() == p.decisions.size());
  for (size_t i = 0; i < p.decisions.size(); ++i) {
    CHECK(again.decisions[i].rule == p.decisions[i].rule);
    CHECK(again.decisions[i].begin == p.decisions[i].begin);
    CHECK(again.decisions[i].reason == p.decisions[i].reason);
  }
}

TEST_CASE("check_contiguous catches every way groups can fail to expand to the ops", "[fuser]") {
  auto g = [](int b, int e) { return Group{b, e, "r", 0, {}, false}; };
  CHECK_NOTHROW(jitfuse::fuser::check_contiguous({g(0, 2), g(2, 3)}, 3, "forward"));
  CHECK_NOTHROW(jitfuse::fuser::check_contiguous({}, 0, "forward"));
  auto bad = [](const std::vector<Group>& groups, int n, const std::string& what) {
    try {
      jitfuse::fuser::check_contiguous(groups, n, "backward");
      FAIL("no error for " << what);
    } catch (const jitfuse::Error& e) {
      CHECK(e.status() == jitfuse::Status::internal);
      CHECK_THAT(e.what(), Catch::Contains("internal error after the backward pass") && Catch::Contains(what));
    }
  };
  bad({g(0, 2), g(3, 4)}, 4, "expected a group starting at op 2");  // gap
  bad({g(0, 2), g(1, 3)}, 3, "expected a group starting at op 2");  // overlap
  bad({g(1, 2), g(0, 1)}, 2, "expected a group starting at op 0");  // out of order
  bad({g(0, 0), g(0, 1)}, 1, "covers ops [0, 0)");                  // empty group
  bad({g(0, 2)}, 3, "the groups cover ops [0, 2) but the sequence has 3 ops");
  bad({g(0, 4)}, 3, "covers ops [0, 4)");
}
