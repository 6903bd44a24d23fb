// Joint strategy recompute_gated_input ([grouped_linear, gated op, grouped_linear]: a mixture-of-experts layer's
// grouped MLP, TransformerEngine's reason for the joint pass): the forward saves FC1's input x and the gated op's
// input h (which their backwards need anyway) but not FC2's input a = act(h_gate) * h_up; the backward recomputes a
// from h with the gated op's forward kernel (one elementwise pass over h), then runs FC2's dgrad and wgrad, the
// gated op's backward and FC1's. It saves T k x ffn elements (the largest activation of the block) for one read
// of h and one write of a in the backward.
#include <fmt/format.h>

#include "exec/lower/impl/grouped_linear.hpp"
#include "exec/lower/impl/registrar.hpp"
#include "exec/lower/lowering.hpp"

namespace jitfuse::exec {
namespace {

class RecomputeGatedInput final : public Implementation {
 public:
  rules::Impl::Kind kind() const override { return rules::Impl::Kind::joint; }
  std::string name() const override { return "recompute_gated_input"; }
  std::string covers_text() const override { return "[grouped_linear, gated op, grouped_linear] (joint pass)"; }
  std::optional<std::string> check(const std::vector<OpUse>& w, const rules::Impl&, rules::Pass pass) const override {
    if (pass != rules::Pass::joint) return "joint strategies run in the joint pass";
    if (w.size() != 3 || w[0].family() != ops::Family::grouped_linear || w[1].family() != ops::Family::gated ||
        w[2].family() != ops::Family::grouped_linear)
      return "recompute_gated_input implements " + covers_text();
    return std::nullopt;
  }
  void lower(Builder& b, const rules::Impl&) const override {
    const auto& g = b.group();
    const int fc1 = g.begin, act = g.begin + 1, fc2 = g.begin + 2;
    const ops::Op& a_op = b.ops()[static_cast<size_t>(act)];
    const int64_t rows = ops::rows_of(a_op.in), a_cols = ops::cols_of(a_op.out);
    const std::string who = g.rule + ": recompute_gated_input";
    if (b.forward()) {
      lower_grouped_linear(b, fc1);
      lower_chain(b, act, act + 1, chain_options(b), rows);
      b.boundary_saves(act, act + 1);  // h, which the gated op's backward reads
      // FC2's input is not saved: the backward recomputes it. Where it is shown: the gated kernel's step.
      lower_grouped_linear(b, fc2, /*save_input=*/false);
      const int64_t saved = rows * a_cols * ops::dtype_bytes(b.recipe().dtype);
      b.note_last(fmt::format("{}: FC2's input ({} x {}) not saved, recomputed in the backward: saves {}", who, rows,
                              a_cols, mib(static_cast<double>(saved))));
      return;
    }
    // a = gated(h) from the saved h: the gated op's forward kernel, saving nothing.
    ChainOptions f = chain_options(b);
    f.dir = codegen::Direction::forward;
    f.training = false;
    f.vec = chain_vectorizable(b.ops(), act, act + 1);
    const int a = b.temp(fmt::format("recomputed op{}.input", fc2), b.recipe().dtype, rows, a_cols);
    lower_spec(b, chain_spec(b.ops(), act, act + 1, f), b.kernel_meta(act, "forward"), b.saved_context(act, Key::input),
               a, rows, who + " (recompute FC2's input from the saved h)");
    b.provide_saved(fc2, Key::input, a);
    lower_grouped_linear(b, fc2);
    b.forget_saved(fc2, Key::input);
    lower_chain(b, act, act + 1, chain_options(b), rows);
    lower_grouped_linear(b, fc1);
  }
};

const Registrar kRegistered(std::make_unique<RecomputeGatedInput>());

}  // namespace
}  // namespace jitfuse::exec
