// Comm ops as comm steps. Each op's backward is the conjugate collective: all_gather <-> reduce_scatter,
// moe_dispatch <-> moe_combine (all_to_all both);
// all_reduce "forward" sums values and passes gradients through, all_reduce "backward" passes values
// through and sums gradients (Megatron's reduce_from / copy_to tensor-parallel region).
#include "exec/lower/impl/comm.hpp"

#include <fmt/format.h>

#include "common/error.hpp"
#include "exec/lower/impl/generated_chain.hpp"

namespace jitfuse::exec {

namespace {
// moe_dispatch / moe_combine: one all_to_all step per pass (CommStep::AllToAll). A dispatch's forward makes its
// routing: every rank's rows per expert and its two bounds (all-gathered from the permute's splits), then this
// rank's experts' splits and starts; saved for the backward (the forward's arena in inference) and read by the grouped linears
// and the moe_combine after it. The backward of each is the other's exchange on the gradients. After a padded
// moe_permute every (rank, expert) pair sends `capacity` rows: fixed counts, no routing, no host read.
void lower_all_to_all(Builder& b, int i) {
  const ops::Op& op = b.ops().at(static_cast<size_t>(i));
  const bool dispatch = op.kind == "moe_dispatch", fwd = b.forward();
  const int disp = dispatch ? i : op.route_op;
  const ops::Op& d = b.ops().at(static_cast<size_t>(disp));
  CommStep c;
  c.op = Collective::all_to_all;
  c.op_index = i;
  c.dtype = b.recipe().dtype;
  auto& a = c.a2a;
  a.to_experts = dispatch == fwd;
  a.experts = d.route_experts;
  a.row = ops::cols_of(op.in);
  a.token_rows = ops::rows_of(d.in);
  a.expert_rows = ops::rows_of(d.out);
  c.count = a.token_rows * a.row;
  if (!d.route_packed) {  // padded: capacity rows per (rank, expert), fixed; no counts, nothing read on the host
  } else if (dispatch && fwd) {
    const int64_t w = op.world_size, ints = w * (a.experts + 2) + 2 * (a.experts / w) + 1;
    const size_t bytes = static_cast<size_t>(ints) * 4;
    a.counts = b.training() ? b.saved_new(i, Key::route, ops::DType::i32, 1, ints, bytes)
                            : b.temp(fmt::format("routing op{}", i), ops::DType::i32, 1, ints, bytes);
    if (!b.training()) b.provide_saved(i, Key::route, a.counts);
    a.route = b.saved_context(op.route_op, Key::route);
    a.route_splits = op.route_splits_at;
  } else {
    a.counts = b.saved_context(disp, Key::route);
  }
  c.send = fwd ? b.act(i) : b.grad_of(i + 1);
  c.recv = fwd ? b.act(i + 1) : b.grad_of(i);
  const int64_t local = a.experts / op.world_size;
  b.comm(c, fmt::format("all_to_all ({}): {}the rows of {} experts {} the ranks owning them ({} each){}", op.label(),
                        fwd ? "" : "gradients: ", a.experts, a.to_experts ? "to" : "back from", local,
                        !d.route_packed ? fmt::format("; padded: {} rows per rank and expert", a.token_rows / a.experts)
                        : dispatch && fwd ? "; every rank's rows per expert all-gathered first" : ""));
}
}  // namespace

void lower_comm(Builder& b, int i) {
  const ops::Op& op = b.ops().at(static_cast<size_t>(i));
  const bool fwd = b.forward();
  CommStep c;
  c.op = Collective::all_reduce;
  c.op_index = i;
  c.dtype = b.recipe().dtype;
  if (op.kind == "moe_dispatch" || op.kind == "moe_combine") return lower_all_to_all(b, i);
  if (op.kind == "all_gather") {
    c.op = fwd ? Collective::all_gather : Collective::reduce_scatter;
    c.count = ops::numel(op.in);  // all_gather: each rank's shard; reduce_scatter: each rank's result
  } else if (op.kind == "reduce_scatter") {
    c.op = fwd ? Collective::reduce_scatter : Collective::all_gather;
    c.count = ops::numel(op.out);
  } else if (op.kind == "all_reduce") {
    const bool sums = (op.str("direction") == "forward") == fwd;
    if (!sums) {
      if (b.pass_through(i)) return;
      // The caller's output or grad_input must be written: an identity kernel copies it.
      ChainOptions opt = chain_options(b);
      opt.comm_identity = true;
      lower_chain(b, i, i + 1, opt, ops::rows_of(op.in));
      return;
    }
    c.count = ops::numel(op.in);
  } else {
    fail(Status::internal, "{} is no comm op", op.label());
  }
  c.send = fwd ? b.act(i) : b.grad_of(i + 1);
  c.recv = fwd ? b.act(i + 1) : b.grad_of(i);
  b.comm(c, std::string(collective_name(c.op)) + " (" + b.ops()[i].label() + ")");
}

}  // namespace jitfuse::exec
