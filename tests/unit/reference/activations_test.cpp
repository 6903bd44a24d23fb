// Tests of the float64 activation and gated references: hand-computed values and
// finite-difference checks of every backward.
#include <catch2/catch.hpp>
#include <cmath>
#include <limits>
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

namespace {
const char* const kActs[] = {"gelu_tanh", "gelu_erf", "relu", "silu", "qgelu", "srelu", "identity"};
const char* const kGated[] = {"swiglu", "geglu", "reglu"};
}  // namespace

TEST_CASE("act_fwd matches hand-computed values", "[reference]") {
  CHECK(ref::act_fwd("gelu_tanh", 1.0) == Approx(0.8411919906082768).epsilon(1e-15));
  CHECK(ref::act_fwd("gelu_tanh", -0.5) == Approx(-0.15428599017485606).epsilon(1e-15));
  CHECK(ref::act_fwd("gelu_erf", 1.0) == Approx(0.8413447460685429).epsilon(1e-15));
  CHECK(ref::act_fwd("gelu_erf", -0.5) == Approx(-0.15426876936299344).epsilon(1e-15));
  CHECK(ref::act_fwd("silu", 1.0) == Approx(0.7310585786300049).epsilon(1e-15));
  CHECK(ref::act_fwd("silu", -0.5) == Approx(-0.1887703343990727).epsilon(1e-15));
  CHECK(ref::act_fwd("qgelu", 1.0) == Approx(0.8457957659328212).epsilon(1e-15));
  CHECK(ref::act_fwd("relu", 3.0) == 3.0);
  CHECK(ref::act_fwd("relu", -2.0) == 0.0);
  CHECK(ref::act_fwd("srelu", 3.0) == 9.0);
  CHECK(ref::act_fwd("srelu", -3.0) == 0.0);
  CHECK(ref::act_fwd("identity", -1.25) == -1.25);
  for (const char* k : kActs) {
    INFO(k);
    CHECK(ref::act_fwd(k, 0.0) == 0.0);
  }
}

TEST_CASE("act_bwd matches hand-computed derivatives", "[reference]") {
  // Every smooth kind here has f'(0) = 1/2 (0.5 * (1 + 0) plus a term that vanishes at 0).
  for (const char* k : {"gelu_tanh", "gelu_erf", "silu", "qgelu"}) {
    INFO(k);
    CHECK(ref::act_bwd(k, 0.0, 2.0) == Approx(1.0).epsilon(1e-15));
  }
  CHECK(ref::act_bwd("relu", 0.0, 1.0) == 0.0);  // kink convention
  CHECK(ref::act_bwd("relu", 0.5, 3.0) == 3.0);
  CHECK(ref::act_bwd("relu", -0.5, 3.0) == 0.0);
  CHECK(ref::act_bwd("srelu", 3.0, 0.5) == 3.0);
  CHECK(ref::act_bwd("srelu", 0.0, 1.0) == 0.0);
  CHECK(ref::act_bwd("srelu", -3.0, 1.0) == 0.0);
  CHECK(ref::act_bwd("identity", 7.0, -1.5) == -1.5);
}

TEST_CASE("activations stay finite far from zero", "[reference]") {
  // Guards against forms like e^x / (1 + e^x), which give inf/inf = NaN once exp overflows.
  for (const char* k : kActs) {
    for (double x : {-800.0, -40.0, 40.0, 800.0}) {
      INFO(k << " at " << x);
      CHECK(std::isfinite(ref::act_fwd(k, x)));
      CHECK(std::isfinite(ref::act_bwd(k, x, 1.0)));
    }
  }
  CHECK(ref::act_fwd("silu", 800.0) == 800.0);
  CHECK(ref::act_fwd("silu", -800.0) == 0.0);
  CHECK(ref::act_bwd("silu", 800.0, 1.0) == 1.0);
  CHECK(ref::act_fwd("gelu_tanh", 40.0) == 40.0);
  CHECK(ref::act_fwd("gelu_erf", -40.0) == Approx(0.0).margin(1e-300));
}

TEST_CASE("act_bwd agrees with finite differences", "[reference]") {
  std::mt19937_64 rng(0x5eed0001);
  const Vec x = random_vec(rng, 64);
  const Vec r = random_vec(rng, 64);
  for (const char* k : kActs) {
    const std::string kind = k;
    auto loss = [&](const Vec& xs) {
      double s = 0.0;
      for (std::size_t i = 0; i < xs.size(); ++i) s += ref::act_fwd(kind, xs[i]) * r[i];
      return s;
    };
    Vec analytic(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) analytic[i] = ref::act_bwd(kind, x[i], r[i]);
    check_grad(k, analytic, numeric_grad(loss, x));
  }
}

TEST_CASE("gated_fwd matches hand-computed values", "[reference]") {
  // x = [[a0, a1, b0, b1]]: the FIRST half is activated, the second is the linear gate.
  const Vec x = {1.0, -0.5, 2.0, 3.0};
  const Vec sw = ref::gated_fwd("swiglu", x, 1, 2);
  REQUIRE(sw.size() == 2);
  CHECK(sw[0] == Approx(1.4621171572600098).epsilon(1e-15));
  CHECK(sw[1] == Approx(3.0 * -0.1887703343990727).epsilon(1e-15));
  const Vec ge = ref::gated_fwd("geglu", x, 1, 2);
  CHECK(ge[0] == Approx(2.0 * 0.8411919906082768).epsilon(1e-15));
  const Vec re = ref::gated_fwd("reglu", x, 1, 2);
  CHECK(re[0] == 2.0);
  CHECK(re[1] == 0.0);
  // Two rows: the halves are per row, not per tensor.
  const Vec y2 = ref::gated_fwd("reglu", Vec{1.0, 5.0, 2.0, 7.0}, 2, 1);
  CHECK(y2 == Vec{5.0, 14.0});
}

TEST_CASE("gated_bwd agrees with finite differences", "[reference]") {
  const int64_t rows = 3, n = 5;
  std::mt19937_64 rng(0x5eed0002);
  const Vec x = random_vec(rng, rows * 2 * n);
  const Vec r = random_vec(rng, rows * n);
  for (const char* k : kGated) {
    const std::string kind = k;
    auto loss = [&](const Vec& xs) { return dot(ref::gated_fwd(kind, xs, rows, n), r); };
    const Vec analytic = ref::gated_bwd(kind, x, r, rows, n);
    REQUIRE(analytic.size() == x.size());
    check_grad(k, analytic, numeric_grad(loss, x));
  }
}

TEST_CASE("activation references reject bad kinds and shapes", "[reference]") {
  const Vec x(8, 1.0), dy(4, 1.0);
  CHECK_THROWS_AS(ref::act_fwd("gelu", 1.0), std::invalid_argument);
  CHECK_THROWS_AS(ref::act_bwd("Relu", 1.0, 1.0), std::invalid_argument);
  CHECK_THROWS_AS(ref::gated_fwd("silu", x, 2, 2), std::invalid_argument);
  CHECK_THROWS_AS(ref::gated_fwd("swiglu", x, 2, 3), std::invalid_argument);
  CHECK_THROWS_AS(ref::gated_fwd("swiglu", x, -2, -2), std::invalid_argument);
  CHECK_THROWS_AS(ref::gated_bwd("geglu", x, Vec(3, 1.0), 2, 2), std::invalid_argument);
  CHECK_NOTHROW(ref::gated_bwd("geglu", x, dy, 2, 2));
  CHECK_THROWS_WITH(ref::act_fwd("gelu", 1.0), Catch::Contains("gelu_tanh"));
}
