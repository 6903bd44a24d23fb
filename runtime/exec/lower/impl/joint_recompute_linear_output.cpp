// Joint strategy recompute_linear_output ([linear, pointwise op that saves its input]): the forward saves
// only the linear's input; the backward recomputes h = x W^T, runs the pointwise backward on it, then the
// linear's dgrad and wgrad from dh.
#include "exec/lower/impl/generated_chain.hpp"
#include "exec/lower/impl/registrar.hpp"

namespace jitfuse::exec {
namespace {

class RecomputeLinearOutput final : public Implementation {
 public:
  rules::Impl::Kind kind() const override { return rules::Impl::Kind::joint; }
  std::string name() const override { return "recompute_linear_output"; }
  std::string covers_text() const override { return "[linear, pointwise op that saves its input] (joint pass)"; }
  std::optional<std::string> check(const std::vector<OpUse>& w, const rules::Impl&, rules::Pass pass) const override {
    if (pass != rules::Pass::joint) return "joint strategies run in the joint pass";
    const bool saves_input =
        w.size() == 2 && (w[1].op ? std::find(w[1].op->saved.begin(), w[1].op->saved.end(), ops::SavedKind::input) !=
                                        w[1].op->saved.end()
                                  : w[1].kind->saves == ops::SavedKind::input);
    if (w.size() != 2 || w[0].family() != ops::Family::linear || w[1].family() != ops::Family::pointwise ||
        !saves_input)
      return "recompute_linear_output implements [linear, pointwise op that saves its input]";
    return std::nullopt;
  }
  void lower(Builder& b, const rules::Impl&) const override {
    const auto& g = b.group();
    const int lin = role(b, ops::Family::linear), act = lin + 1;
    const std::string who = g.rule + ": recompute_linear_output";
    ChainOptions opt = chain_options(b);
    opt.training = false;  // the forward saves nothing of the pointwise op: the backward recomputes it
    const int64_t rows = ops::rows_of(b.ops()[lin].out);
    if (b.forward()) {
      b.gemm(linear_forward(b, lin, b.act(lin), b.act(act)), who + " (forward GEMM)");
      b.boundary_saves(lin, act);
      lower_chain(b, act, g.end, opt, rows);
      return;
    }
    const auto& o = b.ops()[lin];
    const int h = b.temp("recomputed op" + std::to_string(lin) + ".output", b.recipe().dtype, ops::rows_of(o.out),
                         ops::cols_of(o.out));
    b.gemm(linear_forward(b, lin, b.saved_context(lin, Key::input), h), who + " (recompute h = x W^T)");
    b.provide_saved(act, Key::input, h);
    const int dh = b.temp("grad op" + std::to_string(lin) + ".output", b.recipe().dtype, ops::rows_of(o.out),
                          ops::cols_of(o.out));
    lower_chain(b, act, g.end, opt, rows, b.grad_of(g.end), dh);
    b.forget_saved(act, Key::input);
    LinearBackward lb;
    lb.dy = dh;
    lb.dx = b.grad_of(g.begin);
    linear_backward(b, lin, lb);
  }
};

const Registrar kRegistered(std::make_unique<RecomputeLinearOutput>());

}  // namespace
}  // namespace jitfuse::exec
