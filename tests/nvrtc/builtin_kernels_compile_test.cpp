// Every kernel the built-in rules produce (forward and backward, vector and scalar variants, all
// recipes) compiles with NVRTC for sm_80 and sm_90a — no GPU needed, so CI runs it.
#include <catch2/catch.hpp>

#include <set>

#include "cache/kernel_cache.hpp"
#include "common/env.hpp"
#include "common/error.hpp"
#include "exec/executor.hpp"
#include "exec/lowering.hpp"
#include "ops/sequence.hpp"
#include "rules/rule.hpp"

using namespace jitfuse;

namespace {

// One sequence per built-in rule pattern, plus every op alone (the unfused kernels).
const char* kSequences[] = {
    R"([{"op": "bias"}, {"op": "gelu"}])",
    R"([{"op": "bias"}, {"op": "gelu", "approximate": "none"}])",
    R"([{"op": "bias"}, {"op": "relu"}])",
    R"([{"op": "bias"}, {"op": "silu"}])",
    R"([{"op": "bias"}, {"op": "qgelu"}])",
    R"([{"op": "bias"}, {"op": "srelu"}])",
    R"([{"op": "bias"}, {"op": "swiglu"}])",
    R"([{"op": "bias"}, {"op": "geglu"}])",
    R"([{"op": "bias"}, {"op": "reglu"}])",
    R"([{"op": "swiglu"}, {"op": "scale", "value": 0.5}])",
    R"([{"op": "bias"}, {"op": "dropout", "p": 0.1}, {"op": "add_extra_input"}])",
    R"([{"op": "add_extra_input"}, {"op": "layernorm"}])",
    R"([{"op": "add_extra_input"}, {"op": "rmsnorm", "zero_centered_gamma": true}])",
    R"([{"op": "layernorm"}, {"op": "gelu"}, {"op": "scale", "value": 2.0}, {"op": "dropout", "p": 0.2}])",
    R"([{"op": "rmsnorm"}, {"op": "silu"}])",
    R"([{"op": "make_extra_output"}, {"op": "layernorm"}])",
    R"([{"op": "make_extra_output"}, {"op": "rmsnorm"}])",
    R"([{"op": "gelu"}, {"op": "scale", "value": 3.0}, {"op": "add_extra_input"}])",
    R"([{"op": "linear", "in_features": 64, "out_features": 64}, {"op": "bias"}, {"op": "gelu"}])",
    R"([{"op": "linear", "in_features": 64, "out_features": 64}, {"op": "bias"}, {"op": "relu"}])",
    R"([{"op": "linear", "in_features": 64, "out_features": 64}, {"op": "silu"}])",
    R"([{"op": "make_extra_output"}, {"op": "linear", "in_features": 64, "out_features": 64}, {"op": "scale", "value": 0.5}])",
    R"([{"op": "identity"}, {"op": "quantize"}, {"op": "reshape", "shape": [-1]}])",
    R"([{"op": "dropout", "p": 0.3, "training": false}])",
};

// Under the FP8 recipes (quantize is the E4M3 cast; current scaling adds an amax pass).
const char* kFp8Sequences[] = {
    R"([{"op": "layernorm"}, {"op": "quantize"}])",
    R"([{"op": "rmsnorm"}, {"op": "quantize"}])",
    R"([{"op": "bias"}, {"op": "gelu"}, {"op": "quantize"}])",
    R"([{"op": "swiglu"}, {"op": "quantize"}])",
    R"([{"op": "add_extra_input"}, {"op": "dropout", "p": 0.1}, {"op": "quantize"}])",
};

}  // namespace

TEST_CASE("every kernel of the built-in rules compiles with NVRTC for sm_80 and sm_90a", "[nvrtc]") {
  rules::RuleSet rs = rules::RuleSet::with_builtins();
  exec::TemplateStore templates;
  cache::KernelCache cache(cache::Config{});
  exec::KernelLibrary lib(cache, templates);
  std::set<std::string> seen;
  size_t compiled = 0;
  for (const char* arch : {"sm_80", "sm_90a"}) {
    exec::Target target = exec::target_for_arch(arch);
    std::vector<std::pair<const char*, std::vector<const char*>>> cases;
    for (const char* ops_json : kSequences) cases.push_back({ops_json, {"fp32", "fp16", "bf16"}});
    for (const char* ops_json : kFp8Sequences) cases.push_back({ops_json, {"fp8_delayed", "fp8_current"}});
    for (const auto& [ops_json, recipes] : cases) {
      std::string text = std::string(R"({"format": "jitfuse.sequence/1", "name": "n", "ops": )") + ops_json + "}";
      auto def = ops::parse_sequence(text, "<nvrtc test>", rs.registry());
      for (const char* recipe : recipes)
        for (bool training : {true, false})
          for (ops::Shape shape : {ops::Shape{16, 64}, ops::Shape{3, 66}}) {
            // Odd widths exercise the scalar paths; linear's in_features fixes its input width.
            if (ops::cols_of(shape) != 64 && std::string(ops_json).find("linear") != std::string::npos) continue;
            auto ops = ops::infer(def, shape);
            const ops::Recipe rc = ops::parse_recipe(recipe);
            fuser::PlanInputs in{recipe, ops::dtype_name(rc.dtype), arch[3] == '9' ? 90 : 80, training, false};
            auto plan = fuser::plan(ops, in, rs, exec::legality());
            for (auto [spec, meta] : exec::plan_kernel_specs(ops, plan, rc, training, "n"))
              for (bool vec : {true, false}) {
                if (vec && !spec.vec) continue;
                spec.vec = vec;
                auto req = lib.request(spec, target, meta);
                if (!seen.insert(cache::cache_key(req)).second) continue;
                INFO(arch << " " << recipe << " " << ops_json << " kernel " << meta.dump());
                auto res = lib.compiler()(req);
                CHECK(res.cubin.size() > 1000);
                ++compiled;
              }
          }
    }
  }
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
  auto req = lib.request(spec, exec::target_for_arch("sm_90a"), {});
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
