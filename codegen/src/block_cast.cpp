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

Generated generate_block_cast(const KernelSpec& spec) {
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
  const bool weight = q.block == 2, fwd = spec.dir == Direction::forward;
  Generated g;
  g.kernel = kernel_name(spec);
  g.headers = headers_for(spec);
  // block (16, 32), one tile column per grid.x, 4 rows per thread: 128 rows per block iteration.
  g.launch = {16, 32, spec.cols / 128, 4};

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

  // The chain's stages on each of the thread's rows before the cast (producer fusion: an activation's
  // forward, or the backward of the ops after a linear with their column sums), in execution order.
  std::vector<Stage> stages = spec.pre;
  if (!fwd) std::reverse(stages.begin(), stages.end());
  const std::vector<std::string> reads = chain_reads(stages, spec.dir);
  std::map<std::string, std::string> preloaded;
  for (size_t i = 0; i < reads.size(); ++i) preloaded[reads[i]] = fmt::format("pl{}[0]", i);
  Writer body;
  for (int i = 0; i < 4; ++i) body.open();
  const bool gated = spec.gated.has_value();
  const int64_t in_cols = gated ? 2 * spec.cols : spec.cols;
  if (gated) {
    // y = post(act(pre(a)) * pre(b)), a and b the two halves of the input row (the gated skeleton's
    // forward), the gate's input saved when the spec asks; y is the tile's value.
    const std::string n_str = std::to_string(spec.cols);
    const ChunkCtx ca{.var = "a", .base = fmt::format("r * {} + c0", in_cols), .col = "c0", .width = in_cols,
                      .half = "_a", .col_off = "0", .row = "r", .preloaded = nullptr};
    const ChunkCtx cb{.var = "b", .base = fmt::format("r * {} + ({} + c0)", in_cols, n_str),
                      .col = fmt::format("({} + c0)", n_str), .width = in_cols, .half = "_b", .col_off = n_str,
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
      body.line("jf_store8<DT, JF_VEC>({} + r * {} + c0, a, n);", sp, in_cols);
      body.line("jf_store8<DT, JF_VEC>({} + r * {} + {} + c0, b, n);", sp, in_cols, spec.cols);
    }
    body.line("#pragma unroll");
    body.line("for (int e = 0; e < 8; ++e) a[e] = {}::fwd(a[e]) * b[e];", gs.functor);
    const ChunkCtx cv{.var = "a", .base = fmt::format("r * {} + c0", spec.cols), .col = "c0", .width = spec.cols,
                      .half = "", .col_off = "0", .row = "r", .preloaded = nullptr};
    for (const auto& s : spec.post) emit_stage_fwd(body, args, setup, s, cv);
  } else if (!stages.empty()) {
    const ChunkCtx c{.var = fwd ? "v" : "gr", .base = fmt::format("r * {} + c0", spec.cols), .col = "c0",
                     .width = spec.cols, .half = "", .col_off = "0", .row = "r", .preloaded = &preloaded};
    body.line("float (&{})[8] = x[u];", c.var);
    for (const auto& s : stages) {
      if (fwd)
        emit_stage_fwd(body, args, setup, s, c);
      else
        emit_stage_bwd(body, args, setup, s, c);
    }
  }

  Writer w;
  emit_prelude(w, spec, g.headers);
  w.line("// op {}: the E4M3 codes of the FP8 GEMM {}, one scale per {} block{}", q.op,
         q.tensor.empty() ? std::string("output") : q.tensor, weight ? "128x128" : "1x128",
         q.colwise ? (weight ? "; transposed with the same scales" : "; transposed with one scale per 128x1 block")
                   : "");
  if (!stages.empty())
    w.line("// the {} stages run on the values first, in registers: their result is never written in bf16",
           fwd ? "producer's" : "backward");
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
  // Without tensors to read beside the input (a forward chain, a norm), every row's loads first and then
  // the stages (the stages' stores would keep the compiler from moving later loads ahead of them); with
  // them (a backward chain's saved tensors), each row's loads and then its stages, so that those tensors
  // live one row at a time (64 registers without a spill, against 110 for all four rows).
  const bool two_phase = reads.empty() && !gated;  // a gated op: its second half is read beside the first
  w.line("float x[4][8];");
  w.line("#pragma unroll");
  w.line("for (int u = 0; u < 4; ++u) {{");
  w.open();
  w.line("const jf_i64 r = r0 + threadIdx.y * 4 + u;");
  w.line("if (r < rows) {{");
  w.open();
  for (size_t i = 0; i < reads.size(); ++i) w.line("float pl{}[1][8];", i);
  if (gated) w.line("float xb[1][8];");
  w.line("jf_load8<DT, JF_VEC>(in + r * {} + c0, x[u]);", in_cols);
  if (gated) w.line("jf_load8<DT, JF_VEC>(in + r * {} + {} + c0, xb[0]);", in_cols, spec.cols);
  for (size_t i = 0; i < reads.size(); ++i) w.line("jf_load8<DT, JF_VEC>({} + r * {} + c0, pl{}[0]);", reads[i], spec.cols, i);
  w.close();
  if ((gated || !stages.empty()) && !two_phase) w.raw(body.str());
  w.line("}} else {{");
  w.line("  for (int e = 0; e < 8; ++e) x[u][e] = 0.f;");
  w.line("}}");
  w.close();
  w.line("}}");
  if (!stages.empty() && two_phase) {
    w.line("#pragma unroll");
    w.line("for (int u = 0; u < 4; ++u) {{");
    w.open();
    w.line("const jf_i64 r = r0 + threadIdx.y * 4 + u;");
    w.line("if (r < rows) {{");
    w.raw(body.str());
    w.line("}}");
    w.close();
    w.line("}}");
  }
  w.line("jf_block_cast_tile<JF_VEC, {}, {}>(x, out, {}, {}_scale_inv, {}, rows, {}, r0, blockIdx.x, jf_sm);",
         weight ? "true" : "false", q.colwise ? "true" : "false", colwise, pre,
         q.colwise ? pre + "_col_scale_inv" : std::string("nullptr"), spec.cols);
  w.close();
  w.line("}}");
  emit_accumulator_flush(w, setup, 16, 32, spec.cols, "blockIdx.y");
  w.close();
  w.line("}}");
  // Column sums (dbias) as one partial row per 128-row tile: not persistent, every tile its own block (the
  // partials are rows / 128 rows, under 2 % of the bytes the kernel moves), so the grid fills the device.
  g.launch.persistent = false;
  finish(w, setup, args, g, spec);
  return g;
}

}  // namespace jitfuse::codegen::detail
