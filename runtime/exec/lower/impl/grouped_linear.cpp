// grouped_linear as GEMM steps (grouped_linear.hpp), one per group and pass.
// - Equal groups (alone, or after a padded moe_permute: C rows per expert): every GEMM's shape is known when the
//   program is planned and no step depends on the routing: no host synchronisation, and a CUDA graph replays
//   it. The rows an expert did not get are zero and add nothing.
// - After a packed (dropless) moe_permute: group g is expert g's rows [starts[g], starts[g] + splits[g]), which the
//   permute's kernels counted on the device; the executor reads them on the host once per pass (GemmStep::route).
#include "exec/lower/impl/grouped_linear.hpp"

#include <fmt/format.h>

#include <algorithm>

namespace jitfuse::exec {

void lower_grouped_linear(Builder& b, int i) {
  const ops::Op& op = b.ops().at(static_cast<size_t>(i));
  const int64_t groups = op.attrs.at("num_groups").get<int64_t>();
  const int64_t k = ops::cols_of(op.in), n = ops::cols_of(op.out), rows = ops::rows_of(op.in);
  const bool routed = op.route_op >= 0 && op.route_packed;
  // Equal groups: C rows each. Routed: the balanced share (explain's FLOPs, prepare's plan); the rows come per call.
  const int64_t c = routed ? std::max<int64_t>(1, (rows + groups - 1) / groups) : rows / groups;
  const int route = routed ? b.saved_context(op.route_op, Key::route) : -1;
  const std::string who = b.rule_or_unfused() + ": " + op.label();
  const int w = b.param(i, Key::weight);
  // One GEMM of group g: a, b and d at group g's rows (or weight). `row`: elements per row of an operand at the
  // group's rows (0: the weight, at g's [out, in] block).
  struct Operand {
    int buffer;
    int64_t row;
    int64_t weight_elems;
  };
  auto gemm = [&](cuda::GemmKind kind, int64_t g, Operand a, Operand bb, Operand d, const std::string& what) {
    GemmStep s = b.linear_gemm(i, kind);
    s.call.m = c;
    s.call.n = n;
    s.call.k = k;
    auto place = [&](const Operand& o, int& buffer, int64_t& offset, int64_t& row) {
      buffer = o.buffer;
      offset = o.row ? (routed ? 0 : g * c * o.row) : g * o.weight_elems;
      if (routed) row = o.row;
    };
    place(a, s.a, s.a_offset, s.a_row);
    place(bb, s.b, s.b_offset, s.b_row);
    place(d, s.d, s.d_offset, s.d_row);
    std::string rows_text = fmt::format("rows [{}, {})", g * c, (g + 1) * c);
    if (routed) {
      s.route = route;
      s.route_group = g;
      s.route_experts = groups;
      s.route_splits = 2 * op.route_topk * ops::rows_of(op.route_in);  // after dest [T k] and src [T k]
      s.route_bound = rows;
      rows_text = fmt::format("expert {}'s rows of op {}'s routing (read per call)", g, op.route_op);
    }
    b.gemm(s, fmt::format("{}: group {} of {}, {}: {}", who, g, groups, rows_text, what));
  };
  const int64_t wk = n * k;
  if (b.forward()) {
    for (int64_t g = 0; g < groups; ++g)
      gemm(cuda::GemmKind::fwd, g, {b.act(i), k, 0}, {w, 0, wk}, {b.act(i + 1), n, 0}, "y_g = x_g W_g^T");
    b.boundary_saves(i, i + 1);
    return;
  }
  const int x = b.saved_context(i, Key::input), dy = b.grad_of(i + 1), dx = b.grad_of(i), dw = b.grad(i, Key::weight);
  for (int64_t g = 0; g < groups; ++g) {
    gemm(cuda::GemmKind::dgrad, g, {dy, n, 0}, {w, 0, wk}, {dx, k, 0}, "dx_g = dy_g W_g");
    gemm(cuda::GemmKind::wgrad, g, {dy, n, 0}, {x, k, 0}, {dw, 0, wk}, "dW_g = dy_g^T x_g");
  }
}

}  // namespace jitfuse::exec
