// The cast_transpose skeleton under fp8_block (Fp8Spec::block): a tensor cast to E4M3 with a scale per
// block, row-major and (Fp8Spec::colwise) transposed, one 128 x 128 tile per thread block of 16 x 32
// (templates/skeletons/block_cast.cuh holds the tile's work and the scale layouts). The kernel here loads
// the tile's rows into registers, runs the producer's elementwise stages on them (an activation chain
// before a linear, or the backward of the ops after it with their column sums: the quantisation fused into
// its producer, issue 44), and hands the values to the template. A weight's cast has no stages.
#include <algorithm>
#include <stdexcept>

#include "stages.hpp"

namespace jitfuse::codegen::detail {

namespace {

void check_spec(const KernelSpec& spec) {
  const auto& q = *spec.fp8;
  if (q.block != 1 && q.block != 2) throw std::invalid_argument("codegen: Fp8Spec::block must be 1 (1x128) or 2 (128x128)");
  if (q.codes_in || q.amax_only || q.delayed || q.e5m2 || spec.norm || (!spec.gated && !spec.post.empty()))
    throw std::invalid_argument("codegen: a block-scaled cast (Fp8Spec::block) has no amax pass and no recipe "
                                "state, writes E4M3, and takes elementwise stages (or a gated op's forward) only");
  if (spec.gated && (spec.dir != Direction::forward || q.block != 1 || !chain_reads(spec.pre, spec.dir).empty() ||
                     !chain_reads(spec.post, spec.dir).empty()))
    throw std::invalid_argument("codegen: a block-scaled cast takes a gated op's forward on an activation, with "
                                "stages that read no other tensor");
  if (q.block == 2 && !spec.pre.empty())
    throw std::invalid_argument("codegen: a weight's block-scaled cast (128x128) takes no stages");
  if (spec.cols <= 0 || spec.cols % 128 != 0)
    throw std::invalid_argument("codegen: a block-scaled cast needs cols a positive multiple of 128 (got " +
                                std::to_string(spec.cols) + ")");
}

// What the pieces of one kernel share: its chain in execution order, the tensors the chain reads beside
// the input (preloaded per row), the input's width (a gated op reads two halves), the per-row body.
struct BlockCast {
  bool fwd = false, gated = false, weight = false;
  int64_t in_cols = 0;
  std::vector<Stage> stages;
  std::vector<std::string> reads;
  std::map<std::string, std::string> preloaded;
  std::string body;
};

// y = post(act(pre(a)) * pre(b)), a and b the two halves of the input row (the gated skeleton's forward),
// the gate's input saved when the spec asks; y is the tile's value.
void emit_gated_body(Writer& body, Args& args, Setup& setup, const KernelSpec& spec, const BlockCast& bc) {
  const std::string n_str = std::to_string(spec.cols);
  const ChunkCtx ca{.var = "a", .base = fmt::format("r * {} + c0", bc.in_cols), .col = "c0", .width = bc.in_cols,
                    .half = "_a", .col_off = "0", .row = "r", .preloaded = nullptr};
  const ChunkCtx cb{.var = "b", .base = fmt::format("r * {} + ({} + c0)", bc.in_cols, n_str),
                    .col = fmt::format("({} + c0)", n_str), .width = bc.in_cols, .half = "_b", .col_off = n_str,
                    .row = "r", .preloaded = nullptr};
  body.line("float (&a)[8] = x[u];");
  body.line("float (&b)[8] = xb[0];");
  for (const auto& s : spec.pre) {
    emit_stage_fwd(body, args, setup, s, ca);
    emit_stage_fwd(body, args, setup, s, cb);
  }
  const auto& gs = *spec.gated;
  body.line("// op {} gated: y = {}(a) * b", gs.op, comment_text(gs.functor));
  if (gs.save_input) {
    const std::string sp = fmt::format("s{}_input", gs.op);
    args.ptr(Arg::Role::saved, gs.op, Key::input, sp, "ST", true);
    body.line("jf_store8<DT, JF_VEC>({} + r * {} + c0, a, n);", sp, bc.in_cols);
    body.line("jf_store8<DT, JF_VEC>({} + r * {} + {} + c0, b, n);", sp, bc.in_cols, spec.cols);
  }
  body.line("#pragma unroll");
  body.line("for (int e = 0; e < 8; ++e) a[e] = {}::fwd(a[e]) * b[e];", gs.functor);
  const ChunkCtx cv{.var = "a", .base = fmt::format("r * {} + c0", spec.cols), .col = "c0", .width = spec.cols,
                    .half = "", .col_off = "0", .row = "r", .preloaded = nullptr};
  for (const auto& s : spec.post) emit_stage_fwd(body, args, setup, s, cv);
}

// The chain's stages on each of the thread's rows before the cast (producer fusion: an activation's
// forward, a norm's affine part, a gated op, or the backward of the ops after a linear with their column
// sums), declaring the arguments they use.
BlockCast plan_body(Args& args, Setup& setup, const KernelSpec& spec) {
  BlockCast bc;
  bc.fwd = spec.dir == Direction::forward;
  bc.gated = spec.gated.has_value();
  bc.weight = spec.fp8->block == 2;
  bc.in_cols = bc.gated ? 2 * spec.cols : spec.cols;
  bc.stages = spec.pre;
  if (!bc.fwd) std::reverse(bc.stages.begin(), bc.stages.end());
  bc.reads = chain_reads(bc.stages, spec.dir);
  for (size_t i = 0; i < bc.reads.size(); ++i) bc.preloaded[bc.reads[i]] = fmt::format("pl{}[0]", i);
  Writer body;
  for (int i = 0; i < 4; ++i) body.open();
  if (bc.gated) {
    emit_gated_body(body, args, setup, spec, bc);
  } else if (!bc.stages.empty()) {
    const ChunkCtx c{.var = bc.fwd ? "v" : "gr", .base = fmt::format("r * {} + c0", spec.cols), .col = "c0",
                     .width = spec.cols, .half = "", .col_off = "0", .row = "r", .preloaded = &bc.preloaded};
    body.line("float (&{})[8] = x[u];", c.var);
    for (const auto& s : bc.stages) {
      if (bc.fwd)
        emit_stage_fwd(body, args, setup, s, c);
      else
        emit_stage_bwd(body, args, setup, s, c);
    }
  }
  bc.body = body.str();
  return bc;
}

// The tile's rows into x (and the gated op's second half, the chain's side tensors), and the body on them.
// Without side tensors (a forward chain, a norm), every row's loads first and then the stages (the stages'
// stores would keep the compiler from moving later loads ahead of them); with them (a backward chain's
// saved tensors), each row's loads and then its stages, so that those tensors live one row at a time (64
// registers without a spill, against 110 for all four rows).
void emit_tile_rows(Writer& w, const KernelSpec& spec, const BlockCast& bc) {
  const bool has_body = bc.gated || !bc.stages.empty();
  const bool two_phase = bc.reads.empty() && !bc.gated;  // a gated op: its second half is read beside the first
  w.line("float x[4][8];");
  w.line("#pragma unroll");
  w.line("for (int u = 0; u < 4; ++u) {{");
  w.open();
  w.line("const jf_i64 r = r0 + threadIdx.y * 4 + u;");
  w.line("if (r < rows) {{");
  w.open();
  for (size_t i = 0; i < bc.reads.size(); ++i) w.line("float pl{}[1][8];", i);
  if (bc.gated) w.line("float xb[1][8];");
  w.line("jf_load8<DT, JF_VEC>(in + r * {} + c0, x[u]);", bc.in_cols);
  if (bc.gated) w.line("jf_load8<DT, JF_VEC>(in + r * {} + {} + c0, xb[0]);", bc.in_cols, spec.cols);
  for (size_t i = 0; i < bc.reads.size(); ++i)
    w.line("jf_load8<DT, JF_VEC>({} + r * {} + c0, pl{}[0]);", bc.reads[i], spec.cols, i);
  w.close();
  if (has_body && !two_phase) w.raw(bc.body);
  w.line("}} else {{");
  w.line("  for (int e = 0; e < 8; ++e) x[u][e] = 0.f;");
  w.line("}}");
  w.close();
  w.line("}}");
  if (has_body && two_phase) {
    w.line("#pragma unroll");
    w.line("for (int u = 0; u < 4; ++u) {{");
    w.open();
    w.line("const jf_i64 r = r0 + threadIdx.y * 4 + u;");
    w.line("if (r < rows) {{");
    w.raw(bc.body);
    w.line("}}");
    w.close();
    w.line("}}");
  }
}

}  // namespace

Generated generate_block_cast(const KernelSpec& spec) {
  check_spec(spec);
  const auto& q = *spec.fp8;
  Generated g;
  g.kernel = kernel_name(spec);
  g.headers = headers_for(spec);
  // block (16, 32), one tile column per grid.x, 4 rows per thread: 128 rows per block iteration. Column sums
  // (dbias) as one partial row per 128-row tile: not persistent, every tile its own block (the partials are
  // rows / 128 rows, under 2 % of the bytes the kernel moves), so the grid fills the device.
  g.launch = {16, 32, spec.cols / 128, 4};
  g.launch.persistent = false;

  Args args;
  Setup setup;
  args.ptr(Arg::Role::in, -1, "in", "in", "ST", false);
  args.ptr(Arg::Role::out, -1, "out", "out", "unsigned char", true);
  const std::string pre = fmt::format("q{}", q.op), tensor = q.tensor.empty() ? "" : "_" + q.tensor;
  const std::string colwise = q.colwise ? fp8_colwise_arg(args, spec) : "nullptr";
  args.ptr(Arg::Role::fp8_scale_inv, q.op, "scale_inv" + tensor, pre + "_scale_inv", "float", true);
  if (q.colwise)
    args.ptr(Arg::Role::fp8_colwise_scale_inv, q.op, "col_scale_inv" + tensor, pre + "_col_scale_inv", "float", true);
  args.scalar(Arg::Role::rows, -1, "rows", "rows", "jf_i64");
  const BlockCast bc = plan_body(args, setup, spec);

  Writer w;
  emit_prelude(w, spec, g.headers);
  w.line("// op {}: the E4M3 codes of the FP8 GEMM {}, one scale per {} block{}", q.op,
         q.tensor.empty() ? std::string("output") : q.tensor, bc.weight ? "128x128" : "1x128",
         q.colwise ? (bc.weight ? "; transposed with the same scales" : "; transposed with one scale per 128x1 block")
                   : "");
  if (!bc.stages.empty())
    w.line("// the {} stages run on the values first, in registers: their result is never written in bf16",
           bc.fwd ? "producer's" : "backward");
  w.line("// launch: block (16, 32), grid.x = cols / 128, blocks loop over tiles of 128 rows (grid.y)");
  w.line("// vector variant: rows % 16 == 0 (16-byte transposed stores)");
  // Two blocks of 512 threads per SM (<= 64 registers): a backward chain's saved tensors and accumulators
  // took ptxas to 110 registers uncapped, one block (16 warps) per SM, too few loads in flight.
  w.line("extern \"C\" __global__ void __launch_bounds__(512, 2) {}({}) {{", g.kernel, args.decl());
  w.open();
  emit_chunk_prologue(w, setup, "", 16, spec.cols);
  w.line("__shared__ __align__(16) JfBlockSmem jf_sm;");
  w.line("for (jf_i64 r0 = (jf_i64)blockIdx.y * 128; r0 < rows; r0 += (jf_i64)gridDim.y * 128) {{");
  w.open();
  emit_tile_rows(w, spec, bc);
  w.line("jf_block_cast_tile<JF_VEC, {}, {}>(x, out, {}, {}_scale_inv, {}, rows, {}, r0, blockIdx.x, jf_sm);",
         bc.weight ? "true" : "false", q.colwise ? "true" : "false", colwise, pre,
         q.colwise ? pre + "_col_scale_inv" : std::string("nullptr"), spec.cols);
  w.close();
  w.line("}}");
  emit_accumulator_flush(w, setup, 16, 32, spec.cols, "blockIdx.y");
  w.close();
  w.line("}}");
  finish(w, setup, args, g, spec);
  return g;
}

}  // namespace jitfuse::codegen::detail
