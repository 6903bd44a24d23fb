// grouped_linear as GEMM steps (grouped_linear.hpp), one per pass and kind.
// - Equal groups (alone, or after a padded moe_permute: C rows per expert): one strided-batched cuBLASLt GEMM of
//   every group, whose shape is known when the program is planned; no step depends on the routing: no host
//   synchronisation, and a CUDA graph replays it. The rows an expert did not get are zero and add nothing.
// - After a packed (dropless) moe_permute: one step per pass and kind; expert g's rows are [starts[g], starts[g] +
//   splits[g]), which the permute's kernels counted on the device; the executor reads them on the host once per
//   pass and runs every expert's GEMM (GemmStep::route).
#include "exec/lower/impl/grouped_linear.hpp"

#include <fmt/format.h>


namespace jitfuse::exec {

namespace {

// A dropless grouped linear's GEMM of one kind: every expert's rows of the routing, one step (GemmStep::route).
// `row`: elements per row of an operand at an expert's rows; 0 for the weight.
struct RoutedOperand {
  int buffer;
  int64_t row;
};

void routed_gemm(Builder& b, int i, cuda::GemmKind kind, int route, RoutedOperand a, RoutedOperand bb,
                 RoutedOperand d, const std::string& what) {
  const ops::Op& op = b.ops().at(static_cast<size_t>(i));
  const int64_t e = op.attrs.at("num_groups").get<int64_t>();
  GemmStep s = b.linear_gemm(i, kind);  // m: the T k rows' bound
  s.a = a.buffer;
  s.b = bb.buffer;
  s.d = d.buffer;
  s.a_row = a.row;
  s.b_row = bb.row;
  s.d_row = d.row;
  s.route = route;
  s.route_experts = e;
  s.route_splits = op.route_splits_at;
  s.route_weight = s.call.n * s.call.k;
  b.gemm(s, fmt::format("{}: {}: {} experts, each over its rows of op {}'s routing (read per call): {}",
                        b.rule_or_unfused(), op.label(), e, op.route_op, what));
}

void lower_routed(Builder& b, int i, bool save_input) {
  const ops::Op& op = b.ops().at(static_cast<size_t>(i));
  const int64_t k = ops::cols_of(op.in), n = ops::cols_of(op.out);
  const int route = b.saved_context(op.route_op, Key::route), w = b.param(i, Key::weight);
  if (b.forward()) {
    routed_gemm(b, i, cuda::GemmKind::fwd, route, {b.act(i), k}, {w, 0}, {b.act(i + 1), n}, "y_g = x_g W_g^T");
    if (save_input) b.boundary_saves(i, i + 1);
    return;
  }
  const int x = b.saved_context(i, Key::input), dy = b.grad_of(i + 1), dx = b.grad_of(i), dw = b.grad(i, Key::weight);
  routed_gemm(b, i, cuda::GemmKind::dgrad, route, {dy, n}, {w, 0}, {dx, k}, "dx_g = dy_g W_g");
  routed_gemm(b, i, cuda::GemmKind::wgrad, route, {dy, n}, {x, k}, {dw, 0}, "dW_g = dy_g^T x_g");
}

}  // namespace

void lower_grouped_linear(Builder& b, int i, bool save_input) {
  const ops::Op& op = b.ops().at(static_cast<size_t>(i));
  if (op.route_op >= 0 && op.route_packed) return lower_routed(b, i, save_input);
  const int64_t groups = op.attrs.at("num_groups").get<int64_t>();
  const int64_t k = ops::cols_of(op.in), n = ops::cols_of(op.out), c = ops::rows_of(op.in) / groups;
  const int w = b.param(i, Key::weight);
  // Equal groups: one strided-batched GEMM per kind, GEMM g over group g's C rows (and weight); `stride`: the
  // elements one group of an operand spans.
  struct Operand {
    int buffer;
    int64_t stride;
  };
  auto gemm = [&](cuda::GemmKind kind, Operand a, Operand bb, Operand d, const std::string& what) {
    GemmStep s = b.linear_gemm(i, kind);
    s.call.m = c;
    s.call.batch = groups;
    s.a = a.buffer;
    s.b = bb.buffer;
    s.d = d.buffer;
    s.call.stride_a = a.stride;
    s.call.stride_b = bb.stride;
    s.call.stride_d = d.stride;
    b.gemm(s, fmt::format("{}: {}: {} groups of {} rows, one strided-batched GEMM: {}", b.rule_or_unfused(),
                          op.label(), groups, c, what));
  };
  if (b.forward()) {
    gemm(cuda::GemmKind::fwd, {b.act(i), c * k}, {w, n * k}, {b.act(i + 1), c * n}, "y_g = x_g W_g^T");
    if (save_input) b.boundary_saves(i, i + 1);
    return;
  }
  const int x = b.saved_context(i, Key::input), dy = b.grad_of(i + 1), dx = b.grad_of(i), dw = b.grad(i, Key::weight);
  gemm(cuda::GemmKind::dgrad, {dy, c * n}, {w, n * k}, {dx, c * k}, "dx_g = dy_g W_g");
  gemm(cuda::GemmKind::wgrad, {dy, c * n}, {x, c * k}, {dw, n * k}, "dW_g = dy_g^T x_g");
}

}  // namespace jitfuse::exec
