// cuBLASLt DGELU_BGRAD (backward of [bias gelu linear (bias)]): d(bias input) = gelu'(h) * (dy W) with h
// gelu's saved input, and db of the first bias = its column sums, in the dgrad's epilogue; then the
// wgrad (BGRADB for a bias after the linear).
#include "exec/lower/impl/cublaslt_epilogue.hpp"
#include "exec/lower/impl/registrar.hpp"

namespace jitfuse::exec {
namespace {

class DgeluBgrad final : public CublasEpilogue {
 public:
  std::string name() const override { return "DGELU_BGRAD"; }

 protected:
  rules::Pass pass() const override { return rules::Pass::backward; }
  std::vector<Kinds> shapes() const override {
    return {{{"bias"}, {"gelu"}, {"linear"}}, {{"bias"}, {"gelu"}, {"linear"}, {"bias"}}};
  }
  std::optional<std::string> extra(const std::vector<OpUse>& w) const override {
    if (w[1].str("approximate") != "tanh")
      return "DGELU_BGRAD differentiates gelu_tanh only: the gelu needs \"approximate\": \"tanh\"";
    // The dgrad's D is dx [rows, in_features]: the aux matrix's leading dimension is the linear's K.
    const ops::Op* lin = w[2].op;
    return gelu_aux_ld_problem(name(), "reads", lin ? ops::cols_of(lin->in) : 0, "the linear's in_features");
  }
  void backward(Builder& b) const override {
    const auto& g = b.group();
    const int lin = role(b, ops::Family::linear), act = role(b, ops::Family::pointwise);
    LinearBackward lb;
    lb.dy = b.grad_of(g.end);
    lb.dx = b.grad_of(g.begin);
    lb.dgrad_epilogue = cuda::Epilogue::dgelu_bgrad;
    lb.dgrad_aux = b.saved_context(act, Key::input);
    lb.dgrad_bias = b.grad(role(b, ops::Family::bias, 0), Key::bias);
    if (lin + 1 < g.end) lb.bias_grad_op = role(b, ops::Family::bias, 1);
    linear_backward(b, lin, lb);
  }
};

const Registrar kRegistered(std::make_unique<DgeluBgrad>());

}  // namespace
}  // namespace jitfuse::exec
