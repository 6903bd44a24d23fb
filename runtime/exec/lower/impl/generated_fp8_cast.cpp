// generated fp8_cast: the hand-off TransformerEngine's fuser makes between a linear and the ops next to
// it under an FP8 recipe. The op before a linear writes the linear's FP8 input directly, and the ops after
// it write its FP8 output gradient in their backward, so no bf16 copy of either is written and read back:
//   forward  [chain..., linear, bias?, add_extra_input?]   the chain's kernel writes x as E4M3, row-major
//                                         + transposed (training), then y = x W^T (+ b in the GEMM's BIAS
//                                         epilogue) (+ e: the residual as the GEMM's C, beta = 1)
//            [..., linear, bias?, quantize]  (fp8_delayed) the GEMM writes the quantize's E4M3 output
//                                         itself: D scale = the quantize's stored scale, its amax from the
//                                         GEMM (cuBLASLt's AMAX_D), the state rolled by the pass's update
//   backward [linear, chain...]          the chain's backward kernel (dbias, dact, ...) writes dy as
//                                         E5M2, row-major + transposed, then dgrad and wgrad
// The chain is any generated chain (elementwise; a norm or gated forward, which writes the row-major codes
// only, so in training a transpose of its codes follows); empty, the cast stands alone. Under fp8_block the
// chain is elementwise and runs inside the block-scaled cast kernel (fp8/linear.cpp), every operand E4M3,
// and the forward GEMM has no epilogue (the legality check keeps a bias or residual out of the window).
#include "common/error.hpp"
#include "exec/lower/impl/generated_chain.hpp"
#include "exec/lower/impl/registrar.hpp"

namespace jitfuse::exec {
namespace {

// The GEMM writes quantize op `q`'s E4M3 output: D = e4m3(scale * (x W^T + b)) with the state's stored
// scale, cuBLASLt's amax of the result into a one-float buffer that the pass's batched update reduces
// into the state (history roll, scale_inv = 1 / the scale used, the next scale).
void quantize_output(Builder& b, GemmStep& gs, int q) {
  gs.call.dtype = ops::DType::e4m3;
  gs.d_scale = b.fp8_state(q, fp8::Operand::none, fp8::Part::scale);
  gs.d_scale_inv = b.fp8_state(q, fp8::Operand::none, fp8::Part::scale_inv);
  gs.d_history = b.fp8_state(q, fp8::Operand::none, fp8::Part::history);
  gs.d_amax = b.temp("amax op" + std::to_string(q) + " (FP8 GEMM output)", ops::DType::f32, 1, 1, sizeof(float));
}

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
      size_t after = w.size() - static_cast<size_t>(lin) - 1;
      // The GEMM writes the E4M3 output, or adds the residual (C = the extra input, beta = 1).
      if (after > 0 && (w.back().name() == "quantize" || w.back().family() == ops::Family::add_extra_input)) --after;
      if (after > 1 || (after == 1 && w[static_cast<size_t>(lin) + 1].family() != ops::Family::bias))
        return "in the forward, fp8_cast takes at most a bias after the linear (its GEMM's BIAS epilogue), "
               "then a quantize (the GEMM's FP8 output) or an add_extra_input (the GEMM's C, beta = 1)";
      std::vector<OpUse> chain(w.begin(), w.begin() + lin);
      if (chain.empty()) return std::nullopt;
      if (auto p = chain_problem(chain, 0, &sk)) return p;
      return std::nullopt;
    }
    if (lin != 0) return "in the backward, fp8_cast's window starts with the linear";
    std::vector<OpUse> chain(w.begin() + 1, w.end());
    if (chain.empty()) return std::nullopt;
    if (auto p = chain_problem(chain, 0, &sk)) return p;
    if (sk == codegen::Skeleton::gated)
      return "in the backward, a gated op's backward kernel (its gradient twice its output's width) does not "
             "write FP8 gradients: the linear casts its E5M2 gradient with its own cast + transpose kernel";
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
           "[\"fp8_delayed\", \"fp8_current\", \"fp8_block\"])", g.rule);
    if (b.forward()) {
      check_fp8_linear(b, lin);
      if (g.begin < lin) fp8_cast_operand(b, lin, fp8::Operand::input, b.act(g.begin), g.begin, lin);
      const auto& last = b.ops()[static_cast<size_t>(g.end - 1)];
      const int q = last.kind == "quantize" ? g.end - 1 : -1;
      const int add = last.family == ops::Family::add_extra_input && lin < g.end - 1 ? g.end - 1 : -1;
      const int gemm_end = q >= 0 ? q : add >= 0 ? add : g.end;
      const bool bias = lin + 1 < gemm_end;
      // Current scaling needs the output's amax before its cast, which one GEMM cannot give: there the
      // GEMM writes the recipe's dtype and the quantize runs as its own kernel (the built-in rules that
      // end in a quantize ask for fp8_delayed; this serves a user rule that names both recipes).
      const bool gemm_quantizes = q >= 0 && b.recipe().kind == ops::RecipeKind::fp8_delayed;
      GemmStep gs = linear_forward(b, lin, b.act(lin), b.act(gemm_quantizes || add >= 0 ? g.end : gemm_end),
                                   bias ? cuda::Epilogue::bias : cuda::Epilogue::none);
      if (bias) gs.bias = b.param(lin + 1, Key::bias);
      if (gemm_quantizes) quantize_output(b, gs, q);
      if (add >= 0) {  // y = x W^T (+ b) + e: the residual is the GEMM's C (bf16, as D)
        gs.call.beta = 1.f;
        gs.c = b.extra_in(add);
      }
      b.gemm(gs, g.rule + ": FP8 GEMM " + b.ops()[lin].label() + (bias ? " + BIAS" : "") + (add >= 0 ? " + residual" : "") +
                     (gemm_quantizes ? " -> E4M3 output of " + b.ops()[static_cast<size_t>(q)].label() : ""));
      if (q >= 0 && !gemm_quantizes) lower_chain(b, q, g.end, chain_options(b), ops::rows_of(b.ops()[q].in));
      b.boundary_saves(g.begin, g.end);
    } else {
      check_fp8_linear(b, lin);
      if (lin + 1 < g.end) fp8_cast_operand(b, lin, fp8::Operand::grad_output, b.grad_of(g.end), lin + 1, g.end);
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
