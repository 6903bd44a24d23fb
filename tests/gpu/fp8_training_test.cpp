// FP8 training sanity run (issue 13): a small MLP regression trained with plain SGD for 300 steps in bf16
// and under fp8_delayed and fp8_current, from the same initialisation and on the same data. The loss
// curves must stay within a band of the bf16 curve (stated below, with why), and all three must learn.
#include <cmath>
#include <cstdio>
#include <random>

#include "gpu/gpu_check.hpp"
#include "harness/device_tensor.hpp"

using namespace jitfuse;

namespace {

constexpr int64_t kRows = 256, kIn = 64, kHidden = 128, kOut = 32;
constexpr int kSteps = 300;
constexpr double kLr = 0.05;

// Returns the loss (mean squared error) before each step.
std::vector<double> train(const char* recipe) {
  const std::string json = test::seq_json(R"([{"op": "layernorm"}, {"op": "linear", "in_features": 64, "out_features": 128},
      {"op": "bias"}, {"op": "gelu"}, {"op": "linear", "in_features": 128, "out_features": 32}, {"op": "bias"}])", "regression");
  jf_sequence seq = nullptr;
  REQUIRE(jf_sequence_create(test::shared_context(), json.c_str(), recipe, &seq) == JF_OK);
  // The same data and initialisation for every recipe: a fixed teacher y = sin(x A) B.
  std::mt19937_64 rng(2026);
  std::normal_distribution<double> nd(0, 1);
  auto randn = [&](size_t n, double s) {
    std::vector<double> v(n);
    for (auto& e : v) e = s * nd(rng);
    return v;
  };
  const auto x = randn(kRows * kIn, 1.0);
  const auto a = randn(kIn * kHidden, 1.0 / std::sqrt(kIn)), bm = randn(kHidden * kOut, 1.0 / std::sqrt(kHidden));
  std::vector<double> target(kRows * kOut, 0.0);
  for (int64_t r = 0; r < kRows; ++r)
    for (int64_t o = 0; o < kOut; ++o) {
      double t = 0;
      for (int64_t h = 0; h < kHidden; ++h) {
        double z = 0;
        for (int64_t i = 0; i < kIn; ++i) z += x[r * kIn + i] * a[i * kHidden + h];
        t += std::sin(z) * bm[h * kOut + o];
      }
      target[r * kOut + o] = t;
    }
  // Master weights in double (the host's fp32/fp64 copy), bf16 copies for the calls.
  struct P {
    int op;
    const char* name;
    ops::Shape shape;
    std::vector<double> w;
  };
  std::vector<P> ps = {{0, "weight", {kIn}, std::vector<double>(kIn, 1.0)},
                       {0, "bias", {kIn}, std::vector<double>(kIn, 0.0)},
                       {1, "weight", {kHidden, kIn}, randn(kHidden * kIn, 1.0 / std::sqrt(kIn))},
                       {2, "bias", {kHidden}, std::vector<double>(kHidden, 0.0)},
                       {4, "weight", {kOut, kHidden}, randn(kOut * kHidden, 1.0 / std::sqrt(kHidden))},
                       {5, "bias", {kOut}, std::vector<double>(kOut, 0.0)}};
  std::vector<std::unique_ptr<harness::DeviceTensor>> dev, grads;
  std::vector<jf_param> params, gparams;
  for (auto& p : ps) {
    dev.push_back(std::make_unique<harness::DeviceTensor>(p.shape, "bf16"));
    grads.push_back(std::make_unique<harness::DeviceTensor>(p.shape, "bf16"));
    params.push_back({p.op, p.name, dev.back()->dl()});
    gparams.push_back({p.op, p.name, grads.back()->dl()});
  }
  harness::DeviceTensor xt({kRows, kIn}, "bf16"), yt({kRows, kOut}, "bf16"), gy({kRows, kOut}, "bf16"),
      gx({kRows, kIn}, "bf16");
  xt.upload_values(x, nullptr);
  std::vector<double> losses;
  for (int step = 0; step < kSteps; ++step) {
    for (size_t i = 0; i < ps.size(); ++i) dev[i]->upload_values(ps[i].w, nullptr);
    yt.poison(nullptr);
    jf_saved saved = nullptr;
    REQUIRE(test::forward_simple(seq, xt.dl(), yt.dl(), params, true, &saved) == JF_OK);
    const auto y = yt.download_values(nullptr);
    double loss = 0;
    std::vector<double> dy(y.size());
    for (size_t i = 0; i < y.size(); ++i) {
      const double d = y[i] - target[i];
      loss += d * d;
      dy[i] = 2.0 * d / static_cast<double>(y.size());
    }
    loss /= static_cast<double>(y.size());
    REQUIRE(std::isfinite(loss));
    losses.push_back(loss);
    // dy is tiny (2/N): scale it up by N for the call and back down in the update, as loss scaling does,
    // so the bf16 / E5M2 gradients sit in their normal range.
    for (auto& d : dy) d *= static_cast<double>(y.size()) / 2.0;
    gy.upload_values(dy, nullptr);
    REQUIRE(test::backward_simple(seq, saved, xt.dl(), yt.dl(), gy.dl(), gx.dl(), params, gparams) == JF_OK);
    REQUIRE(jf_saved_release(saved, nullptr) == JF_OK);
    for (size_t i = 0; i < ps.size(); ++i) {
      const auto g = grads[i]->download_values(nullptr);
      for (size_t k = 0; k < g.size(); ++k) ps[i].w[k] -= kLr * g[k] * 2.0 / static_cast<double>(y.size());
    }
  }
  jf_sequence_destroy(seq);
  return losses;
}

}  // namespace

TEST_CASE("FP8 training sanity: an MLP regression under fp8_delayed / fp8_current tracks bf16 for 300 SGD steps",
          "[fp8_linear]") {
  cuda::current_device();
  const auto bf = train("bf16"), dl = train("fp8_delayed"), cu = train("fp8_current");
  // The band: |loss_fp8 - loss_bf16| <= 0.05 * loss_bf16(0) + 0.15 * loss_bf16(step) at every step. E4M3
  // keeps 3 mantissa bits (relative rounding error up to 2^-4 = 6 %) on x and W and E5M2 2 bits on dy, so
  // the forward outputs and gradients carry a few per cent of noise against bf16's 0.4 %: the curves may
  // not coincide, but the same optimisation must happen (TransformerEngine reports FP8 loss curves within
  // run-to-run noise of bf16 for the same reason: the rounding errors do not accumulate in the weights,
  // which stay in the host's high-precision master copy).
  std::printf("\nFP8 training sanity (%d steps, lr %.2f): loss at steps 0/50/100/200/299\n", kSteps, kLr);
  for (auto* c : {&bf, &dl, &cu}) {
    const char* name = c == &bf ? "bf16" : c == &dl ? "fp8_delayed" : "fp8_current";
    std::printf("  %-12s %.4f %.4f %.4f %.4f %.4f\n", name, (*c)[0], (*c)[50], (*c)[100], (*c)[200], (*c)[kSteps - 1]);
  }
  double worst_dl = 0, worst_cu = 0;
  for (int s = 0; s < kSteps; ++s) {
    const double band = 0.05 * bf[0] + 0.15 * bf[s];
    worst_dl = std::max(worst_dl, std::fabs(dl[s] - bf[s]) / band);
    worst_cu = std::max(worst_cu, std::fabs(cu[s] - bf[s]) / band);
  }
  std::printf("  worst |fp8 - bf16| / band: fp8_delayed %.3f, fp8_current %.3f\n", worst_dl, worst_cu);
  CHECK(bf[kSteps - 1] < 0.5 * bf[0]);  // bf16 learns
  CHECK(dl[kSteps - 1] < 0.5 * dl[0]);
  CHECK(cu[kSteps - 1] < 0.5 * cu[0]);
  CHECK(worst_dl <= 1.0);
  CHECK(worst_cu <= 1.0);
}
