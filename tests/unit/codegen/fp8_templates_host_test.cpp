// The FP8 templates' integer paths (what GPUs before sm_89 run) compiled for the host: the E4M3 and E5M2
// conversions against the float64 reference encoders bit for bit, the 8-code packing, and the
// cast_transpose tile (a transpose, with the bank pattern its comment promises).
#include <catch2/catch.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <set>

#include "reference/reference.hpp"

// Host stand-ins for the CUDA names the templates use (no __CUDA_ARCH__: the integer paths).
namespace jf_host {
#define __device__
#define __forceinline__ inline
#define __shared__ static
typedef unsigned short jf_u16;
typedef unsigned int jf_u32;
typedef unsigned long long jf_u64;
typedef long long jf_i64;
struct jf_dim3 {
  unsigned x = 0, y = 0, z = 0;
};
inline jf_dim3 threadIdx, blockIdx, blockDim, gridDim;
struct uint2 {
  jf_u32 x, y;
};
struct alignas(16) uint4 {
  jf_u32 x, y, z, w;
};
inline uint2 make_uint2(jf_u32 x, jf_u32 y) { return {x, y}; }
inline jf_u32 __float_as_uint(float f) { return std::bit_cast<jf_u32>(f); }
inline int __float2int_rn(float f) { return static_cast<int>(std::nearbyint(f)); }
inline float fabsf(float f) { return std::fabs(f); }
inline float fmaxf(float a, float b) { return std::fmax(a, b); }
inline float __shfl_xor_sync(unsigned, float v, int) { return v; }
inline void __syncthreads() {}
inline jf_u32 __byte_perm(jf_u32 x, jf_u32 y, jf_u32 s) {
  const uint64_t both = (uint64_t{y} << 32) | x;
  jf_u32 r = 0;
  for (int i = 0; i < 4; ++i) r |= static_cast<jf_u32>((both >> (8 * ((s >> (4 * i)) & 7))) & 0xFF) << (8 * i);
  return r;
}
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunknown-pragmas"
#pragma GCC diagnostic ignored "-Wunused-parameter"
#include "ops/fp8_operand.cuh"  // and ops/fp8.cuh
#include "skeletons/cast_transpose.cuh"
#pragma GCC diagnostic pop
#undef __device__
#undef __forceinline__
#undef __shared__
}  // namespace jf_host

using namespace jf_host;
namespace ref = jitfuse::reference;

namespace {

float from_bits(uint32_t u) { return std::bit_cast<float>(u); }

// Floats where rounding decides: every code's value, the midpoints to its neighbours, and one float either
// side of each; then zeros, infinities, NaNs and the saturation boundary.
std::vector<float> boundary_floats(double (*value)(uint8_t), uint8_t max_code) {
  std::vector<float> out;
  for (int k = 0; k <= max_code; ++k) {
    const double v = value(static_cast<uint8_t>(k));
    const double next = k < max_code ? value(static_cast<uint8_t>(k + 1)) : 2 * v;
    for (double x : {v, (v + next) / 2}) {
      const float f = static_cast<float>(x);
      for (float g : {f, std::nextafter(f, 0.f), std::nextafter(f, 1e30f)})
        for (float s : {1.f, -1.f}) out.push_back(s * g);
    }
  }
  for (float f : {0.f, -0.f, std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN(),
                  std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::max()})
    out.push_back(f);
  return out;
}

template <typename Dev, typename Ref>
void check_format(Dev dev, Ref reference, double (*value)(uint8_t), uint8_t max_code) {
  size_t n = 0;
  for (float f : boundary_floats(value, max_code)) {
    INFO("x = " << f << " (bits " << std::hex << std::bit_cast<uint32_t>(f) << ")");
    REQUIRE(int(dev(f)) == int(reference(static_cast<double>(f))));
    ++n;
  }
  // A stride through every float bit pattern (odd, so every exponent and low mantissa bits are hit).
  for (uint64_t u = 0; u < (uint64_t{1} << 32); u += 4099) {
    const float f = from_bits(static_cast<uint32_t>(u));
    if (dev(f) != reference(static_cast<double>(f))) {
      INFO("x = " << f << " (bits " << std::hex << u << ")");
      REQUIRE(int(dev(f)) == int(reference(static_cast<double>(f))));
    }
    ++n;
  }
  CHECK(n > 1000000);
}

}  // namespace

TEST_CASE("the E5M2 and E4M3 integer conversions match the reference encoders bit for bit", "[codegen][fp8]") {
  SECTION("E5M2") { check_format(jf_to_e5m2, ref::e5m2_bits, ref::e5m2_value, 0x7B); }
  SECTION("E4M3") { check_format(jf_to_e4m3, ref::e4m3_bits, ref::e4m3_value, 0x7E); }
  CHECK(jf_to_fp8<true>(1e9f) == 0x7B);
  CHECK(jf_to_fp8<false>(-1e9f) == 0xFE);
  CHECK(jf_fp8_max<true>() == 57344.f);
  CHECK(jf_fp8_scale_of<true>(2.f, 1.f) == 28672.f);
  CHECK(jf_fp8_scale_of<false>(2.f, 1.f) == jf_fp8_scale(2.f, 1.f));
  CHECK(jf_fp8_scale_of<true>(0.f, 1.f) == 1.f);
}

TEST_CASE("8 values become 8 codes in memory order, stored whole or bounded", "[codegen][fp8]") {
  const float v[8] = {1.f, -2.f, 0.5f, 3.f, 100000.f, -0.f, 1e-6f, 448.f};
  jf_u32 w[2];
  jf_cvt8_fp8<true>(v, 0.5f, w);
  unsigned char all[8] = {}, some[8] = {};
  jf_store8_codes<false>(all, w, 8);
  jf_store8_codes<false>(some, w, 3);
  for (int e = 0; e < 8; ++e) {
    INFO("element " << e);
    CHECK(int(all[e]) == int(ref::e5m2_bits(static_cast<double>(v[e] * 0.5f))));
    CHECK(int(some[e]) == (e < 3 ? int(all[e]) : 0));
  }
  unsigned char e4[8];
  jf_store8_fp8<false, false>(e4, v, 2.f, 8);
  unsigned char legacy[8];
  jf_store8_e4m3<false>(legacy, v, 2.f, 8);
  CHECK(std::memcmp(e4, legacy, 8) == 0);
}

TEST_CASE("the cast_transpose tile transposes, without bank conflicts", "[codegen][fp8][cast_transpose]") {
  // Every thread (x, y) of a block of 8 x 32 stages codes of its 8 columns for rows 2y and 2y + 1; code of
  // (r, c) = r * 3 + c * 7 (mod 256), distinct enough to catch any misplaced byte.
  alignas(16) unsigned char tile[4096];
  std::memset(tile, 0xEE, sizeof tile);
  auto code = [](int r, int c) { return static_cast<unsigned char>(r * 3 + c * 7 + (r >> 3)); };
  std::set<int> offsets;
  for (int y = 0; y < 32; ++y)
    for (int x = 0; x < 8; ++x) {
      jf_u32 lo[2] = {0, 0}, hi[2] = {0, 0};
      for (int e = 0; e < 8; ++e) {
        lo[e >> 2] |= jf_u32{code(2 * y, 8 * x + e)} << (8 * (e & 3));
        hi[e >> 2] |= jf_u32{code(2 * y + 1, 8 * x + e)} << (8 * (e & 3));
        offsets.insert(jf_ct_offset(8 * x + e, 2 * y));
        offsets.insert(jf_ct_offset(8 * x + e, 2 * y + 1));
      }
      jf_ct_stage(tile, 8 * x, 2 * y, lo, hi);
    }
  CHECK(offsets.size() == 4096);  // a bijection onto the tile
  // Thread t stores rows 16k .. 16k + 15 of column c (c = t / 4, k = t % 4); 5 rows only, bounded.
  for (int t = 0; t < 256; ++t) {
    const int c = t >> 2, k = t & 3;
    alignas(16) unsigned char out[16];
    unsigned char part[16];
    std::memset(part, 0, sizeof part);
    jf_ct_store16<true>(out, tile, c, k);
    jf_ct_store16<false>(part, tile, c, k, 5);
    for (int i = 0; i < 16; ++i) {
      INFO("column " << c << " row " << 16 * k + i);
      REQUIRE(int(out[i]) == int(code(16 * k + i, c)));
      REQUIRE(int(part[i]) == (i < 5 ? int(out[i]) : 0));
    }
  }
  // Banks (4-byte words mod 32). Staging: a warp is threads (x = 0..7, y = 4w .. 4w + 3); for each column e of
  // the 8 it writes 32 16-bit values, which must lie in distinct banks or share a word.
  for (int w = 0; w < 8; ++w)
    for (int e = 0; e < 8; ++e) {
      std::map<int, std::set<int>> words_of_bank;
      for (int y = 4 * w; y < 4 * w + 4; ++y)
        for (int x = 0; x < 8; ++x) {
          const int word = jf_ct_offset(8 * x + e, 2 * y) >> 2;
          words_of_bank[word % 32].insert(word);
        }
      for (const auto& [bank, words] : words_of_bank) {
        INFO("warp " << w << " column " << e << " bank " << bank);
        CHECK(words.size() == 1);
      }
    }
  // Loads: 16-byte loads are served 8 threads at a time; the 8 slots must cover all 32 banks.
  for (int p = 0; p < 32; ++p) {
    std::set<int> banks;
    for (int t = 8 * p; t < 8 * p + 8; ++t)
      for (int i = 0; i < 4; ++i) banks.insert(((jf_ct_offset(t >> 2, 16 * (t & 3)) >> 2) + i) % 32);
    INFO("threads " << 8 * p << " .. " << 8 * p + 7);
    CHECK(banks.size() == 32);
  }
}
