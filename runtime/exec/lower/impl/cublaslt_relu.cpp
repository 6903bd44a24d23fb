// cuBLASLt RELU: y = relu(x W^T) for a linear without bias. relu saves its output (y itself), so no aux
// mask is needed (cuBLASLt's RELU_AUX would write a bit-mask nothing reads).
#include "exec/lower/impl/cublaslt_epilogue.hpp"
#include "exec/lower/impl/registrar.hpp"

namespace jitfuse::exec {
namespace {

class Relu final : public CublasEpilogue {
 public:
  std::string name() const override { return "RELU"; }

 protected:
  rules::Pass pass() const override { return rules::Pass::forward; }
  std::vector<Kinds> shapes() const override { return {{{"linear"}, {"relu"}}}; }
  void forward(Builder& b, int, int y) const override {
    const int lin = role(b, ops::Family::linear);
    b.gemm(linear_forward(b, lin, b.act(lin), y, cuda::Epilogue::relu), b.group().rule + ": cublaslt RELU");
  }
};

const Registrar kRegistered(std::make_unique<Relu>());

}  // namespace
}  // namespace jitfuse::exec
