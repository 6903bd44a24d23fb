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
  auto step = [&](cuda::GemmKind kind, int g) {
    GemmStep s = b.linear_gemm(i, kind);
    s.call.m = c;
    s.call.n = n;
    s.call.k = k;
    s.b_offset = kind == cuda::GemmKind::wgrad ? g * c * k : g * n * k;  // W_g, or x_g for the wgrad
    return s;
  };
  if (b.forward()) {
    for (int64_t g = 0; g < groups; ++g) {
      GemmStep s = step(cuda::GemmKind::fwd, static_cast<int>(g));
      s.a = b.act(i);
      s.a_offset = g * c * k;
      s.b = w;
      s.d = b.act(i + 1);
      s.d_offset = g * c * n;
      b.gemm(s, fmt::format("{}: group {} of {}, rows [{}, {}): y_g = x_g W_g^T", who, g, groups, g * c, (g + 1) * c));
    }
    b.boundary_saves(i, i + 1);
    return;
  }
  const int x = b.saved_context(i, Key::input), dy = b.grad_of(i + 1), dx = b.grad_of(i), dw = b.grad(i, Key::weight);
  for (int64_t g = 0; g < groups; ++g) {
    GemmStep d = step(cuda::GemmKind::dgrad, static_cast<int>(g));
    d.a = dy;
    d.a_offset = g * c * n;
    d.b = w;
    d.d = dx;
    d.d_offset = g * c * k;
    b.gemm(d, fmt::format("{}: group {}: dx_g = dy_g W_g", who, g));
    GemmStep wg = step(cuda::GemmKind::wgrad, static_cast<int>(g));
    wg.a = dy;
    wg.a_offset = g * c * n;
    wg.b = x;
    wg.d = dw;
    wg.d_offset = g * n * k;
    b.gemm(wg, fmt::format("{}: group {}: dW_g = dy_g^T x_g", who, g));
  }
}

}  // namespace jitfuse::exec
