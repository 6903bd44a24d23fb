// `jitfuse bench`'s command line without a GPU: its options and every case name in --help, and option
// values the parser refuses before anything runs (the cases themselves run on the GPU machine).
#include "unit/rules/rules_test_util.hpp"

using jf_test::run_cli;

TEST_CASE("bench --help lists its options and every case", "[cli]") {
  auto r = run_cli("bench --help");
  INFO(r.out);
  CHECK(r.status == 0);
  for (const char* opt : {"--json", "--warmup", "--iters", "--sync", "--case"}) CHECK_THAT(r.out, Catch::Contains(opt));
  for (const char* name : {"bias_gelu", "dgelu_dbias", "layernorm", "rmsnorm", "layernorm_fp8_current",
                           "layernorm_fp8_delayed", "swiglu", "bias_dropout_add", "linear_bias_gelu", "mlp,",
                           "mlp_relu", "decode", "mlp_fp8", "gemm_fp8"})
    CHECK_THAT(r.out, Catch::Contains(name));
}

TEST_CASE("bench refuses a non-positive --iters and a negative --warmup before running", "[cli]") {
  for (const char* args : {"bench --iters 0", "bench --warmup -1"}) {
    auto r = run_cli(args);
    INFO(args << ": " << r.out);
    CHECK(r.status != 0);
    CHECK(r.status != 1);
    CHECK(r.status != 2);
  }
}
