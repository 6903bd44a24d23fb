// Tests of round_to / round_all: bit-exact fp32, fp16 and bf16 round-to-nearest-even,
// including ties, subnormals, overflow to inf and NaN.
#include <catch2/catch.hpp>
#include <cmath>
#include <limits>
#include <stdexcept>

#include "reference/reference.hpp"

namespace ref = jitfuse::reference;
using ref::Vec;

namespace {
const double kInf = std::numeric_limits<double>::infinity();
}  // namespace

TEST_CASE("round_to fp32 is (double)(float)v", "[reference]") {
  CHECK(ref::round_to("fp32", 0.1) == 0.100000001490116119384765625);
  CHECK(ref::round_to("fp32", 1.0 + 0x1p-24) == 1.0);                      // tie -> even
  CHECK(ref::round_to("fp32", 1.0 + 3 * 0x1p-24) == 1.0 + 0x1p-22);        // tie -> even (up)
  CHECK(ref::round_to("fp32", 1.0 + 0x1p-24 + 0x1p-40) == 1.0 + 0x1p-23);  // above tie
  const double flt_max = std::numeric_limits<float>::max();
  CHECK(ref::round_to("fp32", flt_max) == flt_max);
  CHECK(ref::round_to("fp32", 0x1p128 - 0x1p103 - 0x1p80) == flt_max);  // below the tie
  CHECK(ref::round_to("fp32", 0x1p128 - 0x1p103) == kInf);              // tie -> even = 2^128
  CHECK(ref::round_to("fp32", -1e40) == -kInf);
  CHECK(ref::round_to("fp32", 0x1p-149) == 0x1p-149);  // smallest float subnormal
  CHECK(ref::round_to("fp32", 0x1p-150) == 0.0);       // tie with 0 -> even
  CHECK(std::isnan(ref::round_to("fp32", std::nan(""))));
  CHECK(ref::round_to("fp32", kInf) == kInf);
}

TEST_CASE("round_to fp16 is IEEE binary16 nearest-even", "[reference]") {
  CHECK(ref::round_to("fp16", 1.0) == 1.0);
  CHECK(ref::round_to("fp16", 1.0 + 0x1p-11) == 1.0);                      // tie -> even (down)
  CHECK(ref::round_to("fp16", 1.0 + 3 * 0x1p-11) == 1.0 + 0x1p-9);         // tie -> even (up)
  CHECK(ref::round_to("fp16", 1.0 + 0x1p-11 + 0x1p-20) == 1.0 + 0x1p-10);  // above tie
  CHECK(ref::round_to("fp16", 0.1) == 0.0999755859375);
  CHECK(ref::round_to("fp16", -3.14159) == -3.140625);
  CHECK(ref::round_to("fp16", 2047.5) == 2048.0);  // ulp 1 at [1024, 2048): tie -> even
  CHECK(ref::round_to("fp16", 2049.0) == 2048.0);  // ulp 2 above 2048: tie -> even
  CHECK(ref::round_to("fp16", 2051.0) == 2052.0);
  // Range: 65504 is the max; 65520 is the tie with 2^16 and goes to inf.
  CHECK(ref::round_to("fp16", 65504.0) == 65504.0);
  CHECK(ref::round_to("fp16", 65519.0) == 65504.0);
  CHECK(ref::round_to("fp16", 65520.0) == kInf);
  CHECK(ref::round_to("fp16", -65520.0) == -kInf);
  CHECK(ref::round_to("fp16", 1e6) == kInf);
  CHECK(ref::round_to("fp16", 1e300) == kInf);
  // Subnormals: the unit is 2^-24, the smallest normal 2^-14.
  CHECK(ref::round_to("fp16", 0x1p-14) == 0x1p-14);
  CHECK(ref::round_to("fp16", 0x1p-14 - 0x1p-25) == 0x1p-14);  // tie between 1023 and 1024 units
  CHECK(ref::round_to("fp16", 0x1p-15 + 0x1p-24) == 0x1p-15 + 0x1p-24);
  CHECK(ref::round_to("fp16", 0x1p-24) == 0x1p-24);
  CHECK(ref::round_to("fp16", 1.5 * 0x1p-24) == 2 * 0x1p-24);  // tie -> even
  CHECK(ref::round_to("fp16", 2.5 * 0x1p-24) == 2 * 0x1p-24);  // tie -> even
  CHECK(ref::round_to("fp16", 0x1p-25) == 0.0);                // tie with 0 -> even
  CHECK(ref::round_to("fp16", 0x1p-25 + 0x1p-40) == 0x1p-24);  // above tie
  CHECK(ref::round_to("fp16", 0x1p-140) == 0.0);               // float subnormal
  CHECK(std::signbit(ref::round_to("fp16", -0x1p-30)));        // underflow keeps the sign
  CHECK(std::isnan(ref::round_to("fp16", std::nan(""))));
  CHECK(ref::round_to("fp16", -kInf) == -kInf);
}

TEST_CASE("round_to bf16 keeps the top 16 float bits, nearest-even", "[reference]") {
  CHECK(ref::round_to("bf16", 1.00390625) == 1.0);                       // 1 + 2^-8: tie -> even
  CHECK(ref::round_to("bf16", 1.0 + 3 * 0x1p-8) == 1.0 + 0x1p-6);        // tie -> even (up)
  CHECK(ref::round_to("bf16", 1.0 + 0x1p-8 + 0x1p-20) == 1.0 + 0x1p-7);  // above tie
  CHECK(ref::round_to("bf16", 0.1) == 0.10009765625);
  CHECK(ref::round_to("bf16", 3.14159) == 3.140625);
  CHECK(ref::round_to("bf16", 0x1p-130) == 0x1p-130);  // float subnormals are bf16 subnormals
  CHECK(ref::round_to("bf16", 0x1p127 * (2 - 0x1p-7)) == 0x1p127 * (2 - 0x1p-7));  // bf16 max
  CHECK(ref::round_to("bf16", std::numeric_limits<float>::max()) == kInf);  // above max + ulp/2
  CHECK(ref::round_to("bf16", -1e39) == -kInf);
  CHECK(std::isnan(ref::round_to("bf16", std::nan(""))));
  CHECK(std::isnan(ref::round_to("bf16", -std::nan(""))));
}

TEST_CASE("round_to goes through fp32 first, like the device", "[reference]") {
  // 1 + 2^-11 + 2^-40 is just above the fp16 tie, but its float is exactly the tie, which
  // __float2half_rn sends to even. The reference models the device's float -> half step.
  CHECK(ref::round_to("fp16", 1.0 + 0x1p-11 + 0x1p-40) == 1.0);
  CHECK(ref::round_to("bf16", 1.0 + 0x1p-8 + 0x1p-40) == 1.0);
}

TEST_CASE("round_all rounds in place and rejects unknown dtypes", "[reference]") {
  Vec v = {1.0 + 0x1p-11, 65520.0, 0.1};
  ref::round_all("fp16", v);
  CHECK(v[0] == 1.0);
  CHECK(v[1] == kInf);
  CHECK(v[2] == 0.0999755859375);
  Vec w = {0.1};
  ref::round_all("bf16", w);
  CHECK(w[0] == 0.10009765625);
  CHECK_THROWS_AS(ref::round_to("fp8", 1.0), std::invalid_argument);
  CHECK_THROWS_AS(ref::round_to("half", 1.0), std::invalid_argument);
  CHECK_THROWS_AS(ref::round_all("FP16", v), std::invalid_argument);
}

TEST_CASE("E4M3 rounding: nearest even, subnormals, saturation at 448, NaN", "[reference]") {
  CHECK(ref::e4m3_bits(0.0) == 0x00);
  CHECK(ref::e4m3_bits(-0.0) == 0x80);
  CHECK(ref::e4m3_bits(1.0) == 0x38);
  CHECK(ref::e4m3_bits(-1.0) == 0xB8);
  CHECK(ref::e4m3_bits(448.0) == 0x7E);
  CHECK(ref::e4m3_bits(1e6) == 0x7E);    // saturates
  CHECK(ref::e4m3_bits(-500.0) == 0xFE);
  CHECK(ref::e4m3_bits(1.0625) == 0x38);  // tie between 1 and 1.125: even mantissa (1)
  CHECK(ref::e4m3_bits(1.1875) == 0x3A);  // tie between 1.125 and 1.25: even (1.25)
  CHECK(ref::e4m3_bits(1.07) == 0x39);
  CHECK(ref::e4m3_bits(0x1p-9) == 0x01);   // smallest subnormal
  CHECK(ref::e4m3_bits(0x1p-10) == 0x00);  // tie with 0: even
  CHECK(ref::e4m3_bits(0x1.8p-9) == 0x02); // tie between 1 and 2 steps: even (2)
  CHECK(ref::e4m3_bits(0x1.fp-7) == 0x08); // rounds up into the first normal 2^-6
  CHECK(ref::e4m3_bits(240.0) == 0x77);
  CHECK(ref::e4m3_bits(232.0) == 0x76);    // tie between 224 (0x76) and 240: even mantissa (224)
  CHECK((ref::e4m3_bits(std::nan("")) & 0x7F) == 0x7F);
  for (int b = 0; b < 256; ++b) {
    if ((b & 0x7F) == 0x7F) continue;  // NaN
    const double v = ref::e4m3_value(static_cast<uint8_t>(b));
    INFO("bits " << b << " value " << v);
    CHECK(ref::e4m3_bits(v) == (b == 0x80 ? 0x80 : b));  // every code round-trips
  }
  CHECK(ref::e4m3_value(0x7E) == 448.0);
  CHECK(ref::e4m3_value(0x01) == 0x1p-9);
  CHECK(std::isnan(ref::e4m3_value(0xFF)));
}

TEST_CASE("E5M2 rounding: nearest even, subnormals, saturation at 57344, NaN and infinities", "[reference]") {
  CHECK(ref::e5m2_bits(0.0) == 0x00);
  CHECK(ref::e5m2_bits(-0.0) == 0x80);
  CHECK(ref::e5m2_bits(1.0) == 0x3C);
  CHECK(ref::e5m2_bits(-2.0) == 0xC0);
  CHECK(ref::e5m2_bits(57344.0) == 0x7B);
  CHECK(ref::e5m2_bits(1e9) == 0x7B);  // saturates (satfinite), never infinity
  CHECK(ref::e5m2_bits(-std::numeric_limits<double>::infinity()) == 0xFB);
  CHECK(ref::e5m2_bits(1.125) == 0x3C);   // tie between 1 and 1.25: even mantissa (1)
  CHECK(ref::e5m2_bits(1.375) == 0x3E);   // tie between 1.25 and 1.5: even (1.5)
  CHECK(ref::e5m2_bits(1.3) == 0x3D);
  CHECK(ref::e5m2_bits(0x1p-16) == 0x01);   // smallest subnormal
  CHECK(ref::e5m2_bits(0x1p-17) == 0x00);   // tie with 0: even
  CHECK(ref::e5m2_bits(0x1.ep-15) == 0x04); // rounds up into the first normal 2^-14
  CHECK((ref::e5m2_bits(std::nan("")) & 0x7F) == 0x7F);
  for (int b = 0; b < 256; ++b) {
    if ((b & 0x7C) == 0x7C) continue;  // infinities and NaNs
    const double v = ref::e5m2_value(static_cast<uint8_t>(b));
    INFO("bits " << b << " value " << v);
    CHECK(ref::e5m2_bits(v) == b);  // every finite code round-trips
  }
  CHECK(ref::e5m2_value(0x7B) == 57344.0);
  CHECK(ref::e5m2_value(0x7C) == std::numeric_limits<double>::infinity());
  CHECK(std::isnan(ref::e5m2_value(0x7F)));
}
