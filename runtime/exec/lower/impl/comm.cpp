// Comm ops as comm steps. Each op's backward is the conjugate collective: all_gather <-> reduce_scatter;
// all_reduce "forward" sums values and passes gradients through, all_reduce "backward" passes values
// through and sums gradients (Megatron's reduce_from / copy_to tensor-parallel region).
#include "exec/lower/impl/comm.hpp"

#include "common/error.hpp"
#include "exec/lower/impl/generated_chain.hpp"

namespace jitfuse::exec {

void lower_comm(Builder& b, int i) {
  const ops::Op& op = b.ops().at(static_cast<size_t>(i));
  const bool fwd = b.forward();
  CommStep c;
  c.op = Collective::all_reduce;
  c.op_index = i;
  c.dtype = b.recipe().dtype;
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
