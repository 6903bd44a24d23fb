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

// The routing kernels move rows in 16-byte chunks: the input's last dim must be a multiple of 8 elements.
void rows_in_chunks_of_8(const Op& op) {
  if (cols_of(op.in) % 8 != 0)
    shape_error(op, fmt::format("the last dim is {}; the routing kernels move rows in chunks of 8 elements: pad it "
                                "to a multiple of 8", cols_of(op.in)));
}

void register_permute(Registry& r) {
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
      // "packed": the kept rows one after another (T k rows, zero after them); "padded": expert e's at
      // [e C, e C + kept) of E C rows (needs a capacity C), every expert C rows: what grouped_linear takes.
      {AttrSpec::Type::string, "layout", "packed", {"packed", "padded"}, {}, {}},
  };
  k.takes_extra_input = true;
  k.extra_input_name = "indices";
  k.infer = [](Op& op) {
    const int64_t e = op.attrs["num_experts"], topk = op.attrs["top_k"];
    if (topk > e)
      fail(Status::invalid_argument, "{}: top_k = {} is more than num_experts = {}: each token picks distinct experts",
           op.label(), topk, e);
    const int64_t t = rows_of(op.in), h = cols_of(op.in);
    rows_in_chunks_of_8(op);
    int64_t n = 0;
    if (__builtin_mul_overflow(t, topk, &n) || n > std::numeric_limits<int32_t>::max())
      shape_error(op, fmt::format("{} tokens x top_k {} routed rows do not fit the int32 routing", t, topk));
    if (op.str("layout") == "padded") {
      const int64_t cap = op.attrs["capacity"];
      if (cap < 1)
        fail(Status::invalid_argument, "{}: \"layout\": \"padded\" gives each expert `capacity` rows: set "
             "\"capacity\" >= 1 (e.g. 1.25 x tokens x top_k / num_experts, GShard's capacity factor)", op.label());
      if (__builtin_mul_overflow(e, cap, &n) || n > std::numeric_limits<int32_t>::max())
        shape_error(op, fmt::format("{} experts x capacity {} rows do not fit the int32 routing", e, cap));
    }
    op.out = {n, h};
    op.saved.clear();  // the routing (an int32 buffer the lowering saves), not a value
    op.extra_input = ExtraInputSpec{"indices", "index_dtype",
                                    op.str("index_dtype") == "int32" ? DType::i32 : DType::i64, {t, topk}};
  };
  r.add(std::move(k));
}

void register_unpermute(Registry& r) {
  OpKind k;
  k.name = "moe_unpermute";
  k.family = Family::moe;
  k.math = "y[t] = sum_j probs[t, j] x[dest(t, j)] with the routing of the moe_permute before it; dx[dest(t, j)] = "
           "probs[t, j] dy[t], dprobs[t, j] = <dy[t], x[dest(t, j)]>";
  k.takes_extra_input = true;
  k.extra_input_name = "probs";
  k.extra_input_grad = true;
  k.infer = [](Op& op) {
    // op.route_in (the permute's input shape, [T, H]), route_topk and route_rows were set by ops::infer.
    const int64_t t = rows_of(op.route_in), n = op.route_rows;
    if (rows_of(op.in) != n)
      shape_error(op, fmt::format("its input has {} rows; the routing of op {} (moe_permute) has {} tokens and "
                                  "permutes them to {} rows", rows_of(op.in), op.route_op, t, n));
    rows_in_chunks_of_8(op);
    op.out = {t, cols_of(op.in)};
    op.saved = {SavedKind::input};  // x, for dprobs
    op.extra_input = ExtraInputSpec{"probs", "", DType::f32, {t, op.route_topk}};
  };
  r.add(std::move(k));
}

void register_grouped_linear(Registry& r) {
  OpKind k;
  k.name = "grouped_linear";
  k.family = Family::grouped_linear;
  k.math = "y_g = x_g W_g^T for G groups of rows (an expert's rows each: after a packed moe_permute its rows, after a "
           "padded one or alone G equal groups), W [G, out, in]; dx_g = dy_g W_g; dW_g = dy_g^T x_g";
  k.attrs = {
      {AttrSpec::Type::integer, "num_groups", nullptr, {}, 1.0, kMaxExperts + 1, true},
      {AttrSpec::Type::integer, "in_features", nullptr, {}, 1.0, {}},
      {AttrSpec::Type::integer, "out_features", nullptr, {}, 1.0, {}},
  };
  k.infer = [](Op& op) {
    const int64_t g = op.attrs["num_groups"], in_f = op.attrs["in_features"], out_f = op.attrs["out_features"];
    if (cols_of(op.in) != in_f)
      shape_error(op, fmt::format("in_features = {} but the input's last dim is {}", in_f, cols_of(op.in)));
    if (op.route_op >= 0 && g != op.route_experts) {
      // A moe_permute's routing has its splits after dest and src (2 T k ints); a moe_dispatch's after its counts.
      const bool ep = op.route_splits_at != 2 * op.route_topk * rows_of(op.route_in);
      fail(Status::invalid_argument, "{}: num_groups = {} but op {} ({}) routes to {} experts{}: one group per "
           "expert", op.label(), g, op.route_op, ep ? "moe_dispatch" : "moe_permute", op.route_experts,
           ep ? fmt::format(" (this rank's: num_experts / world size {})", op.world_size) : "");
    }
    if (op.route_op >= 0 && op.route_packed) {
      // Dropless: group e is expert e's rows [starts[e], starts[e] + splits[e]) of the permuted rows.
      if (rows_of(op.in) != op.route_rows)
        shape_error(op, fmt::format("its {} rows are not the {} rows op {} (moe_permute) dispatched", rows_of(op.in),
                                    op.route_rows, op.route_op));
    } else if (rows_of(op.in) % g != 0) {
      shape_error(op, fmt::format("its {} rows are not {} equal groups: the rows are the experts' (a moe_permute "
                                  "with \"layout\": \"padded\" gives num_experts x capacity, or \"packed\" "
                                  "before it: each expert's own rows)", rows_of(op.in), g));
    }
    op.out = {rows_of(op.in), out_f};
    op.params = {{"weight", {g, out_f, in_f}}};
    op.saved = {SavedKind::input};
  };
  r.add(std::move(k));
}

// Expert parallelism (docs/parallel.md#expert-parallelism): rank r owns experts [r E/W, (r+1) E/W). moe_dispatch
// sends each expert's rows of this rank's packed moe_permute to the rank owning the expert; moe_combine sends them
// back to the same rows. Comm ops (NCCL grouped send/recv, an all_to_all with per-call counts): the routing's
// per-expert row counts of every rank are all-gathered and read on the host once per call.
AttrSpec group_attr() { return {AttrSpec::Type::string, "group", "ep", {}, {}, {}}; }

void register_dispatch(Registry& r) {
  OpKind k;
  k.name = "moe_dispatch";
  k.family = Family::comm;
  k.math = "y = the rows of every rank's moe_permute for the experts this rank owns (rank r: experts [r E/W, "
           "(r+1) E/W)), expert-major then source rank, zero past them; dx = those rows' gradients sent back";
  k.attrs = {group_attr(),
             // The received rows' bound: -1 is world size x this rank's permuted rows (no routing overflows it).
             {AttrSpec::Type::integer, "max_rows", -1, {}, -1.0, {}}};
  k.infer = [](Op& op) {
    // op.route_* (its moe_permute's) were set by ops::infer.
    const int64_t e = op.route_experts, w = op.world_size, rows = rows_of(op.in);
    if (e % w != 0)
      fail(Status::invalid_argument, "{}: num_experts = {} of op {} (moe_permute) is not a multiple of the world size "
           "{}: every rank owns num_experts / world size experts", op.label(), e, op.route_op, w);
    int64_t bound = op.attrs["max_rows"];
    if (!op.route_packed) {  // padded: every expert `capacity` rows from every rank, E C rows in all (fixed)
      if (bound != -1 && bound != rows)
        fail(Status::invalid_argument, "{}: after a padded moe_permute (op {}) each rank's experts receive exactly "
             "num_experts x capacity = {} rows: leave \"max_rows\" -1", op.label(), op.route_op, rows);
      op.out = op.in;
      return;
    }
    if (bound == 0 || bound < -1)
      fail(Status::invalid_argument, "{}: max_rows = {}: the received rows' bound is >= 1, or -1 (world size x the "
           "permuted rows)", op.label(), bound);
    if (bound < 0 && (__builtin_mul_overflow(rows, w, &bound) || bound > std::numeric_limits<int32_t>::max()))
      shape_error(op, fmt::format("{} ranks x {} permuted rows do not fit the int32 routing: set \"max_rows\"", w,
                                  rows));
    if (bound > std::numeric_limits<int32_t>::max())
      shape_error(op, fmt::format("max_rows = {} does not fit the int32 routing", bound));
    op.out = {bound, cols_of(op.in)};
  };
  r.add(std::move(k));
}

void register_combine(Registry& r) {
  OpKind k;
  k.name = "moe_combine";
  k.family = Family::comm;
  k.math = "y = the experts' rows sent back to the ranks and rows they came from (the moe_dispatch before it), zero "
           "past the kept rows; dx = the gradients of those rows, dispatched again";
  k.attrs = {group_attr()};
  k.infer = [](Op& op) {
    // op.route_op is the moe_dispatch before it, route_in its input (the permuted rows), route_rows its output rows.
    if (rows_of(op.in) != op.route_rows)
      shape_error(op, fmt::format("its input has {} rows; op {} (moe_dispatch) received {} rows (its max_rows)",
                                  rows_of(op.in), op.route_op, op.route_rows));
    op.out = {rows_of(op.route_in), cols_of(op.in)};
  };
  r.add(std::move(k));
}

}  // namespace

void register_moe(Registry& r) {
  register_permute(r);
  register_unpermute(r);
  register_grouped_linear(r);
  register_dispatch(r);
  register_combine(r);
}

}  // namespace jitfuse::ops
