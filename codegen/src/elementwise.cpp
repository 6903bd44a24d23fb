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

}  // namespace

Generated generate_elementwise(const KernelSpec& spec) {
  const bool gated = spec.skeleton == Skeleton::gated;
  const bool fwd = spec.dir == Direction::forward;
  const int64_t cols = spec.cols;               // output width (gated: n)
  const int64_t in_cols = gated ? 2 * cols : cols;
  const int64_t chunks = (cols + 7) / 8;
  const int bx = next_pow2(chunks), by = 256 / bx;
  const int unroll_hint = 4;

  Generated g;
  g.kernel = kernel_name(spec);
  g.headers = headers_for(spec);
  g.launch = {bx, by, (chunks + bx - 1) / bx, unroll_hint};

  Args args;
  Setup setup;
  args.ptr(Arg::Role::in, -1, "in", "in", "ST", false);
  if (spec.fp8 && !fwd) throw std::invalid_argument("codegen: an FP8 cast ends forward kernels only");
  args.ptr(Arg::Role::out, -1, "out", "out", out_type(spec), true);
  args.scalar(Arg::Role::rows, -1, "rows", "rows", "jf_i64");

  Writer body;  // the per-row work, inside the unrolled row loop
  body.open();
  body.open();
  body.open();
  body.open();
  const std::string in_w = std::to_string(in_cols), out_w = std::to_string(cols);
  auto ctx = [&](const std::string& var, int64_t width, const std::string& off, const std::string& half) {
    ChunkCtx c;
    c.var = var;
    c.width = width;
    c.col_off = off;
    c.half = half;
    c.col = off == "0" ? "c0" : fmt::format("({} + c0)", off);
    c.base = fmt::format("r * {} + {}", width, c.col);
    return c;
  };
  const std::string n_str = std::to_string(cols);
  // Per-element tensors the chain reads are loaded with the input, U rows at a time, so their loads are
  // in flight together instead of one after another inside the stage chain.
  std::map<std::string, std::string> preloaded;
  std::vector<std::string> reads;
  if (!gated) {
    reads = chain_reads(spec.pre, spec.dir);
    for (size_t i = 0; i < reads.size(); ++i) preloaded[reads[i]] = fmt::format("pl{}[u]", i);
  }
  // Rows per iteration: 4 for one input stream; 1 with extra streams (the gated half, preloaded
  // tensors), which keeps 2-3 16-byte loads in flight per thread at ~40 registers, so 6 blocks fit per
  // SM. Measured on an H200 (docs/benchmarks.md): 2 rows with extra streams needs ~60 registers and
  // ran swiglu / dgelu+dbias / bias+dropout+add at 81-87 % of copy bandwidth, 1 row at 91-94 %.
  const int unroll = (gated || !reads.empty()) ? 1 : unroll_hint;
  g.launch.rows_per_thread_iter = unroll;
  auto with_preload = [&](ChunkCtx c) {
    c.preloaded = &preloaded;
    return c;
  };

  if (fwd) {
    if (!gated) {
      body.line("float (&v)[8] = x[u];");
      for (auto& s : spec.pre) emit_stage_fwd(body, args, setup, s, with_preload(ctx("v", cols, "0", "")));
      emit_out_store(body, spec, fmt::format("r * {} + c0", cols), "v");
    } else {
      body.line("float (&a)[8] = x[u];");
      body.line("float (&b)[8] = xb[u];");
      for (auto& s : spec.pre) {
        emit_stage_fwd(body, args, setup, s, ctx("a", in_cols, "0", "_a"));
        emit_stage_fwd(body, args, setup, s, ctx("b", in_cols, n_str, "_b"));
      }
      const auto& gs = *spec.gated;
      body.line("// op {} gated: y = {}(a) * b", gs.op, comment_text(gs.functor));
      if (gs.save_input) {
        std::string sp = fmt::format("s{}_input", gs.op);
        args.ptr(Arg::Role::saved, gs.op, "input", sp, "ST", true);
        body.line("jf_store8<DT, JF_VEC>({} + r * {} + c0, a, n);", sp, in_cols);
        body.line("jf_store8<DT, JF_VEC>({} + r * {} + {} + c0, b, n);", sp, in_cols, cols);
      }
      body.line("float v[8];");
      body.line("#pragma unroll");
      body.line("for (int e = 0; e < 8; ++e) v[e] = {}::fwd(a[e]) * b[e];", gs.functor);
      for (auto& s : spec.post) emit_stage_fwd(body, args, setup, s, ctx("v", cols, "0", ""));
      emit_out_store(body, spec, fmt::format("r * {} + c0", cols), "v");
    }
  } else {
    body.line("float (&gr)[8] = x[u];");
    if (!gated) {
      for (auto it = spec.pre.rbegin(); it != spec.pre.rend(); ++it)
        emit_stage_bwd(body, args, setup, *it, with_preload(ctx("gr", cols, "0", "")));
      body.line("jf_store8<DT, JF_VEC>(out + r * {} + c0, gr, n);", cols);
    } else {
      for (auto it = spec.post.rbegin(); it != spec.post.rend(); ++it)
        emit_stage_bwd(body, args, setup, *it, ctx("gr", cols, "0", ""));
      const auto& gs = *spec.gated;
      std::string sp = fmt::format("s{}_input", gs.op);
      args.ptr(Arg::Role::saved, gs.op, "input", sp, "ST", false);
      body.line("// op {} gated backward: da = act'(a) * b * g, db = act(a) * g", gs.op);
      body.line("float a[8], b[8];");
      body.line("jf_load8<DT, JF_VEC>({} + r * {} + c0, a, n);", sp, in_cols);
      body.line("jf_load8<DT, JF_VEC>({} + r * {} + {} + c0, b, n);", sp, in_cols, cols);
      body.line("#pragma unroll");
      body.line("for (int e = 0; e < 8; ++e) {{ const float ga = {}::bwd(a[e], gr[e] * b[e]); b[e] = {}::fwd(a[e]) * gr[e]; a[e] = ga; }}",
                gs.functor, gs.functor);
      for (auto it = spec.pre.rbegin(); it != spec.pre.rend(); ++it) {
        emit_stage_bwd(body, args, setup, *it, ctx("a", in_cols, "0", "_a"));
        emit_stage_bwd(body, args, setup, *it, ctx("b", in_cols, n_str, "_b"));
      }
      body.line("jf_store8<DT, JF_VEC>(out + r * {} + c0, a, n);", in_cols);
      body.line("jf_store8<DT, JF_VEC>(out + r * {} + {} + c0, b, n);", in_cols, cols);
    }
  }

  Writer fp8_setup;  // its arguments must exist before the signature is written
  fp8_setup.open();
  emit_fp8_prologue(fp8_setup, args, spec);
  Writer w;
  emit_prelude(w, spec, g.headers);
  w.line("extern \"C\" __global__ void __launch_bounds__({}) {}({}) {{", bx * by, g.kernel, args.decl());
  w.open();
  w.line("const int c0 = (blockIdx.x * {} + threadIdx.x) * 8;", bx);
  w.line("const bool active = c0 < {};", cols);
  w.line("const int n = active ? min(8, {} - c0) : 0;", cols);
  emit_pre_loop(w, setup);
  w.raw(fp8_setup.str());
  w.line("if (active) {{");
  w.open();
  const int slab = by * unroll;
  w.line("for (jf_i64 r0 = (jf_i64)blockIdx.y * {} + threadIdx.y; r0 < rows; r0 += (jf_i64)gridDim.y * {}) {{", slab,
         slab);
  w.open();
  const std::string load_w = fwd ? in_w : out_w;
  w.line("float x[{}][8];", unroll);
  if (gated && fwd) w.line("float xb[{}][8];", unroll);
  for (size_t i = 0; i < reads.size(); ++i) w.line("float pl{}[{}][8];", i, unroll);
  w.line("#pragma unroll");
  w.line("for (int u = 0; u < {}; ++u) {{", unroll);
  w.open();
  w.line("const jf_i64 r = r0 + u * {};", by);
  w.line("if (r < rows) {{");
  w.open();
  w.line("jf_load8<DT, JF_VEC>(in + r * {} + c0, x[u], n);", load_w);
  if (gated && fwd) w.line("jf_load8<DT, JF_VEC>(in + r * {} + {} + c0, xb[u], n);", in_cols, cols);
  for (size_t i = 0; i < reads.size(); ++i) w.line("jf_load8<DT, JF_VEC>({} + r * {} + c0, pl{}[u], n);", reads[i], cols, i);
  w.close();
  w.line("}}");
  w.close();
  w.line("}}");
  w.line("#pragma unroll");
  w.line("for (int u = 0; u < {}; ++u) {{", unroll);
  w.open();
  w.line("const jf_i64 r = r0 + u * {};", by);
  w.line("if (r < rows) {{");
  w.raw(body.str());
  w.line("}}");
  w.close();
  w.line("}}");
  w.close();
  w.line("}}");
  w.close();
  w.line("}}");
  emit_fp8_epilogue(w, spec);
  emit_accumulator_flush(w, setup, bx, by, cols, "blockIdx.y");
  w.close();
  w.line("}}");

  g.launch.persistent = !setup.accs.empty();
  finish(w, setup, args, g, spec);
  return g;
}

}  // namespace jitfuse::codegen::detail
