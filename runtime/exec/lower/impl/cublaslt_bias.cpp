// cuBLASLt BIAS: y = x W^T + b in the GEMM's epilogue.
#include "exec/lower/impl/cublaslt_epilogue.hpp"
#include "exec/lower/impl/registrar.hpp"

namespace jitfuse::exec {
namespace {

class Bias final : public CublasEpilogue {
 public:
  std::string name() const override { return "BIAS"; }
  std::optional<std::string> check_fp8(const std::vector<OpUse>&, const rules::Impl&, rules::Pass) const override {
    return std::nullopt;  // linear_forward with the BIAS epilogue, which FP8 GEMMs take
  }

 protected:
  rules::Pass pass() const override { return rules::Pass::forward; }
  std::vector<Kinds> shapes() const override { return {{{"linear"}, {"bias"}}}; }
  void forward(Builder& b, int, int y) const override {
    const int lin = role(b, ops::Family::linear);
    GemmStep g = linear_forward(b, lin, b.act(lin), y, cuda::Epilogue::bias);
    g.bias = b.param(role(b, ops::Family::bias), Key::bias);
    b.gemm(g, b.group().rule + ": cublaslt BIAS");
  }
};

const Registrar kRegistered(std::make_unique<Bias>());

}  // namespace
}  // namespace jitfuse::exec
