// Float64 reference of dropout: the Philox4x32-10 counter-based RNG and the keep mask built from
// it. Bit-exact with templates/ops/dropout.cuh, so a GPU mask can be compared element by element.
#include <cmath>

#include "reference/checks.hpp"
#include "reference/reference.hpp"

namespace jitfuse::reference {
namespace {

// Random123's constants: round multipliers and the Weyl sequence that bumps the key per round.
constexpr uint32_t kPhiloxM0 = 0xD2511F53u;
constexpr uint32_t kPhiloxM1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u;
constexpr uint32_t kPhiloxW1 = 0xBB67AE85u;

void check_p(const char* fn, double p) {
  // Written as !(in range) so that NaN is rejected too.
  if (!(p >= 0.0 && p < 1.0)) {
    detail::bad_arg(fn, "p = " + std::to_string(p) + "; dropout probability must be in [0, 1)");
  }
}

Vec scale_by_mask(const char* fn, CSpan v, const std::vector<uint8_t>& mask, double p) {
  check_p(fn, p);
  if (mask.size() != v.size()) {
    detail::bad_arg(fn, "mask has " + std::to_string(mask.size()) +
                            " elements but the tensor has " + std::to_string(v.size()) +
                            "; build the mask with the tensor's numel");
  }
  Vec out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = mask[i] ? v[i] / (1.0 - p) : 0.0;
  return out;
}

}  // namespace

void philox4x32_10(const uint32_t counter[4], const uint32_t key[2], uint32_t out[4]) {
  uint32_t c0 = counter[0], c1 = counter[1], c2 = counter[2], c3 = counter[3];
  uint32_t k0 = key[0], k1 = key[1];
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {  // the key is bumped between rounds, not before the first
      k0 += kPhiloxW0;
      k1 += kPhiloxW1;
    }
    const uint64_t p0 = static_cast<uint64_t>(kPhiloxM0) * c0;
    const uint64_t p1 = static_cast<uint64_t>(kPhiloxM1) * c2;
    const auto hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const auto hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
  }
  out[0] = c0;
  out[1] = c1;
  out[2] = c2;
  out[3] = c3;
}

// floor((1-p) * 2^32) is exact in double (a power-of-two scale), so host and device agree on it.
uint32_t keep_threshold(double p) {
  check_p("keep_threshold", p);
  const double t = std::floor((1.0 - p) * 4294967296.0);
  return t >= 4294967295.0 ? 0xffffffffu : static_cast<uint32_t>(t);
}

std::vector<uint8_t> dropout_mask(uint64_t seed, uint64_t offset, int64_t numel, double p) {
  check_p("dropout_mask", p);
  if (numel < 0)
    detail::bad_arg("dropout_mask", "numel = " + std::to_string(numel) + " is negative");
  const uint32_t thr = keep_threshold(p);
  const uint32_t key[2] = {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)};
  const auto n = static_cast<uint64_t>(numel);
  std::vector<uint8_t> mask(n);
  // One Philox call yields the 4 draws for elements 4c .. 4c+3.
  for (uint64_t c = 0; c * 4 < n; ++c) {
    const uint32_t ctr[4] = {static_cast<uint32_t>(c), static_cast<uint32_t>(c >> 32),
                             static_cast<uint32_t>(offset), static_cast<uint32_t>(offset >> 32)};
    uint32_t r[4];
    philox4x32_10(ctr, key, r);
    for (uint64_t j = 0; j < 4 && c * 4 + j < n; ++j) {
      // p == 0 must keep everything, but r == 0xffffffff is not < the saturated threshold.
      mask[c * 4 + j] = (p == 0.0 || r[j] < thr) ? 1 : 0;
    }
  }
  return mask;
}

// y = x * mask / (1-p)
Vec dropout_fwd(CSpan x, const std::vector<uint8_t>& mask, double p) {
  return scale_by_mask("dropout_fwd", x, mask, p);
}

// dx = dy * mask / (1-p): dropout is linear in x, so its backward is the same map applied to dy.
Vec dropout_bwd(CSpan dy, const std::vector<uint8_t>& mask, double p) {
  return scale_by_mask("dropout_bwd", dy, mask, p);
}

}  // namespace jitfuse::reference
