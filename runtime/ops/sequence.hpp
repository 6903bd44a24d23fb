// A sequence: ops input -> output (format "jitfuse.sequence/1"), parsed once, then shape-inferred per
// input shape into a list of Ops. Errors name the file:line:col and the op index.
#pragma once
#include <string>
#include <vector>

#include "ops/op.hpp"

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

SequenceDef parse_sequence(const std::string& text, const std::string& where, const Registry& registry);
SequenceDef parse_sequence_file(const std::string& path, const Registry& registry);

// Shapes through the whole sequence; an error names the op where they stop fitting.
std::vector<Op> infer(const SequenceDef& def, const Shape& input);

}  // namespace jitfuse::ops
