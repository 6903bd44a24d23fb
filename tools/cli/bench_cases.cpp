// The cases of `jitfuse bench` (bench_cases.hpp): memory-bound fused kernels timed against the copy
// bandwidth, and GEMM cases against bare cuBLASLt with the same epilogues. One MLP, one six-GEMM baseline
// per precision, shared by every case that uses them.
#include "bench_cases.hpp"

#include <algorithm>
#include <memory>

#include <fmt/format.h>

#include "cuda/cublaslt.hpp"

namespace jitfuse::cli::bench {
namespace {

constexpr double e = kBf16Bytes;

double forward_ms(const BenchEnv& env, SeqBench& b) {
  return median_ms(env.stream, [&] { b.forward(env.stream, nullptr); }, env.opts);
}

// The backward alone, on the saved block of one training forward.
double backward_ms(const BenchEnv& env, SeqBench& b) {
  jf_saved saved = nullptr;
  b.forward(env.stream, &saved);
  const double ms = median_ms(env.stream, [&] { b.backward(env.stream, saved); }, env.opts);
  jf_saved_release(saved, reinterpret_cast<jf_stream>(env.stream));
  return ms;
}

double step_ms(const BenchEnv& env, SeqBench& b, bool weights_unchanged = false) {
  return median_ms(env.stream, [&] { b.step(env.stream, weights_unchanged); }, env.opts);
}

// ---- Memory-bound cases

SeqBench bias_gelu_seq(const BenchEnv& env, int64_t C) {
  return SeqBench(env.ctx, env.stream, R"([{"op": "bias"}, {"op": "gelu"}])", {R, C}, {R, C}, {{0, "bias", {C}}}, 0, 0);
}

std::vector<Row> bias_gelu(const BenchEnv& env) {
  const int64_t C = 16384;
  SeqBench b = bias_gelu_seq(env, C);
  return {{"bias_gelu fwd", "8192x16384", forward_ms(env, b), e * (2.0 * R * C + C)}};
}

std::vector<Row> dgelu_dbias(const BenchEnv& env) {
  const int64_t C = 16384;
  SeqBench b = bias_gelu_seq(env, C);
  return {{"dgelu_dbias bwd", "8192x16384", backward_ms(env, b), e * (3.0 * R * C + C)}};
}

// Norms: forward and backward (dx with dgamma/dbeta) at 8192x4096, then a hidden-size sweep at the same
// element count (rows = 8192 * 4096 / hidden, so every size moves 64 MiB per tensor and none fits in L2).
// Bytes: forward reads x and writes y; backward reads dy and the saved x and writes dx (the statistics,
// gamma and the dgamma/dbeta partials are under 1 % and not counted).
std::vector<Row> norm_sweep(const BenchEnv& env, const std::string& norm) {
  std::vector<Row> rows;
  for (int64_t C : {4096, 1024, 2048, 8192, 12288}) {
    const int64_t M = R * 4096 / C;
    std::vector<ParamSpec> params = {{0, "weight", {C}}};
    if (norm == "layernorm") params.push_back({0, "bias", {C}});
    SeqBench b(env.ctx, env.stream, fmt::format(R"([{{"op": "{}"}}])", norm), {M, C}, {M, C}, params, 0, 0);
    const std::string shape = fmt::format("{}x{}", M, C);
    rows.push_back({norm + " fwd", shape, forward_ms(env, b), e * 2.0 * M * C});
    rows.push_back({norm + " bwd", shape, backward_ms(env, b), e * 3.0 * M * C});
  }
  return rows;
}

// FP8: the norm with its E4M3 cast. fp8_delayed is one pass (a bf16 read and a 1-byte write per element);
// fp8_current needs the amax before the first byte is cast, so it reads the input twice by necessity (the
// amax pass, then the cast pass) and its bytes count both reads.
// One row per hidden size, at the norm sweep's element count (issue 32).
std::vector<Row> layernorm_fp8(const BenchEnv& env, const std::string& recipe) {
  std::vector<Row> rows;
  for (int64_t C : {4096, 1024, 2048, 8192, 12288}) {
    const int64_t M = R * 4096 / C;
    SeqBench b(env.ctx, env.stream, R"([{"op": "layernorm"}, {"op": "quantize"}])", {M, C}, {M, C},
               {{0, "weight", {C}}, {0, "bias", {C}}}, 0, 0, recipe.c_str());
    const double bytes = (recipe == "fp8_current" ? 5.0 : 3.0) * M * C;
    rows.push_back({"layernorm_" + recipe + " fwd", fmt::format("{}x{} -> e4m3", M, C), forward_ms(env, b), bytes});
  }
  return rows;
}

std::vector<Row> swiglu(const BenchEnv& env) {
  SeqBench b(env.ctx, env.stream, R"([{"op": "swiglu"}])", {R, 22016}, {R, 11008}, {}, 0, 0);
  return {{"swiglu fwd", "8192x22016->11008", forward_ms(env, b), e * (R * 22016.0 + R * 11008.0)}};
}

std::vector<Row> bias_dropout_add(const BenchEnv& env) {
  const int64_t C = 4096;
  SeqBench b(env.ctx, env.stream, R"([{"op": "bias"}, {"op": "dropout", "p": 0.1, "seed": 5}, {"op": "add_extra_input"}])",
             {R, C}, {R, C}, {{0, "bias", {C}}}, 1, 0);
  // Backward (the joint rule regenerates the mask): reads dy, writes dx and the residual's gradient; the
  // bias gradient's partials are under 1 %.
  return {{"bias_dropout_add fwd", "8192x4096", forward_ms(env, b), e * (3.0 * R * C + C)},
          {"bias_dropout_add bwd", "8192x4096", backward_ms(env, b), e * (3.0 * R * C + C)}};
}

// ---- GEMM cases

std::vector<Row> linear_bias_gelu(const BenchEnv& env) {
  const int64_t K = 4096, N = 16384;
  SeqBench b(env.ctx, env.stream,
             R"([{"op": "linear", "in_features": 4096, "out_features": 16384}, {"op": "bias"}, {"op": "gelu"}])",
             {R, K}, {R, N}, {{0, "weight", {N, K}}, {1, "bias", {N}}}, 0, 0);
  Row r{"linear_bias_gelu fwd", "8192x4096 -> 16384", forward_ms(env, b), 0, 2.0 * R * N * K};
  cuda::Blas blas;
  cuda::GemmCall c;
  c.m = R; c.n = N; c.k = K; c.dtype = ops::DType::bf16; c.epilogue = cuda::Epilogue::gelu_bias;
  c.a = ptr(*b.x);
  c.b = b.param(0);
  c.bias = b.param(1);
  c.d = ptr(*b.y);
  DeviceTensor ws({static_cast<int64_t>(cuda::kGemmWorkspace / 2)}, "bf16");
  c.workspace = ptr(ws);
  r.baseline_ms = median_ms(env.stream, [&] { blas.gemm(c, env.stream); }, env.opts);
  return {r};
}

// The MLP of every MLP case: M tokens, 4096 -> 16384 -> 4096, `act` between the linears.
constexpr int64_t H = 4096, F = 16384;
constexpr double kMlpFlops = 3 * 2 * (2.0 * R * H * F);  // six GEMMs at M = 8192
constexpr const char* kMlpShape = "8192: 4096->16384->4096";

SeqBench mlp_seq(const BenchEnv& env, int64_t M, const char* act, const char* recipe = "bf16") {
  const std::string ops = fmt::format(
      R"([{{"op": "linear", "in_features": {0}, "out_features": {1}}}, {{"op": "bias"}}, {{"op": "{2}"}},
          {{"op": "linear", "in_features": {1}, "out_features": {0}}}, {{"op": "bias"}}])",
      H, F, act);
  return SeqBench(env.ctx, env.stream, ops, {M, H}, {M, H},
                  {{0, "weight", {F, H}}, {1, "bias", {F}}, {3, "weight", {H, F}}, {4, "bias", {H}}}, 0, 0, recipe);
}

// Bare cuBLASLt for the bf16 MLP's training step: its six GEMMs with the epilogues the fused plan uses and
// nothing else. gelu: GELU_AUX_BIAS, BIAS, and BGRADB on both wgrads (the fused plan also runs gelu's
// backward as a generated kernel). relu, one joint group: RELU_AUX_BIAS saves cuBLASLt's ReLU bit-mask,
// DRELU_BGRAD applies it in the second linear's dgrad and takes the first bias's gradient there.
double mlp_bf16_baseline_ms(const BenchEnv& env, SeqBench& b, bool relu) {
  using cuda::Epilogue;
  using cuda::GemmKind;
  const auto bf16 = ops::DType::bf16;
  cuda::Blas blas;
  DeviceTensor ws({static_cast<int64_t>(cuda::kGemmWorkspace / 2)}, "bf16");
  DeviceTensor h({R, F}, "bf16"), dh({R, F}, "bf16");
  // gelu: the pre-activation; relu: the bit-mask's bytes, as 2-byte words
  DeviceTensor aux(relu ? ops::Shape{static_cast<int64_t>(cuda::relu_mask_bytes(F, R) / 2)} : ops::Shape{R, F}, "bf16");
  h.upload_values(random_values(static_cast<size_t>(R * F), 7, -1, 1), env.stream);
  void* relu_aux = relu ? ptr(aux) : nullptr;
  cuda::GemmCall calls[] = {
      {GemmKind::fwd, R, F, H, bf16, relu ? Epilogue::relu_aux_bias : Epilogue::gelu_aux_bias, 1, 0, ptr(*b.x),
       b.param(0), nullptr, ptr(h), b.param(1), ptr(aux)},
      {GemmKind::fwd, R, H, F, bf16, Epilogue::bias, 1, 0, ptr(h), b.param(2), nullptr, ptr(*b.y), b.param(3), nullptr},
      {GemmKind::dgrad, R, H, F, bf16, relu ? Epilogue::drelu_bgrad : Epilogue::none, 1, 0, ptr(*b.gy), b.param(2),
       nullptr, ptr(dh), relu ? b.grad(1) : nullptr, relu_aux},
      {GemmKind::wgrad, R, H, F, bf16, Epilogue::bgradb, 1, 0, ptr(*b.gy), ptr(h), nullptr, b.grad(2), b.grad(3), nullptr},
      {GemmKind::dgrad, R, F, H, bf16, Epilogue::none, 1, 0, ptr(dh), b.param(0), nullptr, ptr(*b.gx), nullptr, nullptr},
      {GemmKind::wgrad, R, F, H, bf16, relu ? Epilogue::none : Epilogue::bgradb, 1, 0, ptr(dh), ptr(*b.x), nullptr,
       b.grad(0), relu ? nullptr : b.grad(1), nullptr},
  };
  for (auto& c : calls) c.workspace = ptr(ws);
  return median_ms(env.stream, [&] {
    for (const auto& c : calls) blas.gemm(c, env.stream);
  }, env.opts);
}

std::vector<Row> mlp_train(const BenchEnv& env, const char* act, const char* name) {
  SeqBench b = mlp_seq(env, R, act);
  Row r{name, kMlpShape, step_ms(env, b), 0, kMlpFlops};
  r.baseline_ms = mlp_bf16_baseline_ms(env, b, std::string(act) == "relu");
  return {r};
}

// The MLP's six GEMMs (at 8192 tokens) as the TN problems D[M,N] = A[M,K] B[N,K]^T an FP8 GEMM must be
// (cublaslt.hpp): the forward ones as they are, dgrad and wgrad on transposed copies.
struct TnGemm {
  const char* name;
  int64_t m, n, k;
  bool forward;  // the FP8 program accumulates fast in the forward only (TransformerEngine's choice)
};
constexpr TnGemm kMlpTnGemms[] = {{"fc1 fwd", R, F, H, true},    {"fc2 fwd", R, H, F, true},
                                  {"fc2 dgrad", R, F, H, false}, {"fc2 wgrad", H, F, R, false},
                                  {"fc1 dgrad", R, H, F, false}, {"fc1 wgrad", F, H, R, false}};

// Operands for every problem of kMlpTnGemms, each buffer sized for the largest and filled once: E4M3 A and
// B, a bf16 D, the two scale-inverses (1; their value does not change the time) in separate 16-byte slots
// (cuBLASLt refuses a scale pointer that is not), and the workspace.
struct TnOperands {
  static constexpr int64_t kMost = F * R;  // elements of the MLP's largest operand and output
  int64_t most;
  DeviceTensor a8, b8, d16, ones{{8}, "fp32"}, ws{{static_cast<int64_t>(cuda::kGemmWorkspace / 4)}, "fp32"};

  explicit TnOperands(CUstream s, int64_t most_elements = kMost)
      : most(most_elements), a8({most}, "e4m3"), b8({most}, "e4m3"), d16({most}, "bf16") {
    a8.upload(random_operand_bytes(static_cast<size_t>(most), true, 13), s);
    b8.upload(random_operand_bytes(static_cast<size_t>(most), true, 14), s);
    ones.upload_values({1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0}, s);
  }
  // The problem in bf16 on A and B (bf16 output).
  cuda::GemmCall bf16(const TnGemm& g, const void* a, const void* b) const {
    cuda::GemmCall c;
    c.m = g.m; c.n = g.n; c.k = g.k; c.dtype = ops::DType::bf16;
    c.a = a; c.b = b; c.d = ptr(d16); c.workspace = ptr(ws);
    return c;
  }
  // The problem in FP8: E4M3 x E4M3 -> bf16.
  cuda::GemmCall fp8(const TnGemm& g, bool fast_accum) const {
    cuda::GemmCall c = bf16(g, ptr(a8), ptr(b8));
    const auto sp = reinterpret_cast<const float*>(ones.ptr());
    c.fp8 = cuda::Fp8Gemm{ops::DType::e4m3, ops::DType::e4m3, ops::DType::bf16, sp, sp + 4, nullptr, nullptr, fast_accum};
    return c;
  }
  // The problem as fp8_block runs it: 1x128 block scales on A; on B 128x128 (forward, dgrad: a weight) or
  // 1x128 (wgrad: an activation's transposed copy); fp32 accumulation. The scale tensors (ones) are made
  // on first use, sized for the largest operand.
  cuda::GemmCall block(const TnGemm& g, CUstream s) {
    if (!sa) {
      const int64_t n = most / 128 + 128;
      sa = std::make_unique<DeviceTensor>(ops::Shape{n}, "fp32");
      sb = std::make_unique<DeviceTensor>(ops::Shape{n}, "fp32");
      sa->upload_values(std::vector<double>(static_cast<size_t>(n), 1.0), s);
      sb->upload_values(std::vector<double>(static_cast<size_t>(n), 1.0), s);
    }
    cuda::GemmCall c = fp8(g, false);
    c.fp8->a_scale_inv = reinterpret_cast<const float*>(sa->ptr());
    c.fp8->b_scale_inv = reinterpret_cast<const float*>(sb->ptr());
    c.fp8->a_scaling = cuda::Fp8Scaling::row128;
    c.fp8->b_scaling = std::string(g.name).find("wgrad") != std::string::npos ? cuda::Fp8Scaling::row128
                                                                             : cuda::Fp8Scaling::block128;
    return c;
  }
  std::unique_ptr<DeviceTensor> sa, sb;
};

// Bare cuBLASLt FP8: the six TN GEMMs of the FP8 MLP program, as the program runs them.
// GEMMs alone on bare cuBLASLt, each planned once, then timed back to back as one step.
double gemms_ms(const BenchEnv& env, const std::vector<cuda::GemmCall>& calls) {
  cuda::Blas blas;
  for (const auto& c : calls) blas.prepare(c, env.stream);
  return median_ms(env.stream, [&] {
    for (const auto& c : calls) blas.gemm(c, env.stream);
  }, env.opts);
}

double mlp_fp8_baseline_ms(const BenchEnv& env, bool block = false) {
  TnOperands o(env.stream);
  std::vector<cuda::GemmCall> calls;
  for (const auto& g : kMlpTnGemms) calls.push_back(block ? o.block(g, env.stream) : o.fp8(g, g.forward));
  return gemms_ms(env, calls);
}

// The MLP fwd+bwd under bf16, fp8_delayed and fp8_current in one run. FP8: every GEMM on E4M3 / E5M2
// operands; the input cast stands alone, bias+gelu writes the second GEMM's E4M3 input, dbias (and dgelu +
// dbias) write the E5M2 gradients. "cast W" rows cast the weights every step (one microbatch per optimizer
// step); the others reuse the copies (a later microbatch), and are compared with the bare FP8 GEMMs.
std::vector<Row> mlp_fp8(const BenchEnv& env) {
  std::vector<Row> rows;
  double bf16_ms = 0;
  for (const char* recipe : {"bf16", "fp8_delayed", "fp8_current", "fp8_block"}) {
    SeqBench b = mlp_seq(env, R, "gelu", recipe);
    const bool fp8 = std::string(recipe) != "bf16";
    for (bool unchanged : fp8 ? std::vector<bool>{false, true} : std::vector<bool>{false}) {
      Row r{fmt::format("mlp {} fwd+bwd{}", recipe, fp8 ? (unchanged ? "" : " (cast W)") : ""), kMlpShape,
            step_ms(env, b, unchanged), 0, kMlpFlops};
      if (!fp8) bf16_ms = r.ms;
      if (fp8 && bf16_ms > 0) r.speedup = bf16_ms / r.ms;
      if (fp8 && unchanged) r.baseline_ms = mlp_fp8_baseline_ms(env, std::string(recipe) == "fp8_block");
      rows.push_back(r);
    }
  }
  return rows;
}

// Whole blocks (issue 27): the Llama-style MLP half-block (fork "residual" -> rmsnorm -> linear 4096 ->
// 2*14336 -> swiglu -> linear 14336 -> 4096 -> add "residual") and the GPT-2-style one (fork -> layernorm ->
// linear 4096 -> 16384 -> bias -> gelu -> linear -> bias -> dropout -> add), each ONE sequence with a hidden
// channel, forward + backward at 8192 tokens, against their six GEMMs alone on bare cuBLASLt (bf16: the
// same problems in bf16; FP8: E4M3 x E4M3 -> bf16, as the FP8 program runs them).
constexpr int64_t kLlamaI = 14336;

struct Block {
  const char* name;
  int64_t n1, k2;  // linear 1: H -> n1; linear 2: k2 -> H
};
constexpr Block kLlamaBlock{"llama block", 2 * kLlamaI, kLlamaI}, kGpt2Block{"gpt2 block", F, F};

SeqBench block_seq(const BenchEnv& env, const Block& b, const char* recipe) {
  if (b.n1 == b.k2) {  // GPT-2
    const std::string ops = fmt::format(
        R"([{{"op": "make_extra_output", "channel": "residual"}}, {{"op": "layernorm"}},
            {{"op": "linear", "in_features": {0}, "out_features": {1}}}, {{"op": "bias"}},
            {{"op": "gelu", "approximate": "tanh"}}, {{"op": "linear", "in_features": {1}, "out_features": {0}}},
            {{"op": "bias"}}, {{"op": "dropout", "p": 0.1}}, {{"op": "add_extra_input", "channel": "residual"}}])",
        H, F);
    return SeqBench(env.ctx, env.stream, ops, {R, H}, {R, H},
                    {{1, "weight", {H}}, {1, "bias", {H}}, {2, "weight", {F, H}}, {3, "bias", {F}},
                     {5, "weight", {H, F}}, {6, "bias", {H}}},
                    0, 0, recipe);
  }
  const std::string ops = fmt::format(
      R"([{{"op": "make_extra_output", "channel": "residual"}}, {{"op": "rmsnorm"}},
          {{"op": "linear", "in_features": {0}, "out_features": {1}}}, {{"op": "swiglu"}},
          {{"op": "linear", "in_features": {2}, "out_features": {0}}}, {{"op": "add_extra_input", "channel": "residual"}}])",
      H, b.n1, b.k2);
  return SeqBench(env.ctx, env.stream, ops, {R, H}, {R, H},
                  {{1, "weight", {H}}, {2, "weight", {b.n1, H}}, {4, "weight", {H, b.k2}}}, 0, 0, recipe);
}

// The block's six GEMMs alone as TN problems D[M,N] = A[M,K] B[N,K]^T, bf16 or FP8 (fast accumulation in
// the forward only, as the FP8 program).
double block_gemms_ms(const BenchEnv& env, const Block& b, bool fp8, bool block = false) {
  const TnGemm gemms[] = {{"fc1 fwd", R, b.n1, H, true},    {"fc2 fwd", R, H, b.k2, true},
                          {"fc2 dgrad", R, b.k2, H, false}, {"fc2 wgrad", H, b.k2, R, false},
                          {"fc1 dgrad", R, H, b.n1, false}, {"fc1 wgrad", b.n1, H, R, false}};
  const int64_t most = std::max(b.n1, b.k2) * R;
  TnOperands o(env.stream, most);
  std::unique_ptr<DeviceTensor> a16, b16;
  if (!fp8) {
    a16 = std::make_unique<DeviceTensor>(ops::Shape{most}, "bf16");
    b16 = std::make_unique<DeviceTensor>(ops::Shape{most}, "bf16");
    a16->upload(random_operand_bytes(static_cast<size_t>(most), false, 11), env.stream);
    b16->upload(random_operand_bytes(static_cast<size_t>(most), false, 12), env.stream);
  }
  std::vector<cuda::GemmCall> calls;
  for (const auto& g : gemms)
    calls.push_back(block ? o.block(g, env.stream) : fp8 ? o.fp8(g, g.forward) : o.bf16(g, ptr(*a16), ptr(*b16)));
  return gemms_ms(env, calls);
}

std::vector<Row> blocks(const BenchEnv& env) {
  std::vector<Row> rows;
  for (const Block* b : {&kLlamaBlock, &kGpt2Block}) {
    const double flops = 3 * 2.0 * R * H * static_cast<double>(b->n1 + b->k2);
    const std::string shape = fmt::format("8192: 4096->{}->4096", b->n1);
    for (const char* recipe : {"bf16", "fp8_delayed", "fp8_block"}) {
      SeqBench s = block_seq(env, *b, recipe);
      const bool fp8 = std::string(recipe) != "bf16", block = std::string(recipe) == "fp8_block";
      Row r{fmt::format("{} {} fwd+bwd", b->name, recipe), shape, step_ms(env, s, fp8), 0, flops};
      r.baseline_ms = block_gemms_ms(env, *b, fp8, block);
      rows.push_back(r);
    }
  }
  return rows;
}

// Each of the MLP's six TN problems in bf16 and in FP8 E4M3 x E4M3 -> bf16 with fast accumulation; the FP8
// row reports its speed-up over the bf16 row.
std::vector<Row> gemm_fp8(const BenchEnv& env) {
  const CUstream s = env.stream;
  TnOperands o(s);
  DeviceTensor a16({TnOperands::kMost}, "bf16"), b16({TnOperands::kMost}, "bf16");
  a16.upload(random_operand_bytes(static_cast<size_t>(TnOperands::kMost), false, 11), s);
  b16.upload(random_operand_bytes(static_cast<size_t>(TnOperands::kMost), false, 12), s);
  cuda::Blas blas;
  std::vector<Row> rows;
  for (const auto& g : kMlpTnGemms) {
    const std::string shape = fmt::format("{}x{}x{} (MxNxK)", g.m, g.n, g.k);
    const double flops = 2.0 * g.m * g.n * g.k;
    const cuda::GemmCall c16 = o.bf16(g, ptr(a16), ptr(b16)), c8 = o.fp8(g, true);
    blas.prepare(c16, s);
    Row bf{fmt::format("gemm {} bf16", g.name), shape, median_ms(s, [&] { blas.gemm(c16, s); }, env.opts), 0, flops};
    blas.prepare(c8, s);
    Row f8{fmt::format("gemm {} e4m3", g.name), shape, median_ms(s, [&] { blas.gemm(c8, s); }, env.opts), 0, flops};
    f8.speedup = bf.ms / f8.ms;
    rows.push_back(bf);
    rows.push_back(f8);
  }
  return rows;
}

// FP8 cast + transpose (+ amax) of a linear's input at 8192x4096 and 8192x16384 (issue 32). The kernel runs
// as a step of a linear's training forward, so it is timed as that forward (the weight's FP8 copy reused:
// a later microbatch) minus the bare cuBLASLt FP8 GEMM of the same TN problem in the same run. The linear
// is narrow (256 outputs) so the subtracted GEMM is small against the cast. Bytes: the bf16 input read
// (twice under fp8_current: the amax pass, then the cast), the E4M3 codes and their transpose written.
std::vector<Row> cast_transpose(const BenchEnv& env) {
  constexpr int64_t N = 256;
  TnOperands o(env.stream);
  std::vector<Row> rows;
  for (const char* recipe : {"fp8_delayed", "fp8_current", "fp8_block"})
    for (int64_t K : {int64_t{4096}, int64_t{16384}}) {
      SeqBench b(env.ctx, env.stream,
                 fmt::format(R"([{{"op": "linear", "in_features": {}, "out_features": {}}}])", K, N), {R, K}, {R, N},
                 {{0, "weight", {N, K}}}, 0, 0, recipe);
      b.forward(env.stream, nullptr);  // plans, compiles and makes the weight's FP8 copy
      const double fwd = median_ms(env.stream, [&] {
        jf_saved saved = nullptr;
        b.forward(env.stream, &saved, true);
        jf_saved_release(saved, reinterpret_cast<jf_stream>(env.stream));
      }, env.opts);
      const bool block = std::string(recipe) == "fp8_block";
      const double gemm = gemms_ms(env, {block ? o.block(TnGemm{"fwd", R, N, K, true}, env.stream)
                                               : o.fp8(TnGemm{"fwd", R, N, K, true}, true)});
      const bool current = std::string(recipe) == "fp8_current";
      rows.push_back({fmt::format("cast_transpose {} (fwd {:.3f} - gemm {:.3f})", recipe, fwd, gemm),
                      fmt::format("{}x{} -> e4m3 + T", R, K), std::max(fwd - gemm, 1e-6),
                      (current ? 6.0 : 4.0) * R * K});
    }
  // fp8_block with the quantisation fused into its producer (issue 44), timed the same way: a layernorm
  // before the linear (its statistics kernel reads x, the block cast reads x again and normalises: 2 + 2
  // bytes read, 1 + 1 written per element), and bias + gelu before it (x read, gelu's input saved for the
  // backward, the codes and their transpose written: 2 + 2 + 1 + 1).
  struct Producer {
    const char* name;
    const char* ops;
    int64_t K;
    std::vector<ParamSpec> params;
  };
  const Producer producers[] = {
      {"layernorm", R"({{"op": "layernorm"}}, {{"op": "linear", "in_features": {0}, "out_features": {1}}})", 4096,
       {{0, "weight", {4096}}, {0, "bias", {4096}}, {1, "weight", {N, 4096}}}},
      {"bias+gelu", R"({{"op": "bias"}}, {{"op": "gelu", "approximate": "tanh"}}, {{"op": "linear", "in_features": {0}, "out_features": {1}}})",
       16384, {{0, "bias", {16384}}, {2, "weight", {N, 16384}}}},
  };
  for (const auto& p : producers) {
    SeqBench b(env.ctx, env.stream, "[" + fmt::format(fmt::runtime(p.ops), p.K, N) + "]", {R, p.K}, {R, N}, p.params, 0,
               0, "fp8_block");
    b.forward(env.stream, nullptr);
    const double fwd = median_ms(env.stream, [&] {
      jf_saved saved = nullptr;
      b.forward(env.stream, &saved, true);
      jf_saved_release(saved, reinterpret_cast<jf_stream>(env.stream));
    }, env.opts);
    const double gemm = gemms_ms(env, {o.block(TnGemm{"fwd", R, N, p.K, true}, env.stream)});
    rows.push_back({fmt::format("{} -> fp8_block (fwd {:.3f} - gemm {:.3f})", p.name, fwd, gemm),
                    fmt::format("{}x{} -> e4m3 + T", R, p.K), std::max(fwd - gemm, 1e-6), 6.0 * R * p.K});
  }
  return rows;
}

// The median of replays of one captured forward (as a host holding a CUDA graph of the call runs it).
double graph_ms(const BenchEnv& env, jf_sequence seq, const jf_forward_args& a) {
  const auto& d = cuda::driver();
  const CUstream s = env.stream;
  CUgraph graph = nullptr;
  CUgraphExec exec = nullptr;
  cuda::check(d.cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), "cuStreamBeginCapture");
  jf_status st = jf_forward(seq, &a, nullptr, reinterpret_cast<jf_stream>(s));
  cuda::check(d.cuStreamEndCapture(s, &graph), "cuStreamEndCapture");
  ok(st, "jf_forward (captured)");
  cuda::check(d.cuGraphInstantiateWithFlags(&exec, graph, 0), "cuGraphInstantiate");
  const double ms = median_ms(s, [&] { cuda::check(d.cuGraphLaunch(exec, s), "cuGraphLaunch"); }, env.opts);
  d.cuGraphExecDestroy(exec);
  d.cuGraphDestroy(graph);
  return ms;
}

// Inference of the MLP at decode size M, per call: eager (host work on the critical path at small M) and
// as a replayed CUDA graph of the same call (ABI 2: prepared, host workspace, nothing allocated). The floor
// is the weights read once at the copy bandwidth (bytes column: weights + activations).
std::vector<Row> decode_at(const BenchEnv& env, int64_t M) {
  const CUstream s = env.stream;
  SeqBench b = mlp_seq(env, M, "gelu");
  const int64_t shape[2] = {M, H};
  ok(jf_sequence_prepare(b.seq, shape, 2, 0, reinterpret_cast<jf_stream>(s)), "jf_sequence_prepare");
  jf_program_info info{};
  ok(jf_sequence_info(b.seq, shape, 2, 0, &info), "jf_sequence_info");
  DeviceTensor ws({static_cast<int64_t>(info.forward_workspace_bytes / 2 + 1)}, "bf16");
  auto a = b.forward_args(false);
  a.workspace = ptr(ws);
  a.workspace_bytes = info.forward_workspace_bytes;
  const double bytes = e * (2.0 * H * F + F + H) + e * 2.0 * M * H;
  const std::string shape_s = fmt::format("{}: 4096->16384->4096", M);
  std::vector<Row> rows;
  rows.push_back({fmt::format("decode M={} eager", M), shape_s, median_ms(s, [&] {
                    ok(jf_forward(b.seq, &a, nullptr, reinterpret_cast<jf_stream>(s)), "jf_forward");
                  }, env.opts), bytes});
  rows.push_back({fmt::format("decode M={} graph", M), shape_s, graph_ms(env, b.seq, a), bytes});
  return rows;
}

std::vector<Row> decode(const BenchEnv& env) {
  std::vector<Row> rows;
  for (int64_t M : {int64_t{1}, int64_t{16}, int64_t{128}}) {
    auto at = decode_at(env, M);
    rows.insert(rows.end(), at.begin(), at.end());
  }
  return rows;
}

// Off by default: decode (its rows measure call overhead, not kernels), and the long FP8 comparisons.
const BenchCase kCases[] = {
    {"bias_gelu", true, bias_gelu},
    {"dgelu_dbias", true, dgelu_dbias},
    {"layernorm", true, [](const BenchEnv& env) { return norm_sweep(env, "layernorm"); }},
    {"rmsnorm", true, [](const BenchEnv& env) { return norm_sweep(env, "rmsnorm"); }},
    {"layernorm_fp8_current", true, [](const BenchEnv& env) { return layernorm_fp8(env, "fp8_current"); }},
    {"layernorm_fp8_delayed", true, [](const BenchEnv& env) { return layernorm_fp8(env, "fp8_delayed"); }},
    {"swiglu", true, swiglu},
    {"bias_dropout_add", true, bias_dropout_add},
    {"linear_bias_gelu", true, linear_bias_gelu},
    {"mlp", true, [](const BenchEnv& env) { return mlp_train(env, "gelu", "mlp fwd+bwd"); }},
    {"mlp_fp8", false, mlp_fp8},
    {"mlp_relu", true, [](const BenchEnv& env) { return mlp_train(env, "relu", "mlp_relu fwd+bwd"); }},
    {"gemm_fp8", false, gemm_fp8},
    {"cast_transpose", false, cast_transpose},
    {"blocks", false, blocks},
    {"decode", false, decode},
};

}  // namespace

std::span<const BenchCase> bench_cases() { return kCases; }

}  // namespace jitfuse::cli::bench
