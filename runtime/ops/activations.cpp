// Pointwise activations (gelu, relu, silu, qgelu, srelu) and gated ones (swiglu, geglu, reglu).
// Their device side is templates/ops/activations.cuh; user-declared pointwise ops join this family.
#include "ops/op.hpp"

namespace jitfuse::ops {
namespace {

void add_pointwise(Registry& r, const char* name, const char* functor, const char* math, SavedKind saves) {
  OpKind k;
  k.name = name;
  k.family = Family::pointwise;
  k.math = math;
  k.template_file = "ops/activations.cuh";
  k.functor = functor;
  k.saves = saves;
  r.add(std::move(k));
}

void add_gated(Registry& r, const char* name, const char* functor, const char* math) {
  OpKind k;
  k.name = name;
  k.family = Family::gated;
  k.math = math;
  k.template_file = "ops/activations.cuh";
  k.functor = functor;
  k.infer = [](Op& op) {
    if (cols_of(op.in) % 2 != 0)
      shape_error(op, fmt::format("a gated activation splits the last dim in halves, but it is {} (odd)",
                                  cols_of(op.in)));
    op.out = op.in;
    op.out.back() /= 2;
    op.saved = {SavedKind::input};
    op.functor = op.info->functor;
    op.template_file = op.info->template_file;
  };
  r.add(std::move(k));
}

}  // namespace

void register_activations(Registry& r) {
  {
    OpKind k;
    k.name = "gelu";
    k.family = Family::pointwise;
    k.math = "y = x * Phi(x) (tanh approximation unless approximate = none)";
    k.template_file = "ops/activations.cuh";
    k.functor = "jf_op_gelu_tanh";
    k.attrs = {{AttrSpec::Type::string, "approximate", "tanh", {"tanh", "none"}, {}, {}}};
    k.infer = [](Op& op) {
      op.functor = op.str("approximate") == "tanh" ? "jf_op_gelu_tanh" : "jf_op_gelu_erf";
    };
    r.add(std::move(k));
  }
  // relu saves its output: relu'(x) = [y > 0], which lets cuBLASLt's RELU_BIAS epilogue stand in for it.
  add_pointwise(r, "relu", "jf_op_relu", "y = max(x, 0)", SavedKind::output);
  add_pointwise(r, "silu", "jf_op_silu", "y = x * sigmoid(x)", SavedKind::input);
  add_pointwise(r, "qgelu", "jf_op_qgelu", "y = x * sigmoid(1.702 x)", SavedKind::input);
  add_pointwise(r, "srelu", "jf_op_srelu", "y = max(x, 0)^2", SavedKind::input);
  add_gated(r, "swiglu", "jf_op_silu", "y = silu(x[:, :n]) * x[:, n:]");
  add_gated(r, "geglu", "jf_op_gelu_tanh", "y = gelu_tanh(x[:, :n]) * x[:, n:]");
  add_gated(r, "reglu", "jf_op_relu", "y = relu(x[:, :n]) * x[:, n:]");
}

}  // namespace jitfuse::ops
