// One op alone: linear on cuBLASLt (forward GEMM; dgrad + wgrad), every other op as its own generated kernel,
// except the backward of a channel's only reader (Builder::pass_through_grad: no kernel).
#include "exec/lower/impl/comm.hpp"
#include "exec/lower/impl/cross_entropy.hpp"
#include "exec/lower/impl/generated_chain.hpp"
#include "exec/lower/impl/grouped_linear.hpp"
#include "exec/lower/impl/moe.hpp"
#include "exec/lower/impl/registrar.hpp"

namespace jitfuse::exec {
namespace {

class Unfused final : public Implementation {
 public:
  rules::Impl::Kind kind() const override { return rules::Impl::Kind::unfused; }
  std::string name() const override { return "unfused"; }
  std::string covers_text() const override { return "any single op"; }
  std::optional<std::string> check(const std::vector<OpUse>& w, const rules::Impl&, rules::Pass) const override {
    if (w.size() != 1) return "an unfused group holds one op";
    return std::nullopt;
  }
  std::optional<std::string> check_fp8(const std::vector<OpUse>&, const rules::Impl&, rules::Pass) const override {
    return std::nullopt;  // linear_forward / linear_backward: FP8 GEMMs with standalone casts
  }
  void lower(Builder& b, const rules::Impl&) const override {
    const auto& g = b.group();
    if (!b.forward() && b.pass_through_grad(g.begin)) return;  // a channel's only reader: no kernel
    if (b.ops()[g.begin].family == ops::Family::comm) return lower_comm(b, g.begin);
    if (b.ops()[g.begin].family == ops::Family::loss) return lower_cross_entropy(b, g.begin);
    if (b.ops()[g.begin].family == ops::Family::moe) return lower_moe(b, g.begin);
    if (b.ops()[g.begin].family == ops::Family::grouped_linear) return lower_grouped_linear(b, g.begin);
    if (b.ops()[g.begin].family != ops::Family::linear) return lower_generated_group(b, chain_options(b));
    const int lin = g.begin;
    if (b.forward()) {
      b.gemm(linear_forward(b, lin, b.act(g.begin), b.act(g.end)), "(unfused): " + b.ops()[lin].label());
      b.boundary_saves(g.begin, g.end);
    } else {
      LinearBackward lb;
      lb.dy = b.grad_of(g.end);
      lb.dx = b.grad_of(g.begin);
      linear_backward(b, lin, lb);
    }
  }
};

const Registrar kRegistered(std::make_unique<Unfused>());

}  // namespace
}  // namespace jitfuse::exec
