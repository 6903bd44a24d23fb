// cuBLASLt DGRAD_ACCUMULATE (backward of [make_extra_output linear]): dx = dy W + d_extra in one GEMM
// (C = the extra output's gradient, beta = 1), then the wgrad.
#include "exec/lower/impl/cublaslt_epilogue.hpp"
#include "exec/lower/impl/registrar.hpp"

namespace jitfuse::exec {
namespace {

class DgradAccumulate final : public CublasEpilogue {
 public:
  std::string name() const override { return "DGRAD_ACCUMULATE"; }
  std::optional<std::string> check_fp8(const std::vector<OpUse>&, const rules::Impl&, rules::Pass) const override {
    return std::nullopt;  // the FP8 dgrad takes the extra output's gradient as its bf16 C, beta = 1
  }

 protected:
  rules::Pass pass() const override { return rules::Pass::backward; }
  std::vector<Kinds> shapes() const override { return {{{"make_extra_output"}, {"linear"}}}; }
  std::optional<std::string> extra(const std::vector<OpUse>& w) const override {
    if (w[0].op && w[0].op->grad_two_parts)
      return "the fork's gradient has two parts (the caller's, for its returned channel, and its readers'); "
             "cuBLASLt adds one C";
    return std::nullopt;
  }
  void backward(Builder& b) const override {
    const auto& g = b.group();
    LinearBackward lb;
    lb.dy = b.grad_of(g.end);
    lb.dx = b.grad_of(g.begin);
    lb.accumulate = b.grad_extra_out(role(b, ops::Family::make_extra_output));
    linear_backward(b, role(b, ops::Family::linear), lb);
  }
};

const Registrar kRegistered(std::make_unique<DgradAccumulate>());

}  // namespace
}  // namespace jitfuse::exec
