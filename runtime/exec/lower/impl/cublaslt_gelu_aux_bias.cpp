// cuBLASLt GELU_AUX_BIAS: y = gelu_tanh(x W^T + b); training also writes the pre-activation (gelu's saved
// input) to the aux buffer; inference uses GELU_BIAS.
#include "exec/lower/impl/cublaslt_epilogue.hpp"
#include "exec/lower/impl/registrar.hpp"

namespace jitfuse::exec {
namespace {

class GeluAuxBias final : public CublasEpilogue {
 public:
  std::string name() const override { return "GELU_AUX_BIAS"; }

 protected:
  rules::Pass pass() const override { return rules::Pass::forward; }
  std::vector<Kinds> shapes() const override { return {{{"linear"}, {"bias"}, {"gelu"}}}; }
  std::optional<std::string> extra(const std::vector<OpUse>& w) const override {
    if (w[2].str("approximate") != "tanh")
      return "cuBLASLt's GELU epilogue computes gelu_tanh only: the gelu needs \"approximate\": \"tanh\"";
    // Inference runs GELU_BIAS, without aux, but the legality predicate is not told whether a plan trains.
    const ops::Op* lin = w[0].op;
    return gelu_aux_ld_problem(name(), "saves", lin ? ops::cols_of(lin->out) : 0, "out_features");
  }
  void forward(Builder& b, int, int y) const override {
    const int lin = role(b, ops::Family::linear), act = role(b, ops::Family::pointwise);
    GemmStep g = linear_forward(b, lin, b.act(lin), y, cuda::Epilogue::gelu_bias);
    g.bias = b.param(role(b, ops::Family::bias), Key::bias);
    if (b.training()) {
      g.call.epilogue = cuda::Epilogue::gelu_aux_bias;
      g.aux = epilogue_saved_input(b, act);
    }
    b.gemm(g, b.group().rule + ": cublaslt " + cuda::epilogue_name(g.call.epilogue));
  }
};

const Registrar kRegistered(std::make_unique<GeluAuxBias>());

}  // namespace
}  // namespace jitfuse::exec
