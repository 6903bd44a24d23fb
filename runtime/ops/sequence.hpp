// A sequence: ops input -> output (format "jitfuse.sequence/1"), parsed once, then shape-inferred per
// input shape into a list of Ops. Errors name the file:line:col and the op index.
#pragma once
#include <string>
#include <vector>

#include "ops/op.hpp"
#include "ops/recipe.hpp"

namespace jitfuse::ops {

struct OpDef {
  int index = 0;       // position in the sequence (after the parser's inserted collectives)
  int json_index = 0;  // position in the file's "ops" (what errors point at); an inserted op: its linear's
  int inserted_for = -1;  // a collective the parser inserted for a parallel linear: that linear's index
  std::string kind;
  nlohmann::json attrs;  // validated, defaults filled
  const OpKind* info = nullptr;
  std::string channel;    // "channel" (add_extra_input / make_extra_output), "" if none
  bool returned = false;  // "returned" (make_extra_output of a channel)
};

// One of the caller's extra tensors, as the parser numbers them (check_channels; jf_sequence_wiring).
struct WiringSlot {
  int op = 0;           // the op that owns it, as the document counts ("ops" position)
  int index = 0;        // the same op in the sequence (after the parser's inserted collectives)
  std::string channel;  // its channel, "" if none
  // Extra inputs: "add" (add_extra_input without a channel), "channel" (the first reader of an input
  // channel), "labels" (an op's own extra input: cross_entropy). Extra outputs: "output" (make_extra_output
  // without a channel), "returned" (a channel also handed to the caller).
  std::string kind;
};

// A named channel: its source (the document's op index of its make_extra_output, -1 for an input channel),
// its readers (document op indices, in order) and whether the caller also gets it.
struct WiringChannel {
  std::string name;
  int source = -1;
  std::vector<int> readers;
  bool returned = false;
};

struct SequenceDef {
  std::string name;
  std::vector<OpDef> ops;
  int extra_inputs = 0, extra_outputs = 0;  // the caller's extra tensors (slots; channels count per rules below)
  // The same slots in order, and the channels (input channels first, then by source): the sequence's wiring.
  std::vector<WiringSlot> extra_input_slots, extra_output_slots;
  std::vector<WiringChannel> channels;
  // Extra input slots of an op's own dtype (OpKind::takes_extra_input: cross_entropy's labels): they have no
  // gradient, so the backward's grad_extra_inputs holds NULL there.
  std::vector<int> nograd_extra_inputs;
  // Channels the caller provides ("input_channels"): each is one extra input, numbered at its first reader.
  std::vector<std::string> input_channels;
  std::string canonical;  // canonical JSON of the ops: part of plan cache keys
  // "fp8": {"amax_history_len": N, "margin": M} (FP8 recipes; 0 / -1: the recipe's defaults, 1024 and 0).
  int fp8_amax_history = 0;
  int fp8_margin = -1;
  // Tensor parallelism: the one communicator group its comm ops and parallel linears name ("" if none).
  std::string group;
};

// The ranks a sequence is inferred for: the world size and this rank of its group (docs/parallel.md).
struct Parallel {
  int world_size = 1, rank = 0;
};
inline constexpr int kMaxWorldSize = 1 << 16;
inline constexpr int kMaxAmaxHistory = 1024;  // one thread per entry in the update kernel
inline constexpr int kMaxFp8Margin = 32;

// Ops per sequence: a real model's longest sequence is a few hundred ops.
inline constexpr size_t kMaxOps = 100000;
inline constexpr size_t kMaxNameBytes = 256;  // the sequence's "name"
inline constexpr size_t kMaxChannelName = 64;  // [A-Za-z0-9_.-]{1,64}
SequenceDef parse_sequence(const std::string& text, const std::string& where, const Registry& registry);
SequenceDef parse_sequence_file(const std::string& path, const Registry& registry);

// The recipe a sequence runs: `recipe` with the sequence's FP8 settings applied (its "fp8" object:
// amax history length and margin, used by the FP8 recipes and ignored by the others), after checking
// what the recipe can run (under the FP8 recipes quantize, the FP8 cast, only as the last op).
void apply_recipe(const SequenceDef& def, Recipe& recipe);

// The wiring as JSON (jf_sequence_wiring, docs/c_api.md): {"extra_inputs": [slot...], "extra_outputs":
// [slot...], "channels": [{"name", "source", "readers", "returned"}], "input_channels": [name...]}, a slot
// being {"slot", "op", "index", "kind", "channel" (null if none)}.
nlohmann::json wiring_json(const SequenceDef& def);

// Shapes through the whole sequence; an error names the op where they stop fitting.
// `par`: the group's world size and this rank (shards of parallel linears, shapes around collectives).
std::vector<Op> infer(const SequenceDef& def, const Shape& input, const Parallel& par = {});

}  // namespace jitfuse::ops
