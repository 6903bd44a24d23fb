// Joint strategy chunked_linear_cross_entropy ([linear, bias?, cross_entropy], reduction mean or sum): the
// language-model head and its loss in chunks of rows, the gradient computed in the forward (Liger Kernel's fused linear
// cross-entropy). First one block counts the rows not ignored (the reduction's scale). Per chunk: the head GEMM writes
// the chunk's logits, one kernel turns them into the rows' losses and, in place, dlogits for an upstream gradient of
// 1 (the scale applied), then the dgrad GEMM writes the chunk's rows of dx and the wgrad GEMM adds its dW (and a
// column-sum GEMM its db). The forward saves dx, dW (db), never the logits; the backward multiplies them by the
// upstream gradient, in place over the saved block where the host allows it (Program::grad_aliases), and does
// nothing there for the usual upstream gradient of 1.
#include <fmt/format.h>

#include "exec/lower/impl/cross_entropy.hpp"
#include "exec/lower/impl/registrar.hpp"
#include "exec/lower/lowering.hpp"

namespace jitfuse::exec {
namespace {

using K = codegen::CrossEntropySpec::Kernel;

class ChunkedLinearCrossEntropy final : public Implementation {
 public:
  rules::Impl::Kind kind() const override { return rules::Impl::Kind::joint; }
  std::string name() const override { return "chunked_linear_cross_entropy"; }
  std::string covers_text() const override {
    return "[linear, bias?, cross_entropy] with reduction mean or sum, the head whole or split by vocabulary "
           "(vocab_parallel; joint pass)";
  }
  std::optional<std::string> check(const std::vector<OpUse>& w, const rules::Impl&, rules::Pass pass) const override {
    if (pass != rules::Pass::joint) return "joint strategies run in the joint pass";
    const bool bias = w.size() == 3 && w[1].family() == ops::Family::bias;
    if ((w.size() != 2 && !bias) || w[0].family() != ops::Family::linear || w.back().name() != "cross_entropy")
      return "chunked_linear_cross_entropy implements " + covers_text();
    if (w[0].str("weight_layout") == "in_out")
      return "a head weight stored [in, out] (weight_layout in_out): the chunked head pads the vocabulary's rows of an "
             "[out, in] weight; the ops run unfused";
    if (w.back().str("reduction") == "none")
      return "reduction none: the backward's per-row upstream gradients are "
             "not known in the forward, which computes "
             "dx and dW here; the ops run unfused (or use mean or sum)";
    return std::nullopt;
  }
  void lower(Builder& b, const rules::Impl&) const override {
    if (b.forward())
      forward(b);
    else
      backward(b);
  }

 private:
  struct Ops {
    int lin, bias, ce;
    int64_t rows, h, v;
    // The logits chunk's row stride: V rounded up to 8 elements, so every row starts 16-byte aligned and
    // the three GEMMs take cuBLASLt's aligned kernels at an odd vocabulary (GPT-2's 50257).
    int64_t ld() const { return (v + 7) / 8 * 8; }
  };
  static Ops ops_of(const Builder& b) {
    const auto& g = b.group();
    const auto& o = b.ops()[static_cast<size_t>(g.begin)];
    return {g.begin,
            g.end - g.begin == 3 ? g.begin + 1 : -1,
            g.end - 1,
            ops::rows_of(o.in),
            ops::cols_of(o.in),
            ops::cols_of(o.out)};
  }

  // The buffers a forward's chunks share.
  struct Buffers {
    int x, w, dx, dw, db, logits, losses, ones;
    int stats = -1, gathered = -1;  // vocab-parallel: this rank's row statistics of a chunk, every rank's
    int w_head = -1, b_head = -1;  // the weight and bias the head and dgrad GEMMs read (padded at an odd V)
  };

  // At a vocabulary that is not a multiple of 8, cuBLASLt has only its unaligned kernels for GEMMs of that
  // dimension (H100, GPT-2's 50257: 3x slower), as Inductor's pad_mm knows: the head and dgrad GEMMs run
  // over V rounded up to 8, on a copy of the weight (and bias) with zero rows after it. The padded logits
  // columns are then 0, which the fused kernel leaves alone, so the dgrad's sum over them adds nothing; the
  // wgrad keeps V. One copy of the weight per forward (its bytes once, against three GEMMs over it).
  void pad_head(Builder& b, const Ops& o, Buffers& bf, const nlohmann::json& meta, const std::string& who) const {
    bf.w_head = bf.w;
    bf.b_head = o.bias < 0 ? -1 : b.param(o.bias, Key::bias);
    if (o.v == o.ld()) return;
    const ops::DType dt = b.recipe().dtype;
    auto pad = [&](int src, int64_t cols, const std::string& name) {
      const int out = b.temp(name + " padded", dt, o.ld(), cols);
      codegen::KernelSpec k = cross_entropy_spec(b, o.ce, K::pad_rows);
      k.cols = cols;
      k.ce->pad_from = o.v;
      b.kernel(k, meta, src, out, o.ld(),
               fmt::format("{}: the {} with zero rows to {} (aligned GEMMs at vocabulary {})", who, name, o.ld(), o.v));
      return out;
    };
    bf.w_head = pad(bf.w, o.h, "weight");
    if (o.bias >= 0) bf.b_head = pad(bf.b_head, 1, "bias");
  }

  void forward(Builder& b) const {
    const Ops o = ops_of(b);
    const auto& g = b.group();
    const ops::DType dt = b.recipe().dtype;
    const int64_t e = ops::dtype_bytes(dt);
    const int64_t mib_attr = b.ops()[static_cast<size_t>(o.ce)].attrs.value("chunk_mib", int64_t{0});
    const double budget = static_cast<double>(mib_attr > 0 ? mib_attr : kAutoMib) * 1024.0 * 1024.0;
    const int64_t chunk = chunk_rows(o.rows, o.ld(), e, budget, mib_attr <= 0);
    const int64_t chunks = (o.rows + chunk - 1) / chunk;
    const std::string who = g.rule + ": chunked_linear_cross_entropy";
    Buffers bf{};
    bf.x = b.act(o.lin);
    bf.w = b.param(o.lin, Key::weight);
    bf.dx = b.saved_new(o.lin, Key::dx, dt, o.rows, o.h, static_cast<size_t>(o.rows * o.h * e));
    bf.dw = b.saved_new(o.lin, Key::dW, dt, o.v, o.h, static_cast<size_t>(o.v * o.h * e));
    bf.db = o.bias < 0 ? -1 : b.saved_new(o.bias, Key::db, dt, 1, o.v, static_cast<size_t>(o.v * e));
    b.saved_new(o.ce, Key::scale, ops::DType::f32, 1, 1, 4);
    bf.logits = b.temp("logits chunk", dt, chunk, o.ld());
    bf.losses = b.temp("losses op" + std::to_string(o.ce), ops::DType::f32, o.rows, 1);
    bf.ones = -1;
    const int world = cross_entropy_spec(b, o.ce, K::stats).ce->world;
    if (world > 1) {
      bf.stats = b.temp("row stats chunk", ops::DType::f32, chunk, 4);
      bf.gathered = b.temp("gathered row stats chunk", ops::DType::f32, chunk * world, 4);
    }
    const nlohmann::json meta = b.kernel_meta(o.ce, "forward");
    pad_head(b, o, bf, meta, who);
    // What the unfused ops would save: the linear's input (unless it is the caller's), the logits, the lse.
    const double unfused = static_cast<double>((o.lin > 0 ? o.rows * o.h * e : 0) + o.rows * o.v * e + o.rows * 4 + 4);
    const double fused = static_cast<double>(o.rows * o.h * e + o.v * o.h * e + (o.bias < 0 ? 0 : o.v * e) + 4);
    std::string plan = fmt::format(
        "{} chunk(s) of {} rows (logits chunk {} for the {} budget{}); saves dx + "
        "dW{} = {}, "
        "the unfused ops save {} (the logits)",
        chunks, chunk, mib(static_cast<double>(chunk * o.ld() * e)), mib(budget),
        mib_attr > 0 ? "" : fmt::format(", at least {} rows", kAutoMinRows), o.bias < 0 ? "" : " + db",
        mib(fused), mib(unfused));
    // The scale first (1 / rows not ignored, from the labels alone), so the chunks write dlogits, dx and dW
    // scaled for an upstream gradient of 1 and the backward has nothing to do for loss.backward().
    b.kernel(cross_entropy_spec(b, o.ce, K::count), meta, -1, -1, o.rows,
             who + ": scale = " + (b.ops()[o.ce].str("reduction") == "mean" ? "1 / rows not ignored" : "1") +
                 ", for the chunks' dlogits");
    if (o.bias >= 0) {  // the column of ones of db's column-sum GEMM
      bf.ones = b.temp("ones", dt, chunk, 1);
      b.kernel(cross_entropy_spec(b, o.ce, K::fill_ones), meta, -1, bf.ones, chunk, who + " (ones for db); " + plan);
      plan.clear();
    }
    for (int64_t c0 = 0; c0 < o.rows; c0 += chunk) {
      const int64_t m = std::min(chunk, o.rows - c0);
      const std::string at = fmt::format("{} chunk {}/{} rows [{}, {})", who, c0 / chunk + 1, chunks, c0, c0 + m);
      chunk_steps(b, o, bf, c0, m, at, meta, c0 == 0 ? plan : std::string());
    }
    codegen::KernelSpec red = cross_entropy_spec(b, o.ce, K::reduce);
    b.kernel(red, meta, bf.losses, b.act(g.end), o.rows,
             who + ": loss = " + b.ops()[o.ce].str("reduction") + " of the rows' losses");
  }

  // Rows [c0, c0 + m): the head GEMM, the loss and dlogits kernel, dgrad into dx, wgrad (and db) accumulated.
  void chunk_steps(Builder& b, const Ops& o, const Buffers& bf, int64_t c0, int64_t m, const std::string& at,
                   const nlohmann::json& meta, const std::string& plan) const {
    GemmStep head = b.linear_gemm(o.lin, cuda::GemmKind::fwd);
    head.call.m = m;
    head.call.n = o.ld();  // the padded weight's rows (pad_head)
    head.call.ldy = o.ld();
    head.a = bf.x;
    head.a_offset = c0 * o.h;
    head.b = bf.w_head;
    head.d = bf.logits;
    if (o.bias >= 0) {
      head.call.epilogue = cuda::Epilogue::bias;
      head.bias = bf.b_head;
    }
    b.gemm(head, at + ": logits = x W^T" + (o.bias >= 0 ? " + b" : "") + (plan.empty() ? "" : "; " + plan));
    codegen::KernelSpec k = cross_entropy_spec(b, o.ce, K::fused);
    k.ce->grid_rows = m;  // rows [c0, c0 + m) of the labels: the kernel's `rows` is c0 + m
    k.ce->ld = o.ld();
    k.ce->prescaled = true;
    if (k.ce->vocab_parallel())
      gather_row_stats(b, o.ce, bf.logits, m, c0, o.ld(), bf.stats, bf.gathered, meta, at);
    b.kernel(k, meta, bf.logits, bf.losses, c0 + m,
             at + (k.ce->vocab_parallel() ? ": loss per row from every rank's statistics, dlogits in place"
                                          : ": loss per row, dlogits in place"));
    if (k.ce->vocab_parallel()) b.forget_saved(o.ce, Key::stats);
    GemmStep dg = b.linear_gemm(o.lin, cuda::GemmKind::dgrad);
    dg.call.m = m;
    dg.call.n = o.ld();  // the sum runs over the padded columns too: zero logits times zero rows
    dg.call.ldy = o.ld();
    dg.a = bf.logits;
    dg.b = bf.w_head;
    dg.d = bf.dx;
    dg.d_offset = c0 * o.h;
    b.gemm(dg, at + ": dx = dlogits W");
    // dW (+)= dlogits^T x_chunk; db^T [V, 1] (+)= dlogits^T ones: beta 0 for the first chunk, 1 after.
    for (const bool bias_sum : {false, true}) {
      if (bias_sum && o.bias < 0) break;
      GemmStep wg = b.linear_gemm(o.lin, cuda::GemmKind::wgrad);
      wg.call.m = m;
      wg.call.ldy = o.ld();
      wg.a = bf.logits;
      wg.b = bias_sum ? bf.ones : bf.x;
      wg.b_offset = bias_sum ? 0 : c0 * o.h;
      if (bias_sum) wg.call.k = 1;
      wg.d = bias_sum ? bf.db : bf.dw;
      if (c0 > 0) {
        wg.call.beta = 1.f;
        wg.c = wg.d;
      }
      b.gemm(wg, at + (bias_sum ? (c0 > 0 ? ": db += column sums of dlogits" : ": db = column sums of dlogits")
                                : (c0 > 0 ? ": dW += dlogits^T x" : ": dW = dlogits^T x")));
    }
  }

  // grad = g * saved, g the loss's upstream gradient (the forward applied the scale, 1 / rows not ignored or 1).
  void backward(Builder& b) const {
    const Ops o = ops_of(b);
    const auto& g = b.group();
    const std::string who = g.rule + ": chunked_linear_cross_entropy";
    const nlohmann::json meta = b.kernel_meta(o.ce, "backward");
    const int dy = b.grad_of(g.end);
    // Each kernel reads its saved tensor only to write its gradient, element for element: the caller may
    // pass the gradient as that part of the saved buffer (Builder::alias_saved), unless it accumulates.
    auto scale = [&](int src_op, codegen::Key src, int out, int64_t rows, int64_t cols, bool accumulate,
                     const std::string& what) {
      codegen::KernelSpec k = cross_entropy_spec(b, o.ce, K::scale);
      k.cols = cols;
      k.ce->src_op = src_op;
      k.ce->src = src;
      k.ce->accumulate = accumulate;
      k.ce->prescaled = true;
      b.kernel(k, meta, dy, out, rows, who + ": " + what);
      if (!accumulate) b.alias_saved(out, src_op, src);
    };
    scale(o.lin, Key::dx, b.grad_of(g.begin), o.rows, o.h, false, "dx = g saved dx (nothing in place at g = 1)");
    const bool acc = b.ops()[static_cast<size_t>(o.lin)].flag("accumulate_grad");
    scale(o.lin, Key::dW, b.grad(o.lin, Key::weight), o.v, o.h, acc,
          acc ? "dW += g saved dW" : "dW = g saved dW (nothing in place at g = 1)");
    if (o.bias >= 0) scale(o.bias, Key::db, b.grad(o.bias, Key::bias), 1, o.v, false, "db = g saved db");
  }

  // Rows per chunk: the chunk's logits fit `budget` bytes (the op's chunk_mib: rows x V x dtype bytes), in
  // multiples of 128 rows when at least 128 fit (whole GEMM tiles), at least 1, at most the rows. `automatic`
  // (chunk_mib 0, the default): 256 MiB, but at least kAutoMinRows rows. Each chunk re-reads and re-writes
  // all of dW (the wgrad's beta = 1), which costs in proportion to V x H per chunk: on an H100 (session 36,
  // docs/benchmarks.md) 1024-row chunks of Llama-3's head ran 4-10 % over torch.compile, 2048-row ones
  // 2-3 %, and larger ones gained little more.
  static constexpr int64_t kAutoMib = 256, kAutoMinRows = 2048;
  static int64_t chunk_rows(int64_t rows, int64_t v, int64_t e, double budget, bool automatic) {
    int64_t c = static_cast<int64_t>(budget) / std::max<int64_t>(1, v * e);
    if (automatic) c = std::max(c, kAutoMinRows);
    if (c >= 128) c = c / 128 * 128;
    return std::clamp<int64_t>(c, 1, rows);
  }
};

const Registrar kRegistered(std::make_unique<ChunkedLinearCrossEntropy>());

}  // namespace
}  // namespace jitfuse::exec
