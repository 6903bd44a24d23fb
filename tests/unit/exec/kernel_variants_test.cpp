// One NVRTC program per kernel (issue 14, cold start): a kernel's 16-byte vector and scalar variants are
// two entry points of one source, so the transformer layer's 13 distinct kernels are 13 programs, cache
// entries and modules, not 26; each variant is the same text under its own JF_VEC.
#include <catch2/catch.hpp>

#include <set>

#include "cache/kernel_cache.hpp"
#include "exec/kernels.hpp"
#include "support/deep_model.hpp"

using namespace jitfuse;

namespace {

// The text of the kernel whose signature declares `name`, from `#define JF_VEC` before it to the line
// before the next `#define`/`#undef JF_VEC` or the next kernel (a finalize or FP8 update kernel).
std::string variant_text(const std::string& source, const std::string& name) {
  const size_t sig = source.find(" " + name + "(");
  REQUIRE(sig != std::string::npos);
  const size_t begin = source.rfind("#define JF_VEC", sig);
  REQUIRE(begin != std::string::npos);
  const size_t body = source.find('\n', begin) + 1;
  size_t end = source.find("#undef JF_VEC", body);
  if (end == std::string::npos) end = source.find("\n// ", body);  // the comment before a follow-up kernel
  if (end == std::string::npos) end = source.size();
  return source.substr(body, end - body);
}

size_t count(const std::string& s, const std::string& what) {
  size_t n = 0;
  for (size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + 1)) ++n;
  return n;
}

}  // namespace

TEST_CASE("the transformer layer compiles 13 programs, each with both variants", "[exec][variants]") {
  const test::Planned layer = test::plan_layers(1, "bf16", true);
  const auto kernels = exec::program_kernels(*layer.program);
  // forward and backward: 13 distinct kernels, one program each (26 programs when each variant was its own)
  CHECK(kernels.size() == 13);
  for (const auto& [spec, meta] : kernels) {
    const codegen::Generated g = codegen::generate(spec);
    INFO(g.kernel);
    REQUIRE(spec.vec);  // 1024 columns: every kernel may take the vector path
    CHECK(g.vec);
    CHECK(g.scalar_kernel == g.kernel + "_scalar");
    CHECK(g.entry(true) == g.kernel);
    CHECK(g.entry(false) == g.scalar_kernel);
    CHECK(count(g.source, " " + g.kernel + "(") == 1);
    CHECK(count(g.source, " " + g.scalar_kernel + "(") == 1);
    CHECK(count(g.source, "#define JF_VEC true\n") == 1);
    CHECK(count(g.source, "#define JF_VEC false\n") == 1);
    // The same kernel text under both names: only JF_VEC tells them apart, so each variant compiles to
    // what it compiled to as a program of its own.
    std::string scalar = variant_text(g.source, g.scalar_kernel);
    scalar.replace(scalar.find(" " + g.scalar_kernel + "("), g.scalar_kernel.size() + 2, " " + g.kernel + "(");
    CHECK(variant_text(g.source, g.kernel) == scalar);
    // Follow-up kernels are written once, after both variants.
    for (const auto& f : g.finalize) CHECK(count(g.source, " " + f.kernel + "(") == 1);
  }
}

TEST_CASE("a shape without a vector path has only the scalar entry point", "[exec][variants]") {
  codegen::KernelSpec spec;
  spec.dtype = "bf16";
  spec.cols = 66;  // not a multiple of 8
  spec.vec = false;
  codegen::Stage st;
  st.op = 0;
  st.op_kind = "gelu";
  st.functor = "jf_op_gelu_tanh";
  spec.pre.push_back(st);
  spec.headers["ops/activations.cuh"] = "";
  spec.label = "gelu";
  const codegen::Generated g = codegen::generate(spec);
  CHECK_FALSE(g.vec);
  CHECK(count(g.source, " " + g.kernel + "(") == 0);
  CHECK(count(g.source, " " + g.scalar_kernel + "(") == 1);
  CHECK(count(g.source, "#define JF_VEC true") == 0);
  CHECK(count(g.source, "#define JF_VEC false\n") == 1);

  exec::TemplateStore templates;
  cache::KernelCache cache(cache::Config{});
  exec::KernelLibrary lib(cache, templates);
  const auto req = lib.request(g, spec, exec::Target{"sm_90a", {"--gpu-architecture=sm_90a"}, "13.0"}, {});
  CHECK(req.meta["functions"] == nlohmann::json::array({g.scalar_kernel}));
}

TEST_CASE("a kernel's cache metadata lists every entry point of its module", "[exec][variants]") {
  const test::Planned layer = test::plan_layers(1, "bf16", true);
  exec::TemplateStore templates;
  cache::KernelCache cache(cache::Config{});
  exec::KernelLibrary lib(cache, templates);
  const exec::Target target{"sm_90a", {"--gpu-architecture=sm_90a"}, "13.0"};
  std::set<std::string> keys;
  for (const auto& [spec, meta] : exec::program_kernels(*layer.program)) {
    const codegen::Generated g = codegen::generate(spec);
    const auto req = lib.request(g, spec, target, meta);
    keys.insert(cache::cache_key(req));
    std::vector<std::string> want = {g.kernel, g.scalar_kernel};
    for (const auto& f : g.finalize) want.push_back(f.kernel);
    if (!g.fp8_update.empty()) want.push_back(g.fp8_update);
    CHECK(req.meta["functions"] == nlohmann::json(want));
    // The same request from the spec alone (what warmup and prefetch build): one key, one cache entry.
    CHECK(cache::cache_key(lib.request(spec, target, meta)) == cache::cache_key(req));
  }
  CHECK(keys.size() == 13);
}
