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

// What the pieces of one kernel share: its direction and mode, its width, the stage chain and the tensors
// it preloads, the transposed output's argument.
struct CastTranspose {
  bool fwd = false;
  bool cast = false;   // writes FP8 codes (false: the amax pass)
  bool codes = false;  // Fp8Spec::codes_in: transposes codes another kernel wrote
  int64_t cols = 0;
  std::vector<Stage> stages;  // in execution order
  std::vector<std::string> reads;
  std::map<std::string, std::string> preloaded;  // pointer -> its float[8] of row u
  std::string colwise;                           // the transposed codes' argument (cast only)
};

// Stages in execution order. The amax pass of a backward leaves out the bias stages: they do not change
// the gradient, and their column sums belong to the cast pass.
std::vector<Stage> stages_in_order(const KernelSpec& spec, bool fwd, bool cast) {
  if (fwd) return spec.pre;
  std::vector<Stage> stages;
  for (auto it = spec.pre.rbegin(); it != spec.pre.rend(); ++it)
    if (cast || it->kind != Stage::Kind::bias) stages.push_back(*it);
  return stages;
}

// One row's work, inside the tile loop, `if (active)`, the row loop and `if (r < rows)`: the stages on
// the row's chunk, then its row-major store (codes into jf_q[u] for the transposed one).
std::string emit_body(Args& args, Setup& setup, const KernelSpec& spec, const CastTranspose& ct) {
  Writer body;
  for (int i = 0; i < 5; ++i) body.open();
  const ChunkCtx c{.var = ct.fwd ? "v" : "gr", .base = fmt::format("r * {} + c0", ct.cols), .col = "c0",
                   .width = ct.cols, .half = "", .col_off = "0", .row = "r", .preloaded = &ct.preloaded};
  body.line("float (&{})[8] = x[u];", c.var);
  for (const auto& s : ct.stages) {
    if (ct.fwd)
      emit_stage_fwd(body, args, setup, s, c);
    else
      emit_stage_bwd(body, args, setup, s, c);
  }
  if (!ct.codes) emit_out_store(body, spec, c.base, c.var, ct.cast ? "jf_q[u]" : "");
  return body.str();
}

// The thread's rows of a tile: with codes_in, their codes loaded straight into jf_q; otherwise the loads
// of both rows (input and preloaded tensors), then the work on them.
void emit_tile_rows(Writer& w, const CastTranspose& ct, const std::string& body) {
  if (ct.codes) {
    w.line("#pragma unroll");
    w.line("for (int u = 0; u < {}; ++u) {{", kRowsPerThread);
    w.open();
    w.line("const jf_i64 r = r0 + threadIdx.y * {} + u;", kRowsPerThread);
    w.line("if (active && r < rows) jf_ct_load8<JF_VEC>(in + r * {} + c0, jf_q[u], n);", ct.cols);
    w.close();
    w.line("}}");
    return;
  }
  w.line("if (active) {{");
  w.open();
  w.line("float x[{}][8];", kRowsPerThread);
  for (size_t i = 0; i < ct.reads.size(); ++i) w.line("float pl{}[{}][8];", i, kRowsPerThread);
  for (int pass = 0; pass < 2; ++pass) {  // the loads of both rows, then the work on them
    w.line("#pragma unroll");
    w.line("for (int u = 0; u < {}; ++u) {{", kRowsPerThread);
    w.open();
    w.line("const jf_i64 r = r0 + threadIdx.y * {} + u;", kRowsPerThread);
    w.line("if (r < rows) {{");
    if (pass == 0) {
      w.open();
      w.line("jf_load8<DT, JF_VEC>(in + r * {} + c0, x[u], n);", ct.cols);
      for (size_t i = 0; i < ct.reads.size(); ++i)
        w.line("jf_load8<DT, JF_VEC>({} + r * {} + c0, pl{}[u], n);", ct.reads[i], ct.cols, i);
      w.close();
    } else {
      w.raw(body);
    }
    w.line("}}");
    w.close();
    w.line("}}");
  }
  w.close();
  w.line("}}");
}

// The kernel: the thread's column chunk and setup, the double-buffered shared tile, then tiles of rows
// (grid-strided), each ending with its transposed store; the FP8 amax and the column-sum partials last.
void emit_kernel(Writer& w, const KernelSpec& spec, const Generated& g, const Args& args, const Setup& setup,
                 const std::string& fp8_setup, const std::string& body, const CastTranspose& ct) {
  const auto& q = *spec.fp8;
  emit_prelude(w, spec, g.headers);
  if (ct.codes)
    w.line("// op {}: the transpose of the {} codes of the FP8 GEMM {} (written by the kernel before, with its scale)",
           q.op, q.e5m2 ? "E5M2" : "E4M3", q.tensor);
  w.line("// launch: block ({}, {}), grid.x = ceil(cols / {}), blocks loop over tiles of {} rows (grid.y)", kBx, kBy,
         kTileCols, kTileRows);
  if (ct.cast) w.line("// vector variant: cols % 8 == 0 and rows % 16 == 0 (16-byte transposed stores)");
  w.line("extern \"C\" __global__ void __launch_bounds__({}) {}({}) {{", kBx * kBy, g.kernel, args.decl());
  w.open();
  emit_chunk_prologue(w, setup, fp8_setup, kBx, ct.cols);
  if (ct.cast) {
    w.line("__shared__ __align__(16) unsigned char jf_tile[2][{}];", kTileCols * kTileRows);
    w.line("int jf_buf = 0;");
  }
  // Every thread runs every tile (inactive columns included): the transposed store needs the whole block.
  w.line("for (jf_i64 r0 = (jf_i64)blockIdx.y * {0}; r0 < rows; r0 += (jf_i64)gridDim.y * {0}) {{", kTileRows);
  w.open();
  if (ct.cast) w.line("jf_u32 jf_q[{}][2] = {{{{0u, 0u}}, {{0u, 0u}}}};  // the codes of the thread's rows", kRowsPerThread);
  emit_tile_rows(w, ct, body);
  if (ct.cast) emit_transposed_store(w, ct.cols, ct.colwise);
  w.close();
  w.line("}}");
  if (!ct.codes) emit_fp8_epilogue(w, spec);
  emit_accumulator_flush(w, setup, kBx, kBy, ct.cols, "blockIdx.y");
  w.close();
  w.line("}}");
}

}  // namespace

// Fp8Spec::codes_in: `in` holds the row-major codes another kernel wrote (a norm casts as it normalises,
// one row per block, and cannot write a column); the kernel writes their transpose and nothing else,
// reading 1 byte per element instead of a 2-byte activation (TransformerEngine's FP8 transpose).
Generated generate_cast_transpose(const KernelSpec& spec) {
  const auto& q = *spec.fp8;  // generate() checked the spec (codes_in: no stages, no amax pass)
  CastTranspose ct;
  ct.fwd = spec.dir == Direction::forward;
  ct.cast = !q.amax_only;
  ct.codes = q.codes_in;
  ct.cols = spec.cols;

  Generated g;
  g.kernel = kernel_name(spec);
  g.headers = headers_for(spec);
  g.launch = {kBx, kBy, (ct.cols + kTileCols - 1) / kTileCols, kRowsPerThread};

  Args args;
  Setup setup;
  args.ptr(Arg::Role::in, -1, "in", "in", ct.codes ? "unsigned char" : "ST", false);
  if (!ct.codes) args.ptr(Arg::Role::out, -1, "out", "out", out_type(spec), true);
  ct.colwise = ct.cast ? fp8_colwise_arg(args, spec) : "";
  args.scalar(Arg::Role::rows, -1, "rows", "rows", "jf_i64");
  Writer fp8_setup;  // before the stages: the recipe-state arguments come right after rows
  fp8_setup.open();
  if (!ct.codes) emit_fp8_prologue(fp8_setup, args, spec);

  ct.stages = stages_in_order(spec, ct.fwd, ct.cast);
  ct.reads = chain_reads(ct.stages, spec.dir);
  for (size_t i = 0; i < ct.reads.size(); ++i) ct.preloaded[ct.reads[i]] = fmt::format("pl{}[u]", i);
  const std::string body = emit_body(args, setup, spec, ct);

  Writer w;
  emit_kernel(w, spec, g, args, setup, fp8_setup.str(), body, ct);

  g.launch.persistent = !setup.accs.empty();
  finish(w, setup, args, g, spec);
  return g;
}

}  // namespace jitfuse::codegen::detail
