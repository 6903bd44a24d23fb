// Tests of the float64 layernorm and rmsnorm references: hand-computed rows and
// finite-difference checks of dx, dgamma and dbeta, with and without zero_centered gamma.
#include <catch2/catch.hpp>
#include <cmath>
#include <random>
#include <stdexcept>
#include <string>

#include "grad_check.hpp"
#include "reference/reference.hpp"

namespace ref = jitfuse::reference;
using ref::Vec;
using ref::testing::check_grad;
using ref::testing::dot;
using ref::testing::numeric_grad;
using ref::testing::random_vec;

TEST_CASE("layernorm_fwd of [1,2,3,4]", "[reference]") {
  // mean 2.5, biased var 1.25, so y = (x - 2.5) / sqrt(1.25) with eps = 0.
  const Vec x = {1, 2, 3, 4};
  const auto out = ref::layernorm_fwd(x, Vec(4, 1.0), Vec(4, 0.0), 1, 4, 0.0, false);
  const Vec want = {-1.3416407864998738, -0.4472135954999579, 0.4472135954999579,
                    1.3416407864998738};
  for (int j = 0; j < 4; ++j) CHECK(out.y[j] == Approx(want[j]).epsilon(1e-15));
  REQUIRE(out.mean.size() == 1);
  CHECK(out.mean[0] == 2.5);
  CHECK(out.rstd[0] == Approx(1.0 / std::sqrt(1.25)).epsilon(1e-15));

  // gamma/beta are applied after normalisation; zero_centered stores gamma - 1.
  const Vec g = {2, 0.5, -1, 1}, beta = {0.25, 0, 0, -1};
  const auto affine = ref::layernorm_fwd(x, g, beta, 1, 4, 1e-5, false);
  const auto centered = ref::layernorm_fwd(x, Vec{1, -0.5, -2, 0}, beta, 1, 4, 1e-5, true);
  const double rstd = 0.894423613312618;  // 1/sqrt(1.25 + 1e-5)
  for (int j = 0; j < 4; ++j) {
    const double y = (x[j] - 2.5) * rstd * g[j] + beta[j];
    CHECK(affine.y[j] == Approx(y).epsilon(1e-14));
    CHECK(centered.y[j] == Approx(y).epsilon(1e-14));
  }
}

TEST_CASE("rmsnorm_fwd of [1,2,3,4]", "[reference]") {
  // mean(x^2) = 7.5, so y = x / sqrt(7.5); the mean output is all zeros for rmsnorm.
  const Vec x = {1, 2, 3, 4, -1, -2, -3, -4};
  const auto out = ref::rmsnorm_fwd(x, Vec(4, 1.0), 2, 4, 0.0, false);
  const Vec want = {0.3651483716701107, 0.7302967433402214, 1.0954451150103321, 1.4605934866804429};
  for (int j = 0; j < 4; ++j) {
    CHECK(out.y[j] == Approx(want[j]).epsilon(1e-15));
    CHECK(out.y[4 + j] == Approx(-want[j]).epsilon(1e-15));
  }
  CHECK(out.mean == Vec{0.0, 0.0});
  CHECK(out.rstd[0] == Approx(0.3651483716701107).epsilon(1e-15));
  const auto centered = ref::rmsnorm_fwd(x, Vec{1, -1, 0, 0}, 2, 4, 0.0, true);
  CHECK(centered.y[0] == Approx(2 * want[0]).epsilon(1e-15));
  CHECK(centered.y[1] == 0.0);
}

TEST_CASE("layernorm_bwd agrees with finite differences", "[reference]") {
  const int64_t rows = 3, cols = 8;
  const double eps = 1e-5;
  for (bool zc : {false, true}) {
    INFO("zero_centered = " << zc);
    std::mt19937_64 rng(0x5eed0201);
    const Vec x = random_vec(rng, rows * cols), gamma = random_vec(rng, cols),
              beta = random_vec(rng, cols), r = random_vec(rng, rows * cols);
    auto loss_x = [&](const Vec& xs) {
      return dot(ref::layernorm_fwd(xs, gamma, beta, rows, cols, eps, zc).y, r);
    };
    auto loss_g = [&](const Vec& gs) {
      return dot(ref::layernorm_fwd(x, gs, beta, rows, cols, eps, zc).y, r);
    };
    auto loss_b = [&](const Vec& bs) {
      return dot(ref::layernorm_fwd(x, gamma, bs, rows, cols, eps, zc).y, r);
    };
    const auto g = ref::layernorm_bwd(x, gamma, r, rows, cols, eps, zc);
    check_grad("dx", g.dx, numeric_grad(loss_x, x));
    check_grad("dgamma", g.dgamma, numeric_grad(loss_g, gamma));
    check_grad("dbeta", g.dbeta, numeric_grad(loss_b, beta));
  }
}

TEST_CASE("rmsnorm_bwd agrees with finite differences", "[reference]") {
  const int64_t rows = 3, cols = 8;
  const double eps = 1e-5;
  for (bool zc : {false, true}) {
    INFO("zero_centered = " << zc);
    std::mt19937_64 rng(0x5eed0202);
    const Vec x = random_vec(rng, rows * cols), gamma = random_vec(rng, cols),
              r = random_vec(rng, rows * cols);
    auto loss_x = [&](const Vec& xs) {
      return dot(ref::rmsnorm_fwd(xs, gamma, rows, cols, eps, zc).y, r);
    };
    auto loss_g = [&](const Vec& gs) {
      return dot(ref::rmsnorm_fwd(x, gs, rows, cols, eps, zc).y, r);
    };
    const auto g = ref::rmsnorm_bwd(x, gamma, r, rows, cols, eps, zc);
    check_grad("dx", g.dx, numeric_grad(loss_x, x));
    check_grad("dgamma", g.dgamma, numeric_grad(loss_g, gamma));
    CHECK(g.dbeta.empty());
  }
}

TEST_CASE("norm references reject bad shapes and eps", "[reference]") {
  const Vec x(8, 1.0), g4(4, 1.0), b4(4, 0.0);
  CHECK_THROWS_AS(ref::layernorm_fwd(x, Vec(3, 1.0), b4, 2, 4, 1e-5, false), std::invalid_argument);
  CHECK_THROWS_AS(ref::layernorm_fwd(x, g4, Vec(5, 0.0), 2, 4, 1e-5, false), std::invalid_argument);
  CHECK_THROWS_AS(ref::layernorm_fwd(x, g4, b4, 4, 2, 1e-5, false), std::invalid_argument);
  CHECK_THROWS_AS(ref::layernorm_bwd(x, g4, Vec(7, 1.0), 2, 4, 1e-5, false), std::invalid_argument);
  CHECK_THROWS_AS(ref::rmsnorm_fwd(x, g4, 2, 4, -1e-5, false), std::invalid_argument);
  CHECK_THROWS_AS(ref::rmsnorm_fwd(Vec{}, Vec{}, 0, 0, 1e-5, false), std::invalid_argument);
  CHECK_THROWS_AS(ref::rmsnorm_bwd(x, g4, x, 2, 4, std::nan(""), true), std::invalid_argument);
  CHECK_NOTHROW(ref::rmsnorm_fwd(Vec{}, g4, 0, 4, 1e-5, false));
}
