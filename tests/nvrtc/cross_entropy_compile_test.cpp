// The cross_entropy kernels — unfused (row forward, reduction, row backward) and the joint head's (chunk kernel,
// reduction, gradient scaling, the ones column) — compile with NVRTC for sm_80 and sm_90a at the vocabularies issue 47
// names (8, GPT-2's 50257, Llama-3's 128256, Gemma's 256000: none a multiple of 8 but 8 and 256000) in fp32, fp16 and
// bf16, vector and scalar programs; the vector programs keep out of local memory (no stack frame in the CUBIN), the
// scalar ones nearly. Each attribute at 50257 too. No GPU needed.
#include <fmt/format.h>

#include <catch2/catch.hpp>

#include "cuda/cubin_info.hpp"
#include "support/builtin_cases.hpp"

using namespace jitfuse;

namespace {

// Compiles every new kernel variant of `ops_json` at `shape`; returns how many.
size_t compile_all(test::KernelRig& rig, const std::string& ops_json, const char* recipe, ops::Shape shape,
                   const char* arch) {
  const test::BuiltinCase c{0, ops_json.c_str(), recipe, true, shape};
  return rig.each_new_request(
      c, arch,
      [&](const codegen::KernelSpec& spec, const codegen::Generated& g, bool vector, const cache::KernelRequest& req) {
        INFO(c.id() << " " << arch << " " << g.kernel << (vector ? " vector" : " scalar"));
        CHECK(spec.skeleton == codegen::Skeleton::cross_entropy);
        const cuda::CubinResources r = cuda::read_cubin_resources(rig.lib.compiler()(req).cubin);
        INFO(r.error);
        REQUIRE(r.error.empty());
        REQUIRE_FALSE(r.kernels.empty());
        for (const auto& k : r.kernels) {
          INFO(k.name << ": " << k.registers << " registers, frame " << k.frame_bytes << " B");
          CHECK(k.registers <= 255);
          // The vector programs keep everything in registers; the scalar fallback (misaligned tensors) may spill a word
          // (the fused kernel's bf16 scalar program on sm_90a: 8 B, measured).
          CHECK(k.frame_bytes <= (vector ? 0 : 64));
        }
      });
}

const int64_t kVocabs[] = {8, 50257, 128256, 256000};

}  // namespace

TEST_CASE(
    "cross_entropy kernels compile at every vocabulary, dtype and arch "
    "(unfused)",
    "[nvrtc][cross_entropy]") {
  test::KernelRig rig;
  size_t n = 0;
  for (const char* arch : {"sm_80", "sm_90a"})
    for (const char* recipe : {"fp32", "fp16", "bf16"})
      for (int64_t v : kVocabs) n += compile_all(rig, R"([{"op": "cross_entropy"}])", recipe, {3, v}, arch);
  CHECK(n == 2 * 3 * 4 * 3 * 2);  // row forward, reduction, row backward; vector and scalar
}

TEST_CASE("the joint head's kernels compile at every vocabulary, dtype and arch", "[nvrtc][cross_entropy]") {
  test::KernelRig rig;
  size_t n = 0;
  for (const char* arch : {"sm_80", "sm_90a"})
    for (const char* recipe : {"fp32", "fp16", "bf16"})
      for (int64_t v : kVocabs)
        n += compile_all(rig,
                         fmt::format(
                             R"([{{"op": "linear", "in_features": 64, "out_features": {}}},
                                        {{"op": "cross_entropy", "reduction": "sum"}}])",
                             v),
                         recipe, {3, 64}, arch);
  CHECK(n >= 2 * 3 * 4 * 2 * 2);  // the chunk kernel and the reduction per
                                  // vocabulary; the scaling once per dtype
}

TEST_CASE("cross_entropy kernels compile with every attribute", "[nvrtc][cross_entropy]") {
  test::KernelRig rig;
  size_t n = 0;
  for (const char* arch : {"sm_80", "sm_90a"}) {
    n += compile_all(rig,
                     R"([{"op": "cross_entropy", "reduction": "none", "label_smoothing": 0.1, "z_loss": 1e-4,
                              "softcap": 30, "label_dtype": "int32", "ignore_index": 0}])",
                     "bf16", {7, 50257}, arch);
    n += compile_all(rig,
                     R"([{"op": "linear", "in_features": 24, "out_features": 50257, "accumulate_grad": true},
                              {"op": "bias"}, {"op": "cross_entropy", "softcap": 30, "z_loss": 1e-4}])",
                     "bf16", {7, 24}, arch);
  }
  CHECK(n >= 2 * (2 * 2 + 5 * 2));
}

TEST_CASE("the vocab-parallel head's kernels compile at a rank of 4 of Llama-3's vocabulary", "[nvrtc][cross_entropy]") {
  test::KernelRig rig;
  static const rules::RuleSet rs = rules::RuleSet::with_builtins();
  size_t n = 0;
  for (bool fuse : {true, false})
    for (const char* recipe : {"fp32", "bf16"}) {
      auto def = ops::parse_sequence(
          R"({"ops": [{"op": "linear", "in_features": 64, "out_features": 128256, "tensor_parallel": "column"},
                      {"op": "cross_entropy", "vocab_parallel": true, "label_smoothing": 0.1, "softcap": 30}]})",
          "<vp>", rs.registry());
      ops::Parallel par;
      par.world_size = 4;
      par.rank = 2;
      exec::CompileOptions o;
      o.arch = 90;
      o.disable_fusion = !fuse;
      auto p = exec::compile(ops::infer(def, {300, 64}, par), def.name, ops::parse_recipe(recipe), o, rs);
      for (const char* arch : {"sm_80", "sm_90a"})
        for (const auto* pass : {&p->forward, &p->backward})
          for (const auto& s : *pass) {
            if (s.kind != exec::Step::Kind::kernel || !s.kernel->spec.ce) continue;
            const exec::Target target = exec::target_for_arch(arch);
            const auto req = rig.lib.request(s.kernel->gen, s.kernel->spec, target, nlohmann::json::object(), true);
            const cuda::CubinResources r = cuda::read_cubin_resources(rig.lib.compiler()(req).cubin);
            INFO(arch << " " << s.kernel->gen.kernel << " " << recipe << (fuse ? " fused" : " unfused"));
            INFO(r.error);
            REQUIRE(r.error.empty());
            for (const auto& k : r.kernels) CHECK(k.frame_bytes == 0);
            n += s.kernel->spec.ce->vocab_parallel();
          }
    }
  // Per arch and dtype, every kernel of the op: fused, count + stats + chunk + reduce + 2 scales; unfused, stats +
  // rows + reduce + rows_bwd.
  CHECK(n == 2 * 2 * (6 + 4));
}
