// Every basic op, unfused, forward and backward, against the float64 reference in every recipe, over
// odd small shapes, (5,1,k), (4,2,4,k), a large shape, and a training-like sequence.
#include "gpu/gpu_check.hpp"

using namespace jitfuse;
using jitfuse::test::run_check;

namespace {

struct OpCase {
  const char* json;
  bool even_cols;  // gated ops split the last dim
};

const OpCase kOps[] = {
    {R"({"op": "bias"})", false},
    {R"({"op": "gelu", "approximate": "tanh"})", false},
    {R"({"op": "gelu", "approximate": "none"})", false},
    {R"({"op": "relu"})", false},
    {R"({"op": "silu"})", false},
    {R"({"op": "qgelu"})", false},
    {R"({"op": "srelu"})", false},
    {R"({"op": "swiglu"})", true},
    {R"({"op": "geglu"})", true},
    {R"({"op": "reglu"})", true},
    {R"({"op": "layernorm", "eps": 1e-5})", false},
    {R"({"op": "layernorm", "eps": 1e-5, "zero_centered_gamma": true})", false},
    {R"({"op": "rmsnorm", "eps": 1e-6})", false},
    {R"({"op": "rmsnorm", "eps": 1e-6, "zero_centered_gamma": true})", false},
    {R"({"op": "dropout", "p": 0.25, "seed": 42})", false},
    {R"({"op": "dropout", "p": 0.25, "training": false})", false},
    {R"({"op": "scale", "value": -0.75})", false},
    {R"({"op": "add_extra_input"})", false},
    {R"({"op": "make_extra_output"})", false},
    {R"({"op": "identity"})", false},
    {R"({"op": "quantize"})", false},
    {R"({"op": "reshape", "shape": [-1]})", false},
};

std::vector<ops::Shape> small_shapes(int64_t k) {
  return {{3, 5}, {64, 32}, {5, 1, k}, {4, 2, 4, k}, {1, 8}, {1000, 24}};
}

}  // namespace

TEST_CASE("every pointwise, norm, dropout and structural op matches the reference", "[ops]") {
  for (const auto& c : kOps) {
    std::string seq = test::seq_json(std::string("[") + c.json + "]");
    for (const char* recipe : {"fp32", "fp16", "bf16"}) {
      for (auto shape : small_shapes(40)) {
        if (c.even_cols && ops::cols_of(shape) % 2) continue;
        run_check(seq, recipe, shape);
      }
    }
  }
}

TEST_CASE("every op on a large shape", "[ops]") {
  for (const auto& c : kOps) {
    std::string seq = test::seq_json(std::string("[") + c.json + "]");
    run_check(seq, "bf16", {2048, 4096});
  }
}

TEST_CASE("linear forward, dgrad and wgrad match the reference", "[ops]") {
  for (const char* recipe : {"fp32", "fp16", "bf16"}) {
    for (auto [m, k, n] : {std::tuple{3, 5, 7}, std::tuple{64, 32, 48}, std::tuple{40, 24, 8}, std::tuple{256, 1024, 512}}) {
      std::string seq = test::seq_json(fmt::format(R"([{{"op": "linear", "in_features": {}, "out_features": {}}}])", k, n));
      run_check(seq, recipe, {m, k});
    }
    std::string seq = test::seq_json(R"([{"op": "linear", "in_features": 40, "out_features": 16}])");
    run_check(seq, recipe, {5, 1, 40});
    run_check(seq, recipe, {4, 2, 4, 40});
  }
}

TEST_CASE("a training-like sequence: layernorm linear bias gelu linear bias add_extra_input", "[ops]") {
  std::string seq = test::seq_json(R"([
    {"op": "layernorm", "eps": 1e-5},
    {"op": "linear", "in_features": 64, "out_features": 256},
    {"op": "bias"},
    {"op": "gelu", "approximate": "tanh"},
    {"op": "linear", "in_features": 256, "out_features": 64},
    {"op": "bias"},
    {"op": "add_extra_input"}])", "mlp");
  for (const char* recipe : {"fp32", "fp16", "bf16"}) {
    run_check(seq, recipe, {96, 64});
    test::ScopedEnv off("JITFUSE_DISABLE_FUSION", "1");
    run_check(seq, recipe, {96, 64});
  }
}

// The row-norm kernels (the forward keeps the row in its storage dtype and takes layernorm's statistics in
// one shifted reduction; the backward accumulates dgamma/dbeta per block) at the row counts and hidden
// sizes where their chunking changes: one row, a few rows, many rows; hidden 8 (one chunk), 24 (a partial
// chunk set), 4104 (not a multiple of the block's columns) and 12288 (384 threads). bf16 and fp16 on the
// vector path; fp32 with misaligned pointers on the scalar path. A residual add before the norm keeps the
// float row path covered.
TEST_CASE("norm kernels on odd rows and hidden sizes", "[ops]") {
  const char* norms[] = {R"([{"op": "layernorm", "eps": 1e-5}])", R"([{"op": "rmsnorm", "eps": 1e-6}])",
                         R"([{"op": "layernorm", "eps": 1e-5, "zero_centered_gamma": true}])",
                         R"([{"op": "add_extra_input"}, {"op": "layernorm", "eps": 1e-5}])",
                         R"([{"op": "add_extra_input"}, {"op": "rmsnorm", "eps": 1e-6}])"};
  for (auto rows : {1, 3, 1000})
    for (auto cols : {8, 24, 4104, 12288})
      for (const char* ops : norms) {
        std::string seq = test::seq_json(ops);
        run_check(seq, "bf16", {rows, cols});
        run_check(seq, "fp16", {rows, cols});
        run_check(seq, "fp32", {rows, cols}, true, /*misalign=*/true);
      }
}
