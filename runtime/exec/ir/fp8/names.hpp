// FP8 tensors and recipe-state fields by type: which operand of a linear's GEMMs (or a quantize op's own
// state) and which part of it. Strings appear only at the boundaries that spell them (the C ABI's
// jf_sequence_fp8_operand_state, codegen's KernelSpec::fp8, explain's buffer names).
#pragma once
#include <cstdint>
#include <optional>
#include <string_view>

#include "ops/recipe.hpp"

namespace jitfuse::exec::fp8 {

// The FP8 operands of a linear's GEMMs; `none`: a quantize op's own state.
enum class Operand : int8_t { none = -1, input = 0, weight = 1, grad_output = 2 };
inline constexpr Operand kOperands[] = {Operand::input, Operand::weight, Operand::grad_output};

// One recipe state is one device allocation [scale, scale_inv, history...]; one FP8 copy of an operand is
// its row-major codes, its transposed codes (training) and the scale_inv its cast used. Under fp8_block
// scale_inv is the row-major codes' block scales and col_scale_inv the transposed codes' (cuda::Fp8Scaling
// gives their layouts).
enum class Part : int8_t { scale, scale_inv, history, row, col, col_scale_inv };

const char* name(Operand o);  // "input", "weight", "grad_output"; "" for none
const char* name(Part p);     // "scale", "scale_inv", "amax_history", "row", "col", "col_scale_inv"
std::optional<Operand> parse_operand(std::string_view s);  // the spelling of name(Operand); none for ""

// The sequence's output dtype: E4M3 when an FP8 recipe ends the sequence in quantize, else the recipe's.
ops::DType output_dtype(const ops::Recipe& recipe, std::string_view last_op_kind);

}  // namespace jitfuse::exec::fp8
