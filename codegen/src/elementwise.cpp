// The elementwise and gated skeletons: a 2D grid of (column chunks of 8) x (row slabs); each thread
// keeps its columns' parameters in registers and walks rows, U rows per iteration so several 16-byte
// loads are in flight. Backward kernels reduce parameter grads over rows into per-block partials.
#include <algorithm>

#include "stages.hpp"

namespace jitfuse::codegen::detail {
namespace {

int next_pow2(int64_t v) {
  int p = 1;
  while (p < v && p < 32) p <<= 1;
  return p;
}

// What the body and the row loop of one kernel share: its widths, its thread block, the rows each thread
// walks per iteration, and the per-element tensors the stage chain reads (loaded with the input).
struct Shape {
  bool gated = false, fwd = false;
  int64_t cols = 0;     // output width (gated: n)
  int64_t in_cols = 0;  // gated: 2n
  int bx = 0, by = 0, unroll = 0;
  std::vector<std::string> reads;                // their pointers, in load order
  std::map<std::string, std::string> preloaded;  // pointer -> its float[8] of row u
};

constexpr int kUnrollHint = 4;

Shape shape_of(const KernelSpec& spec) {
  Shape sh;
  sh.gated = spec.skeleton == Skeleton::gated;
  sh.fwd = spec.dir == Direction::forward;
  sh.cols = spec.cols;
  sh.in_cols = sh.gated ? 2 * sh.cols : sh.cols;
  const int64_t chunks = (sh.cols + 7) / 8;
  sh.bx = next_pow2(chunks);
  sh.by = 256 / sh.bx;
  // Per-element tensors the chain reads are loaded with the input, U rows at a time, so their loads are
  // in flight together instead of one after another inside the stage chain.
  if (!sh.gated) {
    sh.reads = chain_reads(spec.pre, spec.dir);
    for (size_t i = 0; i < sh.reads.size(); ++i) sh.preloaded[sh.reads[i]] = fmt::format("pl{}[u]", i);
  }
  // Rows per iteration: 4 for one input stream; 1 with extra streams (the gated half, preloaded
  // tensors), which keeps 2-3 16-byte loads in flight per thread at ~40 registers, so 6 blocks fit per
  // SM. Measured on an H200 (docs/benchmarks.md): 2 rows with extra streams needs ~60 registers and
  // ran swiglu / dgelu+dbias / bias+dropout+add at 81-87 % of copy bandwidth, 1 row at 91-94 %.
  sh.unroll = (sh.gated || !sh.reads.empty()) ? 1 : kUnrollHint;
  return sh;
}

ChunkCtx chunk(const std::string& var, int64_t width, const std::string& off, const std::string& half) {
  ChunkCtx c;
  c.var = var;
  c.width = width;
  c.col_off = off;
  c.half = half;
  c.col = off == "0" ? "c0" : fmt::format("({} + c0)", off);
  c.base = fmt::format("r * {} + {}", width, c.col);
  return c;
}

ChunkCtx preloading(ChunkCtx c, const Shape& sh) {
  c.preloaded = &sh.preloaded;
  return c;
}

// y = post(act(pre(a)) * pre(b)): the pre stages run on both halves of the input row, the gate's input is
// saved for the backward when the spec asks.
void emit_gated_fwd(Writer& body, Args& args, Setup& setup, const KernelSpec& spec, const Shape& sh) {
  const std::string n_str = std::to_string(sh.cols);
  body.line("float (&a)[8] = x[u];");
  body.line("float (&b)[8] = xb[u];");
  for (auto& s : spec.pre) {
    emit_stage_fwd(body, args, setup, s, chunk("a", sh.in_cols, "0", "_a"));
    emit_stage_fwd(body, args, setup, s, chunk("b", sh.in_cols, n_str, "_b"));
  }
  const auto& gs = *spec.gated;
  body.line("// op {} gated: y = {}(a) * b", gs.op, comment_text(gs.functor));
  if (gs.save_input) {
    std::string sp = fmt::format("s{}_input", gs.op);
    args.ptr(Arg::Role::saved, gs.op, Key::input, sp, "ST", true);
    body.line("jf_store8<DT, JF_VEC>({} + r * {} + c0, a, n);", sp, sh.in_cols);
    body.line("jf_store8<DT, JF_VEC>({} + r * {} + {} + c0, b, n);", sp, sh.in_cols, sh.cols);
  }
  body.line("float v[8];");
  body.line("#pragma unroll");
  body.line("for (int e = 0; e < 8; ++e) v[e] = {}::fwd(a[e]) * b[e];", gs.functor);
  for (auto& s : spec.post) emit_stage_fwd(body, args, setup, s, chunk("v", sh.cols, "0", ""));
  emit_out_store(body, spec, fmt::format("r * {} + c0", sh.cols), "v");
}

// The gated backward from the saved gate input: da = act'(a) * b * g, db = act(a) * g, then the pre
// stages' backward on each half.
void emit_gated_bwd(Writer& body, Args& args, Setup& setup, const KernelSpec& spec, const Shape& sh) {
  const std::string n_str = std::to_string(sh.cols);
  for (auto it = spec.post.rbegin(); it != spec.post.rend(); ++it)
    emit_stage_bwd(body, args, setup, *it, chunk("gr", sh.cols, "0", ""));
  const auto& gs = *spec.gated;
  std::string sp = fmt::format("s{}_input", gs.op);
  args.ptr(Arg::Role::saved, gs.op, Key::input, sp, "ST", false);
  body.line("// op {} gated backward: da = act'(a) * b * g, db = act(a) * g", gs.op);
  body.line("float a[8], b[8];");
  body.line("jf_load8<DT, JF_VEC>({} + r * {} + c0, a, n);", sp, sh.in_cols);
  body.line("jf_load8<DT, JF_VEC>({} + r * {} + {} + c0, b, n);", sp, sh.in_cols, sh.cols);
  body.line("#pragma unroll");
  body.line("for (int e = 0; e < 8; ++e) {{ const float ga = {}::bwd(a[e], gr[e] * b[e]); b[e] = {}::fwd(a[e]) * gr[e]; a[e] = ga; }}",
            gs.functor, gs.functor);
  for (auto it = spec.pre.rbegin(); it != spec.pre.rend(); ++it) {
    emit_stage_bwd(body, args, setup, *it, chunk("a", sh.in_cols, "0", "_a"));
    emit_stage_bwd(body, args, setup, *it, chunk("b", sh.in_cols, n_str, "_b"));
  }
  body.line("jf_store8<DT, JF_VEC>(out + r * {} + c0, a, n);", sh.in_cols);
  body.line("jf_store8<DT, JF_VEC>(out + r * {} + {} + c0, b, n);", sh.in_cols, sh.cols);
}

// The work on row r's chunk, inside the unrolled row loop: the stage chain (forward in order, backward in
// reverse) and the store. Declares the arguments it reads and writes as it goes, in that order.
std::string emit_body(Args& args, Setup& setup, const KernelSpec& spec, const Shape& sh) {
  Writer body;
  body.open();
  body.open();
  body.open();
  body.open();
  if (sh.fwd && !sh.gated) {
    body.line("float (&v)[8] = x[u];");
    for (auto& s : spec.pre) emit_stage_fwd(body, args, setup, s, preloading(chunk("v", sh.cols, "0", ""), sh));
    emit_out_store(body, spec, fmt::format("r * {} + c0", sh.cols), "v");
  } else if (sh.fwd) {
    emit_gated_fwd(body, args, setup, spec, sh);
  } else {
    body.line("float (&gr)[8] = x[u];");
    if (!sh.gated) {
      for (auto it = spec.pre.rbegin(); it != spec.pre.rend(); ++it)
        emit_stage_bwd(body, args, setup, *it, preloading(chunk("gr", sh.cols, "0", ""), sh));
      body.line("jf_store8<DT, JF_VEC>(out + r * {} + c0, gr, n);", sh.cols);
    } else {
      emit_gated_bwd(body, args, setup, spec, sh);
    }
  }
  return body.str();
}

// Loads of U rows (the input, the gate's second half, the preloaded tensors) before any of them is
// computed, so their 16-byte loads are in flight together.
void emit_row_loads(Writer& w, const Shape& sh) {
  const std::string load_w = std::to_string(sh.fwd ? sh.in_cols : sh.cols);
  w.line("float x[{}][8];", sh.unroll);
  if (sh.gated && sh.fwd) w.line("float xb[{}][8];", sh.unroll);
  for (size_t i = 0; i < sh.reads.size(); ++i) w.line("float pl{}[{}][8];", i, sh.unroll);
  w.line("#pragma unroll");
  w.line("for (int u = 0; u < {}; ++u) {{", sh.unroll);
  w.open();
  w.line("const jf_i64 r = r0 + u * {};", sh.by);
  w.line("if (r < rows) {{");
  w.open();
  w.line("jf_load8<DT, JF_VEC>(in + r * {} + c0, x[u], n);", load_w);
  if (sh.gated && sh.fwd) w.line("jf_load8<DT, JF_VEC>(in + r * {} + {} + c0, xb[u], n);", sh.in_cols, sh.cols);
  for (size_t i = 0; i < sh.reads.size(); ++i)
    w.line("jf_load8<DT, JF_VEC>({} + r * {} + c0, pl{}[u], n);", sh.reads[i], sh.cols, i);
  w.close();
  w.line("}}");
  w.close();
  w.line("}}");
}

// The kernel: this thread's column chunk, per-thread setup, then slabs of by * U rows, grid-strided,
// each loaded and then computed U rows at a time; the FP8 amax and the parameter-gradient partials last.
void emit_kernel(Writer& w, const KernelSpec& spec, const Generated& g, const Args& args, const Setup& setup,
                 const std::string& fp8_setup, const std::string& body, const Shape& sh) {
  emit_prelude(w, spec, g.headers);
  w.line("extern \"C\" __global__ void __launch_bounds__({}) {}({}) {{", sh.bx * sh.by, g.kernel, args.decl());
  w.open();
  emit_chunk_prologue(w, setup, fp8_setup, sh.bx, sh.cols);
  w.line("if (active) {{");
  w.open();
  const int slab = sh.by * sh.unroll;
  w.line("for (jf_i64 r0 = (jf_i64)blockIdx.y * {} + threadIdx.y; r0 < rows; r0 += (jf_i64)gridDim.y * {}) {{", slab,
         slab);
  w.open();
  emit_row_loads(w, sh);
  w.line("#pragma unroll");
  w.line("for (int u = 0; u < {}; ++u) {{", sh.unroll);
  w.open();
  w.line("const jf_i64 r = r0 + u * {};", sh.by);
  w.line("if (r < rows) {{");
  w.raw(body);
  w.line("}}");
  w.close();
  w.line("}}");
  w.close();
  w.line("}}");
  w.close();
  w.line("}}");
  emit_fp8_epilogue(w, spec);
  emit_accumulator_flush(w, setup, sh.bx, sh.by, sh.cols, "blockIdx.y");
  w.close();
  w.line("}}");
}

}  // namespace

Generated generate_elementwise(const KernelSpec& spec) {
  const Shape sh = shape_of(spec);
  const int64_t chunks = (sh.cols + 7) / 8;

  Generated g;
  g.kernel = kernel_name(spec);
  g.headers = headers_for(spec);
  g.launch = {sh.bx, sh.by, (chunks + sh.bx - 1) / sh.bx, kUnrollHint};
  g.launch.rows_per_thread_iter = sh.unroll;

  Args args;
  Setup setup;
  args.ptr(Arg::Role::in, -1, "in", "in", "ST", false);
  if (spec.fp8 && !sh.fwd) throw std::invalid_argument("codegen: an FP8 cast ends forward kernels only");
  args.ptr(Arg::Role::out, -1, "out", "out", out_type(spec), true);
  args.scalar(Arg::Role::rows, -1, "rows", "rows", "jf_i64");
  const std::string body = emit_body(args, setup, spec, sh);

  Writer fp8_setup;  // its arguments must exist before the signature is written
  fp8_setup.open();
  emit_fp8_prologue(fp8_setup, args, spec);
  Writer w;
  emit_kernel(w, spec, g, args, setup, fp8_setup.str(), body, sh);

  g.launch.persistent = !setup.accs.empty();
  finish(w, setup, args, g, spec);
  return g;
}

}  // namespace jitfuse::codegen::detail
