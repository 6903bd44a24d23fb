// warmup/check report every kernel that fails to compile (not only the first), each with its label and the
// compiler error mapped back to the user template's file:line.
#include <filesystem>

#include "unit/rules/rules_test_util.hpp"

using jf_test::run_cli;

TEST_CASE("warmup lists every failing kernel with template file:line", "[cli][rules]") {
  jf_test::TempDir dir;
  dir.write("r/broken.cuh",
            "#pragma once\n"
            "struct jf_op_b {\n"
            "  static __device__ __forceinline__ float fwd(float x) { return x * undefined_fwd; }\n"
            "  static __device__ __forceinline__ float bwd(float x, float dy) { return dy; }\n"
            "};\n");
  dir.write("r/rules.json", R"J({"format": "jitfuse.rules/1", "ops": [
  {"name": "b", "math": "y = x", "template": "broken.cuh", "functor": "jf_op_b"}]})J");
  std::string seq = dir.write("s.json", R"J({"format": "jitfuse.sequence/1", "name": "s", "ops": [{"op": "b"}]})J");
  auto r = run_cli("warmup '" + seq + "' --recipe bf16 --shape 8x64 --arch sm_90 --rules '" + dir.path() + "/r'",
                   "JITFUSE_CACHE_DIR=" + dir.path() + "/cache");
  INFO(r.out);
  CHECK(r.status == 2);
  // Forward and backward kernels, each one program with both its variants.
  CHECK_THAT(r.out, Catch::Contains("jitfuse warmup: error: 2 of 2 kernels failed (each listed above)"));
  CHECK_THAT(r.out, Catch::Contains("kernel #0 (") && Catch::Contains("kernel #1 ("));
  std::string real = std::filesystem::canonical(dir.path() + "/r/broken.cuh").string();
  CHECK_THAT(r.out, Catch::Contains("(in " + real + ":3: "));
}
