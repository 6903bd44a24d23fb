// FP8 training through the GEMMs (issue 13): linear under fp8_delayed and fp8_current, its operand casts
// (E4M3 input and weight, E5M2 output gradient; row-major and transposed copies), the hand-off rules
// (a norm or an activation writing the next linear's FP8 input, dact + dbias writing the E5M2 gradient),
// the three FP8 GEMMs, and the recipe state across calls. Every output and gradient is checked twice:
// against a float64 reference that quantises the GEMM operands as the casts do (its own copy of the
// recipe state, advanced call by call: the delayed amax history rolls), at the bf16 tolerance, and
// against the exact float64 reference at DESIGN's FP8 tolerance (tools/harness/check.cpp).
#include <cmath>
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>

#include <nlohmann/json.hpp>

#include "gpu/gpu_check.hpp"
#include "ops/sequence.hpp"
#include "harness/device_tensor.hpp"
#include "reference/sequence.hpp"

using namespace jitfuse;

namespace {

const char* kMlp = R"([{"op": "layernorm"}, {"op": "linear", "in_features": 256, "out_features": 512}, {"op": "bias"},
  {"op": "gelu"}, {"op": "linear", "in_features": 512, "out_features": 256}, {"op": "bias"}, {"op": "add_extra_input"}])";

std::vector<std::string> rules_of(jf_sequence seq, const ops::Shape& shape, bool training, const char* pass) {
  const char* js = nullptr;
  REQUIRE(jf_sequence_explain(seq, shape.data(), static_cast<int>(shape.size()), training ? 1 : 0, 90, &js) == JF_OK);
  std::vector<std::string> out;
  const nlohmann::json j = nlohmann::json::parse(js);  // kept: a range over a temporary's member dangles
  for (const auto& g : j.at(pass)) out.push_back(g.value("rule", ""));
  CHECK(!out.empty());
  return out;
}

}  // namespace

TEST_CASE("FP8 linear: standalone casts, the three FP8 GEMMs, bias, accumulate_grad, and both recipes", "[fp8_linear]") {
  struct Case {
    const char* ops;
    ops::Shape shape;
  };
  const Case cases[] = {
      {R"([{"op": "linear", "in_features": 64, "out_features": 96}])", {32, 64}},
      {R"([{"op": "linear", "in_features": 128, "out_features": 48}, {"op": "bias"}])", {80, 128}},
      {R"([{"op": "linear", "in_features": 96, "out_features": 32}])", {2, 24, 96}},
      {R"([{"op": "linear", "in_features": 1024, "out_features": 512}, {"op": "bias"}])", {256, 1024}},
  };
  for (const char* recipe : {"fp8_current", "fp8_delayed"})
    for (const auto& c : cases) {
      harness::CheckOptions o;
      o.recipe = recipe;
      o.shape = c.shape;
      o.calls = 3;
      o.seed = 31;
      auto rep = harness::check_sequence(test::shared_context(), test::builtin_registry(), test::seq_json(c.ops), o);
      INFO(c.ops << " " << recipe << " " << ops::shape_str(c.shape) << "\n" << rep.table());
      CHECK(rep.pass());
    }
}

TEST_CASE("FP8 backward: the ops after a linear with no bias write its E5M2 gradient (act, residual, quantize)",
          "[fp8_linear]") {
  struct Case {
    const char* ops;
    ops::Shape shape;
    const char* rule;  // the backward rule of the linear's group
  };
  const Case cases[] = {
      {R"([{"op": "linear", "in_features": 64, "out_features": 96}, {"op": "gelu"}])", {32, 64}, "fp8_linear_act_bwd"},
      {R"([{"op": "linear", "in_features": 128, "out_features": 64}, {"op": "add_extra_input"}])", {48, 128},
       "fp8_linear_pointwise_bwd"},
      {R"([{"op": "linear", "in_features": 128, "out_features": 64}, {"op": "silu"}, {"op": "scale", "value": 0.5}])",
       {64, 128}, "fp8_linear_act_bwd"},
  };
  for (const char* recipe : {"fp8_current", "fp8_delayed"})
    for (const auto& c : cases) {
      const std::string json = test::seq_json(c.ops);
      jf_sequence seq = nullptr;
      REQUIRE(jf_sequence_create(test::shared_context(), json.c_str(), recipe, &seq) == JF_OK);
      CHECK(rules_of(seq, c.shape, true, "backward").front() == c.rule);
      jf_sequence_destroy(seq);
      harness::CheckOptions o;
      o.recipe = recipe;
      o.shape = c.shape;
      o.calls = 3;
      o.seed = 37;
      auto rep = harness::check_sequence(test::shared_context(), test::builtin_registry(), json, o);
      INFO(c.ops << " " << recipe << "\n" << rep.table());
      CHECK(rep.pass());
    }
}

TEST_CASE("FP8 MLP block: layernorm -> E4M3, bias+gelu -> E4M3, dgelu+dbias -> E5M2, and both recipes", "[fp8_linear]") {
  const std::string json = test::seq_json(kMlp, "mlp");
  const ops::Shape shape{128, 256};
  for (const char* recipe : {"fp8_current", "fp8_delayed"}) {
    jf_sequence seq = nullptr;
    REQUIRE(jf_sequence_create(test::shared_context(), json.c_str(), recipe, &seq) == JF_OK);
    // The hand-off rules are taken in both passes (training) and in the forward (inference).
    auto has = [](const std::vector<std::string>& v, const char* r) {
      return std::find(v.begin(), v.end(), r) != v.end();
    };
    const auto fwd = rules_of(seq, shape, true, "forward"), bwd = rules_of(seq, shape, true, "backward");
    CHECK(has(fwd, "fp8_norm_linear"));
    CHECK(has(fwd, "fp8_act_linear"));
    CHECK(has(bwd, "fp8_linear_act_bwd"));
    CHECK(has(bwd, "fp8_linear_bias_bwd"));
    CHECK(has(rules_of(seq, shape, false, "forward"), "fp8_act_linear"));
    jf_sequence_destroy(seq);
    for (bool training : {true, false}) {
      harness::CheckOptions o;
      o.recipe = recipe;
      o.shape = shape;
      o.backward = training;
      o.calls = 3;
      o.seed = 41;
      auto rep = harness::check_sequence(test::shared_context(), test::builtin_registry(), json, o);
      std::printf("\nFP8 MLP %s %s (128x256 -> 512 -> 256):\n%s", recipe, training ? "training" : "inference",
                  rep.table().c_str());
      CHECK(rep.pass());
    }
    // Unfused (every cast standalone) gives the same numerics.
    test::ScopedEnv off("JITFUSE_DISABLE_FUSION", "1");
    harness::CheckOptions o;
    o.recipe = recipe;
    o.shape = shape;
    o.calls = 2;
    o.seed = 43;
    auto rep = harness::check_sequence(test::shared_context(), test::builtin_registry(), json, o);
    INFO(recipe << " unfused\n" << rep.table());
    CHECK(rep.pass());
  }
}

TEST_CASE("FP8 weights are cast once per optimizer step: fp8_weights_unchanged reuses the copies", "[fp8_linear]") {
  cuda::current_device();
  const std::string json = test::seq_json(R"([{"op": "linear", "in_features": 64, "out_features": 32}])");
  jf_sequence seq = nullptr;
  REQUIRE(jf_sequence_create(test::shared_context(), json.c_str(), "fp8_current", &seq) == JF_OK);
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<double> u(-1, 1);
  auto rnd = [&](size_t n) {
    std::vector<double> v(n);
    for (auto& e : v) e = reference::round_to("bf16", u(rng));
    return v;
  };
  harness::DeviceTensor x({16, 64}, "bf16"), w({32, 64}, "bf16"), y({16, 32}, "bf16");
  x.upload_values(rnd(16 * 64), nullptr);
  const auto w1 = rnd(32 * 64), w2 = rnd(32 * 64);
  std::vector<jf_param> params{{0, "weight", w.dl()}};
  auto forward = [&](int unchanged) {
    y.poison(nullptr);
    jf_forward_args a{};
    a.input = x.dl();
    a.output = y.dl();
    a.params = params.data();
    a.n_params = 1;
    a.fp8_weights_unchanged = unchanged;
    REQUIRE(jf_forward(seq, &a, nullptr, nullptr) == JF_OK);
    return y.download(nullptr);
  };
  w.upload_values(w1, nullptr);
  const auto y1 = forward(1);  // never cast yet: jitfuse casts despite the flag
  w.upload_values(w2, nullptr);
  const auto y2 = forward(0);  // an "optimizer step" (in place, same pointer), announced: cast
  CHECK((y2 != y1));
  w.upload_values(w1, nullptr);         // another in-place step, NOT announced: the W2 copies are used
  CHECK((forward(1) == y2));
  CHECK((forward(0) == y1));   // announced: W1 again gives y1 bit for bit
  CHECK((forward(1) == y1));
  jf_sequence_destroy(seq);
}

TEST_CASE("FP8 linear refuses sizes FP8 GEMMs cannot take, naming the op", "[fp8_linear]") {
  const std::string json = test::seq_json(R"([{"op": "linear", "in_features": 64, "out_features": 40}])");
  jf_sequence seq = nullptr;
  REQUIRE(jf_sequence_create(test::shared_context(), json.c_str(), "fp8_delayed", &seq) == JF_OK);
  const int64_t shape[] = {32, 64};
  CHECK(jf_sequence_prepare(seq, shape, 2, 1, nullptr) == JF_ERR_UNSUPPORTED);
  const std::string err = jf_last_error();
  INFO(err);
  CHECK(err.find("op 0 (linear)") != std::string::npos);
  CHECK(err.find("out_features") != std::string::npos);
  CHECK(err.find("multiple of 16") != std::string::npos);
  jf_sequence_destroy(seq);
}

TEST_CASE("FP8 per-sequence settings: a short amax history and a margin, over more calls than the history",
          "[fp8_linear]") {
  const std::string json = R"({"format": "jitfuse.sequence/1", "name": "short_history",
    "fp8": {"amax_history_len": 3, "margin": 1}, "ops": )" + std::string(kMlp) + "}";
  harness::CheckOptions o;
  o.recipe = "fp8_delayed";
  o.shape = {64, 256};
  o.calls = 5;  // the history wraps: the scale of call 5 comes from calls 2-4 only
  o.seed = 51;
  auto rep = harness::check_sequence(test::shared_context(), test::builtin_registry(), json, o);
  INFO(rep.table());
  CHECK(rep.pass());
  // The state the sequence keeps has the configured length.
  jf_sequence seq = nullptr;
  REQUIRE(jf_sequence_create(test::shared_context(), json.c_str(), "fp8_delayed", &seq) == JF_OK);
  jf_fp8_state st{};
  REQUIRE(jf_sequence_fp8_operand_state(seq, 1, "input", &st) == JF_OK);
  CHECK(st.history_len == 3);
  CHECK(jf_sequence_fp8_operand_state(seq, 0, "input", &st) == JF_ERR_INVALID_ARGUMENT);  // op 0: layernorm
  CHECK(jf_sequence_fp8_operand_state(seq, 1, "bias", &st) == JF_ERR_INVALID_ARGUMENT);
  jf_sequence_destroy(seq);
}

TEST_CASE("FP8 wgrad with accumulate_grad adds to the gradient buffer", "[fp8_linear]") {
  cuda::current_device();
  // fp8_current: the scales come from this call's tensors, so two sequences give the same dW bit for bit.
  const std::string plain = test::seq_json(R"([{"op": "linear", "in_features": 64, "out_features": 32}])");
  const std::string acc =
      test::seq_json(R"([{"op": "linear", "in_features": 64, "out_features": 32, "accumulate_grad": true}])");
  std::mt19937_64 rng(9);
  std::uniform_real_distribution<double> u(-1, 1);
  auto rnd = [&](size_t n) {
    std::vector<double> v(n);
    for (auto& e : v) e = reference::round_to("bf16", u(rng));
    return v;
  };
  harness::DeviceTensor x({48, 64}, "bf16"), w({32, 64}, "bf16"), y({48, 32}, "bf16"), dy({48, 32}, "bf16"),
      dx({48, 64}, "bf16"), dw({32, 64}, "bf16");
  x.upload_values(rnd(48 * 64), nullptr);
  w.upload_values(rnd(32 * 64), nullptr);
  dy.upload_values(rnd(48 * 32), nullptr);
  std::vector<jf_param> params{{0, "weight", w.dl()}}, grads{{0, "weight", dw.dl()}};
  auto grad = [&](const std::string& json, const std::vector<double>& start) {
    jf_sequence seq = nullptr;
    REQUIRE(jf_sequence_create(test::shared_context(), json.c_str(), "fp8_current", &seq) == JF_OK);
    dw.upload_values(start, nullptr);
    jf_saved saved = nullptr;
    REQUIRE(test::forward_simple(seq, x.dl(), y.dl(), params, true, &saved) == JF_OK);
    REQUIRE(test::backward_simple(seq, saved, x.dl(), y.dl(), dy.dl(), dx.dl(), params, grads) == JF_OK);
    REQUIRE(jf_saved_release(saved, nullptr) == JF_OK);
    jf_sequence_destroy(seq);
    return dw.download_values(nullptr);
  };
  const auto g0 = rnd(32 * 64);
  const auto d = grad(plain, g0);  // overwritten: g0 is gone
  const auto sum = grad(acc, g0);  // g0 + the same dW (beta = 1 in the FP8 wgrad GEMM)
  double worst = 0;
  for (size_t i = 0; i < d.size(); ++i)
    worst = std::max(worst, std::fabs(sum[i] - (g0[i] + d[i])) / (1e-2 + 1.6e-2 * std::fabs(g0[i] + d[i])));
  INFO("worst err/tol " << worst);
  CHECK(worst <= 1.0);
  double moved = 0;  // and g0 really was added (not a plain overwrite)
  for (size_t i = 0; i < d.size(); ++i) moved = std::max(moved, std::fabs(sum[i] - d[i]));
  CHECK(moved > 0.1);
}
