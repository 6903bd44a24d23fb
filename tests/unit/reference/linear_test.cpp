// Tests of the float64 bias and linear references: hand-computed products and
// finite-difference checks of db, dgrad and wgrad.
#include <catch2/catch.hpp>
#include <random>
#include <stdexcept>

#include "grad_check.hpp"
#include "reference/reference.hpp"

namespace ref = jitfuse::reference;
using ref::Vec;
using ref::testing::check_grad;
using ref::testing::dot;
using ref::testing::numeric_grad;
using ref::testing::random_vec;

TEST_CASE("bias_fwd and col_sum match hand-computed values", "[reference]") {
  const Vec x = {1, 2, 3, 4, 5, 6};  // [2, 3]
  CHECK(ref::bias_fwd(x, Vec{10, 20, 30}, 2, 3) == Vec{11, 22, 33, 14, 25, 36});
  CHECK(ref::col_sum(x, 2, 3) == Vec{5, 7, 9});
  CHECK(ref::col_sum(x, 3, 2) == Vec{9, 12});
  CHECK(ref::col_sum(Vec{}, 0, 4) == Vec{0, 0, 0, 0});
}

TEST_CASE("bias backward (col_sum) agrees with finite differences", "[reference]") {
  const int64_t rows = 4, cols = 6;
  std::mt19937_64 rng(0x5eed0101);
  const Vec x = random_vec(rng, rows * cols), b = random_vec(rng, cols),
            r = random_vec(rng, rows * cols);
  auto loss_b = [&](const Vec& bs) { return dot(ref::bias_fwd(x, bs, rows, cols), r); };
  check_grad("db", ref::col_sum(r, rows, cols), numeric_grad(loss_b, b));
  // dx of a bias add is dy itself.
  auto loss_x = [&](const Vec& xs) { return dot(ref::bias_fwd(xs, b, rows, cols), r); };
  check_grad("dx", r, numeric_grad(loss_x, x));
}

TEST_CASE("linear_fwd computes x W^T row-major", "[reference]") {
  const Vec x = {1, 2, 3, 4, 5, 6};   // [M=2, K=3]
  const Vec w = {1, 0, -1, 2, 1, 0};  // [N=2, K=3]
  // y[i][j] = sum_k x[i][k] w[j][k]
  CHECK(ref::linear_fwd(x, w, 2, 2, 3) == Vec{-2, 4, -2, 13});
  const Vec dy = {1, 2, 3, 4};                                              // [M=2, N=2]
  CHECK(ref::linear_dgrad(dy, w, 2, 2, 3) == Vec{5, 2, -1, 11, 4, -3});     // dy W  [M, K]
  CHECK(ref::linear_wgrad(dy, x, 2, 2, 3) == Vec{13, 17, 21, 18, 24, 30});  // dy^T x [N, K]
}

TEST_CASE("linear dgrad and wgrad agree with finite differences", "[reference]") {
  const int64_t m = 5, n = 3, k = 4;
  std::mt19937_64 rng(0x5eed0102);
  const Vec x = random_vec(rng, m * k), w = random_vec(rng, n * k), r = random_vec(rng, m * n);
  auto loss_x = [&](const Vec& xs) { return dot(ref::linear_fwd(xs, w, m, n, k), r); };
  auto loss_w = [&](const Vec& ws) { return dot(ref::linear_fwd(x, ws, m, n, k), r); };
  check_grad("dgrad", ref::linear_dgrad(r, w, m, n, k), numeric_grad(loss_x, x));
  check_grad("wgrad", ref::linear_wgrad(r, x, m, n, k), numeric_grad(loss_w, w));
}

TEST_CASE("bias and linear references reject bad shapes", "[reference]") {
  const Vec six(6, 1.0);
  CHECK_THROWS_AS(ref::bias_fwd(six, Vec(2, 0.0), 2, 3), std::invalid_argument);
  CHECK_THROWS_AS(ref::bias_fwd(six, Vec(3, 0.0), 3, 3), std::invalid_argument);
  CHECK_THROWS_AS(ref::col_sum(six, 4, 2), std::invalid_argument);
  CHECK_THROWS_AS(ref::linear_fwd(six, six, 2, 2, 2), std::invalid_argument);
  CHECK_THROWS_AS(ref::linear_dgrad(Vec(4, 1.0), six, 2, 3, 2), std::invalid_argument);
  CHECK_THROWS_AS(ref::linear_wgrad(Vec(4, 1.0), six, 2, 2, -3), std::invalid_argument);
  CHECK_THROWS_WITH(ref::linear_fwd(six, Vec(5, 1.0), 2, 2, 3),
                    Catch::Contains("w has 5 elements"));
}
