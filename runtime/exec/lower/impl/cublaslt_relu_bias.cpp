// cuBLASLt RELU_BIAS: y = relu(x W^T + b); relu saves its output, which is y itself.
#include "exec/lower/impl/cublaslt_epilogue.hpp"
#include "exec/lower/impl/registrar.hpp"

namespace jitfuse::exec {
namespace {

class ReluBias final : public CublasEpilogue {
 public:
  std::string name() const override { return "RELU_BIAS"; }

 protected:
  rules::Pass pass() const override { return rules::Pass::forward; }
  std::vector<Kinds> shapes() const override { return {{{"linear"}, {"bias"}, {"relu"}}}; }
  void forward(Builder& b, int, int y) const override {
    const int lin = role(b, ops::Family::linear);
    GemmStep g = linear_forward(b, lin, b.act(lin), y, cuda::Epilogue::relu_bias);
    g.bias = b.param(role(b, ops::Family::bias), Key::bias);
    b.gemm(g, b.group().rule + ": cublaslt RELU_BIAS");
  }
};

const Registrar kRegistered(std::make_unique<ReluBias>());

}  // namespace
}  // namespace jitfuse::exec
