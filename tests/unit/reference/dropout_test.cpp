// Tests of the dropout reference: Philox4x32-10 against Random123's known answers, the keep
// threshold, mask statistics and reproducibility, and the backward (linear in dy).
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <vector>

#include "grad_check.hpp"
#include "reference/reference.hpp"

namespace ref = jitfuse::reference;
using ref::Vec;
using ref::testing::check_grad;
using ref::testing::dot;
using ref::testing::numeric_grad;
using ref::testing::random_vec;

namespace {
std::size_t count_kept(const std::vector<uint8_t>& m) {
  std::size_t k = 0;
  for (uint8_t v : m) k += v;
  return k;
}
std::size_t count_diff(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  std::size_t d = 0;
  for (std::size_t i = 0; i < a.size(); ++i) d += a[i] != b[i];
  return d;
}
}  // namespace

TEST_CASE("philox4x32_10 matches the Random123 known-answer vectors", "[reference]") {
  struct Kat {
    uint32_t ctr[4], key[2], want[4];
  };
  const Kat kats[] = {
      {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
      {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff},
       {0xffffffff, 0xffffffff},
       {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
      {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344},
       {0xa4093822, 0x299f31d0},
       {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
  };
  for (const Kat& k : kats) {
    uint32_t out[4];
    ref::philox4x32_10(k.ctr, k.key, out);
    for (int i = 0; i < 4; ++i) {
      INFO("counter[0] " << k.ctr[0] << " word " << i);
      CHECK(out[i] == k.want[i]);
    }
  }
}

TEST_CASE("keep_threshold is floor((1-p) 2^32), saturated", "[reference]") {
  CHECK(ref::keep_threshold(0.0) == 0xffffffffu);
  CHECK(ref::keep_threshold(0.5) == 0x80000000u);
  CHECK(ref::keep_threshold(0.25) == 0xc0000000u);
  CHECK(ref::keep_threshold(0.75) == 0x40000000u);
  CHECK(ref::keep_threshold(0.1) == 3865470566u);           // 0.9 * 2^32 = 3865470566.4
  CHECK(ref::keep_threshold(1e-6) == 0xffffffffu - 4294u);  // floor(2^32 - 4294.97)
  for (double p : {-0.1, 1.0, 1.5, std::nan("")}) {
    INFO("p = " << p);
    CHECK_THROWS_AS(ref::keep_threshold(p), std::invalid_argument);
    CHECK_THROWS_AS(ref::dropout_mask(1, 0, 4, p), std::invalid_argument);
  }
}

TEST_CASE("dropout_mask follows the documented counter layout", "[reference]") {
  // Large seed and offset so the hi32 words are exercised; numel not a multiple of 4.
  const uint64_t seed = 0x0123456789abcdefull, offset = 0xfedcba9876543210ull;
  const double p = 0.3;
  const int64_t numel = 4 * 37 + 3;
  const auto mask = ref::dropout_mask(seed, offset, numel, p);
  REQUIRE(mask.size() == static_cast<std::size_t>(numel));
  const uint32_t key[2] = {0x89abcdefu, 0x01234567u};
  const uint32_t thr = ref::keep_threshold(p);
  for (int64_t i = 0; i < numel; ++i) {
    const auto c = static_cast<uint64_t>(i / 4);
    const uint32_t ctr[4] = {static_cast<uint32_t>(c), static_cast<uint32_t>(c >> 32), 0x76543210u,
                             0xfedcba98u};
    uint32_t r[4];
    ref::philox4x32_10(ctr, key, r);
    INFO("element " << i);
    CHECK(mask[i] == (r[i % 4] < thr ? 1 : 0));
  }
  // A longer mask starts with the shorter one: element i depends only on i, not on numel.
  const auto longer = ref::dropout_mask(seed, offset, 1000, p);
  CHECK(std::vector<uint8_t>(longer.begin(), longer.begin() + numel) == mask);
}

TEST_CASE("dropout_mask keeps about 1-p of a million elements", "[reference]") {
  const int64_t n = 1000000;
  for (double p : {0.1, 0.5, 0.9}) {
    const auto mask = ref::dropout_mask(42, 7, n, p);
    const double frac = static_cast<double>(count_kept(mask)) / static_cast<double>(n);
    const double sigma = std::sqrt(p * (1 - p) / static_cast<double>(n));
    INFO("p = " << p << " kept fraction " << frac);
    CHECK(std::fabs(frac - (1 - p)) < 5 * sigma);
  }
  CHECK(count_kept(ref::dropout_mask(42, 7, n, 0.0)) == static_cast<std::size_t>(n));
}

TEST_CASE("dropout_mask is reproducible per (seed, offset) and differs across them",
          "[reference]") {
  const int64_t n = 4096;
  const auto a = ref::dropout_mask(1234, 0, n, 0.5);
  CHECK(ref::dropout_mask(1234, 0, n, 0.5) == a);
  // Independent masks at p = 0.5 disagree on about half the elements.
  for (const auto& other :
       {ref::dropout_mask(1234, 1, n, 0.5), ref::dropout_mask(1234, 1ull << 32, n, 0.5),
        ref::dropout_mask(1235, 0, n, 0.5), ref::dropout_mask(1ull << 32 | 1234, 0, n, 0.5)}) {
    const double frac = static_cast<double>(count_diff(a, other)) / static_cast<double>(n);
    CHECK(frac > 0.4);
    CHECK(frac < 0.6);
  }
}

TEST_CASE("dropout_fwd scales kept elements by 1/(1-p)", "[reference]") {
  const Vec x = {1.0, -2.0, 3.0, 4.0};
  const std::vector<uint8_t> mask = {1, 0, 1, 0};
  CHECK(ref::dropout_fwd(x, mask, 0.5) == Vec{2.0, 0.0, 6.0, 0.0});
  CHECK(ref::dropout_fwd(x, {1, 1, 1, 1}, 0.0) == x);
  CHECK(ref::dropout_bwd(x, mask, 0.75) == Vec{4.0, 0.0, 12.0, 0.0});
  CHECK_THROWS_AS(ref::dropout_fwd(x, {1, 0, 1}, 0.5), std::invalid_argument);
  CHECK_THROWS_AS(ref::dropout_bwd(x, mask, 1.0), std::invalid_argument);
  CHECK_THROWS_AS(ref::dropout_mask(1, 0, -1, 0.5), std::invalid_argument);
}

TEST_CASE("dropout_bwd agrees with finite differences and is linear in dy", "[reference]") {
  const std::size_t n = 64;
  const double p = 0.3;
  std::mt19937_64 rng(0x5eed0301);
  const Vec x = random_vec(rng, n), r = random_vec(rng, n), u = random_vec(rng, n);
  const auto mask = ref::dropout_mask(99, 3, static_cast<int64_t>(n), p);
  REQUIRE(count_kept(mask) > 0);
  REQUIRE(count_kept(mask) < n);
  auto loss = [&](const Vec& xs) { return dot(ref::dropout_fwd(xs, mask, p), r); };
  check_grad("dx", ref::dropout_bwd(r, mask, p), numeric_grad(loss, x));

  // bwd(a r + u) == a bwd(r) + bwd(u)
  const double a = -1.75;
  Vec combo(n);
  for (std::size_t i = 0; i < n; ++i) combo[i] = a * r[i] + u[i];
  const Vec lhs = ref::dropout_bwd(combo, mask, p);
  const Vec br = ref::dropout_bwd(r, mask, p), bu = ref::dropout_bwd(u, mask, p);
  for (std::size_t i = 0; i < n; ++i) CHECK(lhs[i] == Approx(a * br[i] + bu[i]).epsilon(1e-14));
}
