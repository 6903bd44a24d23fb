// Joint strategy regenerate_dropout_mask: an elementwise chain holding an active dropout saves no mask;
// its backward regenerates the mask from the Philox (seed, offset).
#include "exec/lower/impl/generated_chain.hpp"
#include "exec/lower/impl/registrar.hpp"

namespace jitfuse::exec {
namespace {

class RegenerateDropoutMask final : public Implementation {
 public:
  rules::Impl::Kind kind() const override { return rules::Impl::Kind::joint; }
  std::string name() const override { return "regenerate_dropout_mask"; }
  std::string covers_text() const override {
    return "an elementwise chain holding a dropout in training with p > 0 (joint pass)";
  }
  std::optional<std::string> check(const std::vector<OpUse>& w, const rules::Impl&, rules::Pass pass) const override {
    if (pass != rules::Pass::joint) return "joint strategies run in the joint pass";
    codegen::Skeleton sk;
    if (auto p = chain_problem(w, 0, &sk)) return p;
    if (sk != codegen::Skeleton::elementwise) return "regenerate_dropout_mask needs an elementwise chain";
    bool any = false;
    for (const auto& u : w) {
      if (u.family() != ops::Family::dropout) continue;
      // A pattern may leave training and p open; a concrete op must have an active dropout.
      any |= !u.op || (u.op->flag("training") && u.op->num("p") > 0);
    }
    if (!any) return "no active dropout in the window (eval mode or p = 0): nothing to regenerate";
    return std::nullopt;
  }
  void lower(Builder& b, const rules::Impl&) const override {
    ChainOptions opt = chain_options(b);
    opt.regenerate_dropout = true;
    lower_generated_group(b, opt);
  }
};

const Registrar kRegistered(std::make_unique<RegenerateDropoutMask>());

}  // namespace
}  // namespace jitfuse::exec
