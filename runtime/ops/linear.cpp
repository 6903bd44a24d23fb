// linear: y = x W^T with W [out_features, in_features]; saves its input x for wgrad.
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
  };
  k.infer = [](Op& op) {
    int64_t in_f = op.attrs["in_features"], out_f = op.attrs["out_features"];
    if (cols_of(op.in) != in_f)
      shape_error(op, fmt::format("in_features = {} but the input's last dim is {}", in_f, cols_of(op.in)));
    op.out = op.in;
    op.out.back() = out_f;
    op.params = {{"weight", {out_f, in_f}}};
    op.saved = {SavedKind::input};
  };
  r.add(std::move(k));
}

}  // namespace jitfuse::ops
