// Collectives over the ranks of a tensor-parallel group (docs/parallel.md): all_gather, reduce_scatter and
// all_reduce, run by NCCL as comm steps. Each shards or gathers along dim 0 (the sequence dim of
// Megatron's [s, b, h] activations): rank r's shard is rows [r * n / W, (r + 1) * n / W) of dim 0.
#include "ops/op.hpp"

namespace jitfuse::ops {

namespace {
AttrSpec group_attr() { return {AttrSpec::Type::string, "group", "tp", {}, {}, {}}; }
}  // namespace

void register_comm(Registry& r) {
  {
    OpKind k;
    k.name = "all_gather";
    k.family = Family::comm;
    k.math = "y = concat over ranks of x along dim 0; dx = reduce_scatter(dy)";
    k.attrs = {group_attr()};
    k.infer = [](Op& op) {
      int64_t d0 = 0;
      if (__builtin_mul_overflow(op.in.at(0), static_cast<int64_t>(op.world_size), &d0))
        shape_error(op, "the gathered dim 0 overflows");
      op.out.at(0) = d0;
      numel(op.out);
    };
    r.add(std::move(k));
  }
  {
    OpKind k;
    k.name = "reduce_scatter";
    k.family = Family::comm;
    k.math = "y = rank r's dim-0 shard of the sum over ranks of x; dx = all_gather(dy)";
    k.attrs = {group_attr()};
    k.infer = [](Op& op) {
      if (op.in.at(0) % op.world_size != 0)
        shape_error(op, fmt::format("dim 0 ({}) is not divisible by the world size {}: every rank gets an equal "
                                    "shard; pad the sequence dim to a multiple of {}",
                                    op.in.at(0), op.world_size, op.world_size));
      op.out.at(0) = op.in.at(0) / op.world_size;
    };
    r.add(std::move(k));
  }
  {
    OpKind k;
    k.name = "all_reduce";
    k.family = Family::comm;
    k.math = "direction forward: y = sum over ranks of x, dx = dy; direction backward: y = x, dx = sum over ranks of dy";
    k.attrs = {group_attr(), {AttrSpec::Type::string, "direction", "forward", {"forward", "backward"}, {}, {}}};
    k.infer = [](Op& op) {  // its identity half copies with the identity functor where it cannot alias
      op.functor = "jf_op_identity";
      op.template_file = "ops/activations.cuh";
    };
    r.add(std::move(k));
  }
}

}  // namespace jitfuse::ops
