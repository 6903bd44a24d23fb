// A sequence: ops input -> output (format "jitfuse.sequence/1"), parsed once, then shape-inferred per
// input shape into a list of Ops. Errors name the file:line:col and the op index.
#pragma once
#include <string>
#include <vector>

#include "ops/op.hpp"
#include "ops/recipe.hpp"

namespace jitfuse::ops {

struct OpDef {
  int index = 0;
  std::string kind;
  nlohmann::json attrs;  // validated, defaults filled
  const OpKind* info = nullptr;
};

struct SequenceDef {
  std::string name;
  std::vector<OpDef> ops;
  int extra_inputs = 0, extra_outputs = 0;
  std::string canonical;  // canonical JSON of the ops: part of plan cache keys
};

// Ops per sequence: a real model's longest sequence is a few hundred ops.
inline constexpr size_t kMaxOps = 100000;
inline constexpr size_t kMaxNameBytes = 256;  // the sequence's "name"
SequenceDef parse_sequence(const std::string& text, const std::string& where, const Registry& registry);
SequenceDef parse_sequence_file(const std::string& path, const Registry& registry);

// What a recipe can run: under the FP8 recipes a sequence holds no linear (FP8 GEMMs are not
// implemented) and quantize, the FP8 cast, only as its last op (the E4M3 output is the sequence's).
void check_recipe_support(const SequenceDef& def, const Recipe& recipe);

// Shapes through the whole sequence; an error names the op where they stop fitting.
std::vector<Op> infer(const SequenceDef& def, const Shape& input);

}  // namespace jitfuse::ops
