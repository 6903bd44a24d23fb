// Recipes: how numbers are represented. Plain recipes fix the activation/parameter dtype; FP8 recipes
// keep bf16 activations and make quantize an E4M3 cast with a per-tensor scale, from this tensor's amax
// (fp8_current) or an amax history (fp8_delayed) that lives with the sequence. fp8_block (issue 44) scales
// the linears' GEMM operands per block instead (DeepSeek-V3's recipe, TransformerEngine's
// Float8BlockScaling): activations and gradients per 1x128 block along the GEMM's K, weights per 128x128
// block, every operand E4M3, power-of-two scales from each block's own amax (no state); its quantize op
// casts as fp8_current does.
#pragma once
#include <cstdint>
#include <string>

namespace jitfuse::ops {

// i32 / i64: integer tensors an op reads beside the stream (cross_entropy's labels, ops::ExtraInputSpec); never
// an activation, parameter or gradient dtype.
enum class DType { f32, f16, bf16, e4m3, e5m2, i32, i64 };
enum class RecipeKind { fp32, fp16, bf16, fp8_delayed, fp8_current, fp8_block };

struct Recipe {
  RecipeKind kind = RecipeKind::fp32;
  DType dtype = DType::f32;       // activations, parameters and gradients
  DType compute = DType::f32;     // accumulation
  // FP8 only: amax history length (delayed scaling) and the margin applied to scales.
  int amax_history = 0;
  int margin = 0;

  bool is_fp8() const {
    return kind == RecipeKind::fp8_delayed || kind == RecipeKind::fp8_current || kind == RecipeKind::fp8_block;
  }
  bool is_block() const { return kind == RecipeKind::fp8_block; }
};

Recipe parse_recipe(const std::string& name);  // throws with the list of known recipes
std::string recipe_name(RecipeKind k);
std::string dtype_name(DType d);                // "fp32", "fp16", "bf16", "e4m3", "e5m2", "int32", "int64"
int dtype_bytes(DType d);
inline bool is_fp8(DType d) { return d == DType::e4m3 || d == DType::e5m2; }

}  // namespace jitfuse::ops
