// The moe skeleton's kernels (issue 43: routing count / scan / scatter, permute and its backward, unpermute
// with the routing probabilities and its backward) compile with NVRTC for sm_80 and sm_90a at the issue's
// shapes (Mixtral-like E=8 top-2 h4096; Qwen3-MoE-like E=128 top-8 h2048 with a capacity; OLMoE-like E=64
// top-8), int64 and int32 routing indices, fp32 and bf16 probabilities, in bf16 and fp32; vector and scalar
// programs, none in local memory. No GPU needed (the numerics: tests/gpu/moe_test.cpp).
#include <fmt/format.h>

#include <catch2/catch.hpp>

#include "cuda/cubin_info.hpp"
#include "support/builtin_cases.hpp"
#include "support/moe_cases.hpp"

using namespace jitfuse;
using K = codegen::MoeSpec::Kernel;


TEST_CASE("every moe kernel compiles with NVRTC for sm_80 and sm_90a", "[nvrtc][moe]") {
  test::KernelRig rig;
  const K kernels[] = {K::count, K::scan, K::scatter, K::permute, K::permute_bwd, K::unpermute, K::unpermute_bwd};
  struct Shape {
    int64_t e, k, h, capacity;
  };
  const Shape shapes[] = {{8, 2, 4096, -1}, {128, 8, 2048, 640}, {64, 8, 2048, -1}};
  size_t n = 0;
  for (const char* arch : {"sm_80", "sm_90a"}) {
    const exec::Target target = exec::target_for_arch(arch);
    for (const auto& sh : shapes)
      for (K kernel : kernels)
        for (const char* dtype : {"bf16", "fp32"})
          for (int variant = 0; variant < 2; ++variant) {
            auto spec = test::moe_spec(kernel, sh.e, sh.k, sh.h, dtype);
            spec.moe->capacity = sh.capacity;
            spec.moe->idx_i64 = variant == 0;
            spec.moe->probs_f32 = variant == 0;
            spec.moe->residual = variant == 1;
            const codegen::Generated g = codegen::generate(spec);
            for (bool vector : {true, false}) {
              INFO(arch << " " << g.kernel << " E" << sh.e << " k" << sh.k << " h" << sh.h << " " << dtype
                        << " variant " << variant << (vector ? " vector" : " scalar"));
              const auto req = rig.lib.request(g, spec, target, nlohmann::json::object(), vector);
              const cuda::CubinResources r = cuda::read_cubin_resources(rig.lib.compiler()(req).cubin);
              INFO(r.error);
              REQUIRE(r.error.empty());
              for (const auto& kr : r.kernels) {
                INFO(kr.name << ": " << kr.registers << " registers, frame " << kr.frame_bytes << " B");
                CHECK(kr.frame_bytes == 0);
              }
              ++n;
            }
          }
  }
  CHECK(n == 2 * 3 * 7 * 2 * 2 * 2);
}

TEST_CASE("the padded layout's moe kernels compile with NVRTC for sm_80 and sm_90a", "[nvrtc][moe]") {
  test::KernelRig rig;
  const K kernels[] = {K::count, K::scan, K::scatter, K::permute, K::permute_bwd, K::unpermute, K::unpermute_bwd};
  size_t n = 0;
  for (const char* arch : {"sm_80", "sm_90a"}) {
    const exec::Target target = exec::target_for_arch(arch);
    for (K kernel : kernels) {
      auto spec = test::moe_spec(kernel, 128, 8, 2048, "bf16");
      spec.moe->capacity = 640;  // Qwen3-MoE-like, 8192 tokens: capacity factor 1.25
      spec.moe->padded = true;
      const codegen::Generated g = codegen::generate(spec);
      INFO(arch << " " << g.kernel);
      if (kernel == K::permute || kernel == K::unpermute_bwd)
        CHECK_THAT(g.source, Catch::Contains("(p % 640) < rt.splits[p / 640]") ||
                                 Catch::Contains("(q % 640) < rt.splits[q / 640]"));
      const auto req = rig.lib.request(g, spec, target, nlohmann::json::object(), true);
      const cuda::CubinResources r = cuda::read_cubin_resources(rig.lib.compiler()(req).cubin);
      INFO(r.error);
      REQUIRE(r.error.empty());
      for (const auto& kr : r.kernels) CHECK(kr.frame_bytes == 0);
      ++n;
    }
  }
  CHECK(n == 2 * 7);
}
