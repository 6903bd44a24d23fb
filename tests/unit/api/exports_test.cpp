// libjitfuse exports only jf_* symbols (hidden visibility + version script), and the C ABI reports
// bad input as status codes with messages that name what is wrong.
#include <catch2/catch.hpp>

#include <cstdio>
#include <string>

#include "jitfuse/jitfuse.h"
#include "support/run_command.hpp"

namespace {
bool has(const char* needle) { return std::string(jf_last_error()).find(needle) != std::string::npos; }
}  // namespace

TEST_CASE("the shared library exports only jf_ symbols", "[api]") {
  auto nm = jitfuse::test::run_command(std::string("nm -D --defined-only ") + JF_LIB_PATH + " | awk '{print $3}'");
  REQUIRE(nm.status == 0);
  const std::string& syms = nm.out;
  REQUIRE(syms.find("jf_forward") != std::string::npos);
  size_t start = 0, count = 0;
  while (start < syms.size()) {
    size_t end = syms.find('\n', start);
    std::string s = syms.substr(start, end - start);
    start = end + 1;
    if (s.empty() || s == "JITFUSE_2") continue;
    INFO("exported symbol: " << s);
    CHECK(s.rfind("jf_", 0) == 0);
    ++count;
  }
  CHECK(count >= 20);
}

TEST_CASE("C ABI: jf_program handles refuse NULL arguments without a GPU", "[api]") {
  const int64_t shape[] = {4, 8};
  jf_program p = reinterpret_cast<jf_program>(0x1);
  CHECK(jf_program_open(nullptr, shape, 2, 0, nullptr, &p) == JF_ERR_INVALID_ARGUMENT);
  CHECK(has("seq is NULL"));
  CHECK(p == reinterpret_cast<jf_program>(0x1));  // untouched when the call fails before opening
  jf_program_info info{};
  CHECK(jf_program_get_info(nullptr, &info) == JF_ERR_INVALID_ARGUMENT);
  CHECK(has("prog is NULL"));
  jf_forward_args fa{};
  CHECK(jf_program_forward(nullptr, &fa, nullptr, nullptr) == JF_ERR_INVALID_ARGUMENT);
  jf_backward_args ba{};
  CHECK(jf_program_backward(nullptr, &ba, nullptr) == JF_ERR_INVALID_ARGUMENT);
  CHECK(jf_program_close(nullptr) == JF_OK);
  jf_context ctx = nullptr;
  REQUIRE(jf_context_create(&ctx) == JF_OK);
  jf_sequence seq = nullptr;
  REQUIRE(jf_sequence_create(ctx, "{\"ops\": [{\"op\": \"bias\"}]}", "bf16", &seq) == JF_OK);
  CHECK(jf_program_open(seq, shape, 2, 0, nullptr, nullptr) == JF_ERR_INVALID_ARGUMENT);
  CHECK(has("out is NULL"));
  CHECK(jf_program_open(seq, nullptr, 2, 0, nullptr, &p) == JF_ERR_INVALID_ARGUMENT);
  CHECK(p == nullptr);  // cleared once `out` is known good
  jf_sequence_destroy(seq);
  jf_context_destroy(ctx);
}

TEST_CASE("C ABI errors: status codes and messages naming the problem", "[api]") {
  jf_context ctx = nullptr;
  REQUIRE(jf_context_create(&ctx) == JF_OK);
  jf_sequence seq = nullptr;
  CHECK(jf_sequence_create(ctx, "{\"ops\": [", "bf16", &seq) == JF_ERR_PARSE);
  CHECK(has("<sequence>:1:"));
  CHECK(jf_sequence_create(ctx, "{\"ops\": [{\"op\": \"bias\"}]}", "fp64", &seq) == JF_ERR_INVALID_ARGUMENT);
  CHECK(has("unknown recipe 'fp64'"));
  // FP8 recipes: quantize only last; a linear's FP8 GEMMs need multiples of 16 (refused when planned).
  REQUIRE(jf_sequence_create(ctx, "{\"ops\": [{\"op\": \"linear\", \"in_features\": 8, \"out_features\": 8}, "
                                  "{\"op\": \"quantize\"}]}", "fp8_delayed", &seq) == JF_OK);
  {
    const int64_t shape[] = {32, 8};
    const char* js = nullptr;
    CHECK(jf_sequence_explain(seq, shape, 2, 1, 90, &js) == JF_ERR_UNSUPPORTED);
    CHECK(has("op 0 (linear) under recipe fp8_delayed: FP8 GEMMs need in_features to be a multiple of 16"));
    jf_sequence_destroy(seq);
    seq = nullptr;
  }
  CHECK(jf_sequence_create(ctx, "{\"ops\": [{\"op\": \"quantize\"}, {\"op\": \"gelu\"}]}", "fp8_current", &seq) ==
        JF_ERR_INVALID_ARGUMENT);
  CHECK(has("op 0 (quantize) under recipe fp8_current must be the last op"));
  REQUIRE(jf_sequence_create(ctx, "{\"ops\": [{\"op\": \"bias\"}, {\"op\": \"quantize\"}]}", "fp8_current", &seq) ==
          JF_OK);
  jf_fp8_state st{};
  CHECK(jf_sequence_fp8_state(seq, 0, &st) == JF_ERR_INVALID_ARGUMENT);
  CHECK(has("op 0 of sequence"));
  CHECK(has("is not a quantize op"));
  jf_sequence_destroy(seq);
  REQUIRE(jf_sequence_create(ctx, "{\"ops\": [{\"op\": \"quantize\"}]}", "bf16", &seq) == JF_OK);
  CHECK(jf_sequence_fp8_state(seq, 0, &st) == JF_ERR_INVALID_ARGUMENT);
  CHECK(has("runs recipe bf16"));
  jf_sequence_destroy(seq);
  CHECK(jf_sequence_create(ctx, "{\"ops\": [{\"op\": \"gelu\", \"approximate\": \"fast\"}]}", "bf16", &seq) ==
        JF_ERR_INVALID_ARGUMENT);
  CHECK(has("op 0"));
  CHECK(has("one of tanh|none"));
  CHECK(jf_sequence_create(ctx, nullptr, "bf16", &seq) == JF_ERR_INVALID_ARGUMENT);
  CHECK(jf_context_load_rules(ctx, "/nonexistent/rules.json", nullptr) == JF_OK);
  CHECK(has("/nonexistent/rules.json"));

  REQUIRE(jf_sequence_create(ctx, "{\"ops\": [{\"op\": \"linear\", \"in_features\": 8, \"out_features\": 4}]}", "bf16",
                             &seq) == JF_OK);
  int64_t shape[2] = {4, 8};
  DLTensor t{};
  t.device = {kDLCPU, 0};
  t.ndim = 2;
  t.shape = shape;
  t.dtype = {kDLBfloat, 16, 1};
  static char host[64];
  t.data = host;
  // Parameters come with each call (ABI 2); they are checked before anything is prepared.
  int64_t xs[2] = {4, 8}, ys[2] = {4, 4}, ws[2] = {4, 8};
  static char xd[64], yd[64];
  DLTensor x{}, y{};
  x.device = y.device = {kDLCUDA, 0};
  x.ndim = y.ndim = 2;
  x.shape = xs;
  y.shape = ys;
  x.dtype = y.dtype = {kDLBfloat, 16, 1};
  x.data = xd;
  y.data = yd;
  t.shape = ws;
  jf_param p[1] = {{0, "weight", &t}};
  jf_forward_args args{};
  args.input = &x;
  args.output = &y;
  args.params = p;
  args.n_params = 1;
  CHECK(jf_forward(seq, &args, nullptr, nullptr) == JF_ERR_INVALID_ARGUMENT);
  CHECK(has("CUDA device memory"));
  t.device = {kDLCUDA, 0};
  t.dtype = {kDLFloat, 32, 1};
  CHECK(jf_forward(seq, &args, nullptr, nullptr) == JF_ERR_INVALID_ARGUMENT);
  CHECK(has("expected dtype bf16"));
  t.dtype = {kDLBfloat, 16, 1};
  p[0].name = "gamma";
  CHECK(jf_forward(seq, &args, nullptr, nullptr) == JF_ERR_INVALID_ARGUMENT);
  CHECK(has("no parameter 'gamma'"));
  p[0] = {3, "weight", &t};
  CHECK(jf_forward(seq, &args, nullptr, nullptr) == JF_ERR_INVALID_ARGUMENT);
  CHECK(has("out of range"));
  p[0].op_index = 0;
  int64_t strides[2] = {1, 4};
  t.strides = strides;
  CHECK(jf_forward(seq, &args, nullptr, nullptr) == JF_ERR_INVALID_ARGUMENT);
  CHECK(has("not contiguous row-major"));
  const char* js = nullptr;
  int64_t bad_shape[2] = {4, 9};
  CHECK(jf_sequence_explain(seq, bad_shape, 2, 1, 90, &js) == JF_ERR_INVALID_ARGUMENT);
  CHECK(has("op 0 (linear)"));
  CHECK(has("in_features = 8"));
  jf_sequence_destroy(seq);
  jf_context_destroy(ctx);
}
