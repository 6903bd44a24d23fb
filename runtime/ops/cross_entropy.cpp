// cross_entropy: rows of logits [rows, V] and integer labels (an extra input) -> the loss, per row or reduced. The
// sequence's last op; saves its input (the logits) and an fp32 logsumexp per row (docs/ops.md#cross_entropy).
#include <cstdint>
#include <limits>

#include "common/error.hpp"
#include "ops/op.hpp"

namespace jitfuse::ops {

namespace {

// Columns the kernels index with 32-bit ints, with room for a chunk of 8 past the end.
constexpr int64_t kMaxVocab = int64_t{1} << 30;

}  // namespace

void register_cross_entropy(Registry& r) {
  OpKind k;
  k.name = "cross_entropy";
  k.family = Family::loss;
  k.math =
      "z = cap tanh(x / cap) (softcap > 0); loss_r = lse(z_r) - (1 - eps) "
      "z_r[y_r] - (eps / V) sum_j z_rj + "
      "z_loss lse(z_r)^2, 0 where y_r = ignore_index; mean over the other "
      "rows, sum, or none";
  k.attrs = {
      {AttrSpec::Type::string, "reduction", "mean", {"mean", "sum", "none"}, {}, {}},
      {AttrSpec::Type::integer, "ignore_index", -100, {}, {}, {}},
      {AttrSpec::Type::number, "label_smoothing", 0.0, {}, 0.0, 1.0, true},  // 0 <= eps < 1
      {AttrSpec::Type::number, "z_loss", 0.0, {}, 0.0, {}},                  // coefficient of
                                                                             // lse^2, >= 0
      {AttrSpec::Type::number, "softcap", 0.0, {}, 0.0, {}},                 // 0: off
      {AttrSpec::Type::string, "label_dtype", "int64", {"int64", "int32"}, {}, {}},
      // The chunked head after a linear (linear_cross_entropy_chunked): MiB of logits one chunk of rows may
      // hold. Larger chunks run larger GEMMs and accumulate dW fewer times, for that much more memory.
      // 0: automatic (256 MiB, but at least 2048 rows).
      {AttrSpec::Type::integer, "chunk_mib", 0, {}, 0.0, 65536.0},
      // The logits are this rank's shard of the vocabulary, the output of a column-parallel linear (Megatron's
      // vocab-parallel cross-entropy; docs/parallel.md): columns [rank V / W, (rank + 1) V / W) of V = cols x
      // world size. The rows' statistics are gathered over the group; labels index the whole vocabulary.
      {AttrSpec::Type::boolean, "vocab_parallel", false, {}, {}, {}},
  };
  k.takes_extra_input = true;
  k.last_only = true;
  k.infer = [](Op& op) {
    int64_t v = cols_of(op.in);
    if (op.attrs.value("vocab_parallel", false) && __builtin_mul_overflow(v, static_cast<int64_t>(op.world_size), &v))
      shape_error(op, "the vocabulary (columns x world size) overflows");
    if (v > kMaxVocab)
      shape_error(op, fmt::format("the vocabulary is {} columns; cross_entropy takes at most {}", v, kMaxVocab));
    const bool i32 = op.str("label_dtype") == "int32";
    const int64_t ignore = op.attrs["ignore_index"].get<int64_t>();
    if (i32 && (ignore < std::numeric_limits<int32_t>::min() || ignore > std::numeric_limits<int32_t>::max()))
      fail(Status::invalid_argument,
           "{}: ignore_index = {} does not fit the int32 labels of "
           "\"label_dtype\": "
           "\"int32\"; use a value in [-2^31, 2^31) or int64 labels",
           op.label(), ignore);
    // One loss (or label) per row: the input's shape without its last dim ([1] for a single row of logits).
    const Shape per_row = op.in.size() > 1 ? Shape(op.in.begin(), op.in.end() - 1) : Shape(1, 1);
    op.out = op.str("reduction") == "none" ? per_row : Shape{1};
    op.params.clear();
    op.saved = {SavedKind::input, SavedKind::logsumexp};
    op.extra_input = ExtraInputSpec{"labels", "label_dtype", i32 ? DType::i32 : DType::i64, per_row};
  };
  r.add(std::move(k));
}

}  // namespace jitfuse::ops
