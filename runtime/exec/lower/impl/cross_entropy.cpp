// The cross_entropy op's kernels as steps (cross_entropy.hpp).
#include "exec/lower/impl/cross_entropy.hpp"

#include <fmt/format.h>

namespace jitfuse::exec {

using K = codegen::CrossEntropySpec::Kernel;

codegen::KernelSpec cross_entropy_spec(const Builder& b, int i, K kernel) {
  const ops::Op& op = b.ops().at(static_cast<size_t>(i));
  codegen::KernelSpec spec;
  spec.skeleton = codegen::Skeleton::cross_entropy;
  spec.dir = b.forward() ? codegen::Direction::forward : codegen::Direction::backward;
  spec.dtype = ops::dtype_name(b.recipe().dtype);
  spec.cols = ops::cols_of(op.in);
  spec.vec = true;  // the row kernels load from each row's first 16-byte
                    // boundary: any V takes the vector path
  spec.rule = b.group().rule;
  codegen::CrossEntropySpec ce;
  ce.kernel = kernel;
  ce.op = i;
  ce.reduction = op.str("reduction");
  ce.ignore_index = op.attrs.at("ignore_index").get<int64_t>();
  ce.label_smoothing = op.num("label_smoothing");
  ce.z_loss = op.num("z_loss");
  ce.softcap = op.num("softcap");
  ce.labels_i32 = op.str("label_dtype") == "int32";
  if (op.attrs.value("vocab_parallel", false) && op.world_size > 1) {
    ce.world = op.world_size;
    ce.vocab_start = spec.cols * op.rank;
    ce.vocab_total = spec.cols * op.world_size;
  }
  spec.ce = ce;
  switch (kernel) {
    case K::rows_fwd:
    case K::rows_bwd:
      spec.label = "cross_entropy";
      break;
    case K::reduce:
      spec.label = "cross_entropy_reduce";
      break;
    case K::fused:
      spec.label = "cross_entropy_fused";
      break;
    case K::scale:
      spec.label = "cross_entropy_scale";
      break;
    case K::fill_ones:
      spec.label = "cross_entropy_ones";
      break;
    case K::count:
      spec.label = "cross_entropy_count";
      break;
    case K::pad_rows:
      spec.label = "cross_entropy_pad";
      break;
    case K::stats:
      spec.label = "cross_entropy_stats";
      break;
  }
  return spec;
}

int gather_row_stats(Builder& b, int i, int in, int64_t rows, int64_t c0, int64_t ld, int stats, int gathered,
                     const nlohmann::json& meta, const std::string& who) {
  const ops::Op& op = b.ops().at(static_cast<size_t>(i));
  codegen::KernelSpec k = cross_entropy_spec(b, i, K::stats);
  k.ce->grid_rows = rows;
  k.ce->ld = ld;
  b.kernel(k, meta, in, stats, c0 + rows,
           fmt::format("{}: this rank's statistics of rows [{}, {}) over vocabulary columns [{}, {})", who, c0,
                       c0 + rows, k.ce->vocab_start, k.ce->vocab_start + k.cols));
  CommStep c;
  c.op = Collective::all_gather;
  c.op_index = i;
  c.dtype = ops::DType::f32;
  c.count = rows * 4;
  c.send = stats;
  c.recv = gathered;
  b.comm(c, fmt::format("{}: all_gather of the rows' statistics over the {} ranks (vocab-parallel {})", who,
                        op.world_size, op.label()));
  b.provide_saved(i, Key::stats, gathered);
  return gathered;
}

void lower_cross_entropy(Builder& b, int i) {
  const ops::Op& op = b.ops().at(static_cast<size_t>(i));
  const int64_t rows = ops::rows_of(op.in);
  const bool none = op.str("reduction") == "none";
  const std::string who =
      b.rule_or_unfused() + ": generated cross_entropy";
  const nlohmann::json meta = b.kernel_meta(i, b.forward() ? "forward" : "backward");
  if (!b.forward()) {
    b.kernel(cross_entropy_spec(b, i, K::rows_bwd), meta, b.grad_of(i + 1), b.grad_of(i), rows,
             who + " (dlogits per row)");
    return;
  }
  const bool train = b.training();
  codegen::KernelSpec rows_spec = cross_entropy_spec(b, i, K::rows_fwd);
  rows_spec.ce->save = train;
  if (train) b.saved_new(i, Key::lse, ops::DType::f32, rows, 1, static_cast<size_t>(rows) * 4);
  const int losses = none ? b.act(i + 1) : b.temp("losses op" + std::to_string(i), ops::DType::f32, rows, 1);
  const bool vp = rows_spec.ce->vocab_parallel();
  if (vp) {
    const int world = rows_spec.ce->world;
    gather_row_stats(b, i, b.act(i), rows, 0, 0, b.temp("row stats op" + std::to_string(i), ops::DType::f32, rows, 4),
                     b.temp("gathered row stats op" + std::to_string(i), ops::DType::f32, rows * world, 4), meta, who);
  }
  b.kernel(rows_spec, meta, b.act(i), losses, rows,
           who + (vp ? " (loss and lse per row from every rank's statistics)" : " (loss and lse per row)"));
  if (vp) b.forget_saved(i, Key::stats);
  if (!none) {
    codegen::KernelSpec red = cross_entropy_spec(b, i, K::reduce);
    red.ce->save = train;
    if (train) b.saved_new(i, Key::scale, ops::DType::f32, 1, 1, 4);
    b.kernel(red, meta, losses, b.act(i + 1), rows, who + " (" + op.str("reduction") + " over the rows)");
  }
  b.boundary_saves(i, i + 1);
}

}  // namespace jitfuse::exec
