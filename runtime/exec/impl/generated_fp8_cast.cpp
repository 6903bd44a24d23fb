// generated fp8_cast: the hand-off TransformerEngine's fuser makes between a linear and the ops next to
// it under an FP8 recipe. The op before a linear writes the linear's FP8 input directly, and the ops after
// it write its FP8 output gradient in their backward, so no bf16 copy of either is written and read back:
//   forward  [chain..., linear, bias?]   the chain's kernel writes x as E4M3, row-major + transposed
//                                         (training), then y = x W^T (+ b in the GEMM's BIAS epilogue)
//   backward [linear, chain...]          the chain's backward kernel (dbias, dact, ...) writes dy as
//                                         E5M2, row-major + transposed, then dgrad and wgrad
// The chain is any generated chain (elementwise; a norm forward, which writes the row-major codes only, so
// in training a transpose of its codes follows); empty, the cast stands alone.
#include "common/error.hpp"
#include "exec/impl/generated_chain.hpp"
#include "exec/impl/registrar.hpp"

namespace jitfuse::exec {
namespace {

class GeneratedFp8Cast final : public Implementation {
 public:
  rules::Impl::Kind kind() const override { return rules::Impl::Kind::generated; }
  std::string name() const override { return "fp8_cast"; }
  std::string covers_text() const override {
    return "forward [chain..., linear, bias?] (the chain writes the linear's E4M3 input) and backward "
           "[linear, chain...] (the chain's backward writes its E5M2 output gradient), under FP8 recipes";
  }
  std::optional<std::string> check(const std::vector<OpUse>& w, const rules::Impl&, rules::Pass pass) const override {
    if (pass == rules::Pass::joint) return "fp8_cast runs in the forward or the backward pass, not joint";
    int lin = -1;
    for (size_t i = 0; i < w.size(); ++i)
      if (w[i].family() == ops::Family::linear) {
        if (lin >= 0) return std::optional<std::string>("fp8_cast takes one linear per window");
        lin = static_cast<int>(i);
      }
    if (lin < 0) return "fp8_cast needs a linear in the window";
    codegen::Skeleton sk = codegen::Skeleton::elementwise;
    if (pass == rules::Pass::forward) {
      const size_t after = w.size() - static_cast<size_t>(lin) - 1;
      if (after > 1 || (after == 1 && w.back().family() != ops::Family::bias))
        return "in the forward, fp8_cast takes at most a bias after the linear (its GEMM's BIAS epilogue)";
      std::vector<OpUse> chain(w.begin(), w.begin() + lin);
      if (chain.empty()) return std::nullopt;
      if (auto p = chain_problem(chain, 0, &sk)) return p;
      if (sk == codegen::Skeleton::gated) return "fp8_cast cannot write a gated kernel's output as FP8";
      return std::nullopt;
    }
    if (lin != 0) return "in the backward, fp8_cast's window starts with the linear";
    std::vector<OpUse> chain(w.begin() + 1, w.end());
    if (chain.empty()) return std::nullopt;
    if (auto p = chain_problem(chain, 0, &sk)) return p;
    if (sk != codegen::Skeleton::elementwise) return "in the backward, fp8_cast's chain must be elementwise";
    return std::nullopt;
  }
  std::optional<std::string> check_fp8(const std::vector<OpUse>&, const rules::Impl&, rules::Pass) const override {
    return std::nullopt;
  }
  void lower(Builder& b, const rules::Impl&) const override {
    const auto& g = b.group();
    const int lin = role(b, ops::Family::linear);
    if (!b.recipe().is_fp8())
      fail(Status::internal, "rule '{}': fp8_cast lowers under FP8 recipes only (give the rule \"recipes\": "
           "[\"fp8_delayed\", \"fp8_current\"])", g.rule);
    if (b.forward()) {
      check_fp8_linear(b, lin);
      if (g.begin < lin) fp8_cast_operand(b, lin, "input", b.act(g.begin), g.begin, lin);
      const bool bias = lin + 1 < g.end;
      GemmStep gs = linear_forward(b, lin, b.act(lin), b.act(g.end), bias ? cuda::Epilogue::bias : cuda::Epilogue::none);
      if (bias) gs.bias = b.param(lin + 1, "bias");
      b.gemm(gs, g.rule + ": FP8 GEMM " + b.ops()[lin].label() + (bias ? " + BIAS" : ""));
      b.boundary_saves(g.begin, g.end);
    } else {
      check_fp8_linear(b, lin);
      if (lin + 1 < g.end) fp8_cast_operand(b, lin, "grad_output", b.grad_of(g.end), lin + 1, g.end);
      LinearBackward lb;
      lb.dy = b.grad_of(lin + 1);
      lb.dx = b.grad_of(lin);
      linear_backward(b, lin, lb);
    }
  }
};

const Registrar kRegistered(std::make_unique<GeneratedFp8Cast>());

}  // namespace
}  // namespace jitfuse::exec
