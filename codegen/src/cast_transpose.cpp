// The cast_transpose skeleton: a chain of stages (forward, or backward in reverse) whose output is cast to
// FP8 with one scale and written twice: row-major to `out` [rows, cols] and transposed to the fp8_colwise
// argument [cols, rows], the two layouts an FP8 GEMM reads a tensor in (e.g. X for Y = X W^T, X^T for dW).
#include "stages.hpp"

namespace jitfuse::codegen::detail {
namespace {

// A block of 8 x 32 threads works on a tile of 64 columns x 64 rows: thread (x, y) owns the 8 columns
// 8x .. 8x + 7 (16-byte loads, as in the elementwise skeleton) of rows 2y and 2y + 1. The codes go to `out`
// from registers and into a shared-memory tile; after a barrier thread t stores the 16 rows 16 (t % 4) ..
// of tile column t / 4 to the transposed tensor, 16 contiguous bytes (4 threads: one column's 64 rows).
constexpr int kBx = 8, kBy = 32, kRowsPerThread = 2;
constexpr int kTileCols = kBx * 8, kTileRows = kBy * kRowsPerThread;

// The transposed store of one tile: stage the thread's codes, wait for the block, store one 16-row slot.
void emit_transposed_store(Writer& w, int64_t cols, const std::string& colwise) {
  w.line("// transposed: stage this thread's two rows of codes, then slot t % 4 (16 rows) of tile column t / 4");
  w.line("jf_ct_stage(jf_tile[jf_buf], threadIdx.x * 8, threadIdx.y * {}, jf_q[0], jf_q[1]);", kRowsPerThread);
  // One barrier per tile: the tile is double-buffered, so a block's next staging never overwrites the slots
  // that slower threads are still storing from.
  w.line("__syncthreads();");
  w.line("{{");
  w.open();
  w.line("const int t = threadIdx.y * {} + threadIdx.x, c = t >> 2, k = t & 3;", kBx);
  w.line("const int col = blockIdx.x * {} + c;", kTileCols);
  w.line("const jf_i64 r = r0 + k * 16;");
  w.line("if (col < {} && r < rows)", cols);
  w.line("  jf_ct_store16<JF_VEC>({} + (jf_i64)col * rows + r, jf_tile[jf_buf], c, k, (int)min((jf_i64)16, rows - r));",
         colwise);
  w.close();
  w.line("}}");
  w.line("jf_buf ^= 1;");
}

}  // namespace

// Fp8Spec::codes_in: `in` holds the row-major codes another kernel wrote (a norm casts as it normalises,
// one row per block, and cannot write a column); the kernel writes their transpose and nothing else,
// reading 1 byte per element instead of a 2-byte activation (TransformerEngine's FP8 transpose).
Generated generate_cast_transpose(const KernelSpec& spec) {
  const auto& q = *spec.fp8;  // generate() checked the spec (codes_in: no stages, no amax pass)
  const bool fwd = spec.dir == Direction::forward;
  const bool cast = !q.amax_only, codes = q.codes_in;
  const int64_t cols = spec.cols;

  Generated g;
  g.kernel = kernel_name(spec);
  g.headers = headers_for(spec);
  g.launch = {kBx, kBy, (cols + kTileCols - 1) / kTileCols, kRowsPerThread};

  Args args;
  Setup setup;
  args.ptr(Arg::Role::in, -1, "in", "in", codes ? "unsigned char" : "ST", false);
  if (!codes) args.ptr(Arg::Role::out, -1, "out", "out", out_type(spec), true);
  const std::string colwise = cast ? fp8_colwise_arg(args, spec) : "";
  args.scalar(Arg::Role::rows, -1, "rows", "rows", "jf_i64");
  Writer fp8_setup;  // before the stages: the recipe-state arguments come right after rows
  fp8_setup.open();
  if (!codes) emit_fp8_prologue(fp8_setup, args, spec);

  // Stages in execution order. The amax pass of a backward leaves out the bias stages: they do not change
  // the gradient, and their column sums belong to the cast pass.
  std::vector<Stage> stages;
  if (fwd) {
    stages = spec.pre;
  } else {
    for (auto it = spec.pre.rbegin(); it != spec.pre.rend(); ++it)
      if (cast || it->kind != Stage::Kind::bias) stages.push_back(*it);
  }
  const std::vector<std::string> reads = chain_reads(stages, spec.dir);
  std::map<std::string, std::string> preloaded;
  for (size_t i = 0; i < reads.size(); ++i) preloaded[reads[i]] = fmt::format("pl{}[u]", i);

  Writer body;  // one row's work, inside the tile loop, `if (active)`, the row loop and `if (r < rows)`
  for (int i = 0; i < 5; ++i) body.open();
  ChunkCtx c;
  c.var = fwd ? "v" : "gr";
  c.width = cols;
  c.col_off = "0";
  c.col = "c0";
  c.base = fmt::format("r * {} + c0", cols);
  c.preloaded = &preloaded;
  body.line("float (&{})[8] = x[u];", c.var);
  for (const auto& s : stages) {
    if (fwd)
      emit_stage_fwd(body, args, setup, s, c);
    else
      emit_stage_bwd(body, args, setup, s, c);
  }
  if (!codes) emit_out_store(body, spec, c.base, c.var, cast ? "jf_q[u]" : "");

  Writer w;
  emit_prelude(w, spec, g.headers);
  if (codes)
    w.line("// op {}: the transpose of the {} codes of the FP8 GEMM {} (written by the kernel before, with its scale)",
           q.op, q.e5m2 ? "E5M2" : "E4M3", q.tensor);
  w.line("// launch: block ({}, {}), grid.x = ceil(cols / {}), blocks loop over tiles of {} rows (grid.y)", kBx, kBy,
         kTileCols, kTileRows);
  if (cast) w.line("// vector variant: cols % 8 == 0 and rows % 16 == 0 (16-byte transposed stores)");
  w.line("extern \"C\" __global__ void __launch_bounds__({}) {}({}) {{", kBx * kBy, g.kernel, args.decl());
  w.open();
  w.line("const int c0 = (blockIdx.x * {} + threadIdx.x) * 8;", kBx);
  w.line("const bool active = c0 < {};", cols);
  w.line("const int n = active ? min(8, {} - c0) : 0;", cols);
  emit_pre_loop(w, setup);
  w.raw(fp8_setup.str());
  if (cast) {
    w.line("__shared__ __align__(16) unsigned char jf_tile[2][{}];", kTileCols * kTileRows);
    w.line("int jf_buf = 0;");
  }
  // Every thread runs every tile (inactive columns included): the transposed store needs the whole block.
  w.line("for (jf_i64 r0 = (jf_i64)blockIdx.y * {0}; r0 < rows; r0 += (jf_i64)gridDim.y * {0}) {{", kTileRows);
  w.open();
  if (cast) w.line("jf_u32 jf_q[{}][2] = {{{{0u, 0u}}, {{0u, 0u}}}};  // the codes of the thread's rows", kRowsPerThread);
  if (codes) {
    w.line("#pragma unroll");
    w.line("for (int u = 0; u < {}; ++u) {{", kRowsPerThread);
    w.open();
    w.line("const jf_i64 r = r0 + threadIdx.y * {} + u;", kRowsPerThread);
    w.line("if (active && r < rows) jf_ct_load8<JF_VEC>(in + r * {} + c0, jf_q[u], n);", cols);
    w.close();
    w.line("}}");
  } else {
    w.line("if (active) {{");
    w.open();
    w.line("float x[{}][8];", kRowsPerThread);
    for (size_t i = 0; i < reads.size(); ++i) w.line("float pl{}[{}][8];", i, kRowsPerThread);
    for (int pass = 0; pass < 2; ++pass) {  // the loads of both rows, then the work on them
      w.line("#pragma unroll");
      w.line("for (int u = 0; u < {}; ++u) {{", kRowsPerThread);
      w.open();
      w.line("const jf_i64 r = r0 + threadIdx.y * {} + u;", kRowsPerThread);
      w.line("if (r < rows) {{");
      if (pass == 0) {
        w.open();
        w.line("jf_load8<DT, JF_VEC>(in + r * {} + c0, x[u], n);", cols);
        for (size_t i = 0; i < reads.size(); ++i)
          w.line("jf_load8<DT, JF_VEC>({} + r * {} + c0, pl{}[u], n);", reads[i], cols, i);
        w.close();
      } else {
        w.raw(body.str());
      }
      w.line("}}");
      w.close();
      w.line("}}");
    }
    w.close();
    w.line("}}");
  }
  if (cast) emit_transposed_store(w, cols, colwise);
  w.close();
  w.line("}}");
  if (!codes) emit_fp8_epilogue(w, spec);
  emit_accumulator_flush(w, setup, kBx, kBy, cols, "blockIdx.y");
  w.close();
  w.line("}}");

  g.launch.persistent = !setup.accs.empty();
  finish(w, setup, args, g, spec);
  return g;
}

}  // namespace jitfuse::codegen::detail
