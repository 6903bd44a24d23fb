// cuBLASLt RESIDUAL: y = x W^T + b + e (BIAS epilogue, C = the extra input, beta = 1),
// y = s (x W^T) + e (alpha = the scale) or y = x W^T + e (Llama's o_proj / down_proj + residual).
#include "exec/lower/impl/cublaslt_epilogue.hpp"
#include "exec/lower/impl/registrar.hpp"

namespace jitfuse::exec {
namespace {

class Residual final : public CublasEpilogue {
 public:
  std::string name() const override { return "RESIDUAL"; }
  std::optional<std::string> check_fp8(const std::vector<OpUse>&, const rules::Impl&, rules::Pass) const override {
    return std::nullopt;  // FP8 GEMMs take a bf16 C with beta = 1 (D bf16), the BIAS epilogue and alpha
  }

 protected:
  rules::Pass pass() const override { return rules::Pass::forward; }
  std::vector<Kinds> shapes() const override {
    return {{{"linear"}, {"add_extra_input"}}, {{"linear"}, {"bias", "scale"}, {"add_extra_input"}}};
  }
  void forward(Builder& b, int begin, int y) const override {
    const int lin = role(b, ops::Family::linear);
    const int add = role(b, ops::Family::add_extra_input);
    GemmStep g = linear_forward(b, lin, b.act(lin), y);
    const auto& mid = b.ops()[begin + 1];
    if (mid.family == ops::Family::bias) {
      g.call.epilogue = cuda::Epilogue::bias;
      g.bias = b.param(mid.index, Key::bias);
    } else if (mid.family != ops::Family::add_extra_input) {  // scale
      g.call.alpha = static_cast<float>(mid.consts.at(0));
    }  // else [linear add_extra_input]: the plain GEMM accumulating into the residual
    g.call.beta = 1.f;
    g.c = b.extra_in(add);
    b.gemm(g, b.group().rule + ": cublaslt RESIDUAL");
  }
};

const Registrar kRegistered(std::make_unique<Residual>());

}  // namespace
}  // namespace jitfuse::exec
