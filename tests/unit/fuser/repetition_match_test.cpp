// Matching with repetition and op classes: chains of every length up to the bound, greedy-longest within the
// existing priority order, user ops by their declared family, what explain shows, and the built-in rules
// fusing pointwise runs in both passes (swiglu scale backward in one kernel).
#include "exec/lower/impl/implementation.hpp"
#include "fuser/explain.hpp"
#include "fuser/plan.hpp"
#include "unit/rules/rules_test_util.hpp"

using jf_test::make_ops;
using jitfuse::fuser::Decision;
using jitfuse::fuser::Group;
using jitfuse::fuser::Plan;
using jitfuse::fuser::PlanInputs;
using jitfuse::rules::kMaxRepeat;
using jitfuse::rules::Pass;
using jitfuse::rules::RuleSet;
using nlohmann::json;

namespace {

RuleSet rules_of(const std::string& rules_array) {
  RuleSet rs;
  auto errs = rs.load_text("{\"format\": \"jitfuse.rules/1\", \"rules\": " + rules_array + "}", "test.json", "");
  for (const auto& e : errs) UNSCOPED_INFO(e.to_string());
  REQUIRE(errs.empty());
  return rs;
}

std::string rule(const std::string& name, const std::string& pass, int prio, const std::string& pattern,
                 const std::string& skeleton = "elementwise") {
  return "{\"name\": \"" + name + "\", \"math\": \"y = f(x)\", \"pass\": \"" + pass + "\", \"priority\": " +
         std::to_string(prio) + ", \"pattern\": " + pattern + ", \"impl\": {\"kind\": \"generated\", \"skeleton\": \"" +
         skeleton + "\"}}";
}

PlanInputs bf16() {
  PlanInputs in;
  in.recipe = in.dtype = "bf16";
  in.arch = 90;
  return in;
}

std::string spans(const std::vector<Group>& groups) {
  std::string out;
  for (const auto& g : groups)
    out += (out.empty() ? "" : " ") + std::string("[") + std::to_string(g.begin) + "," + std::to_string(g.end) + ")" +
           (g.rule.empty() ? "" : ":" + g.rule);
  return out;
}

// n pointwise ops cycling through several kinds.
json chain(int n) {
  const char* kinds[] = {"gelu", "scale", "silu", "relu", "qgelu", "srelu"};
  json ops = json::array();
  for (int i = 0; i < n; ++i) {
    json op = {{"op", kinds[i % 6]}};
    if (std::string(kinds[i % 6]) == "scale") op["value"] = 0.5;
    ops.push_back(op);
  }
  return ops;
}

const Decision* taken(const Plan& p, Pass pass, const std::string& rule) {
  for (const auto& d : p.decisions)
    if (d.pass == pass && d.rule == rule && d.taken) return &d;
  return nullptr;
}

}  // namespace

TEST_CASE("a repeated class element covers chains of every length up to the bound", "[fuser][repetition]") {
  RuleSet rs = rules_of("[" + rule("chain", "forward", 5, R"(["@pointwise+"])") + "]");
  for (int n = 1; n <= kMaxRepeat; ++n) {
    INFO("n = " << n);
    auto ops = make_ops(rs, chain(n), {4, 64});
    auto p = jitfuse::fuser::plan(ops, bf16(), rs, {});
    CHECK(spans(p.forward) == "[0," + std::to_string(n) + "):chain");
  }
  // Past the bound the run splits into windows of at most kMaxRepeat ops, greedily from the left.
  auto ops = make_ops(rs, chain(kMaxRepeat + 3), {4, 64});
  auto p = jitfuse::fuser::plan(ops, bf16(), rs, {});
  CHECK(spans(p.forward) == "[0,16):chain [16,19):chain");
}

TEST_CASE("+ needs one op, * none, and a non-member ends the run", "[fuser][repetition]") {
  RuleSet rs = rules_of("[" + rule("bias_tail", "forward", 5, R"(["bias", "gelu", "@pointwise*"])") + "," +
                        rule("act_run", "backward", 5, R"(["bias", "@activation+"])") + "]");
  auto ops = make_ops(rs, json::parse(R"([{"op": "bias"}, {"op": "gelu"}, {"op": "bias"}, {"op": "gelu"},
      {"op": "scale", "value": 2}, {"op": "silu"}, {"op": "swiglu"}])"), {4, 64});
  auto p = jitfuse::fuser::plan(ops, bf16(), rs, {});
  CHECK(spans(p.forward) == "[0,2):bias_tail [2,6):bias_tail [6,7)");
  // @activation stops at scale (not an activation): bias gelu only.
  CHECK(spans(p.backward) == "[0,2):act_run [2,4):act_run [4,5) [5,6) [6,7)");
}

TEST_CASE("priority still wins over length, and the longer of equal priority wins", "[fuser][repetition]") {
  auto plan_with = [](const std::string& other, int prio) {
    RuleSet rs = rules_of("[" + rule("chain", "forward", 5, R"(["@pointwise", "@pointwise+"])") + "," +
                          rule("pair", "forward", prio, other) + "]");
    auto ops = make_ops(rs, chain(5), {4, 64});  // gelu scale silu relu qgelu
    return spans(jitfuse::fuser::plan(ops, bf16(), rs, {}).forward);
  };
  // A window is taken whole or not at all: the chain from op 0 overlaps the higher-priority pair and is
  // dropped; the chain from op 3 (after it) is taken.
  CHECK(plan_with(R"(["scale", "silu"])", 20) == "[0,1) [1,3):pair [3,5):chain");
  CHECK(plan_with(R"(["gelu", "scale"])", 5) == "[0,5):chain");
  CHECK(plan_with(R"(["gelu", "scale"])", 6) == "[0,2):pair [2,5):chain");
}

TEST_CASE("a repeated window an implementation refuses falls back to the longest legal one", "[fuser][repetition]") {
  RuleSet rs = RuleSet::with_builtins();
  // reshape runs alone: the chain stops before it.
  auto ops = make_ops(rs, json::parse(R"([{"op": "gelu"}, {"op": "scale", "value": 2}, {"op": "silu"},
      {"op": "reshape", "shape": [-1]}, {"op": "relu"}, {"op": "identity"}])"), {4, 64});
  auto p = jitfuse::fuser::plan(ops, bf16(), rs, jitfuse::exec::legality());
  CHECK(spans(p.forward) == "[0,3):pointwise_chain [3,4) [4,6):pointwise_chain");
  CHECK(spans(p.backward) == "[0,3):pointwise_chain_bwd [3,4) [4,6):pointwise_chain_bwd");
}

TEST_CASE("a user op joins @activation and @pointwise by its declared family", "[fuser][repetition]") {
  RuleSet rs;
  REQUIRE(rs.load_path(jf_test::src("docs/examples/softplus")).empty());
  auto errs = rs.load_text("{\"format\": \"jitfuse.rules/1\", \"rules\": [" +
                               rule("act_chain", "forward", 50, R"(["@activation", "@pointwise+"])") + "]}",
                           "chain.json", "");
  REQUIRE(errs.empty());
  auto ops = make_ops(rs, json::parse(R"([{"op": "softplus"}, {"op": "scale", "value": 2}, {"op": "gelu"}])"),
                      {4, 64});
  auto p = jitfuse::fuser::plan(ops, bf16(), rs, jitfuse::exec::legality());
  CHECK(spans(p.forward) == "[0,3):act_chain");
  // A class rule loaded before the user op exists still matches it: classes are matched by family at plan time.
  RuleSet early = rules_of("[" + rule("act_chain", "forward", 50, R"(["@activation", "@pointwise+"])") + "]");
  REQUIRE(early.load_path(jf_test::src("docs/examples/softplus")).empty());
  ops = make_ops(early, json::parse(R"([{"op": "softplus"}, {"op": "scale", "value": 2}])"), {4, 64});
  p = jitfuse::fuser::plan(ops, bf16(), early, jitfuse::exec::legality());
  CHECK(spans(p.forward) == "[0,2):act_chain");
}

TEST_CASE("explain shows which class or repeated element took which ops", "[fuser][repetition][explain]") {
  RuleSet rs = rules_of("[" + rule("bias_tail", "forward", 5, R"(["bias", "@activation", "@pointwise*", "dropout?"])") +
                        "]");
  auto ops = make_ops(rs, json::parse(R"([{"op": "bias"}, {"op": "silu"}, {"op": "scale", "value": 2},
      {"op": "gelu"}, {"op": "relu"}])"), {4, 64});
  auto p = jitfuse::fuser::plan(ops, bf16(), rs, {});
  const Decision* d = taken(p, Pass::forward, "bias_tail");
  REQUIRE(d != nullptr);
  REQUIRE(d->match.size() == 4);
  CHECK(d->match[0].element == "bias");
  CHECK((d->match[0].begin == 0 && d->match[0].end == 1));
  CHECK(d->match[1].element == "@activation");
  CHECK((d->match[1].begin == 1 && d->match[1].end == 2));
  CHECK(d->match[2].element == "@pointwise*");
  CHECK((d->match[2].begin == 2 && d->match[2].end == 5));
  CHECK(d->match[3].element == "dropout?");
  CHECK(d->match[3].begin == d->match[3].end);
  json j = jitfuse::fuser::plan_json(p, ops);
  json m;
  for (const auto& dj : j["decisions"])
    if (dj["rule"] == "bias_tail" && dj["taken"] == true) m = dj["match"];
  REQUIRE(m.is_array());
  CHECK(m[2] == json({{"element", "@pointwise*"}, {"begin", 2}, {"end", 5}, {"ops", {"scale", "gelu", "relu"}}}));
  // Rules without a class or repetition keep their decisions as they were (no "match").
  RuleSet plain = rules_of("[" + rule("pair", "forward", 5, R"(["bias", "gelu"])") + "]");
  auto ops2 = make_ops(plain, json::parse(R"([{"op": "bias"}, {"op": "gelu"}])"), {4, 64});
  auto p2 = jitfuse::fuser::plan(ops2, bf16(), plain, {});
  REQUIRE(taken(p2, Pass::forward, "pair") != nullptr);
  CHECK(taken(p2, Pass::forward, "pair")->match.empty());
  CHECK_FALSE(jitfuse::fuser::plan_json(p2, ops2)["decisions"][0].contains("match"));
}

TEST_CASE("the explain CLI prints the class match under the taken rule", "[fuser][repetition][explain][cli]") {
  jf_test::TempDir d;
  std::string seq = d.write("s.json", R"({"format": "jitfuse.sequence/1", "name": "s", "ops": [
      {"op": "gelu"}, {"op": "scale", "value": 2}, {"op": "silu"}, {"op": "relu"}]})");
  auto r = jf_test::run_cli("explain '" + seq + "' --recipe bf16 --shape 8x64");
  INFO(r.out);
  CHECK(r.status == 0);
  CHECK_THAT(r.out, Catch::Contains("pointwise_chain"));
  CHECK_THAT(r.out, Catch::Contains("(@pointwise|dropout|add_extra_input)+"));
  CHECK_THAT(r.out, Catch::Contains("ops [1, 4): scale silu relu"));
}

TEST_CASE("built-in rules fuse pointwise runs in both passes, and swiglu scale backward is one group",
          "[fuser][repetition][rules]") {
  RuleSet rs = RuleSet::with_builtins();
  auto plan_of = [&](const char* ops_json) {
    auto ops = make_ops(rs, json::parse(ops_json), {16, 256});
    return jitfuse::fuser::plan(ops, bf16(), rs, jitfuse::exec::legality());
  };
  auto p = plan_of(R"([{"op": "swiglu"}, {"op": "scale", "value": 0.5}])");
  CHECK(spans(p.forward) == "[0,2):gated_pointwise");
  CHECK(spans(p.backward) == "[0,2):gated_pointwise_bwd");

  p = plan_of(R"([{"op": "bias"}, {"op": "swiglu"}, {"op": "scale", "value": 0.5}, {"op": "gelu"}])");
  CHECK(spans(p.forward) == "[0,4):bias_gated");
  CHECK(spans(p.backward) == "[0,4):bias_gated_bwd");

  p = plan_of(R"([{"op": "bias"}, {"op": "gelu"}, {"op": "scale", "value": 2}, {"op": "silu"}])");
  CHECK(spans(p.forward) == "[0,4):bias_act");
  CHECK(spans(p.backward) == "[0,4):act_dbias");

  p = plan_of(R"([{"op": "gelu"}, {"op": "scale", "value": 2}, {"op": "silu"}, {"op": "relu"}, {"op": "qgelu"},
      {"op": "dropout", "p": 0.1}, {"op": "add_extra_input"}])");
  CHECK(spans(p.forward) == "[0,7):pointwise_chain");
  CHECK(spans(p.backward) == "[0,7):pointwise_chain_bwd");

  // No two adjacent pointwise ops stay apart in either pass (reshape aside: it runs alone by design).
  for (const auto* groups : {&p.forward, &p.backward})
    for (size_t i = 0; i + 1 < groups->size(); ++i)
      CHECK(!((*groups)[i].rule.empty() && (*groups)[i + 1].rule.empty()));
}
