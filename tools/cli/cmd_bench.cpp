// `jitfuse bench`: CUDA-event medians after warm-up for the memory-bound cases (GB/s against the
// device-to-device copy bandwidth measured in the same run) and the GEMM cases (TFLOP/s against bare
// cuBLASLt with the same epilogues). Inputs are random (never zeros). See docs/benchmarks.md.
#include <algorithm>
#include <cstring>
#include <deque>
#include <cstdio>
#include <functional>
#include <memory>
#include <random>

#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "common/error.hpp"
#include "cuda/cublaslt.hpp"
#include "cuda/driver.hpp"
#include "jitfuse/jitfuse.h"
#include "reference/device_tensor.hpp"

namespace jitfuse::cli {
namespace {

using reference::DeviceTensor;

struct BenchOpts {
  bool json = false;
  bool sync = false;
  int warmup = 10, iters = 50;
  std::string only;
};

void ok(jf_status s, const char* what) {
  if (s != JF_OK) throw Error(static_cast<Status>(s), fmt::format("{}: {}", what, jf_last_error()));
}

// Each timed call sits between its own pair of events. By default the calls are enqueued back to back
// with no host synchronisation in between, as a training loop runs them: the host prepares call i+1
// while the GPU runs call i, so an interval is the call's GPU time (plus any gap the host could not
// fill). --sync waits for every call before enqueuing the next, so the host's per-call work (argument
// checks, plan lookup, launches) shows in the interval too.
double median_ms(CUstream s, const std::function<void()>& fn, const BenchOpts& o) {
  const auto& d = cuda::driver();
  for (int i = 0; i < o.warmup; ++i) fn();
  std::vector<CUevent> ev(2 * static_cast<size_t>(o.iters));
  for (auto& e : ev) cuda::check(d.cuEventCreate(&e, CU_EVENT_DEFAULT), "cuEventCreate");
  std::vector<float> t;
  for (int i = 0; i < o.iters; ++i) {
    cuda::check(d.cuEventRecord(ev[2 * i], s), "cuEventRecord");
    fn();
    cuda::check(d.cuEventRecord(ev[2 * i + 1], s), "cuEventRecord");
    if (o.sync) cuda::check(d.cuEventSynchronize(ev[2 * i + 1]), "cuEventSynchronize");
  }
  cuda::check(d.cuEventSynchronize(ev.back()), "cuEventSynchronize");
  for (int i = 0; i < o.iters; ++i) {
    float ms = 0;
    cuda::check(d.cuEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]), "cuEventElapsedTime");
    t.push_back(ms);
  }
  for (auto& e : ev) d.cuEventDestroy(e);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

std::vector<double> random_values(size_t n, uint64_t seed, double lo, double hi) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(lo, hi);
  std::vector<double> v(n);
  for (auto& x : v) x = u(rng);
  return v;
}

struct Row {
  std::string name, shape;
  double ms = 0, bytes = 0, flops = 0, baseline_ms = 0;
  std::string note;
  double speedup = 0;  // gemm_fp8: the bf16 row's time over this row's
};

// n random bytes for a GEMM operand without touching doubles (the FP8 case fills 134 M-element buffers):
// bf16 values of magnitude in [2^-7, 2) with random signs and mantissas; E4M3 codes the same way
// (exponent field 0..7, never NaN), so neither format's products overflow and no operand is zero.
std::vector<uint8_t> random_operand_bytes(size_t n, bool fp8, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> b(fp8 ? n : 2 * n);
  for (size_t i = 0; i < n; ++i) {
    const uint64_t r = rng();
    if (fp8) {
      b[i] = static_cast<uint8_t>((r & 0x80) | ((r >> 8) & 0x38) | ((r >> 16) & 0x7));  // sign, exp 0..7, mantissa
    } else {
      const uint16_t v = static_cast<uint16_t>((r & 0x8000) | ((120 + (r >> 20) % 8) << 7) | ((r >> 32) & 0x7F));
      std::memcpy(&b[2 * i], &v, 2);
    }
  }
  return b;
}

// One sequence with random parameters and inputs, in bf16, run through the C ABI (its uploads on `stream`,
// the stream the calls run on).
struct SeqBench {
  jf_sequence seq = nullptr;
  CUstream stream = nullptr;
  std::vector<std::unique_ptr<DeviceTensor>> keep;  // per parameter: the tensor, then its gradient
  DeviceTensor *x = nullptr, *y = nullptr, *gy = nullptr, *gx = nullptr;
  std::vector<DeviceTensor*> ein, eout, gein, geout;
  std::vector<const DLTensor*> ein_t, geout_t, eout_ct;
  std::vector<DLTensor*> eout_t, gein_t;
  std::deque<std::string> names;
  std::vector<jf_param> params, grads;

  DeviceTensor* make(const ops::Shape& s, uint64_t seed) {
    keep.push_back(std::make_unique<DeviceTensor>(s, "bf16"));
    keep.back()->upload_values(random_values(static_cast<size_t>(ops::numel(s)), seed, -1, 1), stream);
    return keep.back().get();
  }

  SeqBench(jf_context ctx, CUstream s, const std::string& ops_json, const ops::Shape& in, const ops::Shape& out,
           const std::vector<std::tuple<int, std::string, ops::Shape>>& ps, int n_extra_in, int n_extra_out,
           const char* recipe = "bf16")
      : stream(s) {
    std::string j = R"({"format": "jitfuse.sequence/1", "name": "bench", "ops": )" + ops_json + "}";
    ok(jf_sequence_create(ctx, j.c_str(), recipe, &seq), "jf_sequence_create");
    // FP8 recipes write E4M3 only where the sequence ends in quantize (a GEMM's output stays bf16).
    const bool fp8_out = std::string(recipe).rfind("fp8", 0) == 0 && ops_json.find("\"quantize\"") != std::string::npos;
    uint64_t seed = 1;
    for (auto& [op, name, shape] : ps) {
      names.push_back(name);
      params.push_back({op, names.back().c_str(), make(shape, seed++)->dl()});
      grads.push_back({op, names.back().c_str(), make(shape, seed++)->dl()});
    }
    x = make(in, seed++);
    if (fp8_out) {  // E4M3 bytes: nothing to upload, the forward writes them
      keep.push_back(std::make_unique<DeviceTensor>(out, "e4m3"));
      y = keep.back().get();
      seed++;
    } else {
      y = make(out, seed++);
    }
    gy = make(out, seed++);
    gx = make(in, seed++);
    for (int i = 0; i < n_extra_in; ++i) {
      ein.push_back(make(out, seed++));
      gein.push_back(make(out, seed++));
    }
    for (int i = 0; i < n_extra_out; ++i) {
      eout.push_back(make(in, seed++));
      geout.push_back(make(in, seed++));
    }
    for (auto* t : ein) ein_t.push_back(t->dl());
    for (auto* t : eout) eout_t.push_back(t->dl());
    for (auto* t : eout) eout_ct.push_back(t->dl());
    for (auto* t : gein) gein_t.push_back(t->dl());
    for (auto* t : geout) geout_t.push_back(t->dl());
  }
  ~SeqBench() { jf_sequence_destroy(seq); }

  jf_forward_args forward_args(bool training) {
    jf_forward_args a{};
    a.input = x->dl();
    a.extra_inputs = ein_t.data();
    a.n_extra_inputs = static_cast<int>(ein_t.size());
    a.output = y->dl();
    a.extra_outputs = eout_t.data();
    a.n_extra_outputs = static_cast<int>(eout_t.size());
    a.params = params.data();
    a.n_params = static_cast<int>(params.size());
    a.training = training ? 1 : 0;
    a.rng_offset = 1;
    return a;
  }
  // saved: a training forward (the saved block is allocated and handed out); NULL: inference.
  // weights_unchanged: FP8 recipes reuse the FP8 weight copies of the last forward (a later microbatch).
  void forward(CUstream s, jf_saved* saved, bool weights_unchanged = false) {
    auto a = forward_args(saved != nullptr);
    a.fp8_weights_unchanged = weights_unchanged ? 1 : 0;
    ok(jf_forward(seq, &a, saved, reinterpret_cast<jf_stream>(s)), "jf_forward");
  }
  void backward(CUstream s, jf_saved saved) {
    jf_backward_args a{};
    a.input = x->dl();
    a.extra_inputs = ein_t.data();
    a.n_extra_inputs = static_cast<int>(ein_t.size());
    a.output = y->dl();
    a.extra_outputs = eout_ct.data();
    a.n_extra_outputs = static_cast<int>(eout_ct.size());
    a.params = params.data();
    a.n_params = static_cast<int>(params.size());
    void* block = nullptr;
    ok(jf_saved_buffer(saved, &block, &a.saved_bytes), "jf_saved_buffer");
    a.saved = block;
    a.grad_output = gy->dl();
    a.grad_extra_outputs = geout_t.data();
    a.n_grad_extra_outputs = static_cast<int>(geout_t.size());
    a.grad_input = gx->dl();
    a.grad_extra_inputs = gein_t.data();
    a.n_grad_extra_inputs = static_cast<int>(gein_t.size());
    a.grads = grads.data();
    a.n_grads = static_cast<int>(grads.size());
    ok(jf_backward(seq, &a, reinterpret_cast<jf_stream>(s)), "jf_backward");
  }
};

double copy_bandwidth(CUstream s, const BenchOpts& o) {
  const size_t bytes = size_t(1) << 30;
  DeviceTensor a({static_cast<int64_t>(bytes / 2)}, "bf16"), b({static_cast<int64_t>(bytes / 2)}, "bf16");
  a.upload_values(random_values(bytes / 2, 99, -1, 1), s);
  double ms = median_ms(s, [&] { cuda::check(cuda::driver().cuMemcpyDtoDAsync(b.ptr(), a.ptr(), bytes, s), "cuMemcpyDtoDAsync"); }, o);
  return 2.0 * static_cast<double>(bytes) / (ms * 1e-3) / 1e9;  // read + write
}

constexpr int64_t R = 8192;

std::vector<Row> run_cases(jf_context ctx, CUstream s, const BenchOpts& o) {
  std::vector<Row> rows;
  // decode runs only when asked for: its rows measure call overhead, not kernels.
  auto want = [&](const char* n) {
    return o.only == n || (o.only.empty() && std::string(n) != "decode" && std::string(n) != "gemm_fp8" &&
                           std::string(n) != "mlp_fp8");
  };
  const double e = 2;  // bf16 bytes
  if (want("bias_gelu")) {
    const int64_t C = 16384;
    SeqBench b(ctx, s, R"([{"op": "bias"}, {"op": "gelu"}])", {R, C}, {R, C}, {{0, "bias", {C}}}, 0, 0);
    rows.push_back({"bias_gelu fwd", "8192x16384", median_ms(s, [&] { b.forward(s, nullptr); }, o), e * (2.0 * R * C + C)});
  }
  if (want("dgelu_dbias")) {
    const int64_t C = 16384;
    SeqBench b(ctx, s, R"([{"op": "bias"}, {"op": "gelu"}])", {R, C}, {R, C}, {{0, "bias", {C}}}, 0, 0);
    jf_saved saved = nullptr;
    b.forward(s, &saved);
    rows.push_back({"dgelu_dbias bwd", "8192x16384", median_ms(s, [&] { b.backward(s, saved); }, o),
                    e * (3.0 * R * C + C)});
    jf_saved_release(saved, reinterpret_cast<jf_stream>(s));
  }
  // Norms: forward and backward (dx with dgamma/dbeta) at 8192x4096, then a hidden-size sweep at the same
  // element count (rows = 8192 * 4096 / hidden, so every size moves 64 MiB per tensor and none fits in L2).
  // Bytes: forward reads x and writes y; backward reads dy and the saved x and writes dx (the statistics,
  // gamma and the dgamma/dbeta partials are under 1 % and not counted).
  for (const char* norm : {"layernorm", "rmsnorm"}) {
    if (!want(norm)) continue;
    for (int64_t C : {4096, 1024, 2048, 8192, 12288}) {
      const int64_t M = R * 4096 / C;
      std::vector<std::tuple<int, std::string, ops::Shape>> params = {{0, "weight", {C}}};
      if (std::string(norm) == "layernorm") params.push_back({0, "bias", {C}});
      SeqBench b(ctx, s, fmt::format(R"([{{"op": "{}"}}])", norm), {M, C}, {M, C}, params, 0, 0);
      const std::string shape = fmt::format("{}x{}", M, C);
      rows.push_back({std::string(norm) + " fwd", shape, median_ms(s, [&] { b.forward(s, nullptr); }, o),
                      e * 2.0 * M * C});
      jf_saved saved = nullptr;
      b.forward(s, &saved);
      rows.push_back({std::string(norm) + " bwd", shape, median_ms(s, [&] { b.backward(s, saved); }, o),
                      e * 3.0 * M * C});
      jf_saved_release(saved, reinterpret_cast<jf_stream>(s));
    }
  }
  // FP8: the norm with its E4M3 cast. fp8_delayed is one pass (a bf16 read and a 1-byte write per
  // element); fp8_current needs the amax before the first byte is cast, so it reads the input twice by
  // necessity (the amax pass, then the cast pass) and its bytes count both reads.
  for (const char* recipe : {"fp8_current", "fp8_delayed"}) {
    const std::string name = std::string("layernorm_") + recipe;
    if (!want(name.c_str())) continue;
    const int64_t C = 4096;
    SeqBench b(ctx, s, R"([{"op": "layernorm"}, {"op": "quantize"}])", {R, C}, {R, C}, {{0, "weight", {C}}, {0, "bias", {C}}},
               0, 0, recipe);
    const double bytes = (std::string(recipe) == "fp8_current" ? 5.0 : 3.0) * R * C;
    rows.push_back({name + " fwd", "8192x4096 -> e4m3", median_ms(s, [&] { b.forward(s, nullptr); }, o), bytes});
  }
  if (want("swiglu")) {
    SeqBench b(ctx, s, R"([{"op": "swiglu"}])", {R, 22016}, {R, 11008}, {}, 0, 0);
    rows.push_back({"swiglu fwd", "8192x22016->11008", median_ms(s, [&] { b.forward(s, nullptr); }, o),
                    e * (R * 22016.0 + R * 11008.0)});
  }
  if (want("bias_dropout_add")) {
    const int64_t C = 4096;
    SeqBench b(ctx, s, R"([{"op": "bias"}, {"op": "dropout", "p": 0.1, "seed": 5}, {"op": "add_extra_input"}])", {R, C},
               {R, C}, {{0, "bias", {C}}}, 1, 0);
    rows.push_back({"bias_dropout_add fwd", "8192x4096", median_ms(s, [&] { b.forward(s, nullptr); }, o),
                    e * (3.0 * R * C + C)});
  }
  if (want("linear_bias_gelu")) {
    const int64_t K = 4096, N = 16384;
    SeqBench b(ctx, s, R"([{"op": "linear", "in_features": 4096, "out_features": 16384}, {"op": "bias"}, {"op": "gelu"}])",
               {R, K}, {R, N}, {{0, "weight", {N, K}}, {1, "bias", {N}}}, 0, 0);
    Row r{"linear_bias_gelu fwd", "8192x4096 -> 16384", median_ms(s, [&] { b.forward(s, nullptr); }, o), 0,
          2.0 * R * N * K};
    cuda::Blas blas;
    cuda::GemmCall c;
    c.m = R; c.n = N; c.k = K; c.dtype = ops::DType::bf16; c.epilogue = cuda::Epilogue::gelu_bias;
    c.a = reinterpret_cast<void*>(b.x->ptr());
    c.b = reinterpret_cast<void*>(b.keep[0]->ptr());
    c.bias = reinterpret_cast<void*>(b.keep[2]->ptr());
    c.d = reinterpret_cast<void*>(b.y->ptr());
    DeviceTensor ws({static_cast<int64_t>(cuda::kGemmWorkspace / 2)}, "bf16");
    c.workspace = reinterpret_cast<void*>(ws.ptr());
    r.baseline_ms = median_ms(s, [&] { blas.gemm(c, s); }, o);
    rows.push_back(r);
  }
  if (want("mlp")) {
    const int64_t H = 4096, F = 16384;
    SeqBench b(ctx, s, R"([{"op": "linear", "in_features": 4096, "out_features": 16384}, {"op": "bias"}, {"op": "gelu"},
                      {"op": "linear", "in_features": 16384, "out_features": 4096}, {"op": "bias"}])",
               {R, H}, {R, H}, {{0, "weight", {F, H}}, {1, "bias", {F}}, {3, "weight", {H, F}}, {4, "bias", {H}}}, 0, 0);
    Row r{"mlp fwd+bwd", "8192: 4096->16384->4096", 0, 0, 3 * 2 * (2.0 * R * H * F)};
    r.ms = median_ms(s, [&] {
      jf_saved saved = nullptr;
      b.forward(s, &saved);
      b.backward(s, saved);
      jf_saved_release(saved, reinterpret_cast<jf_stream>(s));
    }, o);
    // Bare cuBLASLt: the six GEMMs with the epilogues the fused plan uses (GELU_AUX_BIAS, BIAS; BGRADB on
    // both wgrads) and nothing else; the fused plan also runs gelu's backward as a generated kernel.
    cuda::Blas blas;
    DeviceTensor ws({static_cast<int64_t>(cuda::kGemmWorkspace / 2)}, "bf16");
    DeviceTensor h({R, F}, "bf16"), aux({R, F}, "bf16"), dh({R, F}, "bf16");
    h.upload_values(random_values(static_cast<size_t>(R * F), 7, -1, 1), s);
    dh.upload_values(random_values(static_cast<size_t>(R * F), 8, -1, 1), s);
    auto p = [&](int i) { return reinterpret_cast<void*>(b.keep[static_cast<size_t>(i)]->ptr()); };
    auto P = [](const DeviceTensor& t) { return reinterpret_cast<void*>(t.ptr()); };
    r.baseline_ms = median_ms(s, [&] {
      cuda::GemmCall f1{cuda::GemmKind::fwd, R, F, H, ops::DType::bf16, cuda::Epilogue::gelu_aux_bias, 1, 0,
                        P(*b.x), p(0), nullptr, P(h), p(2), P(aux)};
      cuda::GemmCall f2{cuda::GemmKind::fwd, R, H, F, ops::DType::bf16, cuda::Epilogue::bias, 1, 0,
                        P(h), p(4), nullptr, P(*b.y), p(6), nullptr};
      cuda::GemmCall d2{cuda::GemmKind::dgrad, R, H, F, ops::DType::bf16, cuda::Epilogue::none, 1, 0,
                        P(*b.gy), p(4), nullptr, P(dh), nullptr, nullptr};
      cuda::GemmCall w2{cuda::GemmKind::wgrad, R, H, F, ops::DType::bf16, cuda::Epilogue::bgradb, 1, 0,
                        P(*b.gy), P(h), nullptr, p(5), p(7), nullptr};
      cuda::GemmCall d1{cuda::GemmKind::dgrad, R, F, H, ops::DType::bf16, cuda::Epilogue::none, 1, 0,
                        P(dh), p(0), nullptr, P(*b.gx), nullptr, nullptr};
      cuda::GemmCall w1{cuda::GemmKind::wgrad, R, F, H, ops::DType::bf16, cuda::Epilogue::bgradb, 1, 0,
                        P(dh), P(*b.x), nullptr, p(1), p(3), nullptr};
      for (auto* g : {&f1, &f2, &d2, &w2, &d1, &w1}) {
        g->workspace = P(ws);
        blas.gemm(*g, s);
      }
    }, o);
    rows.push_back(r);
  }
  if (want("mlp_fp8")) {
    // The MLP fwd+bwd under bf16, fp8_delayed and fp8_current in one run. FP8: every GEMM on E4M3 / E5M2
    // operands; the input cast stands alone, bias+gelu writes the second GEMM's E4M3 input, dbias (and
    // dgelu + dbias) write the E5M2 gradients. "cast W" rows cast the weights every step (one microbatch
    // per optimizer step); the others reuse the copies (a later microbatch). Bare: the six FP8 GEMMs alone
    // (forward with fast accumulation, dgrad/wgrad without, as the program runs them).
    const int64_t H = 4096, F = 16384;
    const char* mlp = R"([{"op": "linear", "in_features": 4096, "out_features": 16384}, {"op": "bias"}, {"op": "gelu"},
                         {"op": "linear", "in_features": 16384, "out_features": 4096}, {"op": "bias"}])";
    double bf16_ms = 0;
    for (const char* recipe : {"bf16", "fp8_delayed", "fp8_current"}) {
      SeqBench b(ctx, s, mlp, {R, H}, {R, H}, {{0, "weight", {F, H}}, {1, "bias", {F}}, {3, "weight", {H, F}}, {4, "bias", {H}}},
                 0, 0, recipe);
      const bool fp8 = std::string(recipe) != "bf16";
      for (bool unchanged : fp8 ? std::vector<bool>{false, true} : std::vector<bool>{false}) {
        Row r{fmt::format("mlp {} fwd+bwd{}", recipe, fp8 ? (unchanged ? "" : " (cast W)") : ""), "8192: 4096->16384->4096",
              0, 0, 3 * 2 * (2.0 * R * H * F)};
        r.ms = median_ms(s, [&] {
          jf_saved saved = nullptr;
          b.forward(s, &saved, unchanged);
          b.backward(s, saved);
          jf_saved_release(saved, reinterpret_cast<jf_stream>(s));
        }, o);
        if (!fp8) bf16_ms = r.ms;
        if (fp8 && bf16_ms > 0) r.speedup = bf16_ms / r.ms;
        if (fp8 && unchanged) {
          // Bare cuBLASLt FP8: the six TN GEMMs of the program, scales 1, operands of the right sizes.
          cuda::Blas blas;
          DeviceTensor a8({F * R}, "e4m3"), b8({F * R}, "e4m3"), d16({F * R}, "bf16"), ones({8}, "fp32"),
              ws({static_cast<int64_t>(cuda::kGemmWorkspace / 4)}, "fp32");
          a8.upload(random_operand_bytes(static_cast<size_t>(F * R), true, 13), s);
          b8.upload(random_operand_bytes(static_cast<size_t>(F * R), true, 14), s);
          ones.upload_values({1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0}, s);
          const auto sp = reinterpret_cast<const float*>(ones.ptr());
          auto P = [](const DeviceTensor& t) { return reinterpret_cast<void*>(t.ptr()); };
          struct G { int64_t m, n, k; bool fast; };
          const G gs[] = {{R, F, H, true}, {R, H, F, true}, {R, F, H, false}, {H, F, R, false}, {R, H, F, false}, {F, H, R, false}};
          std::vector<cuda::GemmCall> calls;
          for (const auto& g : gs) {
            cuda::GemmCall c;
            c.m = g.m; c.n = g.n; c.k = g.k; c.dtype = ops::DType::bf16;
            c.a = P(a8); c.b = P(b8); c.d = P(d16); c.workspace = P(ws);
            c.fp8 = cuda::Fp8Gemm{ops::DType::e4m3, ops::DType::e4m3, ops::DType::bf16, sp, sp + 4, nullptr, nullptr, g.fast};
            blas.prepare(c, s);
            calls.push_back(c);
          }
          r.baseline_ms = median_ms(s, [&] {
            for (auto& c : calls) blas.gemm(c, s);
          }, o);
        }
        rows.push_back(r);
      }
    }
  }
  if (want("mlp_relu")) {
    // The relu MLP runs as one joint group: RELU_AUX_BIAS saves cuBLASLt's ReLU bit-mask, DRELU_BGRAD
    // applies it in the second linear's dgrad. Bare cuBLASLt: the same six GEMMs and epilogues.
    const int64_t H = 4096, F = 16384;
    SeqBench b(ctx, s, R"([{"op": "linear", "in_features": 4096, "out_features": 16384}, {"op": "bias"}, {"op": "relu"},
                      {"op": "linear", "in_features": 16384, "out_features": 4096}, {"op": "bias"}])",
               {R, H}, {R, H}, {{0, "weight", {F, H}}, {1, "bias", {F}}, {3, "weight", {H, F}}, {4, "bias", {H}}}, 0, 0);
    Row r{"mlp_relu fwd+bwd", "8192: 4096->16384->4096", 0, 0, 3 * 2 * (2.0 * R * H * F)};
    r.ms = median_ms(s, [&] {
      jf_saved saved = nullptr;
      b.forward(s, &saved);
      b.backward(s, saved);
      jf_saved_release(saved, reinterpret_cast<jf_stream>(s));
    }, o);
    cuda::Blas blas;
    DeviceTensor ws({static_cast<int64_t>(cuda::kGemmWorkspace / 2)}, "bf16");
    DeviceTensor h({R, F}, "bf16"), dh({R, F}, "bf16");
    DeviceTensor mask({static_cast<int64_t>(cuda::relu_mask_bytes(F, R) / 2)}, "bf16");  // bytes, as 2-byte words
    h.upload_values(random_values(static_cast<size_t>(R * F), 7, -1, 1), s);
    auto p = [&](int i) { return reinterpret_cast<void*>(b.keep[static_cast<size_t>(i)]->ptr()); };
    auto P = [](const DeviceTensor& t) { return reinterpret_cast<void*>(t.ptr()); };
    r.baseline_ms = median_ms(s, [&] {
      cuda::GemmCall f1{cuda::GemmKind::fwd, R, F, H, ops::DType::bf16, cuda::Epilogue::relu_aux_bias, 1, 0,
                        P(*b.x), p(0), nullptr, P(h), p(2), P(mask)};
      cuda::GemmCall f2{cuda::GemmKind::fwd, R, H, F, ops::DType::bf16, cuda::Epilogue::bias, 1, 0,
                        P(h), p(4), nullptr, P(*b.y), p(6), nullptr};
      cuda::GemmCall d2{cuda::GemmKind::dgrad, R, H, F, ops::DType::bf16, cuda::Epilogue::drelu_bgrad, 1, 0,
                        P(*b.gy), p(4), nullptr, P(dh), p(3), P(mask)};
      cuda::GemmCall w2{cuda::GemmKind::wgrad, R, H, F, ops::DType::bf16, cuda::Epilogue::bgradb, 1, 0,
                        P(*b.gy), P(h), nullptr, p(5), p(7), nullptr};
      cuda::GemmCall d1{cuda::GemmKind::dgrad, R, F, H, ops::DType::bf16, cuda::Epilogue::none, 1, 0,
                        P(dh), p(0), nullptr, P(*b.gx), nullptr, nullptr};
      cuda::GemmCall w1{cuda::GemmKind::wgrad, R, F, H, ops::DType::bf16, cuda::Epilogue::none, 1, 0,
                        P(dh), P(*b.x), nullptr, p(1), nullptr, nullptr};
      for (auto* g : {&f1, &f2, &d2, &w2, &d1, &w1}) {
        g->workspace = P(ws);
        blas.gemm(*g, s);
      }
    }, o);
    rows.push_back(r);
  }
  if (want("gemm_fp8")) {
    // The MLP's six GEMMs (8192 tokens, 4096 -> 16384 -> 4096) as the TN problems D[M,N] = A[M,K] B[N,K]^T
    // an FP8 GEMM must be (cublaslt.hpp): the forward ones as they are, dgrad and wgrad on transposed
    // copies. Each in bf16 (the same TN problem, bf16 output) and in FP8 E4M3 x E4M3 -> bf16 with fast
    // accumulation; the FP8 row reports its speed-up over the bf16 row. Scales are 1 (their value does not
    // change the time). Operands live in three buffers sized for the largest problem, filled once.
    const int64_t H = 4096, F = 16384;
    struct Shape { const char* name; int64_t m, n, k; };
    const Shape shapes[] = {{"fc1 fwd", R, F, H},   {"fc2 fwd", R, H, F},   {"fc2 dgrad", R, F, H},
                            {"fc2 wgrad", H, F, R}, {"fc1 dgrad", R, H, F}, {"fc1 wgrad", F, H, R}};
    const int64_t most = F * R;  // elements of the largest operand and output
    DeviceTensor a16({most}, "bf16"), b16({most}, "bf16"), d16({most}, "bf16"), a8({most}, "e4m3"), b8({most}, "e4m3");
    a16.upload(random_operand_bytes(static_cast<size_t>(most), false, 11), s);
    b16.upload(random_operand_bytes(static_cast<size_t>(most), false, 12), s);
    a8.upload(random_operand_bytes(static_cast<size_t>(most), true, 13), s);
    b8.upload(random_operand_bytes(static_cast<size_t>(most), true, 14), s);
    // The two scale-inverses in separate 16-byte slots (cuBLASLt refuses a scale pointer that is not).
    DeviceTensor ones({8}, "fp32"), ws({static_cast<int64_t>(cuda::kGemmWorkspace / 4)}, "fp32");
    ones.upload_values({1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0}, s);
    const auto sp = reinterpret_cast<const float*>(ones.ptr());
    auto P = [](const DeviceTensor& t) { return reinterpret_cast<void*>(t.ptr()); };
    cuda::Blas blas;
    for (const auto& sh : shapes) {
      cuda::GemmCall g;
      g.m = sh.m; g.n = sh.n; g.k = sh.k; g.dtype = ops::DType::bf16;
      g.a = P(a16); g.b = P(b16); g.d = P(d16); g.workspace = P(ws);
      const std::string shape = fmt::format("{}x{}x{} (MxNxK)", sh.m, sh.n, sh.k);
      const double flops = 2.0 * sh.m * sh.n * sh.k;
      blas.prepare(g, s);
      Row bf{fmt::format("gemm {} bf16", sh.name), shape, median_ms(s, [&] { blas.gemm(g, s); }, o), 0, flops};
      g.a = P(a8); g.b = P(b8);
      g.fp8 = cuda::Fp8Gemm{ops::DType::e4m3, ops::DType::e4m3, ops::DType::bf16, sp, sp + 4, nullptr, nullptr, true};
      blas.prepare(g, s);
      Row f8{fmt::format("gemm {} e4m3", sh.name), shape, median_ms(s, [&] { blas.gemm(g, s); }, o), 0, flops};
      f8.speedup = bf.ms / f8.ms;
      rows.push_back(bf);
      rows.push_back(f8);
    }
  }
  if (want("decode")) {
    // Inference of the MLP at decode sizes, per call: eager (host work on the critical path at small M)
    // and as a replayed CUDA graph of the same call (ABI 2: prepared, host workspace, nothing allocated).
    // The floor is the weights read once at the copy bandwidth (bytes column: weights + activations).
    const int64_t H = 4096, F = 16384;
    for (int64_t M : {int64_t{1}, int64_t{16}, int64_t{128}}) {
      SeqBench b(ctx, s, R"([{"op": "linear", "in_features": 4096, "out_features": 16384}, {"op": "bias"}, {"op": "gelu"},
                        {"op": "linear", "in_features": 16384, "out_features": 4096}, {"op": "bias"}])",
                 {M, H}, {M, H}, {{0, "weight", {F, H}}, {1, "bias", {F}}, {3, "weight", {H, F}}, {4, "bias", {H}}}, 0, 0);
      const int64_t shape[2] = {M, H};
      ok(jf_sequence_prepare(b.seq, shape, 2, 0, reinterpret_cast<jf_stream>(s)), "jf_sequence_prepare");
      jf_program_info info{};
      ok(jf_sequence_info(b.seq, shape, 2, 0, &info), "jf_sequence_info");
      DeviceTensor ws({static_cast<int64_t>(info.forward_workspace_bytes / 2 + 1)}, "bf16");
      auto a = b.forward_args(false);
      a.workspace = reinterpret_cast<void*>(ws.ptr());
      a.workspace_bytes = info.forward_workspace_bytes;
      const double bytes = e * (2.0 * H * F + F + H) + e * 2.0 * M * H;
      const std::string shape_s = fmt::format("{}: 4096->16384->4096", M);
      rows.push_back({fmt::format("decode M={} eager", M), shape_s,
                      median_ms(s, [&] { ok(jf_forward(b.seq, &a, nullptr, reinterpret_cast<jf_stream>(s)), "jf_forward"); }, o),
                      bytes});
      const auto& d = cuda::driver();
      CUgraph graph = nullptr;
      CUgraphExec exec = nullptr;
      cuda::check(d.cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), "cuStreamBeginCapture");
      jf_status st = jf_forward(b.seq, &a, nullptr, reinterpret_cast<jf_stream>(s));
      cuda::check(d.cuStreamEndCapture(s, &graph), "cuStreamEndCapture");
      ok(st, "jf_forward (captured)");
      cuda::check(d.cuGraphInstantiateWithFlags(&exec, graph, 0), "cuGraphInstantiate");
      rows.push_back({fmt::format("decode M={} graph", M), shape_s,
                      median_ms(s, [&] { cuda::check(d.cuGraphLaunch(exec, s), "cuGraphLaunch"); }, o), bytes});
      d.cuGraphExecDestroy(exec);
      d.cuGraphDestroy(graph);
    }
  }
  return rows;
}

void run_bench(const BenchOpts& o) {
  std::string why;
  if (!cuda::try_driver(&why)) fail(Status::no_device, "jitfuse bench needs a GPU: {}", why);
  auto dev = cuda::current_device();
  jf_context ctx = nullptr;
  ok(jf_context_create(&ctx), "jf_context_create");
  CUstream s = nullptr;
  cuda::check(cuda::driver().cuStreamCreate(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
  const double copy = copy_bandwidth(s, o);
  auto rows = run_cases(ctx, s, o);
  nlohmann::json out = {{"gpu", dev.name}, {"arch", dev.arch()}, {"copy_gbps", copy}, {"warmup", o.warmup},
                        {"iters", o.iters}, {"sync", o.sync}, {"cases", nlohmann::json::array()}};
  if (!o.json) {
    std::printf("GPU %s (%s); device-to-device copy %.0f GB/s (read + write); median of %d runs after %d warm-up, %s\n",
                dev.name.c_str(), dev.arch().c_str(), copy, o.iters, o.warmup,
                o.sync ? "each call synchronised (host overhead included)" : "calls enqueued back to back");
    std::printf("%-22s %-24s %9s %9s %9s %7s %9s %11s %9s\n", "case", "shape", "ms", "MB", "GB/s", "%copy", "TFLOP/s",
                "cuBLASLt ms", "vs bare");
  }
  for (const auto& r : rows) {
    nlohmann::json j = {{"case", r.name}, {"shape", r.shape}, {"ms", r.ms}};
    double gbps = r.bytes > 0 ? r.bytes / (r.ms * 1e-3) / 1e9 : 0;
    double tflops = r.flops > 0 ? r.flops / (r.ms * 1e-3) / 1e12 : 0;
    if (r.bytes > 0) {
      j["bytes"] = r.bytes;
      j["gbps"] = gbps;
      j["pct_copy"] = 100 * gbps / copy;
    }
    const bool vs_bare = r.flops > 0 && r.baseline_ms > 0;  // gemm_fp8's rows are bare cuBLASLt themselves
    if (r.flops > 0) j["tflops"] = tflops;
    if (vs_bare) {
      j["cublaslt_ms"] = r.baseline_ms;
      j["slowdown_pct"] = 100 * (r.ms / r.baseline_ms - 1);
    }
    if (r.speedup > 0) j["speedup_vs_bf16"] = r.speedup;
    out["cases"].push_back(j);
    if (!o.json)
      std::printf("%-22s %-24s %9.3f %9s %9s %7s %9s %11s %9s%s\n", r.name.c_str(), r.shape.c_str(), r.ms,
                  r.bytes > 0 ? fmt::format("{:.0f}", r.bytes / 1e6).c_str() : "-",
                  r.bytes > 0 ? fmt::format("{:.0f}", gbps).c_str() : "-",
                  r.bytes > 0 ? fmt::format("{:.1f}", 100 * gbps / copy).c_str() : "-",
                  r.flops > 0 ? fmt::format("{:.0f}", tflops).c_str() : "-",
                  vs_bare ? fmt::format("{:.3f}", r.baseline_ms).c_str() : "-",
                  vs_bare ? fmt::format("{:+.1f}%", 100 * (r.ms / r.baseline_ms - 1)).c_str() : "-",
                  r.speedup > 0 ? fmt::format("  FP8/bf16 {:.2f}x", r.speedup).c_str() : "");
  }
  if (o.json) std::printf("%s\n", out.dump(2).c_str());
  cuda::driver().cuStreamDestroy(s);
  jf_context_destroy(ctx);
}

}  // namespace

void add_bench_commands(CLI::App& app) {
  auto o = std::make_shared<BenchOpts>();
  auto* cmd = app.add_subcommand("bench", "Time the fused kernels: GB/s vs copy bandwidth, TFLOP/s vs bare cuBLASLt");
  cmd->add_flag("--json", o->json, "Machine-readable output");
  cmd->add_option("--warmup", o->warmup, "Untimed runs before timing (default 10)")->check(CLI::NonNegativeNumber);
  cmd->add_option("--iters", o->iters, "Timed runs; the median is reported (default 50)")->check(CLI::PositiveNumber);
  cmd->add_flag("--sync", o->sync, "Wait for each timed call before enqueuing the next (host overhead included)");
  cmd->add_option("--case", o->only,
                  "Run one case: bias_gelu, dgelu_dbias, layernorm, rmsnorm, layernorm_fp8_current, "
                  "layernorm_fp8_delayed, swiglu, bias_dropout_add, linear_bias_gelu, mlp, mlp_relu, decode (MLP inference "
                  "at M = 1, 16, 128: eager and as a replayed CUDA graph; not in the default set), mlp_fp8 (the MLP fwd+bwd under bf16, fp8_delayed and fp8_current, against the bare FP8 GEMMs; not in the default set), gemm_fp8 (the MLP's six GEMMs "
                  "as TN problems in bf16 and FP8 E4M3, TFLOP/s and the FP8 speed-up; not in the default set)");
  cmd->callback([o] { run_bench(*o); });
}

}  // namespace jitfuse::cli
