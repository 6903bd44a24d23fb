// The built-in rules: they load without a single error, carry what the issue asks (math, passes, epilogues,
// cuBLASLt alignment conditions), and each one's canonical window passes its conditions and the legality predicate.
#include <algorithm>
#include <map>
#include <set>

#include "common/embedded.hpp"
#include "jitfuse/jitfuse.h"
#include "exec/lower/impl/implementation.hpp"
#include "fuser/plan.hpp"
#include "unit/rules/rules_test_util.hpp"

using jf_test::find_rule;
using jitfuse::rules::Impl;
using jitfuse::rules::Pass;
using jitfuse::rules::RuleSet;

TEST_CASE("built-in rules load cleanly and are the documented set", "[rules]") {
  RuleSet rs = RuleSet::with_builtins();
  CHECK(rs.errors().empty());
  CHECK(rs.generation() > 0);
  std::map<std::string, Pass> expected = {
      {"linear_bias", Pass::forward},         {"linear_bias_gelu", Pass::forward},
      {"linear_bias_relu", Pass::forward},    {"linear_bias_residual", Pass::forward},
      {"linear_scale_residual", Pass::forward}, {"bias_act", Pass::forward},
      {"linear_residual", Pass::forward},
      {"bias_gated", Pass::forward},          {"bias_dropout_add", Pass::forward},
      {"norm_pointwise", Pass::forward},      {"add_norm", Pass::forward}, {"fork_norm", Pass::forward},
      {"allreduce_fork_norm", Pass::forward},
      {"gated_pointwise", Pass::forward},         {"pointwise_chain", Pass::forward},
      {"act_dbias", Pass::backward},          {"extra_output_linear", Pass::backward},
      {"linear_scale_bwd", Pass::backward},   {"norm_residual_bwd", Pass::backward},
      {"bias_gated_bwd", Pass::backward},     {"bias_dropout_add_joint", Pass::joint},
      {"linear_silu_recompute", Pass::joint}, {"bias_gelu_linear_bias_bwd", Pass::backward},
      {"all_gather_linear_overlap", Pass::joint}, {"linear_reduce_scatter_overlap", Pass::joint},
      {"gated_linear_reduce_scatter_overlap", Pass::joint},
      {"all_reduce_linear_overlap", Pass::joint},
      {"bias_gelu_linear_bwd", Pass::backward}, {"linear_bias_bwd", Pass::backward},
      {"norm_quantize", Pass::forward},       {"bias_act_quantize", Pass::forward},
      {"gated_quantize", Pass::forward},       {"linear_gelu", Pass::forward},
      {"linear_relu", Pass::forward},         {"gated_pointwise_bwd", Pass::backward},
      {"pointwise_chain_bwd", Pass::backward},
      {"fp8_norm_linear", Pass::forward},     {"fp8_act_linear", Pass::forward},
      {"fp8_linear_bias", Pass::forward},     {"fp8_linear_act_bwd", Pass::backward},
      {"fp8_linear_bias_bwd", Pass::backward}, {"fp8_norm_linear_quantize", Pass::forward},
      {"fp8_act_linear_quantize", Pass::forward}, {"fp8_linear_quantize", Pass::forward},
      {"fp8_linear_pointwise_bwd", Pass::backward},
      {"linear_cross_entropy_chunked", Pass::joint}, {"moe_unpermute_residual", Pass::forward},
      {"grouped_mlp_recompute", Pass::joint},
  };
  CHECK(rs.rules().size() == expected.size());
  std::set<size_t> orders;
  for (const auto& r : rs.rules()) {
    INFO(r.name);
    REQUIRE(expected.count(r.name) == 1);
    CHECK(r.pass == expected[r.name]);
    CHECK(!r.math.empty());
    CHECK_THAT(r.file, Catch::StartsWith("<builtin>/"));
    CHECK_THAT(r.where, Catch::StartsWith(r.file + ":"));
    orders.insert(r.order);
    // cuBLASLt takes any in_features and out_features (issue 27): what it does need (the GELU epilogues'
    // aux leading dimension, FP8's 16-multiples) the implementations check, with the reason.
    CHECK(r.conditions.divisible.empty());
    if (r.pass == Pass::joint) {
      CHECK(r.impl.kind == Impl::Kind::joint);
      // Pipelining a GEMM with its collective pays in inference too; the other strategies save less for a backward.
      if (r.impl.strategy != "overlap_collective") CHECK(r.conditions.training == std::optional<bool>(true));
    }
  }
  CHECK(orders.size() == rs.rules().size());  // a total order for tie-breaking
  CHECK(find_rule(rs, "linear_bias_gelu")->impl.epilogue == "GELU_AUX_BIAS");
  CHECK(find_rule(rs, "linear_bias_gelu")->pattern[2].attrs == nlohmann::json{{"approximate", "tanh"}});
  CHECK(find_rule(rs, "extra_output_linear")->impl.epilogue == "DGRAD_ACCUMULATE");
  CHECK(find_rule(rs, "bias_gelu_linear_bias_bwd")->impl.epilogue == "DGELU_BGRAD");
  CHECK(find_rule(rs, "bias_gelu_linear_bias_bwd")->impl.epilogue_ops == 4);
  CHECK(find_rule(rs, "linear_bias_bwd")->impl.epilogue == "BGRADB");
  CHECK(find_rule(rs, "bias_dropout_add_joint")->impl.saves == std::vector<std::string>{"seed", "offset"});
  CHECK(find_rule(rs, "linear_silu_recompute")->impl.strategy == "recompute_linear_output");
  CHECK(find_rule(rs, "pointwise_chain")->priority < find_rule(rs, "bias_act")->priority);
}

TEST_CASE("the embedded schema.json is JSON Schema, not a rules file", "[rules]") {
  bool found = false;
  for (const auto& f : jitfuse::embedded::rules) {
    if (f.path != "schema.json") continue;
    found = true;
    auto schema = nlohmann::json::parse(f.content);
    CHECK(schema.at("$schema") == "https://json-schema.org/draft/2020-12/schema");
    CHECK(schema.at("properties").at("format").at("const") == "jitfuse.rules/1");
  }
  CHECK(found);
}

namespace {

// The simplest sequence a rule's pattern describes: the first kind of each required element (after the
// moe_permute whose routing a moe_unpermute reads).
nlohmann::json canonical_ops(const jitfuse::rules::Rule& r, int64_t& cols) {
  nlohmann::json ops = nlohmann::json::array();
  if (!r.pattern.empty() && r.pattern[0].kinds[0] == "moe_unpermute")
    ops.push_back({{"op", "moe_permute"}, {"num_experts", 8}, {"top_k", 1}});
  int64_t c = cols;
  for (const auto& e : r.pattern) {
    if (e.optional) continue;
    nlohmann::json op = e.attrs;
    op["op"] = e.kinds[0];
    if (e.kinds[0] == "linear") {
      op["in_features"] = c;
      op["out_features"] = 128;
      c = 128;
    }
    if (e.kinds[0] == "grouped_linear") {  // 16 rows: 4 equal groups
      op["num_groups"] = 4;
      op["in_features"] = c;
      op["out_features"] = 128;
      c = 128;
    }
    if (e.kinds[0] == "scale") op["value"] = 0.5;
    if (e.kinds[0] == "dropout") op["p"] = 0.1;
    if (e.kinds[0] == "swiglu" || e.kinds[0] == "geglu" || e.kinds[0] == "reglu") c /= 2;
    ops.push_back(op);
  }
  return ops;
}

}  // namespace

TEST_CASE("every built-in rule's canonical window passes its conditions and the legality predicate", "[rules]") {
  RuleSet rs = RuleSet::with_builtins();
  for (const auto& r : rs.rules()) {
    INFO("rule " << r.name);
    int64_t cols = 256;
    auto ops = jf_test::make_ops(rs, canonical_ops(r, cols), {16, cols});
    jitfuse::fuser::PlanInputs in;
    in.recipe = in.dtype = "bf16";
    // The FP8 cast rules apply under the FP8 recipes only (activations stay bf16).
    if (std::find(r.conditions.recipes.begin(), r.conditions.recipes.end(), "bf16") == r.conditions.recipes.end() &&
        !r.conditions.recipes.empty())
      in.recipe = r.conditions.recipes.front();
    in.arch = 90;
    auto plan = jitfuse::fuser::plan(ops, in, rs, jitfuse::exec::legality(in.recipe.rfind("fp8", 0) == 0));
    bool seen = false;
    const int first = r.pattern[0].kinds[0] == "moe_unpermute" ? 1 : 0;  // after the moe_permute canonical_ops adds
    for (const auto& d : plan.decisions) {
      if (d.rule != r.name || d.begin != first || d.end != static_cast<int>(ops.size())) continue;
      seen = true;
      INFO("reason: " << d.reason);
      // Taken, or lost only to another rule: never refused by a condition or by legality.
      CHECK((d.taken || d.reason.rfind("overlaps", 0) == 0));
    }
    CHECK(seen);
  }
}

TEST_CASE("the opt-in rules in fusion_rules/optional load cleanly and are not built in", "[rules]") {
  jf_context ctx = nullptr;
  REQUIRE(jf_context_create(&ctx) == JF_OK);
  int errors = -1;
  REQUIRE(jf_context_load_rules(ctx, JF_SOURCE_DIR "/fusion_rules/optional", &errors) == JF_OK);
  CHECK(errors == 0);
  jf_context_destroy(ctx);
  RuleSet rs = RuleSet::with_builtins();
  for (const auto& r : rs.rules()) CHECK(r.impl.strategy != "relu_bitmask");
}
