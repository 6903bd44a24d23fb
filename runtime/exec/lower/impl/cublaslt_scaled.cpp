// cuBLASLt SCALED (backward of [linear scale]): dx = s dy W and dW = s dy^T x with alpha = s.
#include "exec/lower/impl/cublaslt_epilogue.hpp"
#include "exec/lower/impl/registrar.hpp"

namespace jitfuse::exec {
namespace {

class Scaled final : public CublasEpilogue {
 public:
  std::string name() const override { return "SCALED"; }

 protected:
  rules::Pass pass() const override { return rules::Pass::backward; }
  std::vector<Kinds> shapes() const override { return {{{"linear"}, {"scale"}}}; }
  void backward(Builder& b) const override {
    const auto& g = b.group();
    LinearBackward lb;
    lb.dy = b.grad_of(g.end);
    lb.dx = b.grad_of(g.begin);
    lb.alpha = static_cast<float>(b.ops()[role(b, ops::Family::pointwise)].consts.at(0));
    linear_backward(b, role(b, ops::Family::linear), lb);
  }
};

const Registrar kRegistered(std::make_unique<Scaled>());

}  // namespace
}  // namespace jitfuse::exec
