// Float64 reference of rounding to a storage dtype (fp32, fp16, bf16), round-to-nearest-even.
// Done by hand on the float bits: bit-exact without compiler __fp16/__bf16 support.
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "reference/checks.hpp"
#include "reference/reference.hpp"

namespace jitfuse::reference {
namespace {

enum class Dtype { fp32, fp16, bf16 };

Dtype parse_dtype(const char* fn, const std::string& dtype) {
  if (dtype == "fp32") return Dtype::fp32;
  if (dtype == "fp16") return Dtype::fp16;
  if (dtype == "bf16") return Dtype::bf16;
  detail::bad_arg(fn, "unknown dtype '" + dtype + "'; expected one of fp32, fp16, bf16");
}

// double -> float, round-to-nearest-even, overflow to inf. Out-of-range casts are undefined in
// C++, so the overflow cases are decided here: the float max is 2^128 - 2^104 and the tie with the
// (absent) next value 2^128 is 2^128 - 2^103; ties go to the even side, which is 2^128, i.e. inf.
float to_float(double v) {
  if (std::isnan(v)) return std::numeric_limits<float>::quiet_NaN();
  const double a = std::fabs(v);
  constexpr double kFltMax = static_cast<double>(std::numeric_limits<float>::max());
  const bool neg = std::signbit(v);
  if (a >= 0x1p128 - 0x1p103)
    return neg ? -std::numeric_limits<float>::infinity() : std::numeric_limits<float>::infinity();
  if (a > kFltMax)
    return neg ? -std::numeric_limits<float>::max() : std::numeric_limits<float>::max();
  return static_cast<float>(v);
}

// Rounds m / 2^shift to nearest, ties to even (shift in 1..31).
uint32_t shift_rne(uint32_t m, uint32_t shift) {
  const uint32_t q = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  return (rem > half || (rem == half && (q & 1u))) ? q + 1u : q;
}

// float -> IEEE binary16 bits, with subnormals, overflow to inf and NaN kept NaN (quieted).
uint16_t float_to_half_bits(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const auto sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return sign | 0x7e00u | static_cast<uint16_t>((ax >> 13) & 0x3ffu);  // NaN
  // 65520 = 65504 + half an ulp is the tie with 2^16; 65504 has an odd mantissa, so it rounds up
  // to 2^16, which is inf. This also catches inf itself.
  if (ax >= 0x477ff000u) return sign | 0x7c00u;
  const uint32_t exp = ax >> 23;
  if (ax >= 0x38800000u) {  // >= 2^-14: a normal half. Rebias 127 -> 15 and drop 13 mantissa bits;
    // a rounding carry out of the mantissa correctly bumps the exponent.
    const uint32_t h = ((exp - 112u) << 23) | (ax & 0x7fffffu);
    return sign | static_cast<uint16_t>(shift_rne(h, 13));
  }
  // Half subnormal: value = m * 2^(exp - 150) and the half's unit is 2^-24, so the half mantissa is
  // m / 2^(126 - exp). Float subnormals (exp 0) are far below 2^-25 and round to zero.
  if (exp == 0) return sign;
  const uint32_t shift = 126u - exp;  // >= 14 because exp <= 112 here
  if (shift > 24) return sign;        // m < 2^24, so m / 2^25 < 0.5: rounds to zero
  return sign | static_cast<uint16_t>(shift_rne((ax & 0x7fffffu) | 0x800000u, shift));
}

double half_bits_to_double(uint16_t h) {
  const double sign = (h & 0x8000u) ? -1.0 : 1.0;
  const int exp = (h >> 10) & 0x1f;
  const int man = h & 0x3ff;
  if (exp == 0x1f)
    return man ? std::numeric_limits<double>::quiet_NaN()
               : sign * std::numeric_limits<double>::infinity();
  if (exp == 0) return sign * std::ldexp(static_cast<double>(man), -24);
  return sign * std::ldexp(static_cast<double>(1024 + man), exp - 25);
}

// float -> bf16 bits: the top 16 bits of the float, rounded to nearest-even on the dropped 16.
uint16_t float_to_bf16_bits(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u)
    return static_cast<uint16_t>((x >> 16) | 0x40u);  // quiet NaN
  // Adding 0x7fff (+1 when the kept lsb is odd) carries exactly when the dropped half is above the
  // tie, or at the tie with an odd lsb. Overflow past the float max lands on inf's bit pattern.
  const uint32_t bias = 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>((x + bias) >> 16);
}

double bf16_bits_to_double(uint16_t b) {
  return static_cast<double>(std::bit_cast<float>(static_cast<uint32_t>(b) << 16));
}

double round_one(Dtype d, double v) {
  // Every dtype goes through float first: the device computes in fp32 and then converts the float
  // (__float2half_rn / __float2bfloat16_rn), so the reference models that same two-step rounding.
  const float f = to_float(v);
  switch (d) {
    case Dtype::fp32:
      return static_cast<double>(f);
    case Dtype::fp16:
      return half_bits_to_double(float_to_half_bits(f));
    case Dtype::bf16:
      return bf16_bits_to_double(float_to_bf16_bits(f));
  }
  return v;  // unreachable
}

}  // namespace

double round_to(const std::string& dtype, double v) {
  return round_one(parse_dtype("round_to", dtype), v);
}

void round_all(const std::string& dtype, Vec& v) {
  const Dtype d = parse_dtype("round_all", dtype);
  for (double& x : v) x = round_one(d, x);
}

}  // namespace jitfuse::reference

namespace jitfuse::reference {

std::vector<uint8_t> encode(const std::string& dtype, CSpan v) {
  const Dtype d = parse_dtype("encode", dtype);
  const size_t w = d == Dtype::fp32 ? 4 : 2;
  std::vector<uint8_t> out(v.size() * w);
  for (size_t i = 0; i < v.size(); ++i) {
    const float f = to_float(v[i]);
    if (d == Dtype::fp32) {
      std::memcpy(&out[i * 4], &f, 4);
    } else {
      const uint16_t h = d == Dtype::fp16 ? float_to_half_bits(f) : float_to_bf16_bits(f);
      std::memcpy(&out[i * 2], &h, 2);
    }
  }
  return out;
}

Vec decode(const std::string& dtype, const std::vector<uint8_t>& bytes) {
  const Dtype d = parse_dtype("decode", dtype);
  const size_t w = d == Dtype::fp32 ? 4 : 2;
  Vec out(bytes.size() / w);
  for (size_t i = 0; i < out.size(); ++i) {
    if (d == Dtype::fp32) {
      float f;
      std::memcpy(&f, &bytes[i * 4], 4);
      out[i] = f;
    } else {
      uint16_t h;
      std::memcpy(&h, &bytes[i * 2], 2);
      out[i] = d == Dtype::fp16 ? half_bits_to_double(h) : bf16_bits_to_double(h);
    }
  }
  return out;
}

namespace {

// An FP8 format: mantissa bits, exponent bias, the largest finite code (saturation), and whether the top
// exponent holds infinities and NaNs (E5M2, IEEE-like) or only NaN at S.1111.111 (E4M3 "fn").
struct Fp8Format {
  int mbits, bias;
  uint8_t max_code;
  bool ieee_specials;
};
constexpr Fp8Format kE4M3{3, 7, 0x7E, false}, kE5M2{2, 15, 0x7B, true};

// Round to nearest even; saturate to the largest finite value (the device's satfinite casts and cuBLASLt's
// FP8 outputs), infinities included; NaN stays NaN.
uint8_t fp8_bits(double v, const Fp8Format& f) {
  const uint8_t sign = std::signbit(v) ? 0x80 : 0x00;
  if (std::isnan(v)) return sign | 0x7F;
  const double a = std::fabs(v);
  const int one = 1 << f.mbits, emax = (f.max_code >> f.mbits) - f.bias, mmax = f.max_code & (one - 1);
  if (a >= std::ldexp(1.0 + double(mmax) / one, emax)) return sign | f.max_code;
  if (a < std::ldexp(1.0, 1 - f.bias))  // subnormals, steps of 2^(1 - bias - mbits)
    return sign | static_cast<uint8_t>(std::nearbyint(std::ldexp(a, f.bias - 1 + f.mbits)));
  int e = std::ilogb(a);
  double q = std::nearbyint((std::ldexp(a, -e) - 1.0) * one);  // ties to even
  if (q == one) {
    q = 0.0;
    ++e;
  }
  const int code = ((e + f.bias) << f.mbits) | static_cast<int>(q);
  return sign | static_cast<uint8_t>(code > f.max_code ? f.max_code : code);
}

double fp8_value(uint8_t bits, const Fp8Format& f) {
  const double sign = (bits & 0x80) ? -1.0 : 1.0;
  const int one = 1 << f.mbits, emask = 0x7F >> f.mbits, e = (bits >> f.mbits) & emask, m = bits & (one - 1);
  if (f.ieee_specials && e == emask)
    return m ? std::numeric_limits<double>::quiet_NaN() : sign * std::numeric_limits<double>::infinity();
  if (!f.ieee_specials && (bits & 0x7F) == 0x7F) return std::numeric_limits<double>::quiet_NaN();
  if (e == 0) return sign * std::ldexp(m, 1 - f.bias - f.mbits);
  return sign * std::ldexp(1.0 + double(m) / one, e - f.bias);
}

}  // namespace

uint8_t e4m3_bits(double v) { return fp8_bits(v, kE4M3); }
double e4m3_value(uint8_t bits) { return fp8_value(bits, kE4M3); }
uint8_t e5m2_bits(double v) { return fp8_bits(v, kE5M2); }
double e5m2_value(uint8_t bits) { return fp8_value(bits, kE5M2); }

}  // namespace jitfuse::reference
