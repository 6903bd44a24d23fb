// Joint strategy relu_bitmask ([linear bias relu linear (bias)]): h = relu(x W1^T + b1) with RELU_AUX_BIAS
// also writing cuBLASLt's 1-bit ReLU mask; the backward takes dh = relu'(mask) * (dy W2) and db1 in the
// second linear's dgrad (DRELU_BGRAD). Saved: x, h (the inputs of the linears) and the mask.
#include "exec/lower/impl/generated_chain.hpp"
#include "exec/lower/impl/registrar.hpp"

namespace jitfuse::exec {
namespace {

class ReluBitmask final : public Implementation {
 public:
  rules::Impl::Kind kind() const override { return rules::Impl::Kind::joint; }
  std::string name() const override { return "relu_bitmask"; }
  std::string covers_text() const override {
    return "[linear bias relu linear] and [linear bias relu linear bias] with a hidden width that is a multiple of 8 "
           "(joint pass)";
  }
  std::optional<std::string> check(const std::vector<OpUse>& w, const rules::Impl&, rules::Pass pass) const override {
    if (pass != rules::Pass::joint) return "joint strategies run in the joint pass";
    if (w.size() < 4 || w.size() > 5 || w[0].family() != ops::Family::linear || w[1].family() != ops::Family::bias ||
        w[2].name() != "relu" || w[3].family() != ops::Family::linear ||
        (w.size() == 5 && w[4].family() != ops::Family::bias))
      return "relu_bitmask implements [linear, bias, relu, linear] and [linear, bias, relu, linear, bias]";
    if (w[0].op && ops::cols_of(w[0].op->out) % 8 != 0)
      return "relu_bitmask: the hidden width " + std::to_string(ops::cols_of(w[0].op->out)) +
             " must be a multiple of 8 (cuBLASLt rows are 16-byte aligned)";
    return std::nullopt;
  }
  void lower(Builder& b, const rules::Impl&) const override {
    const auto& g = b.group();
    const int l1 = role(b, ops::Family::linear, 0), l2 = role(b, ops::Family::linear, 1);
    const int b1 = role(b, ops::Family::bias, 0), relu = role(b, ops::Family::pointwise);
    const int b2 = l2 + 1 < g.end ? role(b, ops::Family::bias, 1) : -1;
    const std::string who = g.rule + ": relu_bitmask";
    const auto& o1 = b.ops()[l1];
    if (b.forward()) {
      GemmStep c1 = linear_forward(b, l1, b.act(l1), b.act(l2), cuda::Epilogue::relu_bias);
      c1.bias = b.param(b1, Key::bias);
      if (b.training()) {
        c1.call.epilogue = cuda::Epilogue::relu_aux_bias;
        c1.aux = b.saved_new(relu, Key::mask, b.recipe().dtype, ops::rows_of(o1.out), 0,
                             cuda::relu_mask_bytes(ops::cols_of(o1.out), ops::rows_of(o1.out)));
        b.save_alias(l1, Key::input, b.act(l1));
        b.save_alias(l2, Key::input, b.act(l2));
      }
      b.gemm(c1, who + " (" + cuda::epilogue_name(c1.call.epilogue) + ")");
      GemmStep c2 = linear_forward(b, l2, b.act(l2), b.act(g.end));
      if (b2 >= 0) {
        c2.call.epilogue = cuda::Epilogue::bias;
        c2.bias = b.param(b2, Key::bias);
      }
      b.gemm(c2, who + (b2 >= 0 ? " (BIAS)" : ""));
      return;
    }
    const int dh = b.temp("grad op" + std::to_string(l1) + ".output", b.recipe().dtype, ops::rows_of(o1.out),
                          ops::cols_of(o1.out));
    LinearBackward second;
    second.dy = b.grad_of(g.end);
    second.dx = dh;
    second.dgrad_epilogue = cuda::Epilogue::drelu_bgrad;
    second.dgrad_aux = b.saved_context(relu, Key::mask);
    second.dgrad_bias = b.grad(b1, Key::bias);
    second.bias_grad_op = b2;
    linear_backward(b, l2, second);
    LinearBackward first;
    first.dy = dh;
    first.dx = b.grad_of(g.begin);
    linear_backward(b, l1, first);
  }
};

const Registrar kRegistered(std::make_unique<ReluBitmask>());

}  // namespace
}  // namespace jitfuse::exec
