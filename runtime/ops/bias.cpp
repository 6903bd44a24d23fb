// bias: y = x + b[col]; db = sum over rows of dy; saves nothing.
#include "ops/op.hpp"

namespace jitfuse::ops {

void register_bias(Registry& r) {
  OpKind k;
  k.name = "bias";
  k.family = Family::bias;
  k.math = "y = x + b; db = sum_rows dy";
  k.infer = [](Op& op) {
    op.out = op.in;
    op.params = {{"bias", {cols_of(op.in)}}};
  };
  r.add(std::move(k));
}

}  // namespace jitfuse::ops
