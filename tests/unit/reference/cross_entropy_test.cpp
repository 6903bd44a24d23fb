// The float64 cross_entropy reference: hand-computed rows (each attribute, each reduction, an ignored row) and
// central-difference checks of dlogits for every attribute and reduction.
#include <catch2/catch.hpp>
#include <cmath>
#include <random>

#include "grad_check.hpp"
#include "reference/reference.hpp"

namespace ref = jitfuse::reference;
using ref::Vec;
using ref::testing::check_grad;
using ref::testing::numeric_grad;
using ref::testing::random_vec;

namespace {

// logits [3, 3]: row 0 = 1 2 3 (label 2), row 1 = 1 1 1 (label 0), row 2 = 0 0 0 (ignored).
const Vec kX = {1, 2, 3, 1, 1, 1, 0, 0, 0};
const std::vector<int64_t> kY = {2, 0, -100};
// log(e + e^2 + e^3) and log 3.
const double kLse0 = 3.4076059644443806, kLse1 = 1 + 1.0986122886681098;

ref::CrossEntropyAttrs attrs(const char* reduction, double eps = 0, double zl = 0, double cap = 0) {
  ref::CrossEntropyAttrs a;
  a.reduction = reduction;
  a.label_smoothing = eps;
  a.z_loss = zl;
  a.softcap = cap;
  return a;
}

}  // namespace

TEST_CASE("cross_entropy_fwd of a hand-computed 3x3 case", "[reference][cross_entropy]") {
  const double l0 = kLse0 - 3, l1 = kLse1 - 1;
  auto none = ref::cross_entropy_fwd(kX, kY, 3, 3, attrs("none"));
  REQUIRE(none.loss.size() == 3);
  CHECK(none.loss[0] == Approx(l0).epsilon(1e-15));
  CHECK(none.loss[1] == Approx(l1).epsilon(1e-15));
  CHECK(none.loss[2] == 0.0);  // ignored
  CHECK(none.lse[0] == Approx(kLse0).epsilon(1e-15));
  CHECK(none.count == 2);
  CHECK(ref::cross_entropy_fwd(kX, kY, 3, 3, attrs("sum")).loss.size() == 1);
  CHECK(ref::cross_entropy_fwd(kX, kY, 3, 3, attrs("sum")).loss[0] == Approx(l0 + l1).epsilon(1e-15));
  CHECK(ref::cross_entropy_fwd(kX, kY, 3, 3, attrs("mean")).loss[0] == Approx((l0 + l1) / 2).epsilon(1e-15));
  // Label smoothing 0.1: lse - 0.9 z_y - 0.1/3 sum z (row 1's z are equal: unchanged).
  auto ls = ref::cross_entropy_fwd(kX, kY, 3, 3, attrs("none", 0.1));
  CHECK(ls.loss[0] == Approx(kLse0 - 0.9 * 3 - 0.1 / 3 * 6).epsilon(1e-15));
  CHECK(ls.loss[1] == Approx(l1).epsilon(1e-15));
  // z-loss: + 1e-2 lse^2.
  auto zl = ref::cross_entropy_fwd(kX, kY, 3, 3, attrs("none", 0, 1e-2));
  CHECK(zl.loss[0] == Approx(l0 + 1e-2 * kLse0 * kLse0).epsilon(1e-15));
  // Soft-capping at 2: z = 2 tanh(x / 2).
  auto sc = ref::cross_entropy_fwd(kX, kY, 3, 3, attrs("none", 0, 0, 2));
  const double z0 = 2 * std::tanh(0.5), z1 = 2 * std::tanh(1.0), z2 = 2 * std::tanh(1.5);
  CHECK(sc.loss[0] == Approx(std::log(std::exp(z0) + std::exp(z1) + std::exp(z2)) - z2).epsilon(1e-14));
  // Every row ignored: "mean" is 0 / 0 (NaN, as PyTorch), "sum" 0.
  const std::vector<int64_t> all_ignored = {-100, -100, -100};
  CHECK(std::isnan(ref::cross_entropy_fwd(kX, all_ignored, 3, 3, attrs("mean")).loss[0]));
  CHECK(ref::cross_entropy_fwd(kX, all_ignored, 3, 3, attrs("sum")).loss[0] == 0.0);
  // A label outside [0, V) that is not ignore_index: NaN (the device cannot raise).
  CHECK(std::isnan(ref::cross_entropy_fwd(kX, {3, 0, -100}, 3, 3, attrs("none")).loss[0]));
}

TEST_CASE("cross_entropy_bwd of the hand-computed case", "[reference][cross_entropy]") {
  // mean over 2 rows, dy = 1: row 0 = (softmax - onehot(2)) / 2, row 1 = (1/3 - onehot(0)) / 2, row 2 = 0.
  const Vec dx = ref::cross_entropy_bwd(kX, kY, Vec{1.0}, 3, 3, attrs("mean"));
  const double s = std::exp(kLse0);
  const Vec want = {std::exp(1) / s / 2,
                    std::exp(2) / s / 2,
                    (std::exp(3) / s - 1) / 2,
                    (1.0 / 3 - 1) / 2,
                    1.0 / 6,
                    1.0 / 6,
                    0,
                    0,
                    0};
  for (size_t i = 0; i < want.size(); ++i) CHECK(dx[i] == Approx(want[i]).epsilon(1e-14).margin(1e-15));
  const Vec nan_row = ref::cross_entropy_bwd(kX, {3, 0, -100}, Vec{1.0}, 3, 3, attrs("sum"));
  CHECK(std::isnan(nan_row[0]));
  CHECK(nan_row[3] == Approx(1.0 / 3 - 1));
}

TEST_CASE("cross_entropy_bwd agrees with finite differences for every attribute", "[reference][cross_entropy]") {
  const int64_t rows = 5, v = 7;
  std::mt19937_64 rng(47);
  const Vec x = random_vec(rng, rows * v);
  const std::vector<int64_t> y = {3, -1, 0, 6, 2};  // row 1 ignored (ignore_index -1)
  for (const char* red : {"mean", "sum", "none"})
    for (auto [eps, zl, cap] : {std::tuple{0.0, 0.0, 0.0}, std::tuple{0.1, 0.0, 0.0}, std::tuple{0.0, 1e-2, 0.0},
                                std::tuple{0.0, 0.0, 1.5}, std::tuple{0.2, 1e-3, 3.0}}) {
      ref::CrossEntropyAttrs a = attrs(red, eps, zl, cap);
      a.ignore_index = -1;
      const bool none = a.reduction == "none";
      const Vec r = none ? random_vec(rng, rows) : Vec{0.7};  // L = sum_r loss_r r_r, or 0.7 loss
      auto loss = [&](const Vec& xx) {
        const Vec l = ref::cross_entropy_fwd(xx, y, rows, v, a).loss;
        double s = 0;
        for (size_t i = 0; i < l.size(); ++i) s += l[i] * r[i];
        return s;
      };
      INFO(red << " eps " << eps << " z_loss " << zl << " softcap " << cap);
      const Vec dx = ref::cross_entropy_bwd(x, y, r, rows, v, a);
      check_grad("dx", dx, numeric_grad(loss, x));
      for (int64_t j = 0; j < v; ++j) CHECK(dx[static_cast<size_t>(v + j)] == 0.0);  // the ignored row
    }
}

TEST_CASE("cross_entropy reference refuses bad arguments", "[reference][cross_entropy]") {
  CHECK_THROWS_WITH(ref::cross_entropy_fwd(kX, {0, 1}, 3, 3, attrs("mean")),
                    Catch::Contains("labels has 2 entries for 3 rows"));
  CHECK_THROWS_WITH(ref::cross_entropy_fwd(kX, kY, 3, 3, attrs("avg")), Catch::Contains("reduction 'avg'"));
  CHECK_THROWS_WITH(ref::cross_entropy_bwd(kX, kY, Vec{1, 2}, 3, 3, attrs("mean")),
                    Catch::Contains("dy has 2 elements"));
}
