// grouped_linear as GEMM steps (grouped_linear.hpp). The groups are equal (C rows each: an expert's capacity), so every
// GEMM's shape is known when the program is planned and no step depends on the routing: a call needs no host
// synchronisation and a CUDA graph replays it. The rows an expert did not get are zero and add nothing.
#include "exec/lower/impl/grouped_linear.hpp"

#include <fmt/format.h>

namespace jitfuse::exec {

void lower_grouped_linear(Builder& b, int i) {
  const ops::Op& op = b.ops().at(static_cast<size_t>(i));
  const int64_t groups = op.attrs.at("num_groups").get<int64_t>();
  const int64_t k = ops::cols_of(op.in), n = ops::cols_of(op.out), c = ops::rows_of(op.in) / groups;
  const std::string who = b.rule_or_unfused() + ": " + op.label();
  const int w = b.param(i, Key::weight);
  // One GEMM of group g: a, b and d at group g's rows (or weight) — offsets in elements, per matrix's row width.
  struct Operand {
    int buffer;
    int64_t group_elems;  // elements one group of it spans
  };
  auto gemm = [&](cuda::GemmKind kind, int64_t g, Operand a, Operand bb, Operand d, const std::string& what) {
    GemmStep s = b.linear_gemm(i, kind);
    s.call.m = c;
    s.call.n = n;
    s.call.k = k;
    s.a = a.buffer;
    s.a_offset = g * a.group_elems;
    s.b = bb.buffer;
    s.b_offset = g * bb.group_elems;
    s.d = d.buffer;
    s.d_offset = g * d.group_elems;
    b.gemm(s, fmt::format("{}: group {} of {}, rows [{}, {}): {}", who, g, groups, g * c, (g + 1) * c, what));
  };
  if (b.forward()) {
    for (int64_t g = 0; g < groups; ++g)
      gemm(cuda::GemmKind::fwd, g, {b.act(i), c * k}, {w, n * k}, {b.act(i + 1), c * n}, "y_g = x_g W_g^T");
    b.boundary_saves(i, i + 1);
    return;
  }
  const int x = b.saved_context(i, Key::input), dy = b.grad_of(i + 1), dx = b.grad_of(i), dw = b.grad(i, Key::weight);
  for (int64_t g = 0; g < groups; ++g) {
    gemm(cuda::GemmKind::dgrad, g, {dy, c * n}, {w, n * k}, {dx, c * k}, "dx_g = dy_g W_g");
    gemm(cuda::GemmKind::wgrad, g, {dy, c * n}, {x, c * k}, {dw, n * k}, "dW_g = dy_g^T x_g");
  }
}

}  // namespace jitfuse::exec
