// dropout: y = x * mask / (1 - p), mask from Philox4x32-10 keyed by (seed, offset); saves the
// bit-packed mask. In eval mode (training = false) or with p = 0 it is the identity and saves nothing.
#include "ops/op.hpp"

namespace jitfuse::ops {

void register_dropout(Registry& r) {
  OpKind k;
  k.name = "dropout";
  k.family = Family::dropout;
  k.math = "y = x * mask / (1 - p); mask ~ Bernoulli(1 - p) from Philox(seed, offset)";
  k.template_file = "ops/dropout.cuh";
  k.attrs = {
      {AttrSpec::Type::number, "p", nullptr, {}, 0.0, 1.0, true},
      {AttrSpec::Type::integer, "seed", 0, {}, 0.0, {}},
      {AttrSpec::Type::boolean, "training", true, {}, {}, {}},
  };
  k.infer = [](Op& op) {
    op.out = op.in;
    bool active = op.flag("training") && op.num("p") > 0;
    if (active) op.saved = {SavedKind::mask_bits};
  };
  r.add(std::move(k));
}

}  // namespace jitfuse::ops
