// The cross_entropy skeleton: the kernels of the cross_entropy op (CrossEntropySpec::Kernel) as calls into
// templates/skeletons/cross_entropy.cuh with the op's attributes as literals. Row kernels run one block per row of
// logits; the per-row losses are reduced by one block in a fixed order (deterministic).
#include <algorithm>
#include <cstdint>
#include <stdexcept>

#include "stages.hpp"

namespace jitfuse::codegen::detail {
namespace {

using K = CrossEntropySpec::Kernel;

// Threads of a row kernel: about 4 chunks of 8 per thread (one round of the 4-chunk loads), 32 to 512.
int row_threads(int64_t v) {
  const int64_t chunks = (v + 7) / 8;
  return static_cast<int>(std::clamp<int64_t>(((chunks + 3) / 4 + 31) / 32 * 32, 32, 512));
}

constexpr int kReduceThreads = 1024, kScaleThreads = 256, kScaleBlocks = 1024;

const char* kNaN = "__int_as_float(0x7fc00000)";

// An int64 as a C literal (INT64_MIN has none: -9223372036854775808 is the negation of an out-of-range one).
std::string i64(int64_t v) {
  if (v == INT64_MIN) return "(-9223372036854775807LL - 1)";
  return fmt::format("{}LL", v);
}

class CrossEntropy {
 public:
  explicit CrossEntropy(const KernelSpec& spec) : spec_(spec), ce_(*spec.ce), v_(spec.cols) {
    if (v_ < 1) throw std::invalid_argument("codegen: a cross_entropy kernel needs cols >= 1");
    cap_ = ce_.softcap > 0;
    mean_ = ce_.reduction == "mean";
    none_ = ce_.reduction == "none";
    labels_ = fmt::format("e{}_labels", ce_.op);
    vp_ = ce_.vocab_parallel();
    vtot_ = vp_ ? ce_.vocab_total : v_;
    const bool vocab_cols = ce_.kernel == K::rows_fwd || ce_.kernel == K::rows_bwd || ce_.kernel == K::fused ||
                            ce_.kernel == K::stats;  // the others' cols are not the vocabulary's (pad_rows: h)
    if (vp_ && vocab_cols && (ce_.vocab_start < 0 || ce_.vocab_start + v_ > vtot_))
      throw std::invalid_argument("codegen: a vocab-parallel cross_entropy's columns lie outside its vocabulary");
  }

  Generated generate() {
    Generated g;
    g.kernel = kernel_name(spec_);
    g.headers = headers_for(spec_);
    Writer w;
    emit_prelude(w, spec_, g.headers);
    w.line("typedef {} LT;  // labels", ce_.labels_i32 ? "int" : "jf_i64");
    w.line("// {}", comment_text(what()));
    Writer k;
    k.open();
    int threads = row_threads(v_);
    g.launch.grid_x = ce_.grid_rows;
    switch (ce_.kernel) {
      case K::rows_fwd:
        rows_fwd(k);
        break;
      case K::reduce:
        threads = kReduceThreads;
        g.launch.grid_x = 1;
        reduce(k);
        break;
      case K::rows_bwd:
        rows_bwd(k);
        break;
      case K::fused:
        fused(k);
        break;
      case K::scale:
        threads = kScaleThreads;
        g.launch.grid_x = kScaleBlocks;
        scale(k);
        break;
      case K::fill_ones:
        threads = kScaleThreads;
        g.launch.grid_x = 1;
        fill_ones(k);
        break;
      case K::count:
        threads = kReduceThreads;
        g.launch.grid_x = 1;
        count(k);
        break;
      case K::pad_rows:
        threads = kScaleThreads;
        g.launch.grid_x = kScaleBlocks;
        pad_rows(k);
        break;
      case K::stats:
        row_stats(k);
        break;
    }
    k.close();
    g.launch.bx = threads;
    g.launch.by = 1;
    w.line("extern \"C\" __global__ void __launch_bounds__({}) {}({}) {{", threads, g.kernel, args_.decl());
    w.raw(k.str());
    w.line("}}");
    Setup none;
    finish(w, none, args_, g, spec_);
    return g;
  }

 private:
  std::string what() const {
    switch (ce_.kernel) {
      case K::rows_fwd:
        return "loss_r = lse_r - (1 - eps) z_r[y_r] - eps/V sum z_r + z_loss "
               "lse_r^2 per row (one block each)";
      case K::reduce:
        return std::string("loss = ") + (mean_ ? "sum_r loss_r / #(y_r != ignore_index)" : "sum_r loss_r") +
               " (one block, fixed order)";
      case K::rows_bwd:
        return "dx_r = g_r ((1 + 2 z_loss lse_r) softmax(z_r) - (1 - eps) "
               "onehot(y_r) - eps/V) z'(x_r)";
      case K::fused:
        return ce_.prescaled ? "a chunk of rows: loss_r, and dx_r for g = scale in place of the logits"
                             : "a chunk of rows: loss_r, and dx_r for g = 1 in place of the "
                               "logits";
      case K::scale:
        return ce_.prescaled ? "out (+)= g[0] * src (nothing where g[0] = 1 in place)"
                             : "out (+)= g[0] * scale[0] * src";
      case K::fill_ones:
        return "out[r] = 1";
      case K::count:
        return std::string("scale = ") + (mean_ ? "1 / #(y_r != ignore_index)" : "1") + " (one block)";
      case K::pad_rows:
        return fmt::format("out = in ({} rows of {}), then zero rows", ce_.pad_from, v_);
      case K::stats:
        return fmt::format("this rank's statistics per row of columns [{}, {}) of {}: max, sum exp, sum z, z[y] or 0",
                           ce_.vocab_start, ce_.vocab_start + v_, vtot_);
    }
    return "";
  }
  // The row of this block: lr in `in` (a chunk's row), r in the labels (rows just past the kernel's rows).
  void row_index(Writer& k) const {
    k.line("const jf_i64 lr = blockIdx.x, r = rows - (jf_i64)gridDim.x + lr;");
    k.line("const jf_i64 y = (jf_i64){}[r];", labels_);
  }
  std::string ignored() const { return "y == (jf_i64)" + i64(ce_.ignore_index); }
  std::string in_range() const { return fmt::format("(y >= 0 && y < {})", vtot_); }
  // The label as a column of this rank's logits (vocab-parallel: out of [0, cols) where another rank has it).
  std::string y_local() const { return vp_ ? fmt::format("(y - {})", i64(ce_.vocab_start)) : "y"; }
  std::string tmpl() const { return fmt::format("DT, JF_VEC, {}", cap_ ? "true" : "false"); }
  void labels_arg() { args_.ptr(Arg::Role::extra_in, ce_.op, "labels", labels_, "LT", false); }
  // Vocab-parallel: every rank's row statistics, gathered (stats kernels, then the all_gather).
  void gathered_arg() {
    if (vp_) args_.ptr(Arg::Role::saved, ce_.op, Key::stats, fmt::format("s{}_stats", ce_.op), "float", false);
  }
  // The row's merged statistics in every thread, and lse. Vocab-parallel: every rank's statistics of the row,
  // gathered, merged in rank order (the same lse and loss on every rank), and zy, z at the label.
  void stats(Writer& k, const std::string& row) const {
    if (vp_) {
      k.line("JfCeStat st = jf_ce_empty();");
      k.line("float zy = 0.f;");
      k.line("for (int q = 0; q < {}; ++q) {{", ce_.world);
      k.line("  const float* p = s{}_stats + ((jf_i64)q * gridDim.x + lr) * 4;", ce_.op);
      k.line("  JfCeStat b;");
      k.line("  b.m = p[0];");
      k.line("  b.s = p[1];");
      k.line("  b.z = p[2];");
      k.line("  jf_ce_merge(st, b);");
      k.line("  zy += p[3];");
      k.line("}}");
      k.line("const float lse = st.m + logf(st.s);");
      return;
    }
    k.line(
        "const JfCeStat st = jf_ce_block_merge(jf_ce_row_stats<{}>({}, {}, "
        "{}), jf_sm);",
        tmpl(), row, v_, num(ce_.softcap));
    k.line("const float lse = st.m + logf(st.s);");
  }
  std::string loss_expr(const std::string& row) const {
    if (vp_)
      return fmt::format("jf_ce_loss(st, lse, {} ? zy : {}, {}, {}, {})", in_range(), kNaN,
                         num(1.0 / static_cast<double>(vtot_)), num(ce_.label_smoothing), num(ce_.z_loss));
    return fmt::format(
        "jf_ce_loss(st, lse, {} ? jf_ce_z<{}>(DT::load({}[y]), "
        "{}) : {}, {}, {}, {})",
        in_range(), cap_ ? "true" : "false", row, num(ce_.softcap), kNaN, num(1.0 / static_cast<double>(v_)),
        num(ce_.label_smoothing), num(ce_.z_loss));
  }
  // The gradient pass of a row for upstream gradient `g`.
  void grad(Writer& k, const std::string& x, const std::string& dx, const std::string& g) const {
    k.line(
        "jf_ce_grad_row<{}>({}, {}, {}, lse, {} * (1.f + {} * lse), {} * "
        "{}, {} * {}, {}, {});",
        tmpl(), x, dx, v_, g, num(2.0 * ce_.z_loss), g, num(1.0 - ce_.label_smoothing), g,
        num(ce_.label_smoothing / static_cast<double>(vtot_)), y_local(), num(ce_.softcap));
  }

  void rows_fwd(Writer& k) {
    args_.ptr(Arg::Role::in, -1, "in", "in", "ST", false);
    args_.ptr(Arg::Role::out, -1, "out", "out", none_ ? "ST" : "float", true);
    args_.scalar(Arg::Role::rows, -1, "rows", "rows", "jf_i64");
    labels_arg();
    const std::string lse = fmt::format("s{}_lse", ce_.op);
    if (ce_.save) args_.ptr(Arg::Role::saved, ce_.op, Key::lse, lse, "float", true);
    gathered_arg();
    const std::string store = none_ ? "DT::store" : "";
    k.line("__shared__ float jf_sm[96];");
    row_index(k);
    k.line("if ({}) {{", ignored());
    k.line("  if (threadIdx.x == 0) {{ out[r] = {}(0.f);{} }}", store,
           ce_.save ? fmt::format(" {}[r] = 0.f;", lse) : "");
    k.line("  return;");
    k.line("}}");
    k.line("const ST* row = in + lr * {};", v_);
    stats(k, "row");
    k.line("if (threadIdx.x == 0) {{");
    k.line("  out[r] = {}({});", store, loss_expr("row"));
    if (ce_.save) k.line("  {}[r] = lse;", lse);
    k.line("}}");
  }

  void reduce(Writer& k) {
    args_.ptr(Arg::Role::in, -1, "in", "in", "float", false);
    args_.ptr(Arg::Role::out, -1, "out", "out", "ST", true);
    args_.scalar(Arg::Role::rows, -1, "rows", "rows", "jf_i64");
    labels_arg();
    const std::string scale = fmt::format("s{}_scale", ce_.op);
    if (ce_.save) args_.ptr(Arg::Role::saved, ce_.op, Key::scale, scale, "float", true);
    k.line("__shared__ float jf_sm[64];");
    k.line("float s;");
    k.line("int n;");
    k.line("jf_ce_reduce<LT>(in, {}, rows, {}, jf_sm, &s, &n);", labels_, i64(ce_.ignore_index));
    k.line("if (threadIdx.x == 0) {{");
    k.line("  out[0] = DT::store({});", mean_ ? "s / (float)n" : "s");
    if (ce_.save) k.line("  {}[0] = {};", scale, mean_ ? "1.f / (float)n" : "1.f");
    k.line("}}");
  }

  void rows_bwd(Writer& k) {
    args_.ptr(Arg::Role::in, -1, "in", "in", "ST", false);
    args_.ptr(Arg::Role::out, -1, "out", "out", "ST", true);
    args_.scalar(Arg::Role::rows, -1, "rows", "rows", "jf_i64");
    labels_arg();
    const std::string x = fmt::format("s{}_input", ce_.op), lse = fmt::format("s{}_lse", ce_.op),
                      scale = fmt::format("s{}_scale", ce_.op);
    args_.ptr(Arg::Role::saved, ce_.op, Key::input, x, "ST", false);
    args_.ptr(Arg::Role::saved, ce_.op, Key::lse, lse, "float", false);
    if (!none_) args_.ptr(Arg::Role::saved, ce_.op, Key::scale, scale, "float", false);
    row_index(k);
    k.line("ST* dx = out + lr * {};", v_);
    k.line("if ({}) {{", ignored());
    k.line("  jf_ce_zero_row<DT, JF_VEC>(dx, {});", v_);
    k.line("  return;");
    k.line("}}");
    k.line("const float g = {} ? {} : {};", in_range(),
           none_ ? "DT::load(in[r])" : fmt::format("DT::load(in[0]) * {}[0]", scale), kNaN);
    k.line("const float lse = {}[r];", lse);
    grad(k, x + fmt::format(" + lr * {}", v_), "dx", "g");
  }

  void fused(Writer& k) {
    args_.ptr(Arg::Role::in, -1, "in", "in", "ST",
              true);  // the chunk's logits, overwritten by dlogits
    args_.ptr(Arg::Role::out, -1, "out", "out", "float", true);
    args_.scalar(Arg::Role::rows, -1, "rows", "rows", "jf_i64");
    labels_arg();
    if (ce_.prescaled) args_.ptr(Arg::Role::saved, ce_.op, Key::scale, "s_scale", "float", false);
    gathered_arg();
    k.line("__shared__ float jf_sm[96];");
    row_index(k);
    if (ce_.prescaled) k.line("const float sc = s_scale[0];  // loaded early: its latency hides under the row's");
    k.line("ST* row = in + lr * {};", ce_.ld > v_ ? ce_.ld : v_);  // rows padded to 16 bytes at an odd V
    k.line("if ({}) {{", ignored());
    k.line("  jf_ce_zero_row<DT, JF_VEC>(row, {});", v_);
    k.line("  if (threadIdx.x == 0) out[r] = 0.f;");
    k.line("  return;");
    k.line("}}");
    stats(k, "row");
    k.line("if (threadIdx.x == 0) out[r] = {};", loss_expr("row"));
    k.line("__syncthreads();  // z[y] is read before the row is overwritten");
    k.line("const float g = {} ? {} : {};", in_range(), ce_.prescaled ? "sc" : "1.f", kNaN);
    grad(k, "row", "row", "g");
  }

  // One block per row of a chunk (rows padded to ld): this rank's partial statistics for the all_gather.
  void row_stats(Writer& k) {
    args_.ptr(Arg::Role::in, -1, "in", "in", "ST", false);
    args_.ptr(Arg::Role::out, -1, "out", "out", "float", true);
    args_.scalar(Arg::Role::rows, -1, "rows", "rows", "jf_i64");
    labels_arg();
    k.line("__shared__ float jf_sm[96];");
    row_index(k);
    k.line("float* o = out + lr * 4;");
    k.line("if ({}) {{  // no loss: statistics of nothing", ignored());
    k.line("  if (threadIdx.x == 0) {{ o[0] = -3.402823466e38f; o[1] = 0.f; o[2] = 0.f; o[3] = 0.f; }}");
    k.line("  return;");
    k.line("}}");
    k.line("const ST* row = in + lr * {};", ce_.ld > v_ ? ce_.ld : v_);
    k.line("const JfCeStat st = jf_ce_block_merge(jf_ce_row_stats<{}>(row, {}, {}), jf_sm);", tmpl(), v_,
           num(ce_.softcap));
    k.line("if (threadIdx.x == 0) {{");
    k.line("  const jf_i64 yl = {};", y_local());
    k.line("  o[0] = st.m;");
    k.line("  o[1] = st.s;");
    k.line("  o[2] = st.z;");
    k.line("  o[3] = yl >= 0 && yl < {} ? jf_ce_z<{}>(DT::load(row[yl]), {}) : 0.f;", v_, cap_ ? "true" : "false",
           num(ce_.softcap));
    k.line("}}");
  }

  void count(Writer& k) {
    args_.scalar(Arg::Role::rows, -1, "rows", "rows", "jf_i64");
    labels_arg();
    const std::string scale = fmt::format("s{}_scale", ce_.op);
    args_.ptr(Arg::Role::saved, ce_.op, Key::scale, scale, "float", true);
    k.line("__shared__ float jf_sm[64];");
    k.line("float s;");
    k.line("int n;");
    k.line("jf_ce_reduce<LT>(nullptr, {}, rows, {}, jf_sm, &s, &n);", labels_, i64(ce_.ignore_index));
    k.line("if (threadIdx.x == 0) {}[0] = {};", scale, mean_ ? "1.f / (float)n" : "1.f");
  }

  void scale(Writer& k) {
    args_.ptr(Arg::Role::in, -1, "in", "in", "ST",
              false);  // the upstream gradient of the loss, [1]
    args_.ptr(Arg::Role::out, -1, "out", "out", "ST", true);
    args_.scalar(Arg::Role::rows, -1, "rows", "rows", "jf_i64");
    args_.ptr(Arg::Role::saved, ce_.src_op, ce_.src, "src", "ST", false);
    if (ce_.prescaled) {
      // The forward scaled src already; in place (out is src: jf_program_grad_aliases) with g = 1 (the
      // usual loss.backward()) there is nothing to write. Each element is read once, by the thread that
      // then writes it, so out may be src.
      k.line("const float g = DT::load(in[0]);");
      if (!ce_.accumulate) k.line("if (g == 1.f && (const void*)out == (const void*)src) return;");
    } else {
      args_.ptr(Arg::Role::saved, ce_.op, Key::scale, "scale", "float", false);
      k.line("const float g = DT::load(in[0]) * scale[0];");
    }
    k.line("const jf_i64 n = rows * {};", v_);
    k.line(
        "for (jf_i64 i = ((jf_i64)blockIdx.x * blockDim.x + threadIdx.x) * "
        "8; i < n; i += (jf_i64)gridDim.x * "
        "blockDim.x * 8) {{");
    k.open();
    k.line("const int m = (int)min((jf_i64)8, n - i);");
    k.line("float v[8];");
    k.line(
        "if (m == 8) jf_load8<DT, JF_VEC>(src + i, v); else jf_load8<DT, "
        "false>(src + i, v, m);");
    if (ce_.accumulate) {
      k.line("float o[8];");
      k.line(
          "if (m == 8) jf_load8<DT, JF_VEC>(out + i, o); else jf_load8<DT, "
          "false>(out + i, o, m);");
      k.line("#pragma unroll");
      k.line("for (int e = 0; e < 8; ++e) v[e] = o[e] + g * v[e];");
    } else {
      k.line("#pragma unroll");
      k.line("for (int e = 0; e < 8; ++e) v[e] *= g;");
    }
    k.line(
        "if (m == 8) jf_store8<DT, JF_VEC>(out + i, v); else jf_store8<DT, "
        "false>(out + i, v, m);");
    k.close();
    k.line("}}");
  }

  void pad_rows(Writer& k) {
    args_.ptr(Arg::Role::in, -1, "in", "in", "ST", false);
    args_.ptr(Arg::Role::out, -1, "out", "out", "ST", true);
    args_.scalar(Arg::Role::rows, -1, "rows", "rows", "jf_i64");
    k.line("const jf_i64 n = rows * {}, n_in = {};", v_, i64(ce_.pad_from * v_));
    k.line("for (jf_i64 i = (jf_i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (jf_i64)gridDim.x * blockDim.x)");
    k.line("  out[i] = i < n_in ? in[i] : DT::store(0.f);");
  }

  void fill_ones(Writer& k) {
    args_.ptr(Arg::Role::out, -1, "out", "out", "ST", true);
    args_.scalar(Arg::Role::rows, -1, "rows", "rows", "jf_i64");
    k.line(
        "for (jf_i64 i = threadIdx.x; i < rows; i += blockDim.x) out[i] = "
        "DT::store(1.f);");
  }

  const KernelSpec& spec_;
  const CrossEntropySpec& ce_;
  const int64_t v_;
  bool cap_ = false, mean_ = false, none_ = false, vp_ = false;
  int64_t vtot_ = 0;  // the whole vocabulary (vocab-parallel: every rank's columns)
  std::string labels_;
  Args args_;
};

}  // namespace

Generated generate_cross_entropy(const KernelSpec& spec) { return CrossEntropy(spec).generate(); }

}  // namespace jitfuse::codegen::detail
