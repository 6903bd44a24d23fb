// The op vocabulary: an OpKind says what an op is (attributes, shape rule, parameters, saved context,
// its device functor); an Op is one validated, shape-inferred occurrence of it in a sequence.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "ops/recipe.hpp"

namespace jitfuse::ops {

using Shape = std::vector<int64_t>;
// Tensors and reshape targets have at most this many dims (DLPack allows any int32; nobody needs more).
inline constexpr size_t kMaxDims = 16;
// Throws Error(invalid_argument) when the product overflows int64 instead of wrapping.
int64_t numel(const Shape& s);
int64_t rows_of(const Shape& s);  // product of all dims but the last
int64_t cols_of(const Shape& s);  // the last dim
std::string shape_str(const Shape& s);
Shape parse_shape(const std::string& text);  // "8192x4096" or "5,1,8"

enum class Family {
  linear,             // y = x W^T (cuBLASLt)
  bias,               // y = x + b[col]
  pointwise,          // y = f(x), f a device functor (built-in or user-declared)
  gated,              // y = act(x[:, :n]) * x[:, n:]
  norm,               // layernorm / rmsnorm over the last dim
  dropout,            // y = x * mask / (1 - p), Philox mask
  add_extra_input,    // y = x + e (residual)
  make_extra_output,  // y = x, extra = x (fork)
  comm,               // a collective over the ranks of a tensor-parallel group (NCCL; docs/parallel.md)
  loss,               // rows of logits -> a loss (cross_entropy); the sequence's last op
  moe,                // token routing to experts and back (moe_permute, moe_unpermute)
  grouped_linear,     // y_g = x_g W_g^T over G equal groups of rows (the experts' linears; cuBLASLt per group)
};
std::string family_name(Family f);

// What an op keeps for its backward. Each op owns its saved context; fused groups must produce it.
enum class SavedKind {
  input,      // the op's input tensor (dtype of the recipe)
  output,     // the op's output tensor
  row_stats,  // fp32 mean and rstd per row (norms)
  mask_bits,  // 1 bit per element, rows padded to whole bytes (dropout)
  logsumexp,  // fp32 logsumexp per row, and the fp32 scale of the reduction (cross_entropy)
};

struct AttrSpec {
  enum class Type { number, integer, boolean, string, shape } type = Type::number;
  std::string name;
  nlohmann::json default_value;  // null: required
  std::vector<std::string> choices;  // strings only
  std::optional<double> min, max;    // numbers only; min inclusive, max exclusive when max_exclusive
  bool max_exclusive = false;
  bool min_exclusive = false;        // e.g. eps > 0
};

// Checks a number attribute against what a kernel can use: finite, |v| <= FLT_MAX (it becomes a float
// constant), and not a nonzero value below FLT_MIN (it would be flushed or lose its precision). Returns
// what is wrong ("" if nothing).
std::string float_range_problem(double v);

struct Op;

// An extra input an op reads with its own dtype and shape instead of the recipe's dtype and the op's input
// shape (cross_entropy's labels: int64 or int32, one per row). The kind's infer fills it; the C ABI checks
// the caller's tensor against it (naming `name`), and it has no gradient: the backward's
// grad_extra_inputs[slot] is NULL.
struct ExtraInputSpec {
  std::string name;        // "labels"
  std::string dtype_attr;  // the op's attribute that sets the dtype ("label_dtype"), for messages
  DType dtype = DType::i64;
  Shape shape;
};

struct OpKind {
  std::string name;
  Family family = Family::pointwise;
  std::string math;  // one line, shown by explain
  std::vector<AttrSpec> attrs;
  // Checks cross-attribute constraints and fills shapes, params, saved context and functor of `op`.
  std::function<void(Op& op)> infer;
  std::string template_file;  // for functor families: "ops/<name>.cuh"
  std::string functor;        // device struct name, e.g. jf_op_silu
  std::vector<std::string> const_attrs;  // attributes passed to the functor as float constants, in order
  SavedKind saves = SavedKind::input;    // pointwise only
  bool user_declared = false;
  std::string declared_in;  // file for user-declared ops
  std::string template_path;  // user-declared ops: the template's real path (for compiler messages)
  // Reads one extra input of the caller beside its input (an ExtraInputSpec its infer fills): it takes
  // the next extra input slot, as an add_extra_input does.
  bool takes_extra_input = false;
  // Must be the sequence's last op (a loss): parse_sequence refuses it anywhere else.
  bool last_only = false;
  // What the extra input is called in messages and the wiring ("labels", "indices", "probs"), and whether the
  // backward writes its gradient (moe_unpermute's probs: an fp32 tensor of the extra input's shape).
  std::string extra_input_name = "labels";
  bool extra_input_grad = false;
};

struct Param {
  std::string name;  // "weight", "bias"
  Shape shape;
};

struct Op {
  int index = 0;
  std::string kind;
  const OpKind* info = nullptr;
  Family family = Family::pointwise;
  nlohmann::json attrs;  // validated, defaults filled
  Shape in, out;
  std::vector<Param> params;
  std::vector<SavedKind> saved;
  std::string functor;           // pointwise / gated: device functor
  std::string template_file;     // header that defines `functor`
  std::vector<double> consts;    // functor constants (from const_attrs)
  // The caller's extra tensor this op owns: add_extra_input, which extra input; make_extra_output, which
  // extra output; -1 for ops that own none (a hidden channel's fork, a channel's readers after the first).
  int extra_slot = -1;
  // An op that reads an extra input of its own dtype and shape (OpKind::takes_extra_input): what it is.
  std::optional<ExtraInputSpec> extra_input;
  // Named channels (add_extra_input / make_extra_output with "channel"; docs/ops.md#channels).
  std::string channel;           // "": the caller's extra tensor, as without channels
  bool returned = false;         // make_extra_output of a channel: also the caller's extra output extra_slot
  // add_extra_input of a channel: the op its value comes from — the make_extra_output writing it, or for a
  // channel of the caller ("input_channels") the channel's first reader, which owns the extra input slot.
  int channel_src = -1;
  // add_extra_input of a channel with several readers: its backward adds its gradient into the channel's
  // (every reader but the last; the last one, first in the backward, writes it).
  bool grad_accumulate = false;
  // make_extra_output of a returned channel that is also read: its backward adds the caller's gradient and
  // the readers' (two tensors).
  bool grad_two_parts = false;
  // The channel's source (a make_extra_output, or a caller's channel's first reader): how many ops read it.
  int channel_readers = 0;

  // Tensor parallelism (docs/parallel.md): the group's world size and this rank, as the sequence was
  // inferred for (1 and 0 without a communicator); what comm ops and parallel linears size their shards by.
  int world_size = 1, rank = 0;
  // An op the planner inserted (a parallel linear's collective): the op it serves; -1 for the sequence's own.
  int inserted_for = -1;
  // moe_unpermute (and moe_dispatch): the moe_permute whose routing it reads, that op's input shape [T, H] and its
  // top_k. A grouped_linear or moe_combine after a moe_dispatch (expert parallelism) reads the dispatch's routing
  // instead: route_in is then the dispatch's input shape (the permuted rows).
  int route_op = -1;
  Shape route_in;
  int64_t route_topk = 0, route_rows = 0;  // the routed rows (the routing op's output rows)
  // grouped_linear between a moe_permute and its unpermute: that permute's num_experts and layout (packed: the
  // groups are its experts' rows, counted on the device; dropless, read on the host per call). After a
  // moe_dispatch: the experts this rank owns (num_experts / world size), packed.
  int64_t route_experts = 0;
  bool route_packed = false;
  // The int index of splits[0] (then starts[route_experts + 1]) in the routing op's int32 routing buffer.
  int64_t route_splits_at = 0;

  std::string label() const;  // "op 3 (gelu)"
  double num(const char* attr) const { return attrs.at(attr).get<double>(); }
  bool flag(const char* attr) const { return attrs.at(attr).get<bool>(); }
  std::string str(const char* attr) const { return attrs.at(attr).get<std::string>(); }
  // A linear's weight attributes (docs/ops.md#linear); false for every other op.
  bool weight_in_out() const { return attrs.value("weight_layout", "out_in") == "in_out"; }  // stored [in, out]
  bool split_weight() const { return attrs.value("split_weight", false); }  // two parameters, the outputs' halves
};

class Registry {
 public:
  Registry();  // the built-in vocabulary
  void add(OpKind kind);  // user-declared ops; replaces a user op of the same name
  const OpKind* find(const std::string& name) const;
  std::vector<std::string> names() const;

 private:
  std::map<std::string, std::shared_ptr<OpKind>> kinds_;
  std::vector<std::shared_ptr<OpKind>> retired_;  // replaced user ops, still referenced by old sequences
};

// One file per op family registers its kinds.
void register_linear(Registry& r);
void register_bias(Registry& r);
void register_activations(Registry& r);
void register_norms(Registry& r);
void register_dropout(Registry& r);
void register_structural(Registry& r);
void register_comm(Registry& r);
void register_cross_entropy(Registry& r);
void register_moe(Registry& r);

// Validates `attrs` against `kind.attrs` (unknown names, types, ranges, choices) and fills defaults.
// Errors about one attribute name `where_attr(name)` when given (its own file:line:col), else `where`.
nlohmann::json validate_attrs(const OpKind& kind, const nlohmann::json& attrs, const std::string& where,
                              const std::function<std::string(const std::string&)>& where_attr = {});

[[noreturn]] void shape_error(const Op& op, const std::string& what);

}  // namespace jitfuse::ops
