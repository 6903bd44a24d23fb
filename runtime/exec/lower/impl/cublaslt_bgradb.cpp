// cuBLASLt BGRADB (backward of [linear bias]): dx = dy W, then dW = dy^T x with db = column sums of dy in
// the wgrad's epilogue (or a ones-column GEMM when cuBLASLt has no BGRADB algorithm for the problem).
#include "exec/lower/impl/cublaslt_epilogue.hpp"
#include "exec/lower/impl/registrar.hpp"

namespace jitfuse::exec {
namespace {

class Bgradb final : public CublasEpilogue {
 public:
  std::string name() const override { return "BGRADB"; }

 protected:
  rules::Pass pass() const override { return rules::Pass::backward; }
  std::vector<Kinds> shapes() const override { return {{{"linear"}, {"bias"}}}; }
  void backward(Builder& b) const override {
    const auto& g = b.group();
    LinearBackward lb;
    lb.dy = b.grad_of(g.end);
    lb.dx = b.grad_of(g.begin);
    lb.bias_grad_op = role(b, ops::Family::bias);
    linear_backward(b, role(b, ops::Family::linear), lb);
  }
};

const Registrar kRegistered(std::make_unique<Bgradb>());

}  // namespace
}  // namespace jitfuse::exec
