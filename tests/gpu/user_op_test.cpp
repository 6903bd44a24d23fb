// The docs/rules.md walk-through on the GPU: softplus declared in docs/examples/softplus/ (no rebuild),
// fused with bias by the user's rule, run forward and backward, checked against a float64 softplus.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>

#include "gpu/gpu_check.hpp"
#include "common/json_util.hpp"
#include "harness/device_tensor.hpp"

using namespace jitfuse;

TEST_CASE("user-declared softplus fused with bias matches float64", "[fusion]") {
  jf_context ctx = nullptr;
  REQUIRE(jf_context_create(&ctx) == JF_OK);
  int errors = -1;
  REQUIRE(jf_context_load_rules(ctx, JF_SOURCE_DIR "/docs/examples/softplus", &errors) == JF_OK);
  REQUIRE(errors == 0);
  std::string seq_text = json_util::read_file(JF_SOURCE_DIR "/docs/examples/bias_softplus.json");
  jf_sequence seq = nullptr;
  REQUIRE(jf_sequence_create(ctx, seq_text.c_str(), "fp32", &seq) == JF_OK);
  const int64_t R = 77, C = 136;
  const double beta = 2.0;
  int64_t shape[2] = {R, C};
  const char* js = nullptr;
  REQUIRE(jf_sequence_explain(seq, shape, 2, 1, 90, &js) == JF_OK);
  auto plan = nlohmann::json::parse(js);
  CHECK(plan["forward"][0]["rule"] == "bias_softplus");
  CHECK(plan["backward"][0]["rule"] == "softplus_dbias");

  std::mt19937_64 rng(11);
  std::uniform_real_distribution<double> u(-3, 3);
  std::vector<double> x(R * C), b(C), gy(R * C);
  for (auto& v : x) v = static_cast<float>(u(rng));
  for (auto& v : b) v = static_cast<float>(u(rng));
  for (auto& v : gy) v = static_cast<float>(u(rng));
  harness::DeviceTensor dx({R, C}, "fp32"), db({C}, "fp32"), dy({R, C}, "fp32"), dgy({R, C}, "fp32"),
      dgx({R, C}, "fp32"), dgb({C}, "fp32");
  dx.upload_values(x, nullptr);
  db.upload_values(b, nullptr);
  dgy.upload_values(gy, nullptr);
  dy.poison(nullptr);
  dgx.poison(nullptr);
  dgb.poison(nullptr);
  const std::vector<jf_param> params = {{0, "bias", db.dl()}}, grads = {{0, "bias", dgb.dl()}};
  jf_saved saved = nullptr;
  REQUIRE(test::forward_simple(seq, dx.dl(), dy.dl(), params, true, &saved) == JF_OK);
  REQUIRE(test::backward_simple(seq, saved, dx.dl(), dy.dl(), dgy.dl(), dgx.dl(), params, grads) == JF_OK);
  REQUIRE(jf_saved_release(saved, nullptr) == JF_OK);
  auto y = dy.download_values(nullptr), gx = dgx.download_values(nullptr), gb = dgb.download_values(nullptr);
  std::vector<double> ref_gb(C, 0.0);
  double worst = 0;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) {
      const double h = x[r * C + c] + b[c];
      const double ry = std::log1p(std::exp(beta * h)) / beta;
      const double rg = gy[r * C + c] / (1 + std::exp(-beta * h));
      ref_gb[c] += rg;
      worst = std::max(worst, std::fabs(y[r * C + c] - ry) / (1e-5 + 1.3e-6 * 2 * std::fabs(ry)));
      worst = std::max(worst, std::fabs(gx[r * C + c] - rg) / (1e-5 + 1.3e-6 * 2 * std::fabs(rg)));
    }
  for (int64_t c = 0; c < C; ++c)
    worst = std::max(worst, std::fabs(gb[c] - ref_gb[c]) / (1e-5 * R + 1.3e-6 * 2 * std::fabs(ref_gb[c])));
  INFO("worst err/tol " << worst);
  CHECK(worst <= 1.0);  // NaN (unwritten poison) fails this too
  jf_sequence_destroy(seq);
  jf_context_destroy(ctx);
}

TEST_CASE("linear with accumulate_grad adds dW into the existing gradient buffer", "[ops]") {
  jf_context ctx = test::shared_context();
  const int64_t M = 37, K = 32, N = 16;
  jf_sequence seq = nullptr;
  REQUIRE(jf_sequence_create(ctx, R"({"ops": [{"op": "linear", "in_features": 32, "out_features": 16,
                                                "accumulate_grad": true}]})", "fp32", &seq) == JF_OK);
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<double> u(-1, 1);
  auto rnd = [&](size_t n) {
    std::vector<double> v(n);
    for (auto& x : v) x = static_cast<float>(u(rng));
    return v;
  };
  auto x = rnd(M * K), w = rnd(N * K), g0 = rnd(N * K), gy = rnd(M * N);
  harness::DeviceTensor dx({M, K}, "fp32"), dw({N, K}, "fp32"), dg({N, K}, "fp32"), dy({M, N}, "fp32"),
      dgy({M, N}, "fp32"), dgx({M, K}, "fp32");
  dx.upload_values(x, nullptr);
  dw.upload_values(w, nullptr);
  dg.upload_values(g0, nullptr);
  dgy.upload_values(gy, nullptr);
  dy.poison(nullptr);
  dgx.poison(nullptr);
  const std::vector<jf_param> params = {{0, "weight", dw.dl()}}, grads = {{0, "weight", dg.dl()}};
  jf_saved saved = nullptr;
  REQUIRE(test::forward_simple(seq, dx.dl(), dy.dl(), params, true, &saved) == JF_OK);
  REQUIRE(test::backward_simple(seq, saved, dx.dl(), dy.dl(), dgy.dl(), dgx.dl(), params, grads) == JF_OK);
  REQUIRE(jf_saved_release(saved, nullptr) == JF_OK);
  auto g = dg.download_values(nullptr);
  double worst = 0;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) {
      double ref = g0[n * K + k];
      for (int64_t m = 0; m < M; ++m) ref += gy[m * N + n] * x[m * K + k];
      worst = std::max(worst, std::fabs(g[n * K + k] - ref) / (1e-5 + 1e-3 * std::fabs(ref)));  // fp32 GEMM: fp16 tol
    }
  INFO("worst err/tol " << worst);
  CHECK(worst <= 1.0);
  jf_sequence_destroy(seq);
}

// A scalar variant that does not compile (here: a user template that refuses -DJF_SCALAR) fails only the
// call that needs it, with the C ABI's status and a message naming the misaligned tensor and NVRTC's log;
// aligned calls before and after run, and the process goes on.
TEST_CASE("a misaligned call whose scalar variant fails to compile returns JF_ERR_COMPILE, not a crash",
          "[fusion]") {
  char tmpl[] = "/tmp/jf_softplus_XXXXXX";
  REQUIRE(mkdtemp(tmpl));
  const std::string dir = tmpl;
  std::filesystem::copy_file(JF_SOURCE_DIR "/docs/examples/softplus/rules.json", dir + "/rules.json");
  {
    std::ofstream t(dir + "/softplus.cuh");
    t << json_util::read_file(JF_SOURCE_DIR "/docs/examples/softplus/softplus.cuh")
      << "#ifdef JF_SCALAR\n#error \"softplus test template: no scalar variant\"\n#endif\n";
  }
  test::FreshContext fresh;
  int errors = -1;
  REQUIRE(jf_context_load_rules(fresh.ctx, dir.c_str(), &errors) == JF_OK);
  REQUIRE(errors == 0);  // the template is validated as the vector programs compile it
  std::string seq_text = json_util::read_file(JF_SOURCE_DIR "/docs/examples/bias_softplus.json");
  jf_sequence seq = nullptr;
  REQUIRE(jf_sequence_create(fresh.ctx, seq_text.c_str(), "fp32", &seq) == JF_OK);
  const int64_t R = 40, C = 64;
  harness::DeviceTensor x({R, C}, "fp32"), b({C}, "fp32"), y({R, C}, "fp32"), xm({R, C}, "fp32", true),
      ym({R, C}, "fp32", true);
  x.upload_values(std::vector<double>(R * C, 0.5), nullptr);
  xm.upload_values(std::vector<double>(R * C, 0.5), nullptr);
  b.upload_values(std::vector<double>(C, 0.25), nullptr);
  const std::vector<jf_param> params = {{0, "bias", b.dl()}};
  REQUIRE(test::forward_simple(seq, x.dl(), y.dl(), params, false, nullptr) == JF_OK);
  const jf_status st = test::forward_simple(seq, xm.dl(), ym.dl(), params, false, nullptr);
  const std::string msg = jf_last_error();
  CHECK(st == JF_ERR_COMPILE);
  CHECK_THAT(msg, Catch::Contains("not 16-byte aligned") && Catch::Contains("scalar variant") &&
                      Catch::Contains("no scalar variant"));
  y.poison(nullptr);
  REQUIRE(test::forward_simple(seq, x.dl(), y.dl(), params, false, nullptr) == JF_OK);
  REQUIRE(cuda::driver().cuCtxSynchronize() == CUDA_SUCCESS);
  const double want = std::log1p(std::exp(2.0 * 0.75)) / 2.0;  // softplus(x + b), beta 2
  for (double v : y.download_values(nullptr)) CHECK(std::fabs(v - want) < 1e-5);
  jf_sequence_destroy(seq);
  std::filesystem::remove_all(dir);
}
