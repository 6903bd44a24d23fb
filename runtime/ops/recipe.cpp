// Parsing and naming of recipes and dtypes.
#include "ops/recipe.hpp"

#include "common/error.hpp"
#include "common/text.hpp"

namespace jitfuse::ops {

Recipe parse_recipe(const std::string& name) {
  Recipe r;
  if (name == "fp32") {
    r.kind = RecipeKind::fp32; r.dtype = DType::f32;
  } else if (name == "fp16") {
    r.kind = RecipeKind::fp16; r.dtype = DType::f16;
  } else if (name == "bf16") {
    r.kind = RecipeKind::bf16; r.dtype = DType::bf16;
  } else if (name == "fp8_delayed" || name == "fp8_current") {
    // Activations, parameters and gradients stay bf16; quantize casts its input to E4M3 with a per-tensor
    // scale (delayed: from the amax history of earlier calls; current: from this tensor's amax).
    r.kind = name == "fp8_delayed" ? RecipeKind::fp8_delayed : RecipeKind::fp8_current;
    r.dtype = DType::bf16;
    r.amax_history = r.kind == RecipeKind::fp8_delayed ? 1024 : 1;
    r.margin = 0;
  } else if (name == "fp8_block") {
    // Block scaling of the GEMM operands (recipe.hpp); a quantize op casts with its current amax.
    r.kind = RecipeKind::fp8_block;
    r.dtype = DType::bf16;
    r.amax_history = 1;
    r.margin = 0;
  } else {
    fail(Status::invalid_argument,
         "unknown recipe '{}': expected one of fp32, fp16, bf16, fp8_delayed, fp8_current, fp8_block",
         jitfuse::text::shorten(name));
  }
  return r;
}

std::string recipe_name(RecipeKind k) {
  switch (k) {
    case RecipeKind::fp32: return "fp32";
    case RecipeKind::fp16: return "fp16";
    case RecipeKind::bf16: return "bf16";
    case RecipeKind::fp8_delayed: return "fp8_delayed";
    case RecipeKind::fp8_current: return "fp8_current";
    case RecipeKind::fp8_block: return "fp8_block";
  }
  return "?";
}

std::string dtype_name(DType d) {
  switch (d) {
    case DType::f32: return "fp32";
    case DType::f16: return "fp16";
    case DType::bf16: return "bf16";
    case DType::e4m3: return "e4m3";
    case DType::e5m2: return "e5m2";
    case DType::i32: return "int32";
    case DType::i64: return "int64";
  }
  return "?";
}

int dtype_bytes(DType d) {
  switch (d) {
    case DType::f32:
    case DType::i32: return 4;
    case DType::i64: return 8;
    case DType::f16:
    case DType::bf16: return 2;
    default: return 1;
  }
}

}  // namespace jitfuse::ops
