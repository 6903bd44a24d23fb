// Closeness for the GPU tests that launch generated kernels directly (moe_test, cross_entropy_vp_test): every
// element within rtol x (|want| + 1) + 1e-6 of the float64 reference; a failure names the worst element.
#pragma once
#include <catch2/catch.hpp>

#include <cmath>
#include <string>
#include <vector>

namespace jitfuse::test {

inline void check_close(const std::string& what, const std::vector<double>& got, const std::vector<double>& want,
                        double rtol) {
  INFO(what);
  REQUIRE(got.size() == want.size());
  double worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(got[i] - want[i]) / (1e-6 + rtol * (std::fabs(want[i]) + 1.0));
    if (!(err <= worst)) {
      worst = err;
      at = i;
    }
  }
  INFO("worst at " << at << ": got " << got[at] << " want " << want[at]);
  CHECK(worst <= 1.0);
}

}  // namespace jitfuse::test
