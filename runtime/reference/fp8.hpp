// The float64 reference's model of the GPU's FP8 GEMM operand casts (SeqInputs::quantize): the recipe
// state and the casts, in float as the kernels compute them.
#pragma once
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "ops/recipe.hpp"

namespace jitfuse::reference {

// scale = fp8_max / amax / 2^margin (1 while amax is 0), codes = RNE + saturation of (float)x * scale,
// the GEMM reading code * (1 / scale). fp8_current: amax of this tensor; fp8_delayed: the stored scale,
// then the history rolls (newest first) and the next scale comes from its maximum. Called as
// SeqInputs::quantize (op, tensor = "input" | "weight" | "grad_output", values quantised in place).
// fp8_block: every operand E4M3 with a power-of-two scale per block (templates/skeletons/block_cast.cuh):
// "input" / "grad_output" per 1x128 block of a row, "input_t" / "grad_output_t" per 128x1 block of a
// column, "weight" per 128x128 block.
class Fp8Reference {
 public:
  explicit Fp8Reference(const ops::Recipe& r);
  void operator()(int op, const std::string& tensor, std::vector<double>& v, int64_t rows, int64_t cols);
  bool block() const { return block_; }

 private:
  float scale_of(float amax, float fmax) const;
  void block_cast(const std::string& tensor, std::vector<double>& v, int64_t rows, int64_t cols) const;
  bool block_;
  struct State {
    float scale = 1.f;
    std::vector<float> hist;
  };
  bool delayed_;
  int len_;
  float margin_;
  std::map<std::pair<int, std::string>, State> state_;
};

}  // namespace jitfuse::reference
