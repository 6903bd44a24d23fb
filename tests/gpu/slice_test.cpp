// The first slice end to end: [bias, gelu(tanh)] matched by a rule, stitched, NVRTC-compiled, run on
// the caller's stream and checked against float64, fused and with the kill switch, in all recipes.
#include "gpu/gpu_check.hpp"

using namespace jitfuse;
using jitfuse::test::run_check;

static const std::string kBiasGelu = test::seq_json(R"([{"op": "bias"}, {"op": "gelu", "approximate": "tanh"}])");

TEST_CASE("bias + gelu fused matches the float64 reference", "[slice]") {
  for (const char* recipe : {"fp32", "fp16", "bf16"}) {
    for (ops::Shape shape : {ops::Shape{3, 5}, ops::Shape{5, 1, 8}, ops::Shape{64, 32}, ops::Shape{8192, 16384}}) {
      run_check(kBiasGelu, recipe, shape, /*backward=*/ops::numel(shape) < 1000000);
    }
  }
}

TEST_CASE("bias + gelu unfused (JITFUSE_DISABLE_FUSION=1) matches the reference", "[slice]") {
  test::ScopedEnv off("JITFUSE_DISABLE_FUSION", "1");
  for (const char* recipe : {"fp32", "fp16", "bf16"})
    for (ops::Shape shape : {ops::Shape{3, 5}, ops::Shape{5, 1, 8}, ops::Shape{8192, 16384}})
      run_check(kBiasGelu, recipe, shape, ops::numel(shape) < 1000000);
}

TEST_CASE("bias + gelu on misaligned pointers takes the scalar path and stays right", "[slice]") {
  for (const char* recipe : {"fp32", "bf16"})
    run_check(kBiasGelu, recipe, {64, 32}, true, /*misalign=*/true);
}

// Issue 14: prepare compiles and loads only the vector variants a plan launches; the first call whose
// tensors sit one element off a 16-byte boundary compiles the scalar variants then, once, and is right.
TEST_CASE("a call misaligned by one element after a vector-only prepare compiles the scalar variants once",
          "[slice]") {
  test::FreshContext fresh;
  for (const char* recipe : {"fp32", "bf16"}) {
    INFO(recipe);
    const uint64_t before = fresh.compiled();
    // Aligned: prepares (forward + backward kernels, vector variants only) and runs the vector path.
    run_check(kBiasGelu, recipe, {64, 32}, true, /*misalign=*/false, 1, fresh.ctx);
    const uint64_t vec = fresh.compiled() - before;
    CHECK(vec >= 2);
    // Misaligned by one element (input, output, bias, gradients): every kernel's scalar variant, compiled
    // by this call, once each; the numerics against the float64 reference as always.
    run_check(kBiasGelu, recipe, {64, 32}, true, /*misalign=*/true, 2, fresh.ctx);
    CHECK(fresh.compiled() - before == 2 * vec);
    // From now on a lookup: no compile, the same results.
    run_check(kBiasGelu, recipe, {64, 32}, true, /*misalign=*/true, 3, fresh.ctx);
    run_check(kBiasGelu, recipe, {64, 32}, true, /*misalign=*/false, 4, fresh.ctx);
    CHECK(fresh.compiled() - before == 2 * vec);
  }
}

TEST_CASE("the fused plan really fuses and explain says so", "[slice]") {
  jf_sequence seq = nullptr;
  REQUIRE(jf_sequence_create(test::shared_context(), kBiasGelu.c_str(), "bf16", &seq) == JF_OK);
  int64_t shape[2] = {64, 32};
  const char* js = nullptr;
  REQUIRE(jf_sequence_explain(seq, shape, 2, 1, 90, &js) == JF_OK);
  auto j = nlohmann::json::parse(js);
  REQUIRE(j["forward"].size() == 1);
  CHECK(j["forward"][0]["rule"] == "bias_act");
  jf_sequence_destroy(seq);
}
