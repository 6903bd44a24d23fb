// FP8 linear: the casts that make a linear's GEMM operands FP8 (E4M3 activations and weights, E5M2
// gradients; TransformerEngine's HYBRID format) and the three FP8 GEMMs. cuBLASLt takes FP8 operands in
// the "TN" layout only (cuda::Fp8Gemm), so every operand a GEMM contracts along its other dimension is
// read from a transposed FP8 copy, written by the same cast kernel as the row-major one:
//
//   forward  y  = x W^T   A = x  row-major  [m, k]   B = W  row-major  [n, k]   fast accumulation
//   dgrad    dx = dy W    A = dy row-major  [m, n]   B = W^T (W col)   [k, n]   fp32 accumulation
//   wgrad    dW = dy^T x  A = dy^T (dy col) [n, m]   B = x^T (x col)   [k, m]   fp32 accumulation
//
// fp8_block scales per block instead (cuda::Fp8Scaling): x and dy per 1x128 block along their rows for the
// forward and dgrad, per 128x1 block along their columns for the wgrad (their transposed copies, cast from
// the bf16 tensor with scales of their own, not a transpose of the row-major codes); W per 128x128 block
// (its transposed copy shares the scales). Every operand E4M3.
#include <algorithm>

#include "common/error.hpp"
#include "exec/lower/lowering.hpp"

namespace jitfuse::exec {

using codegen::KernelSpec;

void check_fp8_linear(const Builder& b, int lin) {
  const auto& o = b.ops().at(static_cast<size_t>(lin));
  const int64_t m = ops::rows_of(o.in), k = ops::cols_of(o.in), n = ops::cols_of(o.out);
  auto need16 = [&](int64_t v, const char* what) {
    if (v % 16 != 0)
      fail(Status::unsupported, "{} under recipe {}: FP8 GEMMs need {} to be a multiple of 16 (got {}; the "
           "operands are {}x{} and {}x{}): pad it, or run this sequence under bf16", o.label(),
           ops::recipe_name(b.recipe().kind), what, v, m, k, n, k);
  };
  if (b.recipe().is_block()) {
    // Block scales: whole 1x128 blocks along every K, whole 128x128 weight blocks.
    auto need = [&](int64_t v, int64_t mult, const char* what) {
      if (v % mult != 0)
        fail(Status::unsupported, "{} under recipe fp8_block: {} must be a multiple of {} (got {}; the operands are "
             "{}x{} and {}x{}): block scaling takes whole 1x128 blocks along each GEMM's K and 128x128 weight "
             "blocks; pad it, or run this sequence under fp8_current or bf16", o.label(), what, mult, v, m, k, n, k);
    };
    need(k, 128, "in_features");
    need(n, 128, "out_features");
    if (b.training())
      need(m, 128, "the number of rows (the wgrad GEMM contracts over them in 1x128 blocks)");
    else
      need(m, 16, "the number of rows");
    return;
  }
  need16(k, "in_features");
  need16(n, "out_features");
  if (b.training()) need16(m, "the number of rows (the wgrad GEMM contracts over them)");
}

namespace {

// A kernel over an operand itself, no ops' stages (a standalone cast, a transpose of codes, a block cast):
// the builder's direction, dtype and rule.
KernelSpec stageless_spec(const Builder& b, int64_t cols, const std::string& label) {
  const ChainOptions opt = chain_options(b);
  KernelSpec s;
  s.dir = opt.dir;
  s.dtype = opt.dtype;
  s.rule = opt.rule;
  s.cols = cols;
  s.label = label;
  return s;
}

// A chain fused into a linear's operand cast writes no bf16 output, so where its last op keeps its own
// output for the backward (relu), the kernel's stage saves it (boundary_saves covers the group's last op,
// the linear, not this one).
void save_chain_output(const Builder& b, KernelSpec& spec, int e) {
  if (!b.training() || !b.forward()) return;
  const auto& saved = b.ops().at(static_cast<size_t>(e - 1)).saved;
  if (std::find(saved.begin(), saved.end(), ops::SavedKind::output) == saved.end()) return;
  for (auto* stages : {&spec.pre, &spec.post})
    for (auto& st : *stages)
      if (st.op == e - 1 && st.kind == codegen::Stage::Kind::unary) st.save_output = true;
}

// Training, a norm (and the ops before it) producing a linear's input: the norm kernel saves its row
// statistics (and runs its pre stages) without writing an output; the block cast reads the norm's input
// again and normalises in its tiles, so the normalised tensor is never written in bf16 (2 + 2 bytes read,
// 1 + 1 written per element, against 8 for a bf16 norm output and a cast of it). Lowers the statistics
// kernel of `chain` (the rownorm spec of [bgn, the linear)) and returns the cast's spec (its one stage:
// normalize); `src` becomes what the cast reads.
KernelSpec norm_statistics(Builder& b, KernelSpec chain, int bgn, int64_t rows, const char* stem, int& src) {
  const int ni = chain.norm->op;
  const auto& no = b.ops().at(static_cast<size_t>(ni));
  chain.norm->stats_only = true;
  chain.label += "_stats";
  b.kernel(chain, b.kernel_meta(bgn, "forward"), src, -1, rows,
           fmt::format("{}: generated row statistics of {} (no output: the block-scaled cast normalises)",
                       b.rule_or_unfused(), no.label()));
  codegen::Stage st;
  st.kind = codegen::Stage::Kind::normalize;
  st.op = ni;
  st.op_kind = no.kind;
  st.math = no.kind == "rmsnorm" ? "y = x * rstd * g (the saved statistics)"
                                 : "y = (x - mean) * rstd * g + beta (the saved statistics)";
  st.norm_rms = no.kind == "rmsnorm";
  st.norm_zero_centered = no.flag("zero_centered_gamma");
  if (ni != bgn) src = b.saved_context(ni, Key::input);  // pre stages ran: their output was saved
  KernelSpec spec = stageless_spec(b, chain.cols, std::string(no.kind) + "_" + stem);
  spec.pre = {st};
  return spec;
}

// fp8_block: the operand's block-scaled cast (codegen Fp8Spec::block): row-major codes with their scales
// and, in training, the transposed codes with theirs, in one kernel. With a chain [bgn, e) (the ops before
// the linear in the forward, after it in the backward; elementwise), the cast kernel runs the chain's
// stages on `src` itself (the chain's input, or the gradient of its output) and no bf16 copy of the
// operand is written: the quantisation fused into its producer (a gated op's forward too: the cast reads
// both halves of its input). A forward chain with a norm (and the residual add / fork before it) runs as a
// statistics kernel and the cast normalises (training).
void block_cast_operand(Builder& b, int lin, fp8::Operand operand, int src, int bgn, int e) {
  auto& dst = b.fp8_operand(lin, operand);
  const bool weight = operand == fp8::Operand::weight;
  const auto& o = b.ops().at(static_cast<size_t>(lin));
  const char* stem = weight ? "block_cast_128x128_e4m3"
                     : b.training() ? "block_cast_transpose_1x128_e4m3" : "block_cast_1x128_e4m3";
  KernelSpec spec;
  bool vec = true;
  std::string chain_what;
  if (bgn < e) {
    ChainOptions opt = chain_options(b);
    opt.fp8.reset();
    opt.vec = vec = chain_vectorizable(b.ops(), bgn, e);
    spec = chain_spec(b.ops(), bgn, e, opt);
    if (spec.skeleton == codegen::Skeleton::rownorm && b.forward() && !weight) {
      if (!b.training()) {
        // Inference saves no statistics: the norm kernel writes bf16 and the block cast reads it.
        const int h = b.act(lin);
        lower_chain(b, bgn, e, opt, dst.rows, src, h);
        return block_cast_operand(b, lin, operand, h, lin, lin);
      }
      spec = norm_statistics(b, spec, bgn, dst.rows, stem, src);
      chain_what = "normalise -> ";
    } else {
      const bool gated_fwd = spec.skeleton == codegen::Skeleton::gated && b.forward();
      if ((spec.skeleton != codegen::Skeleton::elementwise && !gated_fwd) || weight)
        fail(Status::internal, "{}: under fp8_block only an elementwise chain, a gated op's forward or a norm writes "
             "a linear's activation or gradient operand (the rule's legality check should have refused this "
             "window)", o.label());
      spec.label += std::string("_") + stem;
      save_chain_output(b, spec, e);
      chain_what = b.forward() ? "chain -> " : "chain backward -> ";
    }
  } else {
    spec = stageless_spec(b, dst.cols, stem);
  }
  spec.skeleton = codegen::Skeleton::cast_transpose;
  spec.vec = vec && dst.cols % 8 == 0 && dst.rows % 16 == 0;
  codegen::Fp8Spec q;
  q.op = lin;
  q.tensor = fp8::name(operand);
  q.block = weight ? 2 : 1;
  q.colwise = b.training();
  spec.fp8 = q;
  nlohmann::json meta = b.kernel_meta(bgn < e ? bgn : lin, b.forward() ? "forward" : "backward");
  meta["fp8_operand"] = q.tensor;
  const std::string who = b.rule_or_unfused();
  const size_t first = b.steps();
  b.kernel(spec, meta, src, dst.row, dst.rows,
           fmt::format("{}: generated {}block-scaled E4M3 cast of {} of {} ({}{})", who,
                       chain_what, q.tensor, o.label(),
                       weight ? "128x128 blocks" : "1x128 blocks",
                       b.training() ? (weight ? ", row-major and transposed" : ", row-major; transposed with 128x1 blocks")
                                    : ""));
  if (weight) b.mark_weight_casts(first);
  dst.ready = true;
}

}  // namespace

void fp8_cast_operand(Builder& b, int lin, fp8::Operand operand, int src, int bgn, int e) {
  if (b.recipe().is_block()) return block_cast_operand(b, lin, operand, src, bgn, e);
  const auto& ops = b.ops();
  auto& dst = b.fp8_operand(lin, operand);
  const bool weight = operand == fp8::Operand::weight;
  const std::string tensor = fp8::name(operand);
  const auto& o = ops.at(static_cast<size_t>(lin));
  const int64_t rows = dst.rows, cols = dst.cols;
  ChainOptions opt = chain_options(b);
  codegen::Fp8Spec q;
  q.op = lin;
  q.tensor = tensor;
  q.e5m2 = operand == fp8::Operand::grad_output;
  q.delayed = b.recipe().kind == ops::RecipeKind::fp8_delayed;
  q.margin = b.recipe().margin;
  opt.fp8.reset();  // chain_spec's quantize hand-off is not this
  const char* format = q.e5m2 ? "e5m2" : "e4m3";
  KernelSpec spec;
  if (bgn < e) {
    opt.vec = chain_vectorizable(ops, bgn, e);
    spec = chain_spec(ops, bgn, e, opt);
    save_chain_output(b, spec, e);
  } else {
    spec = stageless_spec(b, cols, "cast");
  }
  spec.vec = (bgn < e ? opt.vec : true) && cols % 8 == 0;
  spec.fp8 = q;
  // A norm or gated kernel writes the row-major codes only (a norm works a row at a time; a gated kernel's
  // output is half its input's width); in training the transposed copy is a transpose of those codes (1 byte
  // read per element, not the 2-byte activation).
  const bool row_codes = spec.skeleton == codegen::Skeleton::rownorm || spec.skeleton == codegen::Skeleton::gated;
  const bool codes_transpose = row_codes && b.training();
  if ((b.training() || !b.forward()) && !row_codes) {
    spec.skeleton = codegen::Skeleton::cast_transpose;
    spec.label += "_transpose";
    spec.vec = spec.vec && rows % 16 == 0;  // the transposed 16-byte stores: 16 rows of one column
  }
  spec.label += std::string("_") + format;
  const std::string who = b.rule_or_unfused();
  nlohmann::json meta = b.kernel_meta(bgn < e ? bgn : lin, b.forward() ? "forward" : "backward");
  meta["fp8_operand"] = tensor;
  const size_t first = b.steps();
  lower_spec(b, spec, meta, src, dst.row, rows,
             fmt::format("{}: generated {} -> {} {} of {}", who, codegen::skeleton_name(spec.skeleton),
                         q.e5m2 ? "E5M2" : "E4M3", tensor, o.label()));
  if (codes_transpose) {
    KernelSpec t = stageless_spec(b, cols, std::string("transpose_") + format);
    t.skeleton = codegen::Skeleton::cast_transpose;
    t.vec = cols % 8 == 0 && rows % 16 == 0;
    t.fp8 = q;
    t.fp8->codes_in = true;
    b.kernel(t, meta, dst.row, dst.col, rows,
             fmt::format("{}: generated transpose of the {} {} codes of {}", who, q.e5m2 ? "E5M2" : "E4M3", tensor,
                         o.label()));
  }
  if (weight) b.mark_weight_casts(first);
  dst.ready = true;
}

}  // namespace jitfuse::exec
