// Ops that move or route values: scale, add_extra_input (residual), make_extra_output (fork),
// identity, reshape, and quantize (the identity under plain recipes; FP8 gives it meaning).
#include "ops/op.hpp"

#include "common/error.hpp"
#include "common/text.hpp"

namespace jitfuse::ops {

void register_structural(Registry& r) {
  {
    OpKind k;
    k.name = "scale";
    k.family = Family::pointwise;
    k.math = "y = value * x";
    k.template_file = "ops/activations.cuh";
    k.functor = "jf_op_scale";
    k.const_attrs = {"value"};
    k.saves = SavedKind::input;
    k.attrs = {{AttrSpec::Type::number, "value", nullptr, {}, {}, {}}};
    k.infer = [](Op& op) { op.saved.clear(); };  // the backward needs only the constant
    r.add(std::move(k));
  }
  for (const char* name : {"identity", "quantize"}) {
    OpKind k;
    k.name = name;
    k.family = Family::pointwise;
    k.math = std::string(name) == "identity" ? "y = x" : "y = x (plain recipes); FP8 cast under FP8 recipes";
    k.template_file = "ops/activations.cuh";
    k.functor = "jf_op_identity";
    k.infer = [](Op& op) { op.saved.clear(); };
    r.add(std::move(k));
  }
  {
    OpKind k;
    k.name = "reshape";
    k.family = Family::pointwise;
    k.math = "y = x viewed with another shape (same elements, same order)";
    k.template_file = "ops/activations.cuh";
    k.functor = "jf_op_identity";
    k.attrs = {{AttrSpec::Type::shape, "shape", nullptr, {}, {}, {}}};
    k.infer = [](Op& op) {
      Shape s;
      int infer_at = -1;
      int64_t known = 1;
      for (auto& d : op.attrs["shape"]) {
        int64_t v = d.get<int64_t>();
        if (v == -1) {
          if (infer_at >= 0) shape_error(op, "reshape allows at most one -1");
          infer_at = static_cast<int>(s.size());
        } else {
          if (__builtin_mul_overflow(known, v, &known)) shape_error(op, "reshape target has too many elements");
        }
        s.push_back(v);
      }
      if (infer_at >= 0) {
        if (known == 0 || numel(op.in) % known != 0)
          shape_error(op, fmt::format("cannot reshape {} elements to {}", numel(op.in), jitfuse::text::shorten(op.attrs["shape"].dump())));
        s[infer_at] = numel(op.in) / known;
      }
      if (numel(s) != numel(op.in))
        shape_error(op, fmt::format("reshape to {} has {} elements, the input has {}", jitfuse::text::shorten(op.attrs["shape"].dump()),
                                    numel(s), numel(op.in)));
      op.out = s;
      op.saved.clear();
    };
    r.add(std::move(k));
  }
  {
    OpKind k;
    k.name = "add_extra_input";
    k.family = Family::add_extra_input;
    k.math = "y = x + e; dx = de = dy";
    r.add(std::move(k));
  }
  {
    OpKind k;
    k.name = "make_extra_output";
    k.family = Family::make_extra_output;
    k.math = "y = x, extra = x; dx = dy + d_extra";
    r.add(std::move(k));
  }
}

}  // namespace jitfuse::ops
