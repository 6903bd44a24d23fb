// Hostile arguments at the C ABI: every one comes back as a status with a valid-UTF-8 message naming the
// culprit, checked before any planning or device work (so without a GPU too), and nothing escapes.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <string>

#include "common/text.hpp"
#include "jitfuse/jitfuse.h"

namespace {

std::string last() { return jf_last_error(); }

struct Abi {
  jf_context ctx = nullptr;
  Abi() { REQUIRE(jf_context_create(&ctx) == JF_OK); }
  ~Abi() { jf_context_destroy(ctx); }
  jf_sequence seq(const char* json, const char* recipe = "bf16") {
    jf_sequence s = nullptr;
    REQUIRE(jf_sequence_create(ctx, json, recipe, &s) == JF_OK);
    return s;
  }
};

struct Tensor {
  int64_t shape[4] = {4, 8, 0, 0};
  DLTensor t{};
  alignas(16) char storage[64] = {};
  Tensor() {
    t.device = {kDLCUDA, 0};
    t.ndim = 2;
    t.shape = shape;
    t.dtype = {kDLBfloat, 16, 1};
    t.data = storage;  // never dereferenced: every case here fails before any device work
  }
};

}  // namespace

TEST_CASE("C ABI: invalid UTF-8 in builder and op names is an error, not an abort", "[api][untrusted]") {
  Abi a;
  jf_builder b = nullptr;
  CHECK(jf_builder_create("mlp\xff\xfe", &b) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() == "builder name 'mlp\\xff\\xfe' is not valid UTF-8 (names must be UTF-8 text)");
  CHECK(b == nullptr);
  REQUIRE(jf_builder_create("mlp", &b) == JF_OK);
  CHECK(jf_builder_add(b, "gelu\xc3\x28", nullptr) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() == "op 'gelu\\xc3(' is not valid UTF-8 (names must be UTF-8 text)");
  std::string huge(100000, 'g');
  CHECK(jf_builder_add(b, huge.c_str(), nullptr) == JF_ERR_INVALID_ARGUMENT);
  CHECK_THAT(last(), Catch::StartsWith("op 'gggg") && Catch::Contains("is longer than 4096 bytes"));
  CHECK(last().size() < 300);
  REQUIRE(jf_builder_add(b, "gelu", nullptr) == JF_OK);
  // A valid-UTF-8 unknown op: the error names it (shortened) and the builder.
  REQUIRE(jf_builder_add(b, "g\xc3\xa9lu", nullptr) == JF_OK);
  jf_sequence s = nullptr;
  CHECK(jf_builder_finish(b, a.ctx, "bf16", &s) == JF_ERR_INVALID_ARGUMENT);
  CHECK_THAT(last(), Catch::StartsWith("<builder mlp>:") && Catch::Contains("op 1: unknown op 'g\xc3\xa9lu'"));
  CHECK(jf_builder_finish(nullptr, a.ctx, "bf16", &s) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() == "builder is NULL");
  CHECK(jf_builder_finish(b, a.ctx, "bf\xff", &s) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() == "recipe 'bf\\xff' is not valid UTF-8 (names must be UTF-8 text)");
  jf_builder_destroy(b);
}

TEST_CASE("C ABI: messages quoting host bytes are valid UTF-8 and bounded", "[api][untrusted]") {
  Abi a;
  int n = 0;
  CHECK(jf_context_load_rules(a.ctx, "/nonexistent/\xff\xfe/rules.json", &n) == JF_OK);
  CHECK(n == 1);
  CHECK(jitfuse::text::valid_utf8(last()));
  CHECK_THAT(last(), Catch::Contains("/nonexistent/\xef\xbf\xbd\xef\xbf\xbd/rules.json"));
  jf_sequence s = nullptr;
  std::string bad = "{\"ops\": [{\"op\": \"" + std::string(200000, 'x') + "\x01\"}]}";
  CHECK(jf_sequence_create(a.ctx, bad.c_str(), "bf16", &s) == JF_ERR_PARSE);
  CHECK_THAT(last(), Catch::StartsWith("<sequence>:1:"));
  CHECK(jitfuse::text::valid_utf8(last()));
  CHECK(last().size() < 1000);
  std::string deep = "{\"ops\": " + std::string(100000, '[');
  CHECK(jf_sequence_create(a.ctx, deep.c_str(), "bf16", &s) == JF_ERR_PARSE);
  CHECK_THAT(last(), Catch::StartsWith("<sequence>:1:72: JSON nested more than 64 levels deep"));
}

TEST_CASE("C ABI: files that are not regular are refused without blocking", "[api][untrusted]") {
  Abi a;
  char tmpl[] = "/tmp/jf-abi-XXXXXX";
  REQUIRE(::mkdtemp(tmpl));
  const std::string dir = tmpl, fifo = dir + "/seq.json";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  auto t0 = std::chrono::steady_clock::now();
  jf_sequence s = nullptr;
  CHECK(jf_sequence_create_from_file(a.ctx, fifo.c_str(), "bf16", &s) == JF_ERR_IO);
  CHECK_THAT(last(), Catch::Contains(fifo) && Catch::Contains("is a FIFO, not a regular file"));
  CHECK(jf_sequence_create_from_file(a.ctx, "/dev/zero", "bf16", &s) == JF_ERR_IO);
  CHECK_THAT(last(), Catch::Contains("'/dev/zero': it is a character device, not a regular file"));
  int n = 0;
  // Rule paths: the rules loader may refuse them before reading (issue15-rules) or the reader does; either
  // way one load error naming the path and saying it is not a regular file.
  CHECK(jf_context_load_rules(a.ctx, "/dev/zero", &n) == JF_OK);
  CHECK(n == 1);
  CHECK_THAT(last(), Catch::Contains("'/dev/zero'") && Catch::Contains("not a regular file"));
  CHECK(jf_context_load_rules(a.ctx, fifo.c_str(), &n) == JF_OK);
  CHECK(n == 1);
  CHECK_THAT(last(), Catch::Contains(fifo) && Catch::Contains("not a regular file"));
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5));
  std::filesystem::remove_all(dir);
}

TEST_CASE("C ABI: jf_forward checks every tensor struct before planning", "[api][untrusted]") {
  Abi a;
  jf_sequence s = a.seq("{\"ops\": [{\"op\": \"bias\"}, {\"op\": \"gelu\"}]}");
  Tensor in, out;
  jf_forward_args args{};
  auto fwd = [&](const DLTensor* i, DLTensor* o) {
    args.input = i;
    args.output = o;
    return jf_forward(s, &args, nullptr, nullptr);
  };
  in.t.shape = nullptr;  // used to SEGV
  CHECK(fwd(&in.t, &out.t) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() == "tensor 'input' has ndim 2 but its shape pointer is NULL");
  in.t.shape = in.shape;
  in.t.ndim = -3;
  CHECK(fwd(&in.t, &out.t) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() == "tensor 'input' has ndim -3; jitfuse takes 1 to 16 dims");
  in.t.ndim = 3;
  in.shape[0] = in.shape[1] = in.shape[2] = int64_t(1) << 30;  // 2^90 elements: used to wrap to 0
  CHECK(fwd(&in.t, &out.t) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() == "tensor 'input': shape (1073741824,1073741824,1073741824) has more elements than int64 can count");
  in.t.ndim = 2;
  in.shape[0] = 4;
  in.shape[1] = -8;
  CHECK(fwd(&in.t, &out.t) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() == "tensor 'input': dim 1 of shape (4,-8) is -8; every dim must be positive");
  in.shape[1] = 8;
  CHECK(fwd(&in.t, nullptr) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() == "tensor 'output' is NULL");
  out.t.dtype = {kDLBfloat, 16, 4};
  CHECK(fwd(&in.t, &out.t) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() == "tensor 'output': dtype bfloat16x4 (code 4, 16 bits, 4 lanes) is not a scalar type jitfuse reads");
  out.t.dtype = {kDLFloat, 32, 1};
  CHECK(fwd(&in.t, &out.t) == JF_ERR_INVALID_ARGUMENT);  // not NO_DEVICE: checked before planning
  CHECK(last() == "tensor 'output': expected dtype bf16 for this recipe, got float32");
  out.t.dtype = {kDLBfloat, 16, 1};
  out.t.device = {kDLCPU, 0};
  CHECK(fwd(&in.t, &out.t) == JF_ERR_INVALID_ARGUMENT);
  CHECK_THAT(last(), Catch::StartsWith("tensor 'output' must be in CUDA device memory"));
  out.t.device = {kDLCUDA, 0};
  out.t.data = nullptr;
  CHECK(fwd(&in.t, &out.t) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() == "tensor 'output': data is NULL");
  out.t.data = out.storage;
  int64_t strides[2] = {-8, 1};
  in.t.strides = strides;
  CHECK(fwd(&in.t, &out.t) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() == "tensor 'input': stride 0 is -8; negative strides are not supported");
  in.t.strides = nullptr;
  args.n_extra_inputs = 1;
  CHECK(fwd(&in.t, &out.t) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() == "sequence 'sequence' takes 0 extra input(s) (add_extra_input ops without a channel), got 1");
  args.n_extra_inputs = 0;
  CHECK(jf_forward(s, nullptr, nullptr, nullptr) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() == "args is NULL");
  jf_sequence_destroy(s);

  jf_sequence r = a.seq("{\"ops\": [{\"op\": \"add_extra_input\"}]}");
  args.n_extra_inputs = 1;
  args.input = &in.t;
  args.output = &out.t;
  CHECK(jf_forward(r, &args, nullptr, nullptr) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() == "the extra input array is NULL but 1 extra input(s) were announced");
  const DLTensor* extras[1] = {nullptr};
  args.extra_inputs = extras;
  CHECK(jf_forward(r, &args, nullptr, nullptr) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() == "tensor 'extra input 0' is NULL");
  jf_sequence_destroy(r);
}

TEST_CASE("C ABI 2: per-call parameters, buffers and overlaps are checked before planning, naming the culprit",
          "[api][untrusted]") {
  Abi a;
  jf_sequence s = a.seq("{\"ops\": [{\"op\": \"linear\", \"in_features\": 8, \"out_features\": 4}, "
                        "{\"op\": \"bias\"}, {\"op\": \"gelu\"}]}");
  Tensor in, out, w, b, w2;
  out.shape[1] = 4;
  w.shape[0] = 4;
  b.t.ndim = 1;
  b.shape[0] = 4;
  w2.shape[0] = 4;
  jf_param params[3] = {{0, "weight", &w.t}, {1, "bias", &b.t}, {0, "weight", &w2.t}};
  jf_forward_args args{};
  args.input = &in.t;
  args.output = &out.t;
  args.params = params;
  auto fwd = [&](int n) {
    args.n_params = n;
    return jf_forward(s, &args, nullptr, nullptr);
  };
  CHECK(fwd(1) == JF_ERR_INVALID_ARGUMENT);  // not NO_DEVICE: checked before anything is prepared
  CHECK(last() == "params: op 1 (bias) 'bias' (4) is missing: pass every parameter with each call");
  CHECK(fwd(3) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() == "params[2]: op 0 (linear) 'weight' is passed twice");
  args.params = nullptr;
  CHECK(fwd(2) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() == "params is NULL");
  args.params = params;
  CHECK(fwd(-1) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() == "n_params is -1");
  params[1].name = "gamma";
  CHECK(fwd(2) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() == "params[1]: op 1 (bias) has no parameter 'gamma' (its parameters: bias)");
  params[1] = {2, "bias", &b.t};
  CHECK(fwd(2) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() == "params[1]: op 2 (gelu) has no parameter 'bias' (it has no parameters)");
  params[1] = {7, "bias", &b.t};
  CHECK(fwd(2) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() == "params[1]: op index 7 out of range: sequence 'sequence' has 3 ops");
  params[1] = {1, nullptr, &b.t};
  CHECK(fwd(2) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() == "params[1].name is NULL");
  params[1] = {1, "bias", &b.t};
  w.shape[0] = 5;
  CHECK(fwd(2) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() == "tensor 'params op 0 (linear) 'weight'': expected shape 4x8, got 5x8");
  w.shape[0] = 4;
  w.t.dtype = {kDLFloat, 16, 1};
  CHECK(fwd(2) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() == "tensor 'params op 0 (linear) 'weight'': expected dtype bf16 for this recipe, got float16");
  w.t.dtype = {kDLBfloat, 16, 1};
  // The output written over the input, a parameter or itself: refused naming both tensors.
  out.t.data = in.storage;
  CHECK(fwd(2) == JF_ERR_INVALID_ARGUMENT);
  CHECK_THAT(last(), Catch::Contains("tensor 'input'") && Catch::Contains("overlaps tensor 'output'") &&
                         Catch::Contains("the second is written"));
  out.t.data = b.storage + 2;
  CHECK(fwd(2) == JF_ERR_INVALID_ARGUMENT);
  CHECK_THAT(last(), Catch::Contains("'params op 1 (bias) 'bias''") && Catch::Contains("'output'"));
  out.t.data = out.storage;
  // Two parameters may share memory (read only).
  w2.t.data = w.storage;
  jf_sequence_destroy(s);

  // The backward: gradients are checked like parameters, and may not overlap what it reads.
  jf_sequence t = a.seq("{\"ops\": [{\"op\": \"bias\"}]}");
  Tensor x, y, dy, dx, bb, db;
  bb.t.ndim = db.t.ndim = 1;
  bb.shape[0] = db.shape[0] = 8;
  jf_param p1[1] = {{0, "bias", &bb.t}};
  jf_param g1[1] = {{0, "bias", &db.t}};
  jf_backward_args ba{};
  ba.input = &x.t;
  ba.output = &y.t;
  ba.params = p1;
  ba.n_params = 1;
  ba.grad_output = &dy.t;
  ba.grad_input = &dx.t;
  ba.grads = g1;
  ba.n_grads = 0;
  CHECK(jf_backward(t, &ba, nullptr) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() == "grads: op 0 (bias) 'bias' (8) is missing: pass every parameter with each call");
  ba.n_grads = 1;
  db.t.data = dy.storage;
  CHECK(jf_backward(t, &ba, nullptr) == JF_ERR_INVALID_ARGUMENT);
  CHECK_THAT(last(), Catch::Contains("'grad_output'") && Catch::Contains("'grads op 0 (bias) 'bias''"));
  CHECK(jf_backward(t, nullptr, nullptr) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() == "args is NULL");
  jf_sequence_destroy(t);

  // Prepare and info check their shape like explain does.
  jf_sequence u = a.seq("{\"ops\": [{\"op\": \"gelu\"}]}");
  jf_program_info info{};
  CHECK(jf_sequence_prepare(u, nullptr, 2, 1, nullptr) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() == "shape is NULL");
  int64_t shape[2] = {4, 8};
  CHECK(jf_sequence_info(u, shape, 0, 1, &info) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() == "shape: ndim is 0; give 1 to 16 dims");
  CHECK(jf_sequence_info(u, shape, 2, 1, nullptr) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() == "out is NULL");
  void* buf = nullptr;
  CHECK(jf_saved_buffer(nullptr, &buf, nullptr) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() == "saved is NULL");
  jf_sequence_destroy(u);
}

TEST_CASE("C ABI: jf_sequence_explain checks its shape arguments", "[api][untrusted]") {
  Abi a;
  jf_sequence s = a.seq("{\"ops\": [{\"op\": \"linear\", \"in_features\": 8, \"out_features\": 4}]}");
  const char* js = nullptr;
  int64_t shape[2] = {4, 8};
  CHECK(jf_sequence_explain(s, shape, -1, 1, 90, &js) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() == "shape: ndim is -1; give 1 to 16 dims");
  CHECK(jf_sequence_explain(s, nullptr, 2, 1, 90, &js) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() == "shape is NULL");
  int64_t huge[3] = {int64_t(1) << 40, int64_t(1) << 40, 8};
  CHECK(jf_sequence_explain(s, huge, 3, 1, 90, &js) == JF_ERR_INVALID_ARGUMENT);
  CHECK_THAT(last(), Catch::Contains("more elements than a signed 64-bit count can hold"));
  CHECK(jf_sequence_explain(s, shape, 2, 1, 90, &js) == JF_OK);
  // A parameter's tensor struct and name are checked like the input's.
  Tensor in, out, w;
  out.shape[1] = 4;
  w.t.shape = nullptr;
  jf_param p[1] = {{0, "weight", &w.t}};
  jf_forward_args args{};
  args.input = &in.t;
  args.output = &out.t;
  args.params = p;
  args.n_params = 1;
  CHECK(jf_forward(s, &args, nullptr, nullptr) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() == "tensor 'params op 0 (linear) 'weight'' has ndim 2 but its shape pointer is NULL");
  w.t.shape = w.shape;
  p[0].name = "wei\xffght";
  CHECK(jf_forward(s, &args, nullptr, nullptr) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() == "params[0].name 'wei\\xffght' is not valid UTF-8 (names must be UTF-8 text)");
  jf_sequence_destroy(s);
}

TEST_CASE("C ABI: jf_sequence_wiring reports the parser's wiring and refuses NULL arguments", "[api][untrusted]") {
  Abi a;
  const char* js = "unchanged";
  CHECK(jf_sequence_wiring(nullptr, &js) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() == "seq is NULL");
  CHECK(js == nullptr);  // set to NULL before anything else is checked
  jf_sequence s = a.seq(R"({"input_channels": ["skip"], "ops": [
      {"op": "make_extra_output", "channel": "residual", "returned": true}, {"op": "gelu"},
      {"op": "add_extra_input", "channel": "skip"}, {"op": "add_extra_input"},
      {"op": "add_extra_input", "channel": "residual"}, {"op": "add_extra_input", "channel": "skip"}]})");
  CHECK(jf_sequence_wiring(s, nullptr) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() == "json_out is NULL");
  REQUIRE(jf_sequence_wiring(s, &js) == JF_OK);
  REQUIRE(js != nullptr);
  const std::string first = js;
  const char* again = nullptr;
  REQUIRE(jf_sequence_wiring(s, &again) == JF_OK);
  CHECK(again == js);  // one string for the sequence's lifetime
  CHECK(first ==
        R"({"channels":[{"name":"skip","readers":[2,5],"returned":false,"source":-1},)"
        R"({"name":"residual","readers":[4],"returned":true,"source":0}],)"
        R"("extra_inputs":[{"channel":"skip","index":2,"kind":"channel","op":2,"slot":0},)"
        R"({"channel":null,"index":3,"kind":"add","op":3,"slot":1}],)"
        R"("extra_outputs":[{"channel":"residual","index":0,"kind":"returned","op":0,"slot":0}],)"
        R"("input_channels":["skip"]})");
  jf_sequence_destroy(s);
  // A document whose wiring the parser refuses never becomes a sequence: the refusal names the op.
  jf_sequence bad = nullptr;
  CHECK(jf_sequence_create(a.ctx, R"({"ops": [{"op": "gelu"}, {"op": "add_extra_input", "channel": "r"}]})", "bf16",
                           &bad) == JF_ERR_INVALID_ARGUMENT);
  CHECK_THAT(last(), Catch::Contains("op 1 (add_extra_input): channel 'r' is read before anything writes it"));
  CHECK(bad == nullptr);
}
