// The FP8 recipe-state updates a pass launches (the FP8 module's part of a call): the per-kernel update
// after a cast (current scaling's amax pass, a quantize op's delayed update) and the batched update of the
// pass's delayed-scaling operand casts and FP8 GEMM outputs, launched once after the pass.
#pragma once
#include <cuda.h>

#include <tuple>
#include <vector>

namespace jitfuse::exec::fp8 {

// One recipe state's update inputs: the per-block amax partials a cast (or one float a GEMM) wrote, and
// the state it rolls.
struct UpdateEntry {
  const float* partials = nullptr;
  int count = 0;  // partials
  float* history = nullptr;
  float* scale = nullptr;
  float* scale_inv = nullptr;  // null: a cast wrote its copy's own
};

// Reduces one kernel's amax partials into `e`'s state right after it (one block of 1024 threads): into
// amax_history[0] (current scaling's amax pass), or the history roll with the scale update (delayed).
void launch_update(CUfunction update, const UpdateEntry& e, int history_len, CUstream stream);

// The per-pass batch (codegen::Generated::fp8_batched): what the pass's casts left to it, kFp8Batch states
// per launch of the batch kernel (mirrors its JfFp8Batch).
class UpdateBatch {
 public:
  // `kernel`: the batch kernel of the cast that queued (any cast's of the pass: one format and margin per
  // pass), or null for a GEMM output (joining the batch of its linear's input cast, which runs before it).
  void add(CUfunction kernel, int history_len, const UpdateEntry& e);
  void launch(CUstream stream);  // after the pass's last step; no-op when nothing was queued

 private:
  CUfunction fn_ = nullptr;
  int len_ = 0;
  std::vector<UpdateEntry> entries_;
};

}  // namespace jitfuse::exec::fp8
