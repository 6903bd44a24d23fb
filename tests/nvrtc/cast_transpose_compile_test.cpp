// Every variant of the cast_transpose skeleton (forward / backward, no stages / bias + gelu, E4M3 / E5M2,
// delayed / current scaling's cast pass / its amax pass, bf16 / fp16, vector and scalar programs) compiles
// with NVRTC for sm_80 (the integer FP8 conversions) and sm_90a (the cvt.satfinite ones).
#include <catch2/catch.hpp>

#include <set>

#include "cache/kernel_cache.hpp"
#include "exec/run/kernels.hpp"
#include "support/cast_transpose_cases.hpp"

using namespace jitfuse;

namespace {

void compile_all(const char* arch) {
  exec::TemplateStore templates;
  cache::KernelCache cache(cache::Config{});
  exec::KernelLibrary lib(cache, templates);
  const exec::Target target = exec::target_for_arch(arch);
  std::set<std::string> seen;
  size_t compiled = 0;
  for (const auto& c : test::cast_transpose_cases()) {
    const codegen::KernelSpec spec = test::cast_transpose_spec(c);
    const codegen::Generated g = codegen::generate(spec);
    for (bool vector : exec::variants_of(spec, exec::Variants::all)) {
      auto req = lib.request(g, spec, target, {}, vector);
      if (!seen.insert(cache::cache_key(req)).second) continue;  // e.g. an amax pass is the same for both formats
      INFO(arch << " " << c.name() << (vector ? " vector" : " scalar"));
      auto res = lib.compiler()(req);
      CHECK(res.cubin.size() > 1000);
      for (const auto& fn : req.meta["functions"]) {
        INFO("entry point " << fn.get<std::string>());
        CHECK(res.cubin.find(".text." + fn.get<std::string>() + '\0') != std::string::npos);
      }
      ++compiled;
    }
  }
  INFO("compiled " << compiled << " distinct programs");
  CHECK(compiled > 100);
}

}  // namespace

TEST_CASE("every cast_transpose variant compiles with NVRTC for sm_80", "[nvrtc][cast_transpose]") { compile_all("sm_80"); }

TEST_CASE("every cast_transpose variant compiles with NVRTC for sm_90a", "[nvrtc][cast_transpose]") { compile_all("sm_90a"); }
