// FP8 recipes on the GPU: the E4M3 cast that ends a sequence, its per-tensor amax reduction and the
// recipe state (scale, scale_inv, amax history) against a float64 reference; current and delayed scaling;
// fused (norm / bias+act / gated + quantize) and alone; vector and scalar paths; the straight-through
// backward.
#include <cmath>
#include <limits>
#include <random>

#include "gpu/gpu_check.hpp"
#include "harness/check.hpp"
#include "harness/device_tensor.hpp"
#include "ops/sequence.hpp"
#include "reference/fp8.hpp"
#include "reference/sequence.hpp"

using namespace jitfuse;

namespace {

struct Fp8Case {
  const char* ops;
  ops::Shape shape;
  const char* rule;  // expected forward rule ("" = quantize runs alone)
};

const Fp8Case kCases[] = {
    {R"([{"op": "layernorm"}, {"op": "quantize"}])", {100, 264}, "norm_quantize"},
    {R"([{"op": "rmsnorm", "zero_centered_gamma": true}, {"op": "quantize"}])", {33, 1024}, "norm_quantize"},
    {R"([{"op": "bias"}, {"op": "gelu"}, {"op": "quantize"}])", {100, 72}, "bias_act_quantize"},
    {R"([{"op": "swiglu"}, {"op": "quantize"}])", {100, 96}, "gated_quantize"},
    {R"([{"op": "quantize"}])", {1000, 30}, ""},  // odd width: the scalar path
};

// The calls of this file run on the legacy default stream (nullptr); so do its copies.
std::vector<float> read_floats(const float* p, size_t n) {
  std::vector<float> v(n);
  harness::device_to_host(v.data(), reinterpret_cast<CUdeviceptr>(p), n * sizeof(float), nullptr);
  return v;
}

struct Run {
  std::vector<double> ref;  // float64 values before the cast
  std::vector<uint8_t> out;
  float scale_used = 0, scale_inv = 0, scale_next = 0;
  std::vector<float> hist;
};

// One forward of `seq` on fresh random inputs (bf16-exact), output poisoned first.
// `quantize` (FP8 GEMMs: reference::Fp8Reference) quantises the linears' operands in the reference.
Run forward_once(jf_sequence seq, const std::vector<ops::Op>& ops, std::mt19937_64& rng, bool train,
                 std::vector<double>* x_keep = nullptr, std::map<reference::ParamKey, std::vector<double>>* p_keep = nullptr,
                 reference::Fp8Reference* quantize = nullptr) {
  std::uniform_real_distribution<double> u(-2, 2);
  auto rnd = [&](int64_t n) {
    std::vector<double> v(static_cast<size_t>(n));
    for (auto& e : v) e = reference::round_to("bf16", u(rng));
    return v;
  };
  const int qi = static_cast<int>(ops.size()) - 1;
  reference::SeqInputs in;
  if (quantize)
    in.quantize = [quantize](int op, const std::string& t, std::vector<double>& v, int64_t r, int64_t c) {
      (*quantize)(op, t, v, r, c);
    };
  in.input = x_keep && !x_keep->empty() ? *x_keep : rnd(ops::numel(ops.front().in));
  if (x_keep) *x_keep = in.input;
  std::vector<std::unique_ptr<harness::DeviceTensor>> keep;
  std::vector<jf_param> params;
  for (const auto& op : ops)
    for (const auto& p : op.params) {
      auto& v = in.params[{op.index, p.name}];
      v = p_keep && p_keep->count({op.index, p.name}) ? p_keep->at({op.index, p.name}) : rnd(ops::numel(p.shape));
      if (p_keep) (*p_keep)[{op.index, p.name}] = v;
      keep.push_back(std::make_unique<harness::DeviceTensor>(p.shape, "bf16"));
      keep.back()->upload_values(v, nullptr);
      params.push_back({op.index, p.name.c_str(), keep.back()->dl()});
    }
  harness::DeviceTensor x(ops.front().in, "bf16"), y(ops.back().out, "e4m3");
  x.upload_values(in.input, nullptr);
  y.poison(nullptr);  // 0xFF = E4M3 NaN: an unwritten byte shows
  jf_fp8_state st{};
  REQUIRE(jf_sequence_fp8_state(seq, qi, &st) == JF_OK);
  Run run;
  run.scale_used = read_floats(st.scale, 1)[0];
  jf_saved saved = nullptr;
  REQUIRE(test::forward_simple(seq, x.dl(), y.dl(), params, train, &saved) == JF_OK);
  if (saved) REQUIRE(jf_saved_release(saved, nullptr) == JF_OK);
  run.out = y.download(nullptr);
  run.scale_inv = read_floats(st.scale_inv, 1)[0];
  run.scale_next = read_floats(st.scale, 1)[0];
  run.hist = read_floats(st.amax_history, static_cast<size_t>(st.history_len));
  run.ref = reference::sequence_forward(ops, in).output;  // quantize is the identity in float64
  return run;
}

double amax_of(const std::vector<double>& v) {
  double m = 0;
  for (double e : v) m = std::max(m, std::fabs(e));
  return m;
}

// fp8_delayed after call r: this call's amax recorded first in the history (within the fp32-vs-float64
// tolerance), the earlier ones (`amaxes`, newest first) moved down one entry, the rest zero, and the next
// scale = 448 / max(history). Records r's amax in `amaxes`.
void check_history(const Run& r, std::vector<float>& amaxes) {
  const double amax = amax_of(r.ref);
  REQUIRE(r.hist.size() == 1024);
  CHECK(std::fabs(r.hist[0] - amax) <= 1.6e-2 * amax);
  amaxes.insert(amaxes.begin(), r.hist[0]);
  for (size_t i = 0; i < amaxes.size(); ++i) CHECK(r.hist[i] == amaxes[i]);  // newest first
  CHECK(r.hist[amaxes.size()] == 0.f);
  const float hmax = *std::max_element(amaxes.begin(), amaxes.end());
  CHECK(r.scale_next == Approx(448.0 / hmax).epsilon(1e-6));
}

// Every byte written and within `max_steps` E4M3 steps of the float64 value cast with the scale used;
// at least `min_exact_pct` % exact.
void check_cast(const Run& r, float scale, double max_steps = 1.0, size_t min_exact_pct = 95) {
  size_t exact = 0, unwritten = 0;
  double worst_steps = 0, worst_tol = 0;
  for (size_t i = 0; i < r.out.size(); ++i) {
    const uint8_t ref_bits = reference::e4m3_bits(r.ref[i] * scale);
    const double got = reference::e4m3_value(r.out[i]), ref_v = reference::e4m3_value(ref_bits);
    if (std::isnan(got)) ++unwritten;  // the 0xFF poison survived
    if (r.out[i] == ref_bits) {
      ++exact;
      continue;
    }
    // One step of the E4M3 grid at this magnitude: 2^(exponent - 3), 2^-9 for subnormals.
    const double step = std::ldexp(1.0, std::ilogb(std::max(std::fabs(ref_v), 0x1p-6)) - 3);
    worst_steps = std::max(worst_steps, std::fabs(got - ref_v) / step);
    // DESIGN's FP8 tolerance on the dequantized value, too.
    worst_tol = std::max(worst_tol, std::fabs(got / scale - r.ref[i]) / (0.0675 + 0.125 * std::fabs(r.ref[i])));
  }
  INFO("exact " << exact << " of " << r.out.size() << ", worst " << worst_steps << " E4M3 steps, worst err/tol "
                << worst_tol);
  CHECK(unwritten == 0);
  CHECK(worst_steps <= max_steps);
  CHECK(worst_tol <= 1.0);
  CHECK(exact >= r.out.size() * min_exact_pct / 100);  // off by a step only where fp32 and float64 straddle a tie
}

}  // namespace

TEST_CASE("fp8_current: amax pass, then the E4M3 cast with scale = 448 / amax", "[fp8]") {
  cuda::current_device();  // a current context before the test allocates
  std::mt19937_64 rng(21);
  for (const auto& c : kCases) {
    INFO(c.ops << " shape " << ops::shape_str(c.shape));
    std::string json = test::seq_json(c.ops);
    jf_sequence seq = nullptr;
    REQUIRE(jf_sequence_create(test::shared_context(), json.c_str(), "fp8_current", &seq) == JF_OK);
    const char* js = nullptr;
    REQUIRE(jf_sequence_explain(seq, c.shape.data(), static_cast<int>(c.shape.size()), 0, 90, &js) == JF_OK);
    if (*c.rule) CHECK(nlohmann::json::parse(js)["forward"][0]["rule"] == c.rule);
    auto ops = ops::infer(ops::parse_sequence(json, "<test>", test::builtin_registry()), c.shape);
    for (int call = 0; call < 2; ++call) {  // a second call recomputes everything from its own tensor
      Run r = forward_once(seq, ops, rng, call == 1);
      const double amax = amax_of(r.ref);
      REQUIRE(r.hist.size() == 1);
      CHECK(std::fabs(r.hist[0] - amax) <= 1.6e-2 * amax);  // reduced over the fp32 chain values
      CHECK(r.scale_next == Approx(448.0 / r.hist[0]).epsilon(1e-6));
      CHECK(r.scale_inv == Approx(1.0 / r.scale_next).epsilon(1e-6));
      check_cast(r, r.scale_next);
    }
    jf_sequence_destroy(seq);
  }
}

TEST_CASE("fp8_delayed: cast with the stored scale, then roll the amax history and update the scale", "[fp8]") {
  cuda::current_device();
  std::mt19937_64 rng(22);
  for (const auto& c : kCases) {
    INFO(c.ops << " shape " << ops::shape_str(c.shape));
    std::string json = test::seq_json(c.ops);
    jf_sequence seq = nullptr;
    REQUIRE(jf_sequence_create(test::shared_context(), json.c_str(), "fp8_delayed", &seq) == JF_OK);
    auto ops = ops::infer(ops::parse_sequence(json, "<test>", test::builtin_registry()), c.shape);
    std::vector<float> amaxes;
    float expect_scale = 1.f;  // the initial scale
    for (int call = 0; call < 3; ++call) {
      Run r = forward_once(seq, ops, rng, call == 2);
      CHECK(r.scale_used == Approx(expect_scale).epsilon(1e-6));
      CHECK(r.scale_inv == Approx(1.0 / expect_scale).epsilon(1e-6));
      check_cast(r, r.scale_used);
      check_history(r, amaxes);
      expect_scale = r.scale_next;
    }
    jf_sequence_destroy(seq);
  }
}

// The last block of the cast kernel rolls the history in slices of its thread count (32 for a 64-wide
// layernorm, 128 for the large shape): 300 calls cross several slice boundaries. The many blocks of the
// large shape also race to count themselves done; each call's amax must land exactly once.
TEST_CASE("fp8_delayed: the amax history rolls correctly over many calls", "[fp8]") {
  cuda::current_device();
  std::mt19937_64 rng(23);
  for (const ops::Shape shape : {ops::Shape{7, 64}, ops::Shape{4096, 1024}}) {
    INFO("shape " << ops::shape_str(shape));
    const std::string json = test::seq_json(R"([{"op": "layernorm"}, {"op": "quantize"}])");
    jf_sequence seq = nullptr;
    REQUIRE(jf_sequence_create(test::shared_context(), json.c_str(), "fp8_delayed", &seq) == JF_OK);
    auto ops = ops::infer(ops::parse_sequence(json, "<test>", test::builtin_registry()), shape);
    std::vector<float> amaxes;
    const int calls = shape[0] == 7 ? 300 : 40;
    for (int call = 0; call < calls; ++call) {
      Run r = forward_once(seq, ops, rng, false);
      const double amax = amax_of(r.ref);
      REQUIRE(std::fabs(r.hist[0] - amax) <= 1.6e-2 * amax);
      amaxes.insert(amaxes.begin(), r.hist[0]);
      if (call % 37 == 0 || call == calls - 1) {
        for (size_t i = 0; i < amaxes.size(); ++i) REQUIRE(r.hist[i] == amaxes[i]);  // newest first
        CHECK(r.hist[amaxes.size()] == 0.f);
        const float hmax = *std::max_element(amaxes.begin(), amaxes.end());
        CHECK(r.scale_next == Approx(448.0 / hmax).epsilon(1e-6));
      }
    }
    jf_sequence_destroy(seq);
  }
}

TEST_CASE("FP8 recipes: the backward passes gradients straight through quantize", "[fp8]") {
  // bf16 gradients against the float64 reference, where quantize's backward is the identity.
  cuda::current_device();
  for (const char* recipe : {"fp8_current", "fp8_delayed"}) {
    std::string json = test::seq_json(R"([{"op": "layernorm"}, {"op": "quantize"}])");
    jf_sequence seq = nullptr;
    REQUIRE(jf_sequence_create(test::shared_context(), json.c_str(), recipe, &seq) == JF_OK);
    const ops::Shape shape{64, 256};
    auto ops = ops::infer(ops::parse_sequence(json, "<test>", test::builtin_registry()), shape);
    std::mt19937_64 rng(23);
    std::uniform_real_distribution<double> u(-2, 2);
    auto rnd = [&](int64_t n) {
      std::vector<double> v(static_cast<size_t>(n));
      for (auto& e : v) e = reference::round_to("bf16", u(rng));
      return v;
    };
    reference::SeqInputs in;
    in.input = rnd(64 * 256);
    in.params[{0, "weight"}] = rnd(256);
    in.params[{0, "bias"}] = rnd(256);
    auto gy = rnd(64 * 256);
    harness::DeviceTensor x(shape, "bf16"), y(shape, "e4m3"), w({256}, "bf16"), b({256}, "bf16"), dy(shape, "bf16"),
        dx(shape, "bf16"), dw({256}, "bf16"), db({256}, "bf16");
    x.upload_values(in.input, nullptr);
    w.upload_values(in.params[{0, "weight"}], nullptr);
    b.upload_values(in.params[{0, "bias"}], nullptr);
    dy.upload_values(gy, nullptr);
    for (auto* t : {&y, &dx, &dw, &db}) t->poison(nullptr);
    const std::vector<jf_param> params = {{0, "weight", w.dl()}, {0, "bias", b.dl()}};
    const std::vector<jf_param> grads = {{0, "weight", dw.dl()}, {0, "bias", db.dl()}};
    jf_saved saved = nullptr;
    REQUIRE(test::forward_simple(seq, x.dl(), y.dl(), params, true, &saved) == JF_OK);
    REQUIRE(test::backward_simple(seq, saved, x.dl(), y.dl(), dy.dl(), dx.dl(), params, grads) == JF_OK);
    REQUIRE(jf_saved_release(saved, nullptr) == JF_OK);
    auto fwd = reference::sequence_forward(ops, in);
    auto g = reference::sequence_backward(ops, in, fwd, gy, {});
    auto check = [&](const char* what, const std::vector<double>& got, const std::vector<double>& ref, double atol) {
      double worst = 0;
      for (size_t i = 0; i < ref.size(); ++i)
        worst = std::max(worst, std::fabs(got[i] - ref[i]) / (atol + 1.6e-2 * std::fabs(ref[i])));
      INFO(recipe << " " << what << " worst err/tol " << worst);
      CHECK(worst <= 1.0);  // NaN poison fails too
    };
    check("dx", dx.download_values(nullptr), g.grad_input, 1e-5 * 16);
    check("dgamma", dw.download_values(nullptr), g.grad_params.at({0, "weight"}), 1e-5 * 64 * 16);
    check("dbeta", db.download_values(nullptr), g.grad_params.at({0, "bias"}), 1e-5 * 64 * 16);
    jf_sequence_destroy(seq);
  }
}

// fp8_delayed: a linear followed by quantize writes the E4M3 output from its FP8 GEMM (cuBLASLt D scale =
// the quantize's stored scale, AMAX_D into the pass's batched state update, which also records scale_inv),
// with no bf16 copy and no quantize kernel. Checked over calls as the quantize kernel's delayed test is:
// codes against the float64 GEMM of the operands quantised as the casts do (reference::Fp8Reference),
// the scale used, scale_inv, the amax history (newest first) and the next scale.
TEST_CASE("fp8_delayed: the FP8 GEMM writes a trailing quantize's E4M3 output, its amax and scale_inv", "[fp8]") {
  cuda::current_device();
  struct Case {
    const char* ops;
    ops::Shape shape;
    const char* rule;
  };
  const Case cases[] = {
      {R"([{"op": "linear", "in_features": 128, "out_features": 96}, {"op": "bias"}, {"op": "quantize"}])", {64, 128},
       "fp8_linear_quantize"},
      {R"([{"op": "linear", "in_features": 256, "out_features": 64}, {"op": "quantize"}])", {2, 48, 256},
       "fp8_linear_quantize"},
      {R"([{"op": "rmsnorm"}, {"op": "linear", "in_features": 128, "out_features": 96}, {"op": "bias"}, {"op": "quantize"}])",
       {64, 128}, "fp8_norm_linear_quantize"},
      {R"([{"op": "bias"}, {"op": "gelu"}, {"op": "linear", "in_features": 96, "out_features": 128}, {"op": "bias"}, {"op": "quantize"}])",
       {80, 96}, "fp8_act_linear_quantize"},
  };
  std::mt19937_64 rng(24);
  for (const auto& c : cases) {
    INFO(c.ops << " shape " << ops::shape_str(c.shape));
    const std::string json = test::seq_json(c.ops);
    jf_sequence seq = nullptr;
    REQUIRE(jf_sequence_create(test::shared_context(), json.c_str(), "fp8_delayed", &seq) == JF_OK);
    for (int training : {0, 1}) {
      const char* js = nullptr;
      REQUIRE(jf_sequence_explain(seq, c.shape.data(), static_cast<int>(c.shape.size()), training, 90, &js) == JF_OK);
      const auto plan = nlohmann::json::parse(js);
      CHECK(plan["forward"][0]["rule"] == c.rule);
      CHECK(plan["forward"].size() == 1);  // one group: no quantize kernel after the GEMM
    }
    auto def = ops::parse_sequence(json, "<test>", test::builtin_registry());
    auto ops = ops::infer(def, c.shape);
    reference::Fp8Reference q8(ops::parse_recipe("fp8_delayed"));
    std::vector<float> amaxes;
    float expect_scale = 1.f;  // the initial scale
    for (int call = 0; call < 4; ++call) {
      INFO("call " << call);
      Run r = forward_once(seq, ops, rng, call % 2 == 1, nullptr, nullptr, &q8);
      CHECK(r.scale_used == Approx(expect_scale).epsilon(1e-6));
      CHECK(r.scale_inv == Approx(1.0 / expect_scale).epsilon(1e-6));  // written by the batched update
      // GEMM outputs: 99 % of the codes exact, every one within DESIGN's FP8 tolerance of the float64 value.
      // Not "one E4M3 step": where a dot product cancels to near zero, the fast accumulation's absolute
      // error (TransformerEngine's forward setting) spans several of that small value's fine steps (H100
      // run #2: 99.4-99.6 % exact, up to 6 steps at small magnitudes, err/tol <= 0.46). A fused norm or
      // activation also writes its codes from fp32 where the reference rounds through bf16 first.
      check_cast(r, r.scale_used, std::numeric_limits<double>::infinity(), 99);
      double num = 0, den = 0;  // and the tensor's relative error: half an E4M3 step (2^-4)
      for (size_t i = 0; i < r.out.size(); ++i) {
        const double d = reference::e4m3_value(r.out[i]) / r.scale_used - r.ref[i];
        num += d * d;
        den += r.ref[i] * r.ref[i];
      }
      CHECK(std::sqrt(num / den) <= 0.0625);
      check_history(r, amaxes);  // the amax: cuBLASLt's AMAX_D of the fp32 result
      expect_scale = r.scale_next;
    }
    jf_sequence_destroy(seq);
  }
}
