// Every kernel the built-in rules produce (forward and backward, all recipes; each variant of each source:
// the vector program, and the scalar one under -DJF_SCALAR) compiles with NVRTC for sm_80 and sm_90a — no
// GPU needed, so CI runs it.
#include <catch2/catch.hpp>

#include <set>

#include "cache/kernel_cache.hpp"
#include "common/env.hpp"
#include "common/error.hpp"
#include "exec/run/executor.hpp"
#include "exec/lower/lowering.hpp"
#include "ops/sequence.hpp"
#include "rules/rule.hpp"
#include "support/builtin_cases.hpp"

using namespace jitfuse;


TEST_CASE("every kernel of the built-in rules compiles with NVRTC for sm_80 and sm_90a", "[nvrtc]") {
  test::KernelRig rig;
  size_t compiled = 0;
  for (const char* arch : {"sm_80", "sm_90a"})
    for (const auto& c : test::builtin_cases())
      compiled += rig.each_new_request(c, arch, [&](const codegen::KernelSpec& spec, const codegen::Generated& g,
                                                    bool vector, const cache::KernelRequest& req) {
          INFO(arch << " " << c.id() << " kernel " << req.meta.dump() << (vector ? " vector" : " scalar"));
          auto res = rig.lib.compiler()(req);
          CHECK(res.cubin.size() > 1000);
          // One program per variant, every entry point a launch of it may need: a code section for each,
          // and none for the other variant.
          for (const auto& fn : req.meta["functions"]) {
            INFO("entry point " << fn.get<std::string>());
            CHECK(res.cubin.find(".text." + fn.get<std::string>() + '\0') != std::string::npos);
          }
          CHECK(req.meta["functions"][0] == g.entry(vector));
          if (spec.vec) CHECK(res.cubin.find(".text." + g.entry(!vector) + '\0') == std::string::npos);
        });
  INFO("compiled " << compiled << " distinct kernels");
  CHECK(compiled > 100);
}

TEST_CASE("an uncompilable user template fails with the NVRTC log, not a crash", "[nvrtc]") {
  exec::TemplateStore templates;
  templates.add("user/broken.cuh", "struct jf_op_broken { static __device__ float fwd(float x) { return x +; } };\n");
  cache::KernelCache cache(cache::Config{});
  exec::KernelLibrary lib(cache, templates);
  codegen::KernelSpec spec;
  spec.dtype = "fp32";
  spec.cols = 64;
  spec.headers["user/broken.cuh"] = "";
  codegen::Stage st;
  st.op = 0;
  st.op_kind = "broken";
  st.functor = "jf_op_broken";
  spec.pre.push_back(st);
  spec.label = "broken";
  auto req = lib.request(spec, exec::target_for_arch("sm_90a"), {}, true);
  try {
    lib.compiler()(req);
    FAIL("expected a compile error");
  } catch (const Error& e) {
    CHECK(e.status() == Status::compile_error);
    std::string msg = e.what();
    CHECK(msg.find("Compiler log") != std::string::npos);
    CHECK(msg.find("expected an expression") != std::string::npos);
  }
}
