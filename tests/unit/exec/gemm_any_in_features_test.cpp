// Issue 27, "any in_features": the cuBLASLt rules fuse a linear of any K (and any out_features and row
// count) under fp32/fp16/bf16, planned and lowered; the conditions that stay are cuBLASLt's real ones, each
// refusing with its reason: the GELU epilogues' aux leading dimension (a multiple of 8) and the FP8 GEMMs'
// 16-multiples.
#include <catch2/catch.hpp>

#include "cuda/cublaslt.hpp"
#include "exec/lower/compile.hpp"
#include "exec/lower/impl/implementation.hpp"
#include "exec/ir/program.hpp"
#include "fuser/plan.hpp"
#include "rules/rule.hpp"
#include "unit/rules/rules_test_util.hpp"

using namespace jitfuse;
using nlohmann::json;
using rules::Pass;

namespace {

const rules::RuleSet& builtins() {
  static const rules::RuleSet rs = rules::RuleSet::with_builtins();
  return rs;
}

json linear(int64_t in, int64_t out) { return {{"op", "linear"}, {"in_features", in}, {"out_features", out}}; }
json op(const char* kind) { return {{"op", kind}}; }
json gelu_tanh() { return {{"op", "gelu"}, {"approximate", "tanh"}}; }
json scale(double v) { return {{"op", "scale"}, {"value", v}}; }

std::string spans(const std::vector<fuser::Group>& groups) {
  std::string out;
  for (const auto& g : groups)
    out += (out.empty() ? "" : " ") + std::string("[") + std::to_string(g.begin) + "," + std::to_string(g.end) + ")" +
           (g.rule.empty() ? "" : ":" + g.rule);
  return out;
}

const fuser::Decision* decision(const fuser::Plan& p, Pass pass, const std::string& rule, int b, int e) {
  for (const auto& d : p.decisions)
    if (d.pass == pass && d.rule == rule && d.begin == b && d.end == e) return &d;
  return nullptr;
}

// The program of `ops` (planned with the implementations' legality, then lowered), as a context makes it.
std::shared_ptr<const exec::Program> program_of(const json& ops, const char* recipe, const ops::Shape& shape,
                                                bool training = true) {
  exec::CompileOptions o;
  o.arch = 90;
  o.training = training;
  return exec::compile(jf_test::make_ops(builtins(), ops, shape), "t", ops::parse_recipe(recipe), o, builtins());
}

fuser::Plan plan_of(const json& ops, const char* recipe, const ops::Shape& shape, bool training = true) {
  fuser::PlanInputs in;
  in.recipe = recipe;
  in.dtype = std::string(recipe).rfind("fp8", 0) == 0 ? "bf16" : recipe;
  in.arch = 90;
  in.training = training;
  return fuser::plan(jf_test::make_ops(builtins(), ops, shape), in, builtins(),
                     exec::legality(std::string(recipe).rfind("fp8", 0) == 0));
}

// The GEMM steps' epilogues of a pass, in order ("DEFAULT BGRADB").
std::string gemms(const std::vector<exec::Step>& steps) {
  std::string out;
  for (const auto& s : steps)
    if (s.kind == exec::Step::Kind::gemm) out += (out.empty() ? "" : " ") + cuda::epilogue_name(s.gemm.call.epilogue);
  return out;
}

constexpr int64_t kOddK[] = {1, 5, 7, 13, 100};
constexpr const char* kPlain[] = {"fp32", "fp16", "bf16"};

}  // namespace

TEST_CASE("linear -> bias (-> gelu | relu) fuses for any in_features, forward and backward", "[exec][rules]") {
  struct Case {
    json ops;
    std::string forward, backward, fwd_gemms, bwd_gemms;
  };
  for (const int64_t k : kOddK)
    for (const char* recipe : kPlain)
      for (const int64_t rows : {int64_t{3}, int64_t{97}}) {
        const Case cases[] = {
            {json::array({linear(k, 48), op("bias"), op("gelu")}), "[0,3):linear_bias_gelu", "[0,2):linear_bias_bwd [2,3)",
             "GELU_AUX_BIAS", "DEFAULT BGRADB"},
            {json::array({linear(k, 48), op("bias"), op("relu")}), "[0,3):linear_bias_relu", "[0,2):linear_bias_bwd [2,3)",
             "RELU_BIAS", "DEFAULT BGRADB"},
            {json::array({linear(k, 48), op("bias")}), "[0,2):linear_bias", "[0,2):linear_bias_bwd", "BIAS",
             "DEFAULT BGRADB"},
        };
        for (const auto& c : cases) {
          INFO(recipe << " K=" << k << " rows=" << rows << " " << c.ops.dump());
          auto p = program_of(c.ops, recipe, {rows, k});
          CHECK(spans(p->plan.forward) == c.forward);
          CHECK(spans(p->plan.backward) == c.backward);
          CHECK(gemms(p->forward) == c.fwd_gemms);
          CHECK(gemms(p->backward) == c.bwd_gemms);
          // Every GEMM has the linear's own dims (GemmCall's m, n, k are x [m, k], W [n, k]): no padding.
          for (const auto* steps : {&p->forward, &p->backward})
            for (const auto& s : *steps)
              if (s.kind == exec::Step::Kind::gemm) {
                CHECK(s.gemm.call.m == rows);
                CHECK(s.gemm.call.n == 48);
                CHECK(s.gemm.call.k == k);
              }
        }
      }
}

TEST_CASE("the other cuBLASLt rules take any in_features too", "[exec][rules]") {
  const json residual = op("add_extra_input");
  for (const int64_t k : kOddK)
    for (const char* recipe : kPlain) {
      INFO(recipe << " K=" << k);
      auto fwd = [&](const json& ops) { return spans(plan_of(ops, recipe, {5, k}).forward); };
      auto bwd = [&](const json& ops) { return spans(plan_of(ops, recipe, {5, k}).backward); };
      CHECK(fwd(json::array({linear(k, 48), gelu_tanh()})) == "[0,2):linear_gelu");
      CHECK(fwd(json::array({linear(k, 48), op("relu")})) == "[0,2):linear_relu");
      CHECK(fwd(json::array({linear(k, 48), op("bias"), residual})) == "[0,3):linear_bias_residual");
      CHECK(fwd(json::array({linear(k, 48), residual})) == "[0,2):linear_residual");
      CHECK(fwd(json::array({linear(k, 48), scale(0.5), residual})) == "[0,3):linear_scale_residual");
      CHECK(bwd(json::array({op("make_extra_output"), linear(k, 32)})) == "[0,2):extra_output_linear");
      CHECK(bwd(json::array({linear(k, 32), scale(0.125)})) == "[0,2):linear_scale_bwd");
      // Odd out_features: everything but the GELU epilogues' aux (below).
      CHECK(spans(plan_of(json::array({linear(64, k), op("bias"), op("relu")}), recipe, {5, 64}).forward) ==
            "[0,3):linear_bias_relu");
      CHECK(spans(plan_of(json::array({linear(64, k), op("bias")}), recipe, {5, 64}).backward) == "[0,2):linear_bias_bwd");
    }
}

TEST_CASE("the GELU epilogues' aux leading dimension stays a multiple of 8, with cuBLASLt's reason", "[exec][rules]") {
  for (const int64_t n : kOddK) {
    INFO("out_features " << n);
    // Forward: GELU_AUX(_BIAS)'s aux matrix has out_features as its leading dimension.
    auto p = plan_of(json::array({linear(64, n), op("bias"), op("gelu")}), "bf16", {7, 64});
    const std::string why = "GELU_AUX_BIAS saves gelu's input as cuBLASLt's aux matrix, whose leading dimension is "
                            "out_features = " + std::to_string(n) +
                            "; cuBLASLt needs it to be a multiple of 8 (CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD)";
    REQUIRE(decision(p, Pass::forward, "linear_bias_gelu", 0, 3) != nullptr);
    CHECK(decision(p, Pass::forward, "linear_bias_gelu", 0, 3)->reason == why);
    CHECK(spans(p.forward) == "[0,2):linear_bias [2,3)");
    p = plan_of(json::array({linear(64, n), gelu_tanh()}), "fp32", {7, 64});
    REQUIRE(decision(p, Pass::forward, "linear_gelu", 0, 2) != nullptr);
    CHECK_THAT(decision(p, Pass::forward, "linear_gelu", 0, 2)->reason,
               Catch::StartsWith("GELU_AUX saves gelu's input as cuBLASLt's aux matrix") &&
                   Catch::Contains("out_features = " + std::to_string(n)));
    // Backward: DGELU_BGRAD's aux (gelu's saved input) has the linear's in_features as its leading dimension.
    const json dgelu = json::array({op("bias"), gelu_tanh(), linear(n, 40), op("bias")});
    p = plan_of(dgelu, "bf16", {7, n});
    REQUIRE(decision(p, Pass::backward, "bias_gelu_linear_bias_bwd", 0, 4) != nullptr);
    CHECK(decision(p, Pass::backward, "bias_gelu_linear_bias_bwd", 0, 4)->reason ==
          "DGELU_BGRAD reads gelu's input as cuBLASLt's aux matrix, whose leading dimension is the linear's "
          "in_features = " + std::to_string(n) +
              "; cuBLASLt needs it to be a multiple of 8 (CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD)");
  }
  // Not the DGELU_BGRAD linear's out_features: there the rule is only outranked (act_dbias, linear_bias_bwd).
  auto p = plan_of(json::array({op("bias"), gelu_tanh(), linear(72, 13), op("bias")}), "bf16", {7, 72});
  REQUIRE(decision(p, Pass::backward, "bias_gelu_linear_bias_bwd", 0, 4) != nullptr);
  CHECK_THAT(decision(p, Pass::backward, "bias_gelu_linear_bias_bwd", 0, 4)->reason, Catch::StartsWith("overlaps"));
}

TEST_CASE("FP8 rules keep their 16-multiples, with the reason shown", "[exec][rules]") {
  const std::string k_why = "FP8 GEMMs need in_features to be a multiple of 16 (cuBLASLt's FP8 kernels need 16-byte "
                            "aligned leading dimensions): op 0 (linear) has in_features = 100";
  for (const char* recipe : {"fp8_delayed", "fp8_current"}) {
    INFO(recipe);
    auto p = plan_of(json::array({linear(100, 64), op("bias")}), recipe, {32, 100});
    REQUIRE(decision(p, Pass::forward, "fp8_linear_bias", 0, 2) != nullptr);
    CHECK(decision(p, Pass::forward, "fp8_linear_bias", 0, 2)->reason == k_why);
    REQUIRE(decision(p, Pass::backward, "fp8_linear_bias_bwd", 0, 2) != nullptr);
    CHECK(decision(p, Pass::backward, "fp8_linear_bias_bwd", 0, 2)->reason == k_why);
    CHECK(spans(p.forward) == "[0,1) [1,2)");
    // The plain-recipe rule names its recipes first.
    CHECK(decision(p, Pass::forward, "linear_bias", 0, 2)->reason ==
          "condition recipe in [fp32, fp16, bf16] failed: recipe = " + std::string(recipe));
    // A norm or an activation before the linear: the same reason.
    p = plan_of(json::array({op("layernorm"), linear(100, 64), op("bias")}), recipe, {32, 100});
    REQUIRE(decision(p, Pass::forward, "fp8_norm_linear", 0, 3) != nullptr);
    CHECK_THAT(decision(p, Pass::forward, "fp8_norm_linear", 0, 3)->reason,
               Catch::StartsWith("FP8 GEMMs need in_features to be a multiple of 16") &&
                   Catch::EndsWith("op 1 (linear) has in_features = 100"));
    // out_features, and the rows in the backward (the wgrad contracts over them).
    p = plan_of(json::array({linear(64, 100), op("bias")}), recipe, {32, 64});
    CHECK_THAT(decision(p, Pass::forward, "fp8_linear_bias", 0, 2)->reason,
               Catch::EndsWith("op 0 (linear) has out_features = 100"));
    p = plan_of(json::array({linear(64, 64), op("bias")}), recipe, {100, 64});
    CHECK(decision(p, Pass::forward, "fp8_linear_bias", 0, 2)->taken);
    CHECK_THAT(decision(p, Pass::backward, "fp8_linear_bias_bwd", 0, 2)->reason,
               Catch::Contains("the wgrad GEMM contracts over the rows") && Catch::EndsWith("has rows = 100"));
    // Inference has no wgrad: any row count.
    p = plan_of(json::array({linear(64, 64), op("bias")}), recipe, {100, 64}, false);
    CHECK(decision(p, Pass::forward, "fp8_linear_bias", 0, 2)->taken);
    // Multiples of 16: taken.
    p = plan_of(json::array({linear(96, 64), op("bias")}), recipe, {32, 96});
    CHECK(spans(p.forward) == "[0,2):fp8_linear_bias");
    CHECK(spans(p.backward) == "[0,2):fp8_linear_bias_bwd");
  }
}
