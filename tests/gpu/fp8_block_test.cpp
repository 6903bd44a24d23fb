// fp8_block (issue 44) on the GPU: linears on cuBLASLt's block-scaled FP8 GEMMs (1x128 activations and
// gradients, 128x128 weights, all E4M3) with their block-scaled casts, checked twice per output and
// gradient (tools/harness/check.cpp): against a float64 reference that quantises every GEMM operand as the
// casts do (runtime/reference/fp8.cpp: the same power-of-two block scales, the wgrad's own 128x1-block
// copies of x and dy), at the bf16 tolerance, so a wrong scale layout, block or rounding fails; and against
// the exact float64 reference at DESIGN's FP8 tolerance. Weight copies reused across calls; inference.
#include <catch2/catch.hpp>

#include "gpu/gpu_check.hpp"

using namespace jitfuse;

namespace {

void check(const char* ops_json, const ops::Shape& shape, bool backward, int calls, uint64_t seed,
           bool host_memory = false) {
  harness::CheckOptions o;
  o.host_memory = host_memory;
  o.recipe = "fp8_block";
  o.shape = shape;
  o.backward = backward;
  o.calls = calls;
  o.seed = seed;
  auto rep = harness::check_sequence(test::shared_context(), test::builtin_registry(), test::seq_json(ops_json), o);
  INFO(ops_json << " " << ops::shape_str(shape) << (backward ? " train" : " infer") << "\n" << rep.table());
  CHECK(rep.pass());
}

}  // namespace

TEST_CASE("fp8_block: a linear alone, with bias, and at several block counts", "[fp8_block]") {
  check(R"([{"op": "linear", "in_features": 128, "out_features": 128}])", {128, 128}, true, 1, 41);
  check(R"([{"op": "linear", "in_features": 384, "out_features": 256}, {"op": "bias"}])", {256, 384}, true, 2, 43);
  check(R"([{"op": "linear", "in_features": 1024, "out_features": 512}])", {2, 192, 1024}, true, 3, 47);
  check(R"([{"op": "linear", "in_features": 256, "out_features": 640}, {"op": "gelu"}])", {512, 256}, true, 1, 53);
}

TEST_CASE("fp8_block: the GPT-2 MLP with its residual, and the Llama half-block with a channel", "[fp8_block]") {
  check(R"([{"op": "layernorm"}, {"op": "linear", "in_features": 256, "out_features": 1024}, {"op": "bias"},
            {"op": "gelu", "approximate": "tanh"}, {"op": "linear", "in_features": 1024, "out_features": 256},
            {"op": "bias"}, {"op": "add_extra_input"}])", {256, 256}, true, 2, 59);
  check(R"([{"op": "make_extra_output", "channel": "r"}, {"op": "rmsnorm"},
            {"op": "linear", "in_features": 256, "out_features": 1024}, {"op": "swiglu"},
            {"op": "linear", "in_features": 512, "out_features": 256}, {"op": "add_extra_input", "channel": "r"}])",
        {384, 256}, true, 2, 61);
  // [linear, add_extra_input]: the RESIDUAL rule (the residual as the block-scaled GEMM's C, beta = 1).
  check(R"([{"op": "linear", "in_features": 256, "out_features": 256}, {"op": "add_extra_input"}])", {128, 256}, true, 1, 67);
}

// Issue 44: quantisation fused into its producer. A residual add + fork + norm before a linear (the norm's
// statistics kernel, then the block cast normalising its saved input), activation chains with dropout
// before a linear (their forward inside the cast), and the backward of the ops after each linear (dact,
// dropout, dbias column sums inside the grad_output cast); rmsnorm with zero-centred gamma.
TEST_CASE("fp8_block: norms, activations and their backward fused into the block-scaled casts", "[fp8_block]") {
  check(R"([{"op": "add_extra_input"}, {"op": "make_extra_output", "channel": "r"}, {"op": "layernorm"},
            {"op": "linear", "in_features": 256, "out_features": 512}, {"op": "bias"}, {"op": "silu"},
            {"op": "dropout", "p": 0.1}, {"op": "linear", "in_features": 512, "out_features": 256},
            {"op": "add_extra_input", "channel": "r"}])", {256, 256}, true, 2, 97);
  check(R"([{"op": "add_extra_input"}, {"op": "rmsnorm", "zero_centered_gamma": true},
            {"op": "linear", "in_features": 384, "out_features": 256}, {"op": "silu"},
            {"op": "linear", "in_features": 256, "out_features": 384}, {"op": "bias"}, {"op": "gelu"}])",
        {2, 128, 384}, true, 2, 101);
  check(R"([{"op": "rmsnorm"}, {"op": "linear", "in_features": 256, "out_features": 256}, {"op": "bias"},
            {"op": "gelu", "approximate": "tanh"}, {"op": "linear", "in_features": 256, "out_features": 128}])",
        {80, 256}, false, 1, 103);  // inference: the bf16 norm, then its cast; bias + gelu inside the cast
}

TEST_CASE("fp8_block: inference (row-major codes only) at a row count of whole 16-row groups", "[fp8_block]") {
  check(R"([{"op": "layernorm"}, {"op": "linear", "in_features": 256, "out_features": 512}, {"op": "bias"},
            {"op": "gelu"}, {"op": "linear", "in_features": 512, "out_features": 256}])", {48, 256}, false, 1, 71);
  check(R"([{"op": "linear", "in_features": 128, "out_features": 384}])", {16, 128}, false, 2, 73);
}

TEST_CASE("fp8_block: a gated op right after a linear, with the caller's memory and with jitfuse's", "[fp8_block]") {
  for (bool host : {false, true}) {
    check(R"([{"op": "linear", "in_features": 256, "out_features": 1024}, {"op": "swiglu"}])", {256, 256}, true, 1, 79, host);
    check(R"([{"op": "linear", "in_features": 256, "out_features": 1024}, {"op": "swiglu"},
              {"op": "linear", "in_features": 512, "out_features": 256}])", {256, 256}, true, 1, 83, host);
    check(R"([{"op": "linear", "in_features": 256, "out_features": 256}, {"op": "gelu"}])", {256, 256}, true, 1, 89, host);
  }
}


// relu last before a linear: the fused cast kernel saves relu's output for its backward (nothing else
// writes it: the chain writes only the codes; before session 39 the backward failed with "saved context
// 'output' missing", under fp8_current too). Compared with the reference that quantises as the kernels do
// (bf16 tolerance); the comparison with the exact reference is left out: relu's kink turns the FP8
// operands' rounding into sign flips of relu' that no tolerance of a smooth op covers (a bf16 run shows
// the same with dropout's larger gradients).
TEST_CASE("fp8_block and fp8_current: relu before a linear saves its output from the cast kernel", "[fp8_block]") {
  for (const char* recipe : {"fp8_block", "fp8_current"}) {
    harness::CheckOptions o;
    o.recipe = recipe;
    o.shape = {256, 256};
    o.backward = true;
    o.calls = 2;
    o.seed = 107;
    auto rep = harness::check_sequence(test::shared_context(), test::builtin_registry(),
                                       test::seq_json(R"([{"op": "linear", "in_features": 256, "out_features": 512},
                                                          {"op": "bias"}, {"op": "relu"},
                                                          {"op": "linear", "in_features": 512, "out_features": 256}])"),
                                       o);
    INFO(recipe << "\n" << rep.table());
    int compared = 0;
    for (const auto& t : rep.tensors) {
      if (t.name.find("vs exact") != std::string::npos) continue;
      ++compared;
      CHECK(t.pass());
    }
    CHECK(compared >= 8);  // output, grad_input, both weights and the bias, elementwise and normwise
  }
}
