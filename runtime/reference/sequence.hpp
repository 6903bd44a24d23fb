// Float64 reference of a whole shape-inferred sequence, forward and backward, built from the per-op
// references. It is what every GPU check and `jitfuse check` compare against.
#pragma once
#include <functional>
#include <map>
#include <utility>

#include "ops/op.hpp"
#include "reference/reference.hpp"

namespace jitfuse::reference {

using ParamKey = std::pair<int, std::string>;

struct SeqInputs {
  Vec input;
  std::vector<Vec> extra_in;
  std::map<ParamKey, Vec> params;
  uint64_t rng_offset = 0;
  uint64_t rng_seed = 0;  // the call's Philox seed: a dropout's key is its seed attribute XOR this
  // FP8 recipes: replaces a linear's GEMM operand [rows, cols] by its quantised value (op, "input" |
  // "weight" | "grad_output"), as the GPU's cast does; called once per operand per pass. Unset: exact GEMMs.
  // With `transposed_copies` (fp8_block) the wgrad reads copies of x and dy quantised on their own
  // ("input_t", "grad_output_t": the GPU's transposed copies, scaled per block of 128 rows of a column).
  std::function<void(int op, const std::string& tensor, Vec& v, int64_t rows, int64_t cols)> quantize;
  bool transposed_copies = false;
};

struct SeqForward {
  Vec output;
  std::vector<Vec> extra_out;
  std::vector<Vec> values;  // values[i] = input of op i; values[n] = output
  std::map<ParamKey, Vec> quantized;  // SeqInputs::quantize: (linear, "input" | "weight") as the GEMMs read them
};

struct SeqGrads {
  Vec grad_input;
  std::vector<Vec> grad_extra_in;
  std::map<ParamKey, Vec> grad_params;
};

// Throws std::invalid_argument for ops without a float64 reference (user-declared ops).
SeqForward sequence_forward(const std::vector<ops::Op>& ops, const SeqInputs& in);
SeqGrads sequence_backward(const std::vector<ops::Op>& ops, const SeqInputs& in, const SeqForward& fwd,
                           const Vec& grad_output, const std::vector<Vec>& grad_extra_out);

}  // namespace jitfuse::reference
