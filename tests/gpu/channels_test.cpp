// Named channels on the GPU (docs/ops.md#channels): every channel shape (hidden, fan-out, returned, from
// the caller) and the Llama- and GPT-2-style MLP blocks as one sequence each, forward and backward against
// the float64 reference (tools/harness/check: fresh random inputs, outputs poisoned, the recipe's tolerances),
// fused and with fusion off, on odd row counts and misaligned pointers.
#include "gpu/gpu_check.hpp"

using namespace jitfuse;
using jitfuse::test::run_check;

namespace {

std::string seq(const std::string& ops_json, const std::string& inputs = "") {
  return R"({"format": "jitfuse.sequence/1", "name": "channels", )" +
         (inputs.empty() ? std::string() : R"("input_channels": )" + inputs + ", ") + R"("ops": )" + ops_json + "}";
}

// Hidden 64, intermediate 96 (FP8 GEMMs need multiples of 16).
const std::string kLlama = seq(R"([{"op": "make_extra_output", "channel": "residual"}, {"op": "rmsnorm"},
    {"op": "linear", "in_features": 64, "out_features": 192}, {"op": "swiglu"},
    {"op": "linear", "in_features": 96, "out_features": 64}, {"op": "add_extra_input", "channel": "residual"}])");
const std::string kGpt2 = seq(R"([{"op": "make_extra_output", "channel": "residual"}, {"op": "layernorm"},
    {"op": "linear", "in_features": 64, "out_features": 256}, {"op": "bias"}, {"op": "gelu", "approximate": "tanh"},
    {"op": "linear", "in_features": 256, "out_features": 64}, {"op": "bias"}, {"op": "dropout", "p": 0.1, "seed": 11},
    {"op": "add_extra_input", "channel": "residual"}])");
// The residual of the attention half comes in from the caller and feeds both halves' residual adds.
const std::string kLlamaWithSkip = seq(R"([{"op": "add_extra_input", "channel": "skip"},
    {"op": "make_extra_output", "channel": "residual"}, {"op": "rmsnorm"},
    {"op": "linear", "in_features": 64, "out_features": 192}, {"op": "swiglu"},
    {"op": "linear", "in_features": 96, "out_features": 64}, {"op": "add_extra_input", "channel": "residual"},
    {"op": "add_extra_input", "channel": "skip"}])", R"(["skip"])");

struct Shape {
  const char* what;
  std::string json;
};

const Shape kShapes[] = {
    {"hidden, one reader", seq(R"([{"op": "make_extra_output", "channel": "r"}, {"op": "gelu"}, {"op": "scale", "value": 0.5},
                                   {"op": "add_extra_input", "channel": "r"}])")},
    {"fan-out: three readers", seq(R"([{"op": "make_extra_output", "channel": "r"}, {"op": "gelu"},
                                       {"op": "add_extra_input", "channel": "r"}, {"op": "silu"},
                                       {"op": "add_extra_input", "channel": "r"}, {"op": "relu"},
                                       {"op": "add_extra_input", "channel": "r"}])")},
    {"fan-out, two readers side by side", seq(R"([{"op": "make_extra_output", "channel": "r"}, {"op": "gelu"},
                                                  {"op": "add_extra_input", "channel": "r"},
                                                  {"op": "add_extra_input", "channel": "r"}])")},
    {"returned and read", seq(R"([{"op": "make_extra_output", "channel": "r", "returned": true}, {"op": "silu"},
                                  {"op": "add_extra_input", "channel": "r"}])")},
    {"returned and read, through a linear", seq(R"([{"op": "make_extra_output", "channel": "r", "returned": true},
                                                    {"op": "linear", "in_features": 64, "out_features": 64},
                                                    {"op": "add_extra_input", "channel": "r"}])")},
    {"hidden through a linear (cuBLASLt accumulates)", seq(R"([{"op": "make_extra_output", "channel": "r"},
                                                    {"op": "linear", "in_features": 64, "out_features": 64}, {"op": "bias"},
                                                    {"op": "add_extra_input", "channel": "r"}])")},
    {"from the caller, two readers, beside plain extras",
     seq(R"([{"op": "add_extra_input", "channel": "skip"}, {"op": "gelu"}, {"op": "add_extra_input"},
             {"op": "make_extra_output"}, {"op": "silu"}, {"op": "add_extra_input", "channel": "skip"}])", R"(["skip"])")},
    {"add, fork, norm (the new residual and the normalised output)",
     seq(R"([{"op": "add_extra_input", "channel": "skip"}, {"op": "make_extra_output", "channel": "r"},
             {"op": "rmsnorm"}, {"op": "gelu"}, {"op": "add_extra_input", "channel": "r"}])", R"(["skip"])")},
};

}  // namespace

TEST_CASE("every channel shape matches the float64 reference, fused and unfused", "[channels]") {
  for (const auto& s : kShapes) {
    INFO(s.what);
    for (const char* recipe : {"fp32", "bf16"})
      for (ops::Shape shape : {ops::Shape{33, 64}, ops::Shape{8, 64}}) {
        run_check(s.json, recipe, shape);
        run_check(s.json, recipe, shape, true, /*misalign=*/true, 3);
      }
    test::ScopedEnv off("JITFUSE_DISABLE_FUSION", "1");
    run_check(s.json, "bf16", {33, 64}, true, false, 5);
  }
}

TEST_CASE("the Llama and GPT-2 MLP blocks, one sequence each, match the reference in every recipe", "[channels]") {
  for (const std::string* block : {&kLlama, &kGpt2, &kLlamaWithSkip}) {
    for (const char* recipe : {"fp32", "bf16"}) {
      run_check(*block, recipe, {33, 64});
      run_check(*block, recipe, {4, 2, 64}, true, false, 2);
    }
    // FP8 GEMMs take rows in multiples of 16 in training.
    for (const char* recipe : {"fp8_delayed", "fp8_current"}) run_check(*block, recipe, {48, 64});
    test::ScopedEnv off("JITFUSE_DISABLE_FUSION", "1");
    run_check(*block, "bf16", {33, 64}, true, false, 7);
    run_check(*block, "fp8_delayed", {48, 64}, true, false, 7);
  }
}

TEST_CASE("a fan-out channel whose readers sit in FP8 backward chains sums each gradient once", "[channels]") {
  // Op 3 reads the channel and accumulates: its backward runs inside fp8_linear_pointwise_bwd's E5M2 cast
  // kernel, which under fp8_current is preceded by an amax pass over the same stages.
  const std::string fan = seq(R"([{"op": "make_extra_output", "channel": "r"}, {"op": "rmsnorm"},
      {"op": "linear", "in_features": 64, "out_features": 64}, {"op": "add_extra_input", "channel": "r"},
      {"op": "linear", "in_features": 64, "out_features": 64}, {"op": "bias"}, {"op": "add_extra_input", "channel": "r"}])");
  const std::string skip = seq(R"([{"op": "add_extra_input", "channel": "skip"}, {"op": "rmsnorm"},
      {"op": "linear", "in_features": 64, "out_features": 64}, {"op": "add_extra_input", "channel": "skip"},
      {"op": "linear", "in_features": 64, "out_features": 64}, {"op": "add_extra_input", "channel": "skip"}])", R"(["skip"])");
  for (const std::string* s : {&fan, &skip})
    for (const char* recipe : {"fp8_current", "fp8_delayed", "bf16"}) run_check(*s, recipe, {48, 64});
}

TEST_CASE("under the FP8 recipes the residual is the GEMM's C and a fork's gradient the dgrad's C", "[channels]") {
  // linear_residual / linear_bias_residual / linear_scale_residual (cuBLASLt RESIDUAL on FP8 operands) and
  // extra_output_linear (DGRAD_ACCUMULATE on the FP8 dgrad), each checked taken in the plan.
  struct Case {
    const char* rule;
    std::string json;
  } cases[] = {
      {"linear_residual", seq(R"([{"op": "linear", "in_features": 64, "out_features": 48}, {"op": "add_extra_input"}])")},
      {"linear_bias_residual", seq(R"([{"op": "linear", "in_features": 64, "out_features": 48}, {"op": "bias"},
                                       {"op": "add_extra_input"}])")},
      {"linear_scale_residual", seq(R"([{"op": "linear", "in_features": 64, "out_features": 48},
                                        {"op": "scale", "value": 0.5}, {"op": "add_extra_input"}])")},
      {"extra_output_linear", seq(R"([{"op": "make_extra_output", "channel": "r"}, {"op": "gelu"},
                                      {"op": "make_extra_output", "channel": "s"},
                                      {"op": "linear", "in_features": 64, "out_features": 64},
                                      {"op": "add_extra_input", "channel": "s"}, {"op": "add_extra_input", "channel": "r"}])")},
  };
  for (const auto& c : cases)
    for (const char* recipe : {"fp8_delayed", "fp8_current"}) {
      INFO(c.rule << " " << recipe);
      jf_sequence s = nullptr;
      REQUIRE(jf_sequence_create(test::shared_context(), c.json.c_str(), recipe, &s) == JF_OK);
      const ops::Shape shape{48, 64};
      const char* js = nullptr;
      REQUIRE(jf_sequence_explain(s, shape.data(), static_cast<int>(shape.size()), 1, 90, &js) == JF_OK);
      bool taken = false;
      const nlohmann::json plan = nlohmann::json::parse(js);  // kept: a range over a temporary's member dangles
      for (const char* dir : {"forward", "backward"})
        for (const auto& g : plan.at(dir)) taken |= g.at("rule") == c.rule;
      jf_sequence_destroy(s);
      CHECK(taken);
      run_check(c.json, recipe, shape);
    }
}
