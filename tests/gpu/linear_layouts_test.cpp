// A linear's weight as the model stores it (issue 42): weight_layout "in_out" (GPT-2's Conv1D, [in, out]) and
// split_weight (a gated MLP's gate and up weights as two parameters), forward and backward against the float64
// reference in every plain recipe, fused (the cuBLASLt epilogue rules, BGRADB as BGRADA) and unfused, aligned
// and misaligned, and accumulate_grad adding into the caller's gradients.
#include <fmt/format.h>

#include <cmath>
#include <random>

#include "gpu/gpu_check.hpp"
#include "harness/device_tensor.hpp"

using namespace jitfuse;
using jitfuse::test::run_check;

namespace {

std::string linear(int64_t in, int64_t out, const char* extra) {
  return fmt::format(R"({{"op": "linear", "in_features": {}, "out_features": {}{}}})", in, out, extra);
}

constexpr const char* kInOut = R"(, "weight_layout": "in_out")";
constexpr const char* kSplit = R"(, "split_weight": true)";

}  // namespace

TEST_CASE("weight_layout in_out: a linear alone, every plain recipe and odd shapes", "[ops][layouts]") {
  for (const char* recipe : {"fp32", "fp16", "bf16"})
    for (auto [m, k, n] : {std::tuple{3, 5, 7}, std::tuple{64, 32, 48}, std::tuple{40, 24, 8}, std::tuple{256, 1024, 512}}) {
      run_check(test::seq_json("[" + linear(k, n, kInOut) + "]"), recipe, {m, k});
      run_check(test::seq_json("[" + linear(k, n, kInOut) + "]"), recipe, {m, k}, true, true);  // misaligned
    }
}

TEST_CASE("weight_layout in_out: GPT-2's MLP with its epilogue rules, fused and unfused", "[ops][layouts]") {
  const std::string seq = test::seq_json("[" + linear(64, 256, kInOut) + R"(, {"op": "bias"},
      {"op": "gelu", "approximate": "tanh"}, )" + linear(256, 64, kInOut) + R"(, {"op": "bias"},
      {"op": "add_extra_input"}])", "gpt2_mlp");
  for (const char* recipe : {"fp32", "fp16", "bf16"}) {
    run_check(seq, recipe, {96, 64});
    run_check(seq, recipe, {37, 64});
    run_check(seq, recipe, {96, 64}, false);  // inference: GELU_BIAS
    test::ScopedEnv off("JITFUSE_DISABLE_FUSION", "1");
    run_check(seq, recipe, {96, 64});
  }
  // linear + bias + relu (RELU_AUX_BIAS / DRELU_BGRAD) and linear + bias (BIAS / BGRADB -> BGRADA).
  run_check(test::seq_json("[" + linear(64, 128, kInOut) + R"(, {"op": "bias"}, {"op": "relu"}, )" +
                           linear(128, 64, kInOut) + R"(, {"op": "bias"}])"), "bf16", {80, 64});
  run_check(test::seq_json("[" + linear(48, 40, kInOut) + R"(, {"op": "bias"}])"), "fp32", {33, 48});
}

TEST_CASE("split_weight: a gated MLP on two weights, every plain recipe", "[ops][layouts]") {
  const std::string mlp = test::seq_json(R"([{"op": "rmsnorm", "eps": 1e-6}, )" + linear(64, 192, kSplit) +
                                         R"(, {"op": "swiglu"}, )" + linear(96, 64, "") +
                                         R"(, {"op": "add_extra_input"}])", "gated_mlp");
  for (const char* recipe : {"fp32", "fp16", "bf16"}) {
    run_check(mlp, recipe, {128, 64});
    run_check(mlp, recipe, {7, 64});
    run_check(mlp, recipe, {128, 64}, false);
    run_check(mlp, recipe, {40, 64}, true, true);  // misaligned: the halves' columns at odd offsets
    test::ScopedEnv off("JITFUSE_DISABLE_FUSION", "1");
    run_check(mlp, recipe, {128, 64});
  }
  // A split linear with a bias and GELU after it: the epilogue rules are refused, the chain runs generated.
  run_check(test::seq_json("[" + linear(32, 80, kSplit) + R"(, {"op": "bias"}, {"op": "gelu", "approximate": "tanh"}])"),
            "bf16", {50, 32});
  run_check(test::seq_json("[" + linear(40, 24, kSplit) + "]"), "fp32", {3, 40});
}

namespace {

// accumulate_grad with both layouts (fp32): the weight gradients are added to random values already there.
void accumulate_case(const char* attrs, bool split) {
  jf_context ctx = test::shared_context();
  const int64_t M = 37, K = 32, N = 16;
  jf_sequence seq = nullptr;
  REQUIRE(jf_sequence_create(ctx, test::seq_json("[" + linear(K, N, attrs) + "]").c_str(), "fp32", &seq) == JF_OK);
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<double> u(-1, 1);
  auto rnd = [&](size_t n) {
    std::vector<double> v(n);
    for (auto& x : v) x = static_cast<float>(u(rng));
    return v;
  };
  // Stored weights: in_out [K, N]; split two [N/2, K]; gradient buffers of the same shapes.
  const ops::Shape wshape = split ? ops::Shape{N / 2, K} : ops::Shape{K, N};
  const size_t wn = static_cast<size_t>(ops::numel(wshape));
  auto x = rnd(M * K), gy = rnd(M * N), w1 = rnd(wn), w2 = rnd(wn), g1 = rnd(wn), g2 = rnd(wn);
  harness::DeviceTensor dx({M, K}, "fp32"), dy({M, N}, "fp32"), dgy({M, N}, "fp32"), dgx({M, K}, "fp32"),
      dw1(wshape, "fp32"), dw2(wshape, "fp32"), dg1(wshape, "fp32"), dg2(wshape, "fp32");
  dx.upload_values(x, nullptr);
  dgy.upload_values(gy, nullptr);
  dw1.upload_values(w1, nullptr);
  dw2.upload_values(w2, nullptr);
  dg1.upload_values(g1, nullptr);
  dg2.upload_values(g2, nullptr);
  dy.poison(nullptr);
  dgx.poison(nullptr);
  std::vector<jf_param> params = {{0, "weight", dw1.dl()}}, grads = {{0, "weight", dg1.dl()}};
  if (split) {
    params.push_back({0, "weight2", dw2.dl()});
    grads.push_back({0, "weight2", dg2.dl()});
  }
  // W[n][k] of the [out, in] weight these store.
  auto W = [&](int64_t n, int64_t k) {
    if (!split) return w1[static_cast<size_t>(k * N + n)];
    return n < N / 2 ? w1[static_cast<size_t>(n * K + k)] : w2[static_cast<size_t>((n - N / 2) * K + k)];
  };
  jf_saved saved = nullptr;
  REQUIRE(test::forward_simple(seq, dx.dl(), dy.dl(), params, true, &saved) == JF_OK);
  REQUIRE(test::backward_simple(seq, saved, dx.dl(), dy.dl(), dgy.dl(), dgx.dl(), params, grads) == JF_OK);
  REQUIRE(jf_saved_release(saved, nullptr) == JF_OK);
  const auto y = dy.download_values(nullptr), gx = dgx.download_values(nullptr);
  const auto r1 = dg1.download_values(nullptr), r2 = dg2.download_values(nullptr);
  double worst = 0;
  auto tol = [](double ref) { return 1e-5 + 1e-3 * std::fabs(ref); };  // fp32 GEMMs may run TF32-free; fp16 tol
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double ref = 0;
      for (int64_t k = 0; k < K; ++k) ref += x[static_cast<size_t>(m * K + k)] * W(n, k);
      worst = std::max(worst, std::fabs(y[static_cast<size_t>(m * N + n)] - ref) / tol(ref));
    }
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) {
      double ref = 0;
      for (int64_t n = 0; n < N; ++n) ref += gy[static_cast<size_t>(m * N + n)] * W(n, k);
      worst = std::max(worst, std::fabs(gx[static_cast<size_t>(m * K + k)] - ref) / tol(ref));
    }
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) {
      double dw = 0;
      for (int64_t m = 0; m < M; ++m) dw += gy[static_cast<size_t>(m * N + n)] * x[static_cast<size_t>(m * K + k)];
      const size_t at = split ? static_cast<size_t>((n % (N / 2)) * K + k) : static_cast<size_t>(k * N + n);
      const auto& got = split && n >= N / 2 ? r2 : r1;
      const auto& before = split && n >= N / 2 ? g2 : g1;
      const double ref = before[at] + dw;
      worst = std::max(worst, std::fabs(got[at] - ref) / tol(ref));
    }
  INFO(attrs << ": worst err/tol " << worst);
  CHECK(worst <= 1.0);  // NaN (unwritten poison) fails this too
  jf_sequence_destroy(seq);
}

}  // namespace

TEST_CASE("accumulate_grad adds into the gradients of an in_out and a split weight", "[ops][layouts]") {
  accumulate_case(R"(, "weight_layout": "in_out", "accumulate_grad": true)", false);
  accumulate_case(R"(, "split_weight": true, "accumulate_grad": true)", true);
}
