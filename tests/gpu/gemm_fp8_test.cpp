// FP8 GEMMs on cuBLASLt (cuda::Blas with GemmCall::fp8, the TN primitive D = A B^T of cublaslt.hpp)
// against a float64 reference on the dequantized operands: E4M3/E5M2 operands with random per-tensor
// scales, bf16/fp32 output or FP8 output with D scale and amax, bias, fast accumulation on and off.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include "common/error.hpp"
#include "cuda/cublaslt.hpp"
#include "gpu/gpu_check.hpp"
#include "harness/device_tensor.hpp"
#include "reference/reference.hpp"

using namespace jitfuse;
using ops::DType;
using harness::DeviceTensor;

namespace {

double fp8_max(DType d) { return d == DType::e4m3 ? 448.0 : 57344.0; }
uint8_t fp8_bits(DType d, double v) { return d == DType::e4m3 ? reference::e4m3_bits(v) : reference::e5m2_bits(v); }
double fp8_value(DType d, uint8_t b) { return d == DType::e4m3 ? reference::e4m3_value(b) : reference::e5m2_value(b); }
// Codes as signed integers in value order: adjacent finite codes differ by one.
void* P(const DeviceTensor& t) { return reinterpret_cast<void*>(t.ptr()); }

// A random operand quantized on the host: values uniform in [-1, 1] (never all zero), a per-tensor scale
// scale_inv = amax / fp8_max * u with u in [0.7, 1.3] (u < 1 saturates the largest values, as a stale
// delayed-scaling amax would), codes = fp8(value / scale_inv) with round-to-nearest-even and
// saturation, and the dequantized values code * scale_inv the reference multiplies.
struct Quantized {
  std::vector<uint8_t> codes;
  std::vector<double> deq;
  float scale_inv = 1;
  Quantized(DType d, size_t n, std::mt19937_64& rng) {
    std::uniform_real_distribution<double> u(-1, 1), f(0.7, 1.3);
    std::vector<double> v(n);
    double amax = 0;
    for (auto& x : v) amax = std::max(amax, std::fabs(x = u(rng)));
    scale_inv = static_cast<float>(amax / fp8_max(d) * f(rng));
    codes.resize(n);
    deq.resize(n);
    for (size_t i = 0; i < n; ++i) {
      codes[i] = fp8_bits(d, v[i] / scale_inv);
      deq[i] = fp8_value(d, codes[i]) * scale_inv;
    }
  }
};

struct Case {
  DType a, b, out;
  bool bias, fast;
};

// Per element, |got - ref| <= out_rtol * |ref| + acc_tol * S, S = sum_k |A_ik B_jk| (+ |bias_j|): the
// products of FP8 values are exact, so all the error is in the accumulation (bounded by S) and in
// rounding the result to the output dtype. Accumulation: Hopper's FP8 tensor cores keep about 14
// mantissa bits inside an MMA; without fast accumulation cuBLASLt promotes partial sums to fp32 every few
// MMAs (acc_tol 2^-12 of S), with it the whole K loop stays in the tensor core (acc_tol (k/32 + 1) * 2^-13
// of S, a chunk's error per 32-deep MMA). Output rounding: bf16 2^-8 (half an ulp of 8 bits), fp32 2^-23.
struct Tol {
  double out_rtol, acc_tol;
};
Tol tolerance(const Case& c, int64_t k) {
  const double out = c.out == DType::bf16 ? 0x1p-8 : c.out == DType::f32 ? 0x1p-23 : 0;
  return {out, c.fast ? (static_cast<double>(k) / 32 + 1) * 0x1p-13 : 0x1p-12};
}

std::string case_name(const Case& c, int64_t m, int64_t n, int64_t k) {
  return fmt::format("{} x {} -> {}{}, fast accumulation {}, m={} n={} k={}", ops::dtype_name(c.a), ops::dtype_name(c.b),
                     ops::dtype_name(c.out), c.bias ? " + bf16 bias" : "", c.fast ? "on" : "off", m, n, k);
}

void run_case(cuda::Blas& blas, const Case& c, int64_t m, int64_t n, int64_t k, std::mt19937_64& rng) {
  INFO(case_name(c, m, n, k));
  Quantized qa(c.a, static_cast<size_t>(m * k), rng), qb(c.b, static_cast<size_t>(n * k), rng);
  std::uniform_real_distribution<double> u(-1, 1);
  std::vector<double> bias(static_cast<size_t>(n), 0.0);
  if (c.bias)
    for (auto& v : bias) v = reference::round_to("bf16", u(rng));
  const float alpha = static_cast<float>(0.5 + std::uniform_real_distribution<double>(0, 1)(rng));
  // float64 reference: D = alpha * (A B^T) + bias on the dequantized values, and S for the tolerance.
  std::vector<double> ref(static_cast<size_t>(m * n)), mag(ref.size());
  double ref_amax = 0;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double s = 0, sa = 0;
      for (int64_t p = 0; p < k; ++p) {
        const double t = qa.deq[static_cast<size_t>(i * k + p)] * qb.deq[static_cast<size_t>(j * k + p)];
        s += t;
        sa += std::fabs(t);
      }
      ref[static_cast<size_t>(i * n + j)] = alpha * s + bias[static_cast<size_t>(j)];
      mag[static_cast<size_t>(i * n + j)] = alpha * sa + std::fabs(bias[static_cast<size_t>(j)]);
      ref_amax = std::max(ref_amax, std::fabs(ref[static_cast<size_t>(i * n + j)]));
    }

  DeviceTensor da({m, k}, ops::dtype_name(c.a)), db({n, k}, ops::dtype_name(c.b));
  da.upload(qa.codes, nullptr);
  db.upload(qb.codes, nullptr);
  // a_scale_inv, b_scale_inv, d_scale, amax: one per 16-byte slot (floats 0, 4, 8, 12), as cuBLASLt needs.
  DeviceTensor scales({16}, "fp32");
  const bool fp8_out = ops::is_fp8(c.out);
  // FP8 output: a d_scale that puts max|D| at 0.6..0.95 of the format's range.
  const float d_scale = static_cast<float>(fp8_max(c.out == DType::e5m2 ? DType::e5m2 : DType::e4m3) / ref_amax *
                                           std::uniform_real_distribution<double>(0.6, 0.95)(rng));
  {
    float host[16] = {qa.scale_inv, 0, 0, 0, qb.scale_inv, 0, 0, 0, d_scale, 0, 0, 0, std::nanf("")};  // amax poisoned
    std::vector<uint8_t> bytes(sizeof host);
    std::memcpy(bytes.data(), host, sizeof host);
    scales.upload(bytes, nullptr);
  }
  const auto sp = reinterpret_cast<float*>(scales.ptr());
  DeviceTensor dbias({n}, "bf16"), dd({m, n}, fp8_out ? ops::dtype_name(c.out) : c.out == DType::f32 ? "fp32" : "bf16");
  dbias.upload_values(bias, nullptr);
  DeviceTensor ws({static_cast<int64_t>(cuda::kGemmWorkspace / 4)}, "fp32");

  cuda::GemmCall g;
  g.m = m;
  g.n = n;
  g.k = k;
  g.dtype = c.out;
  g.alpha = alpha;
  g.a = P(da);
  g.b = P(db);
  g.d = P(dd);
  g.epilogue = c.bias ? cuda::Epilogue::bias : cuda::Epilogue::none;
  g.bias = c.bias ? P(dbias) : nullptr;
  g.workspace = P(ws);
  g.fp8 = cuda::Fp8Gemm{c.a, c.b, DType::bf16, sp, sp + 4, fp8_out ? sp + 8 : nullptr, fp8_out ? sp + 12 : nullptr, c.fast};
  dd.poison(nullptr);  // NaN in bf16 and fp32, and 0xFF is NaN in E4M3 and E5M2: an unwritten element fails
  REQUIRE(blas.prepare(g));
  blas.gemm(g, nullptr);
  const Tol tol = tolerance(c, k);

  if (!fp8_out) {
    const auto got = dd.download_values(nullptr);
    double worst = 0, worst_acc = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      const double err = std::fabs(got[i] - ref[i]);
      worst = std::max(worst, err / (tol.out_rtol * std::fabs(ref[i]) + tol.acc_tol * mag[i]));
      if (std::isnan(err)) worst = INFINITY;
      worst_acc = std::max(worst_acc, err / mag[i]);
    }
    INFO("worst err/tol " << worst << ", worst err/S " << worst_acc);
    CHECK(worst <= 1.0);
    return;
  }
  // FP8 output: the amax is max|D| before d_scale (the float64 reference's, within the accumulation
  // tolerance), and every code decodes to d_scale * D within the accumulation tolerance (scaled by d_scale)
  // plus one code step of the format at that magnitude: near zero the accumulation error alone spans many
  // (logarithmically spaced) codes, so a bound in codes would be wrong there (H100 run #16 measured up to 10
  // codes at |value| ~ 0.02 of a 448 range).
  const auto codes = dd.download(nullptr);
  float amax = 0;
  {
    auto b = scales.download(nullptr);
    std::memcpy(&amax, b.data() + 12 * sizeof(float), sizeof(float));  // slot of float 12 (bytes from 48)
  }
  size_t at = 0;
  for (size_t i = 0; i < ref.size(); ++i) at = std::fabs(ref[i]) > std::fabs(ref[at]) ? i : at;
  INFO("amax " << amax << " reference " << ref_amax);
  CHECK(std::fabs(amax - ref_amax) <= 0x1p-20 * ref_amax + tol.acc_tol * mag[at] * 2);
  // One code step of the format at |x|: E4M3 has 3 mantissa bits (subnormal step 2^-9), E5M2 2 (2^-16).
  const auto step = [&](double x) {
    const bool e4 = c.out == DType::e4m3;
    const double sub = e4 ? 0x1p-9 : 0x1p-16;
    return x <= 0 ? sub : std::max(sub, std::exp2(std::floor(std::log2(x))) * (e4 ? 0.125 : 0.25));
  };
  double worst = 0;
  size_t worst_i = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const bool nan = c.out == DType::e4m3 ? (codes[i] & 0x7F) == 0x7F : (codes[i] & 0x7C) == 0x7C;
    const double want = d_scale * ref[i], got = nan ? 1e30 : fp8_value(c.out, codes[i]);
    const double allowed = d_scale * (tol.acc_tol * mag[i] + 0x1p-20 * std::fabs(ref[i])) +
                           step(std::max(std::fabs(want), std::fabs(got)));
    const double r = std::fabs(got - want) / allowed;
    if (r > worst) {
      worst = r;
      worst_i = i;
    }
  }
  INFO("worst err/tol " << worst << " at " << worst_i << ": got 0x" << std::hex << int(codes[worst_i])
                        << " reference value " << d_scale * ref[worst_i]);
  CHECK(worst <= 1.0);
}

const int64_t kShapes[][3] = {{1, 16, 16}, {16, 32, 64}, {17, 48, 96}, {77, 64, 256}, {129, 128, 1024}};

}  // namespace

TEST_CASE("FP8 GEMMs (E4M3/E5M2, bf16/fp32 output, bias, fast accumulation) match float64", "[gemm_fp8]") {
  cuda::Blas blas;
  std::mt19937_64 rng(13);
  for (auto [a, b, out] : {std::tuple{DType::e4m3, DType::e4m3, DType::bf16}, std::tuple{DType::e4m3, DType::e5m2, DType::bf16},
                           std::tuple{DType::e5m2, DType::e4m3, DType::f32}})
    for (bool bias : {false, true})
      for (bool fast : {true, false})
        for (auto& s : kShapes) run_case(blas, {a, b, out, bias, fast}, s[0], s[1], s[2], rng);
}

TEST_CASE("FP8 GEMMs with FP8 output: D scale, amax and codes match float64", "[gemm_fp8]") {
  cuda::Blas blas;
  std::mt19937_64 rng(14);
  for (auto [a, b, out] : {std::tuple{DType::e4m3, DType::e4m3, DType::e4m3}, std::tuple{DType::e4m3, DType::e5m2, DType::e5m2}})
    for (bool bias : {false, true})
      for (auto& s : kShapes) run_case(blas, {a, b, out, bias, true}, s[0], s[1], s[2], rng);
}

TEST_CASE("FP8 GEMMs: prepare caches per FP8 configuration, and refused calls throw, never crash", "[gemm_fp8]") {
  cuda::Blas blas;
  DeviceTensor a({64, 64}, "e4m3"), b({64, 64}, "e4m3"), d({64, 64}, "bf16"), scales({8}, "fp32");
  DeviceTensor ws({static_cast<int64_t>(cuda::kGemmWorkspace / 4)}, "fp32");
  a.upload(std::vector<uint8_t>(64 * 64, 0x38), nullptr);  // 1.0
  b.upload(std::vector<uint8_t>(64 * 64, 0x38), nullptr);
  scales.upload_values({1, 0, 0, 0, 1, 0, 0, 0}, nullptr);
  const auto sp = reinterpret_cast<float*>(scales.ptr());
  cuda::GemmCall g;
  g.m = g.n = g.k = 64;
  g.dtype = DType::bf16;
  g.a = P(a);
  g.b = P(b);
  g.d = P(d);
  g.workspace = P(ws);
  g.fp8 = cuda::Fp8Gemm{};
  g.fp8->a_scale_inv = sp;
  g.fp8->b_scale_inv = sp + 4;
  const size_t n0 = blas.heuristic_cache_size();
  REQUIRE(blas.prepare(g));
  CHECK(blas.heuristic_cache_size() == n0 + 1);
  REQUIRE(blas.prepare(g));
  CHECK(blas.heuristic_cache_size() == n0 + 1);
  g.fp8->fast_accum = false;  // a different key
  CUstream s = nullptr;
  cuda::check(cuda::driver().cuStreamCreate(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
  REQUIRE(blas.prepare(g, s));  // candidates timed on scratch operands
  CHECK(blas.heuristic_cache_size() == n0 + 2);
  cuda::GemmCall plain = g;  // the same dims in bf16: its own entry
  plain.fp8.reset();
  plain.dtype = DType::bf16;
  REQUIRE(blas.prepare(plain));
  CHECK(blas.heuristic_cache_size() == n0 + 3);
  d.poison(s);
  blas.gemm(g, s);
  for (double v : d.download_values(s)) REQUIRE(v == 64.0);
  cuda::driver().cuStreamDestroy(s);

  cuda::GemmCall bad = g;
  bad.k = 40;
  CHECK_THROWS_AS(blas.gemm(bad, nullptr), Error);
  CHECK_THROWS_AS(blas.prepare(bad), Error);  // invalid_argument is not "no algorithm": it propagates
  bad = g;
  bad.fp8->a = bad.fp8->b = DType::e5m2;
  CHECK_THROWS_WITH(blas.gemm(bad, nullptr), Catch::Matchers::Contains("E5M2 x E5M2"));
  bad = g;
  bad.kind = cuda::GemmKind::wgrad;
  CHECK_THROWS_WITH(blas.gemm(bad, nullptr), Catch::Matchers::Contains("TN layout only"));
}
