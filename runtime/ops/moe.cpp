// Mixture-of-experts token routing (issue 43; docs/ops.md#mixture-of-experts): moe_permute dispatches token rows
// to expert-contiguous rows by the top-k routing indices (an integer extra input), on the device, without a host
// synchronisation; moe_unpermute combines them back with the routing probabilities (an fp32 extra input that
// takes a gradient). An unpermute pairs with the moe_permute before it (ops::infer), whose routing it reads.
#include <limits>

#include "common/error.hpp"
#include "ops/op.hpp"

namespace jitfuse::ops {

namespace {
constexpr double kMaxExperts = 4096, kMaxTopK = 64;  // the routing kernels' limits (codegen moe.cpp)
}  // namespace

void register_moe(Registry& r) {
  {
    OpKind k;
    k.name = "moe_permute";
    k.family = Family::moe;
    k.math = "y[dest(t, j)] = x[t] for the top_k experts j of each token t, rows grouped by expert (stable), rows past "
             "the kept ones 0; dx[t] = sum_j dy[dest(t, j)]";
    k.attrs = {
        {AttrSpec::Type::integer, "num_experts", nullptr, {}, 1.0, kMaxExperts + 1, true},
        {AttrSpec::Type::integer, "top_k", nullptr, {}, 1.0, kMaxTopK + 1, true},
        // Rows kept per expert, first come (token order): -1 keeps every row (dropless).
        {AttrSpec::Type::integer, "capacity", -1, {}, -1.0, {}},
        {AttrSpec::Type::string, "index_dtype", "int64", {"int64", "int32"}, {}, {}},
    };
    k.takes_extra_input = true;
    k.extra_input_name = "indices";
    k.infer = [](Op& op) {
      const int64_t e = op.attrs["num_experts"], topk = op.attrs["top_k"];
      if (topk > e)
        fail(Status::invalid_argument, "{}: top_k = {} is more than num_experts = {}: each token picks distinct experts",
             op.label(), topk, e);
      const int64_t t = rows_of(op.in), h = cols_of(op.in);
      if (h % 8 != 0)
        shape_error(op, fmt::format("the hidden size (last dim) is {}; the routing kernels move rows in chunks of 8 "
                                    "elements: pad it to a multiple of 8", h));
      int64_t n = 0;
      if (__builtin_mul_overflow(t, topk, &n) || n > std::numeric_limits<int32_t>::max())
        shape_error(op, fmt::format("{} tokens x top_k {} routed rows do not fit the int32 routing", t, topk));
      op.out = {n, h};
      op.saved.clear();  // the routing (an int32 buffer the lowering saves), not a value
      op.extra_input = ExtraInputSpec{"indices", "index_dtype",
                                      op.str("index_dtype") == "int32" ? DType::i32 : DType::i64, {t, topk}};
    };
    r.add(std::move(k));
  }
  {
    OpKind k;
    k.name = "moe_unpermute";
    k.family = Family::moe;
    k.math = "y[t] = sum_j probs[t, j] x[dest(t, j)] with the routing of the moe_permute before it; dx[dest(t, j)] = "
             "probs[t, j] dy[t], dprobs[t, j] = <dy[t], x[dest(t, j)]>";
    k.takes_extra_input = true;
    k.extra_input_name = "probs";
    k.extra_input_grad = true;
    k.infer = [](Op& op) {
      // op.route_in (the permute's input shape, [T, H]) and route_topk were set by ops::infer.
      const int64_t t = rows_of(op.route_in), n = t * op.route_topk;
      if (rows_of(op.in) != n)
        shape_error(op, fmt::format("its input has {} rows; the routing of op {} (moe_permute) has {} tokens x top_k "
                                    "{} = {} rows", rows_of(op.in), op.route_op, t, op.route_topk, n));
      if (cols_of(op.in) % 8 != 0)
        shape_error(op, fmt::format("the last dim is {}; the routing kernels move rows in chunks of 8 elements: pad it "
                                    "to a multiple of 8", cols_of(op.in)));
      op.out = {t, cols_of(op.in)};
      op.saved = {SavedKind::input};  // x, for dprobs
      op.extra_input = ExtraInputSpec{"probs", "", DType::f32, {t, op.route_topk}};
    };
    r.add(std::move(k));
  }
}

}  // namespace jitfuse::ops
