// Recipes: how numbers are represented. Plain recipes fix the activation/parameter dtype; FP8 recipes
// keep bf16 activations and make quantize an E4M3 cast with a per-tensor scale, from this tensor's amax
// (fp8_current) or an amax history (fp8_delayed) that lives with the sequence.
#pragma once
#include <cstdint>
#include <string>

namespace jitfuse::ops {

// i32 / i64: integer tensors an op reads beside the stream (cross_entropy's labels, ops::ExtraInputSpec); never
// an activation, parameter or gradient dtype.
enum class DType { f32, f16, bf16, e4m3, e5m2, i32, i64 };
enum class RecipeKind { fp32, fp16, bf16, fp8_delayed, fp8_current };

struct Recipe {
  RecipeKind kind = RecipeKind::fp32;
  DType dtype = DType::f32;       // activations, parameters and gradients
  DType compute = DType::f32;     // accumulation
  // FP8 only: amax history length (delayed scaling) and the margin applied to scales.
  int amax_history = 0;
  int margin = 0;

  bool is_fp8() const { return kind == RecipeKind::fp8_delayed || kind == RecipeKind::fp8_current; }
};

Recipe parse_recipe(const std::string& name);  // throws with the list of known recipes
std::string recipe_name(RecipeKind k);
std::string dtype_name(DType d);                // "fp32", "fp16", "bf16", "e4m3", "e5m2", "int32", "int64"
int dtype_bytes(DType d);
inline bool is_fp8(DType d) { return d == DType::e4m3 || d == DType::e5m2; }

}  // namespace jitfuse::ops
