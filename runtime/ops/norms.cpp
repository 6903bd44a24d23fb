// layernorm and rmsnorm over the last dim; they save their input and fp32 mean/rstd per row.
#include "ops/op.hpp"

namespace jitfuse::ops {
namespace {

void add_norm(Registry& r, const char* name, const char* math, bool has_beta) {
  OpKind k;
  k.name = name;
  k.family = Family::norm;
  k.math = math;
  k.attrs = {
      {AttrSpec::Type::number, "eps", 1e-5, {}, 0.0, {}, false, true},  // eps > 0
      {AttrSpec::Type::boolean, "zero_centered_gamma", false, {}, {}, {}},
  };
  k.infer = [has_beta](Op& op) {
    if (op.num("eps") <= 0) shape_error(op, "eps must be > 0");
    op.out = op.in;
    int64_t h = cols_of(op.in);
    op.params = {{"weight", {h}}};
    if (has_beta) op.params.push_back({"bias", {h}});
    op.saved = {SavedKind::input, SavedKind::row_stats};
  };
  r.add(std::move(k));
}

}  // namespace

void register_norms(Registry& r) {
  add_norm(r, "layernorm", "y = (x - mean) * rstd * g + beta, g = gamma (+1 if zero_centered)", true);
  add_norm(r, "rmsnorm", "y = x * rsqrt(mean(x^2) + eps) * g, g = gamma (+1 if zero_centered)", false);
}

}  // namespace jitfuse::ops
