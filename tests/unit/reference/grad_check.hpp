// Helpers for the reference tests: seeded random tensors and central-difference gradient checks.
// Every backward is checked against d/dx of L = sum(y * R) for a fixed random R.
#pragma once
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstddef>
#include <functional>
#include <random>

#include "reference/reference.hpp"

namespace jitfuse::reference::testing {

// Magnitudes in [0.1, 2] with a random sign: never zero, and at least 0.1 away from the relu kink.
inline Vec random_vec(std::mt19937_64& rng, std::size_t n) {
  std::uniform_real_distribution<double> mag(0.1, 2.0);
  std::bernoulli_distribution neg(0.5);
  Vec v(n);
  for (double& x : v) x = neg(rng) ? -mag(rng) : mag(rng);
  return v;
}

inline double dot(const Vec& a, const Vec& b) {
  REQUIRE(a.size() == b.size());
  double s = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// dL/dx_i ~ (L(x + h e_i) - L(x - h e_i)) / 2h. Truncation is O(h^2) ~ 1e-12 and cancellation
// ~ 1e-16 |L| / h ~ 1e-10, both far under the 1e-6 tolerance.
inline Vec numeric_grad(const std::function<double(const Vec&)>& loss, Vec x, double h = 1e-6) {
  Vec g(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double x0 = x[i];
    x[i] = x0 + h;
    const double lp = loss(x);
    x[i] = x0 - h;
    const double lm = loss(x);
    x[i] = x0;
    g[i] = (lp - lm) / (2.0 * h);
  }
  return g;
}

// Relative error with a floor of 1 on the scale, so near-zero gradients are held to 1e-6 absolute.
// Also insists the gradient is not all ~0, which would make the comparison vacuous.
inline void check_grad(const char* what, const Vec& analytic, const Vec& numeric,
                       double rtol = 1e-6) {
  INFO(what);
  REQUIRE(analytic.size() == numeric.size());
  REQUIRE(!analytic.empty());
  double worst = 0.0, biggest = 0.0;
  std::size_t worst_i = 0;
  for (std::size_t i = 0; i < analytic.size(); ++i) {
    const double err = std::fabs(analytic[i] - numeric[i]) / std::max(1.0, std::fabs(analytic[i]));
    if (err > worst) {
      worst = err;
      worst_i = i;
    }
    biggest = std::max(biggest, std::fabs(numeric[i]));
  }
  INFO("worst element " << worst_i << ": analytic " << analytic[worst_i] << " numeric "
                        << numeric[worst_i]);
  CHECK(worst <= rtol);
  CHECK(biggest > 1e-3);
}

}  // namespace jitfuse::reference::testing
