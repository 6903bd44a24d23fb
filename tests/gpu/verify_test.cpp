// JITFUSE_VERIFY on the GPU: every fused group of a training sequence is compared with its unfused ops
// (nothing differs for the built-in rules), and an ill-conditioned user op whose fused result legitimately
// differs (fp32 intermediates vs bf16 rounding between ops) is reported with group, rule, tensor and error.
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>

#include "api/handles.hpp"
#include "gpu/gpu_check.hpp"
#include "harness/device_tensor.hpp"

using namespace jitfuse;
using jitfuse::test::run_check;

namespace {

// A context created with JITFUSE_VERIFY=1 (the variable is read when the context is created).
jf_context verifying_context() {
  setenv("JITFUSE_VERIFY", "1", 1);
  jf_context ctx = nullptr;
  REQUIRE(jf_context_create(&ctx) == JF_OK);
  unsetenv("JITFUSE_VERIFY");
  return ctx;
}

}  // namespace

TEST_CASE("JITFUSE_VERIFY compares every fused group with the unfused ops and finds no difference", "[verify]") {
  jf_context ctx = verifying_context();
  const auto* log = api::context_of(ctx).verify_log();
  REQUIRE(log);
  const char* mlp = R"([{"op": "layernorm"}, {"op": "linear", "in_features": 64, "out_features": 128}, {"op": "bias"},
                        {"op": "gelu", "approximate": "tanh"}, {"op": "linear", "in_features": 128, "out_features": 64},
                        {"op": "bias"}, {"op": "dropout", "p": 0.1, "seed": 5}, {"op": "add_extra_input"}])";
  for (const char* recipe : {"fp32", "bf16"}) run_check(test::seq_json(mlp), recipe, {96, 64}, true, false, 1, ctx);
  INFO(log->first);
  CHECK(log->groups_compared >= 8);  // forward and backward groups of both recipes
  CHECK(log->tensors_compared > log->groups_compared);
  CHECK(log->failures == 0);
  jf_context_destroy(ctx);
}

TEST_CASE("JITFUSE_VERIFY follows channels: a fused fork reads the gradient its readers produced", "[verify]") {
  jf_context ctx = verifying_context();
  const auto* log = api::context_of(ctx).verify_log();
  REQUIRE(log);
  // Llama's half-block (fork_norm / norm_residual_bwd read and write the channel; the add's backward is a
  // pass-through) and a fan-out whose readers run unfused beside a fused fork.
  const char* llama = R"([{"op": "make_extra_output", "channel": "r"}, {"op": "rmsnorm"},
                          {"op": "linear", "in_features": 64, "out_features": 192}, {"op": "swiglu"},
                          {"op": "linear", "in_features": 96, "out_features": 64}, {"op": "add_extra_input", "channel": "r"}])";
  const char* fan = R"([{"op": "make_extra_output", "channel": "r"}, {"op": "layernorm"}, {"op": "gelu"},
                        {"op": "add_extra_input", "channel": "r"}, {"op": "linear", "in_features": 64, "out_features": 64},
                        {"op": "add_extra_input", "channel": "r"}])";
  for (const char* ops_json : {llama, fan})
    for (const char* recipe : {"fp32", "bf16"}) run_check(test::seq_json(ops_json), recipe, {96, 64}, true, false, 1, ctx);
  INFO(log->first);
  CHECK(log->groups_compared >= 8);
  CHECK(log->failures == 0);
  jf_context_destroy(ctx);
}

TEST_CASE("JITFUSE_VERIFY reports the first fused group that differs beyond the tolerance", "[verify]") {
  // frac(1000 x): fused, bias + frac sees x + b in fp32; unfused, x + b is rounded to bf16 first.
  const auto dir = std::filesystem::temp_directory_path() / "jf_verify_frac";
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "frac.cuh") << "#pragma once\nstruct jf_op_frac {\n"
                                     "  static __device__ __forceinline__ float fwd(float x) { float z = 1000.f * x; return z - floorf(z); }\n"
                                     "  static __device__ __forceinline__ float bwd(float x, float dy) { return 1000.f * dy; }\n};\n";
  std::ofstream(dir / "rules.json") << R"J({"format": "jitfuse.rules/1",
    "ops": [{"name": "frac", "math": "y = frac(1000 x)", "template": "frac.cuh", "functor": "jf_op_frac", "saves": "input", "arity": 1}],
    "rules": [{"name": "bias_frac", "math": "y = frac(1000 (x + b))", "pass": "forward", "priority": 20,
               "pattern": ["bias", "frac"], "impl": {"kind": "generated", "skeleton": "elementwise"}}]})J";
  jf_context ctx = verifying_context();
  int errors = -1;
  REQUIRE(jf_context_load_rules(ctx, dir.c_str(), &errors) == JF_OK);
  REQUIRE(errors == 0);
  jf_sequence seq = nullptr;
  REQUIRE(jf_sequence_create(ctx, test::seq_json(R"([{"op": "bias"}, {"op": "frac"}])").c_str(), "bf16", &seq) == JF_OK);
  harness::DeviceTensor x({64, 256}, "bf16"), b({256}, "bf16"), y({64, 256}, "bf16");
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<double> u(-1, 1);
  std::vector<double> xv(64 * 256), bv(256);
  for (auto& v : xv) v = u(rng);
  for (auto& v : bv) v = u(rng);
  x.upload_values(xv, nullptr);
  b.upload_values(bv, nullptr);
  y.poison(nullptr);
  REQUIRE(test::forward_simple(seq, x.dl(), y.dl(), {{0, "bias", b.dl()}}, false, nullptr) == JF_OK);
  const auto* log = api::context_of(ctx).verify_log();
  INFO(log->first);
  CHECK(log->failures == 1);
  CHECK(log->first.find("forward group [0, 2) rule 'bias_frac': output differs from the unfused ops") !=
        std::string::npos);
  CHECK(log->first.find("x the tolerance") != std::string::npos);
  jf_sequence_destroy(seq);
  jf_context_destroy(ctx);
}
