// linear: y = x W^T with W [out_features, in_features] (weight_layout "in_out": W [in_features,
// out_features], y = x W, read as it lies); saves its input x for wgrad. Tensor parallel
// (docs/parallel.md): in_features and out_features stay the full layer's; the weight is this rank's shard —
// "column": [out_features / W, in_features], the output holds out_features / W columns; "row":
// [out_features, in_features / W], the input holds in_features / W columns. The sequence's parser inserts
// the collectives around it (ops::parse_sequence).
#include "ops/op.hpp"

namespace jitfuse::ops {

void register_linear(Registry& r) {
  OpKind k;
  k.name = "linear";
  k.family = Family::linear;
  k.math = "y = x W^T; dx = dy W; dW (+)= dy^T x";
  k.attrs = {
      {AttrSpec::Type::integer, "in_features", nullptr, {}, 1.0, {}},
      {AttrSpec::Type::integer, "out_features", nullptr, {}, 1.0, {}},
      {AttrSpec::Type::boolean, "accumulate_grad", false, {}, {}, {}},
      {AttrSpec::Type::string, "tensor_parallel", "none", {"none", "column", "row"}, {}, {}},
      {AttrSpec::Type::boolean, "sequence_parallel", false, {}, {}, {}},
      {AttrSpec::Type::string, "group", "tp", {}, {}, {}},
      // How the weight is stored: "out_in" [out_features, in_features] (nn.Linear's), or "in_out"
      // [in_features, out_features] (GPT-2's Conv1D, a transposed weight): the GEMMs read it as it lies.
      {AttrSpec::Type::string, "weight_layout", "out_in", {"out_in", "in_out"}, {}, {}},
      // The weight as two parameters, "weight" and "weight2" ([out_features / 2, in_features] each), the
      // outputs' first and second halves: a gated MLP's gate and up projections without joining them.
      {AttrSpec::Type::boolean, "split_weight", false, {}, {}, {}},
  };
  k.infer = [](Op& op) {
    int64_t in_f = op.attrs["in_features"], out_f = op.attrs["out_features"];
    const std::string tp = op.attrs.value("tensor_parallel", "none");  // absent: one rank's linear
    const int64_t w = op.world_size;
    auto shard = [&](int64_t features, const char* name) {
      if (features % w != 0)
        shape_error(op, fmt::format("{} = {} is not divisible by the world size {}: a {}-parallel linear splits it "
                                    "into equal shards", name, features, w, tp));
      return features / w;
    };
    if (tp == "column") out_f = shard(out_f, "out_features");
    if (tp == "row") in_f = shard(in_f, "in_features");
    if (cols_of(op.in) != in_f)
      shape_error(op, tp == "row" ? fmt::format("a row-parallel linear takes this rank's in_features / {} = {} input "
                                                "columns, the input's last dim is {}", w, in_f, cols_of(op.in))
                                  : fmt::format("in_features = {} but the input's last dim is {}", in_f, cols_of(op.in)));
    op.out = op.in;
    op.out.back() = out_f;
    const bool in_out = op.weight_in_out();
    if (in_out && tp != "none")
      shape_error(op, fmt::format("weight_layout \"in_out\" with tensor_parallel \"{}\": a parallel linear's shard is "
                                  "cut from an [out_features, in_features] weight; store it that way (transpose it "
                                  "once) or run the linear without tensor parallelism", tp));
    if (op.split_weight()) {
      if (out_f % 2 != 0 || in_out || tp != "none")
        shape_error(op, fmt::format("split_weight needs an even out_features (it is {}), weight_layout \"out_in\" and no "
                                    "tensor parallelism: its two weights are the outputs' halves, [out_features / 2, "
                                    "in_features] each", out_f));
      op.params = {{"weight", {out_f / 2, in_f}}, {"weight2", {out_f / 2, in_f}}};
    } else {
      op.params = {{"weight", in_out ? Shape{in_f, out_f} : Shape{out_f, in_f}}};
    }
    op.saved = {SavedKind::input};
  };
  r.add(std::move(k));
}

}  // namespace jitfuse::ops
