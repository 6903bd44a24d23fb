// Every built-in rule against the float64 reference (fused forward and backward), the check that the
// rule was really taken, and interchangeability: fused forward + unfused backward and the reverse.
#include <algorithm>
#include <fstream>
#include <random>

#include "cuda/cublaslt.hpp"
#include "gpu/gpu_check.hpp"
#include "harness/device_tensor.hpp"
#include "reference/reference.hpp"

using namespace jitfuse;
using jitfuse::test::run_check;

namespace {

struct RuleCase {
  const char* rule;
  const char* ops;
  ops::Shape shape;
  std::vector<std::string> disable = {};  // higher-priority rules switched off so `rule` is taken
  const char* rules_file = nullptr;       // an opt-in rule file (fusion_rules/optional) to load first
};

const RuleCase kCases[] = {
    {"linear_bias", R"([{"op": "linear", "in_features": 64, "out_features": 48}, {"op": "bias"}])", {96, 64}},
    {"linear_bias_gelu", R"([{"op": "linear", "in_features": 64, "out_features": 48}, {"op": "bias"}, {"op": "gelu"}])", {96, 64}},
    {"linear_bias_relu", R"([{"op": "linear", "in_features": 64, "out_features": 48}, {"op": "bias"}, {"op": "relu"}])", {96, 64}},
    {"linear_gelu", R"([{"op": "linear", "in_features": 64, "out_features": 48}, {"op": "gelu", "approximate": "tanh"}])", {96, 64}},
    {"linear_relu", R"([{"op": "linear", "in_features": 64, "out_features": 48}, {"op": "relu"}])", {96, 64}},
    {"linear_bias_residual", R"([{"op": "linear", "in_features": 64, "out_features": 48}, {"op": "bias"}, {"op": "add_extra_input"}])", {96, 64}},
    {"linear_residual", R"([{"op": "linear", "in_features": 64, "out_features": 48}, {"op": "add_extra_input"}])", {96, 64}},
    {"linear_residual", R"([{"op": "linear", "in_features": 64, "out_features": 48}, {"op": "add_extra_input"}])", {7, 64}},
    {"linear_scale_residual", R"([{"op": "linear", "in_features": 64, "out_features": 48}, {"op": "scale", "value": 0.5}, {"op": "add_extra_input"}])", {96, 64}},
    {"add_norm", R"([{"op": "add_extra_input"}, {"op": "layernorm"}])", {50, 264}},
    {"add_norm", R"([{"op": "add_extra_input"}, {"op": "rmsnorm", "zero_centered_gamma": true}])", {50, 264}},
    {"fork_norm", R"([{"op": "add_extra_input"}, {"op": "make_extra_output"}, {"op": "rmsnorm"}])", {50, 264}},
    {"fork_norm", R"([{"op": "make_extra_output"}, {"op": "layernorm"}])", {33, 1024}},
    {"norm_pointwise", R"([{"op": "layernorm"}, {"op": "gelu"}, {"op": "scale", "value": 2.0}])", {33, 1024}},
    {"norm_pointwise", R"([{"op": "rmsnorm"}, {"op": "silu"}, {"op": "dropout", "p": 0.2, "seed": 7}])", {33, 200}},
    {"bias_act", R"([{"op": "bias"}, {"op": "gelu", "approximate": "tanh"}])", {100, 72}},
    {"bias_act", R"([{"op": "bias"}, {"op": "relu"}])", {100, 72}},
    {"bias_act", R"([{"op": "bias"}, {"op": "silu"}])", {100, 72}},
    {"bias_act", R"([{"op": "bias"}, {"op": "qgelu"}])", {100, 72}},
    {"bias_act", R"([{"op": "bias"}, {"op": "srelu"}])", {100, 72}},
    {"bias_gated", R"([{"op": "bias"}, {"op": "swiglu"}])", {100, 96}},
    {"bias_gated", R"([{"op": "bias"}, {"op": "geglu"}])", {100, 96}},
    {"bias_gated", R"([{"op": "bias"}, {"op": "reglu"}])", {100, 30}},
    {"gated_pointwise", R"([{"op": "swiglu"}, {"op": "scale", "value": 0.25}])", {100, 96}},
    {"gated_pointwise_bwd", R"([{"op": "swiglu"}, {"op": "scale", "value": 0.25}])", {100, 96}},
    {"gated_pointwise", R"([{"op": "geglu"}, {"op": "relu"}, {"op": "scale", "value": 3.0}])", {100, 96}},
    {"bias_gated", R"([{"op": "bias"}, {"op": "swiglu"}, {"op": "scale", "value": 0.5}, {"op": "gelu"}])", {100, 96}},
    {"bias_act", R"([{"op": "bias"}, {"op": "gelu"}, {"op": "scale", "value": 2.0}, {"op": "silu"}, {"op": "dropout", "p": 0.1, "seed": 5}])", {100, 72}},
    {"pointwise_chain", R"([{"op": "gelu"}, {"op": "scale", "value": 3.0}, {"op": "add_extra_input"}])", {100, 72}},
    {"pointwise_chain_bwd", R"([{"op": "gelu"}, {"op": "scale", "value": 2.0}, {"op": "silu"}, {"op": "relu"}, {"op": "qgelu"}, {"op": "srelu"}, {"op": "add_extra_input"}])", {100, 72}},
    {"extra_output_linear", R"([{"op": "make_extra_output"}, {"op": "linear", "in_features": 64, "out_features": 32}])", {96, 64}},
    {"linear_scale_bwd", R"([{"op": "linear", "in_features": 64, "out_features": 32}, {"op": "scale", "value": 0.125}])", {96, 64}},
    {"bias_gelu_linear_bias_bwd", R"([{"op": "bias"}, {"op": "gelu", "approximate": "tanh"}, {"op": "linear", "in_features": 72, "out_features": 40}, {"op": "bias"}])", {96, 72},
     {"act_dbias", "linear_bias_bwd"}},
    {"bias_gelu_linear_bwd", R"([{"op": "bias"}, {"op": "gelu", "approximate": "tanh"}, {"op": "linear", "in_features": 72, "out_features": 40}])", {96, 72},
     {"act_dbias"}},
    {"linear_bias_bwd", R"([{"op": "linear", "in_features": 64, "out_features": 48}, {"op": "bias"}])", {96, 64}},
    {"norm_residual_bwd", R"([{"op": "make_extra_output"}, {"op": "layernorm"}])", {40, 512}},
    {"bias_dropout_add_joint", R"([{"op": "bias"}, {"op": "dropout", "p": 0.1, "seed": 3}, {"op": "add_extra_input"}])", {100, 72}},
    {"linear_silu_recompute", R"([{"op": "linear", "in_features": 64, "out_features": 48}, {"op": "silu"}])", {96, 64}},
    {"linear_bias_relu_linear_joint", R"([{"op": "linear", "in_features": 64, "out_features": 200}, {"op": "bias"}, {"op": "relu"},
                                         {"op": "linear", "in_features": 200, "out_features": 40}])", {96, 64}, {},
     JF_SOURCE_DIR "/fusion_rules/optional/relu_bitmask.json"},
    {"linear_bias_relu_linear_joint", R"([{"op": "linear", "in_features": 64, "out_features": 128}, {"op": "bias"}, {"op": "relu"},
                                         {"op": "linear", "in_features": 128, "out_features": 48}, {"op": "bias"}])", {33, 64}, {},
     JF_SOURCE_DIR "/fusion_rules/optional/relu_bitmask.json"},
};

bool rule_taken(jf_context ctx, const std::string& seq, const ops::Shape& shape, const std::string& rule) {
  jf_sequence s = nullptr;
  REQUIRE(jf_sequence_create(ctx, seq.c_str(), "bf16", &s) == JF_OK);
  const char* js = nullptr;
  REQUIRE(jf_sequence_explain(s, shape.data(), static_cast<int>(shape.size()), 1, 90, &js) == JF_OK);
  auto j = nlohmann::json::parse(js);
  jf_sequence_destroy(s);
  for (const char* dir : {"forward", "backward"})
    for (auto& g : j[dir])
      if (g["rule"] == rule) return true;
  return false;
}

// A context whose rules of `pass` (all, or only those named in `only`) are switched off by overriding
// each by name with an impossible condition, so the other direction's fusions run against unfused ops.
jf_context context_without(const char* pass, const std::vector<std::string>& only = {}) {
  std::string path = std::string("/tmp/jf_disable_") + pass;
  for (const auto& n : only) path += "_" + n;
  path += ".json";
  nlohmann::json rules = nlohmann::json::array();
  const rules::RuleSet builtins = rules::RuleSet::with_builtins();
  for (const auto& r : builtins.rules())
    if (rules::pass_name(r.pass) == pass && (only.empty() || std::find(only.begin(), only.end(), r.name) != only.end()))
      rules.push_back({{"name", r.name}, {"pass", pass}, {"priority", 0}, {"math", "disabled for the test"},
                       {"overrides", true},
                       {"pattern", r.impl.strategy == "regenerate_dropout_mask"   ? nlohmann::json::array({"dropout"})
                                   : r.impl.strategy == "relu_bitmask"            ? nlohmann::json::array({"linear", "bias", "relu", "linear"})
                                   : r.impl.strategy == "overlap_collective"      ? nlohmann::json::array({"all_gather", "linear"})
                                   : r.impl.strategy == "recompute_gated_input"
                                       ? nlohmann::json::array({"grouped_linear", "swiglu", "grouped_linear"})
                                   : r.impl.strategy == "chunked_linear_cross_entropy"
                                       ? nlohmann::json::array({"linear", "cross_entropy"})
                                   : r.impl.strategy.empty()                      ? nlohmann::json::array({"identity"})
                                                                                  : nlohmann::json::array({"linear", "silu"})},
                       {"conditions", {{"min_arch", 1000}}},
                       {"impl", std::string(pass) == "joint"
                                    ? nlohmann::json{{"kind", "joint"}, {"strategy", r.impl.strategy}, {"saves", r.impl.saves}}
                                    : nlohmann::json{{"kind", "generated"}, {"skeleton", "elementwise"}}}});
  std::ofstream(path) << nlohmann::json{{"format", "jitfuse.rules/1"}, {"rules", rules}}.dump(2);
  jf_context ctx = nullptr;
  REQUIRE(jf_context_create(&ctx) == JF_OK);
  int errors = -1;
  REQUIRE(jf_context_load_rules(ctx, path.c_str(), &errors) == JF_OK);
  REQUIRE(errors == 0);
  return ctx;
}

}  // namespace

TEST_CASE("every built-in rule is taken and matches the reference", "[fusion]") {
  for (const auto& c : kCases) {
    std::string seq = test::seq_json(c.ops, c.rule);
    INFO("rule " << c.rule << ": " << c.ops);
    jf_context ctx = c.disable.empty() ? test::shared_context() : context_without("backward", c.disable);
    if (c.rules_file) {
      REQUIRE(jf_context_create(&ctx) == JF_OK);
      int errors = -1;
      REQUIRE(jf_context_load_rules(ctx, c.rules_file, &errors) == JF_OK);
      REQUIRE(errors == 0);
    }
    CHECK(rule_taken(ctx, seq, c.shape, c.rule));
    for (const char* recipe : {"fp32", "bf16"}) run_check(seq, recipe, c.shape, true, false, 1, ctx);
    if (ctx != test::shared_context()) jf_context_destroy(ctx);
  }
}

TEST_CASE("bias_dropout_add as a forward-only fusion (joint rule off) is interchangeable", "[fusion]") {
  jf_context ctx = context_without("joint");
  std::string seq = test::seq_json(R"([{"op": "bias"}, {"op": "dropout", "p": 0.1, "seed": 3}, {"op": "add_extra_input"}])");
  CHECK(rule_taken(ctx, seq, {100, 72}, "bias_dropout_add"));
  run_check(seq, "bf16", {100, 72}, true, false, 1, ctx);
  jf_context_destroy(ctx);
}

TEST_CASE("fused forward with unfused backward, and unfused forward with fused backward", "[fusion]") {
  jf_context no_bwd = context_without("backward");
  jf_context no_fwd = context_without("forward");
  for (const auto& c : kCases) {
    std::string seq = test::seq_json(c.ops, c.rule);
    INFO("rule " << c.rule << ": " << c.ops);
    run_check(seq, "fp32", c.shape, true, false, 2, no_bwd);
    run_check(seq, "fp32", c.shape, true, false, 3, no_fwd);
  }
  jf_context_destroy(no_bwd);
  jf_context_destroy(no_fwd);
}

TEST_CASE("fused kernels on odd shapes and misaligned pointers", "[codegen]") {
  for (auto rows : {1, 3, 1000})
    for (auto cols : {8, 24, 4104}) {
      for (const char* ops : {R"([{"op": "bias"}, {"op": "gelu"}])", R"([{"op": "layernorm"}, {"op": "silu"}])",
                              R"([{"op": "bias"}, {"op": "swiglu"}])"}) {
        std::string seq = test::seq_json(ops);
        run_check(seq, "bf16", {rows, cols});
        run_check(seq, "fp32", {rows, cols}, true, /*misalign=*/true);
      }
    }
}

TEST_CASE("GEMM groups on odd row counts and misaligned pointers", "[codegen]") {
  // cuBLASLt picks its algorithm per alignment: [linear bias] runs BIAS forward and BGRADB backward (or the
  // column-sum fallback when BGRADB has no algorithm), [linear bias gelu] GELU_AUX_BIAS.
  for (auto rows : {1, 3, 100})
    for (const char* ops : {R"([{"op": "linear", "in_features": 64, "out_features": 48}, {"op": "bias"}])",
                            R"([{"op": "linear", "in_features": 64, "out_features": 48}, {"op": "bias"}, {"op": "gelu"}])"})
      for (const char* recipe : {"fp32", "bf16"})
        for (bool misalign : {false, true}) run_check(test::seq_json(ops), recipe, {rows, 64}, true, misalign);
}

TEST_CASE("cuBLASLt rules on any in_features and odd row counts (issue 27)", "[fusion]") {
  // cuBLASLt runs these epilogues for any K in fp32/bf16: each rule is taken for K = 1, 5, 7, 13, 100
  // (rows of x and W at 2- or 4-byte offsets) and matches float64 forward and backward. The GELU epilogues
  // need their aux leading dimension (out_features; DGELU_BGRAD: the linear's in_features) to be a multiple
  // of 8, so their cases keep it; odd out_features are run where nothing needs it.
  struct KCase {
    const char* rule;
    std::string ops;
    bool both_row_counts;  // rows 1 and 97; else 33
  };
  auto lin = [](int64_t in, int64_t out) {
    return R"({"op": "linear", "in_features": )" + std::to_string(in) + R"(, "out_features": )" + std::to_string(out) + "}";
  };
  jf_context no_act_dbias = context_without("backward", {"act_dbias", "linear_bias_bwd"});
  for (const int64_t k : {1, 5, 7, 13, 100}) {
    const std::string n = std::to_string(k);
    const std::vector<KCase> cases = {
        {"linear_bias", "[" + lin(k, 48) + R"(, {"op": "bias"}])", true},
        {"linear_bias_bwd", "[" + lin(k, 48) + R"(, {"op": "bias"}])", false},
        {"linear_bias_gelu", "[" + lin(k, 48) + R"(, {"op": "bias"}, {"op": "gelu"}])", true},
        {"linear_bias_relu", "[" + lin(k, 48) + R"(, {"op": "bias"}, {"op": "relu"}])", true},
        {"linear_gelu", "[" + lin(k, 48) + R"(, {"op": "gelu", "approximate": "tanh"}])", false},
        {"linear_relu", "[" + lin(k, 48) + R"(, {"op": "relu"}])", false},
        {"linear_bias_residual", "[" + lin(k, 48) + R"(, {"op": "bias"}, {"op": "add_extra_input"}])", false},
        {"linear_residual", "[" + lin(k, 48) + R"(, {"op": "add_extra_input"}])", false},
        {"linear_scale_residual", "[" + lin(k, 48) + R"(, {"op": "scale", "value": 0.5}, {"op": "add_extra_input"}])", false},
        {"extra_output_linear", R"([{"op": "make_extra_output"}, )" + lin(k, 32) + "]", false},
        {"linear_scale_bwd", "[" + lin(k, 32) + R"(, {"op": "scale", "value": 0.125}])", false},
        // Odd out_features (= k): BIAS and BGRADB with a bias of k entries, RELU_BIAS, the residual's C.
        {"linear_bias", "[" + lin(64, k) + R"(, {"op": "bias"}])", true},
        {"linear_bias_relu", "[" + lin(64, k) + R"(, {"op": "bias"}, {"op": "relu"}])", false},
        {"linear_residual", "[" + lin(64, k) + R"(, {"op": "add_extra_input"}])", false},
        {"linear_bias_relu", "[" + lin(k, k) + R"(, {"op": "bias"}, {"op": "relu"}])", false},
    };
    for (const auto& c : cases) {
      const int64_t in = c.ops.find(R"("in_features": 64)") != std::string::npos ? 64 : k;
      std::string seq = test::seq_json(c.ops, c.rule);
      for (const int64_t rows : c.both_row_counts ? std::vector<int64_t>{1, 97} : std::vector<int64_t>{33}) {
        INFO("rule " << c.rule << ", K " << k << ": " << c.ops << " rows " << rows);
        CHECK(rule_taken(test::shared_context(), seq, {rows, in}, c.rule));
        for (const char* recipe : {"fp32", "bf16"}) run_check(seq, recipe, {rows, in});
      }
    }
    // DGELU_BGRAD with an odd out_features (its aux is dx's layout: in_features 72 keeps it a multiple of 8).
    std::string dgelu = test::seq_json(R"([{"op": "bias"}, {"op": "gelu", "approximate": "tanh"}, )" + lin(72, k) +
                                       R"(, {"op": "bias"}])");
    INFO("bias_gelu_linear_bias_bwd, out_features " << n);
    CHECK(rule_taken(no_act_dbias, dgelu, {33, 72}, "bias_gelu_linear_bias_bwd"));
    for (const char* recipe : {"fp32", "bf16"}) run_check(dgelu, recipe, {33, 72}, true, false, 1, no_act_dbias);
    // Odd K with misaligned pointers: cuBLASLt's alignment of each row start, pointer and ld together.
    if (k == 5 || k == 100)
      for (const char* recipe : {"fp32", "bf16"}) {
        run_check(test::seq_json("[" + lin(k, 48) + R"(, {"op": "bias"}, {"op": "gelu"}])"), recipe, {33, k}, true, true);
        run_check(test::seq_json("[" + lin(k, 48) + R"(, {"op": "bias"}])"), recipe, {33, k}, true, true);
      }
  }
  jf_context_destroy(no_act_dbias);
}

TEST_CASE("Blas::column_sums (the BGRADB fallback) matches float64 column sums", "[ops]") {
  cuda::Blas blas;
  std::mt19937_64 rng(9);
  std::uniform_real_distribution<double> u(-1, 1);
  const int64_t m = 77, n = 48;
  for (const char* dt : {"fp32", "fp16", "bf16"}) {
    std::vector<double> x(m * n), ones(m, 1.0), ref(n, 0.0);
    for (auto& v : x) v = reference::round_to(dt, u(rng));
    for (int64_t r = 0; r < m; ++r)
      for (int64_t c = 0; c < n; ++c) ref[c] += x[r * n + c];
    harness::DeviceTensor dx({m, n}, dt), d1({m}, dt), dout({n}, dt);
    harness::DeviceTensor ws({static_cast<int64_t>(cuda::kGemmWorkspace / 4)}, "fp32");
    dx.upload_values(x, nullptr);
    d1.upload_values(ones, nullptr);
    dout.poison(nullptr);
    blas.column_sums(ops::parse_recipe(dt).dtype, m, n, reinterpret_cast<void*>(dx.ptr()), reinterpret_cast<void*>(d1.ptr()),
                     reinterpret_cast<void*>(dout.ptr()), reinterpret_cast<void*>(ws.ptr()), nullptr);
    auto got = dout.download_values(nullptr);
    double worst = 0;
    const double rtol = std::string(dt) == "fp32" ? 1e-5 : 1.6e-2;
    for (int64_t c = 0; c < n; ++c) worst = std::max(worst, std::fabs(got[c] - ref[c]) / (1e-5 * m + rtol * std::fabs(ref[c])));
    INFO(dt << " worst err/tol " << worst);
    CHECK(worst <= 1.0);  // NaN (unwritten) fails too
  }
}
