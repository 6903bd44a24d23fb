// The cast_transpose skeleton under fp8_block (Fp8Spec::block): a tensor cast to E4M3 with a scale per
// block, row-major and (Fp8Spec::colwise) transposed, one 128 x 128 tile per thread block of 16 x 32
// (templates/skeletons/block_cast.cuh holds the tile's work and the scale layouts). The kernel here loads
// the tile's rows into registers and hands them to the template; its input is the bf16 tensor itself (the
// chain's kernel wrote it), so the spec carries no stages.
#include <stdexcept>

#include "stages.hpp"

namespace jitfuse::codegen::detail {

Generated generate_block_cast(const KernelSpec& spec) {
  const auto& q = *spec.fp8;
  if (q.block != 1 && q.block != 2) throw std::invalid_argument("codegen: Fp8Spec::block must be 1 (1x128) or 2 (128x128)");
  if (!spec.pre.empty() || q.codes_in || q.amax_only || q.delayed || q.e5m2)
    throw std::invalid_argument("codegen: a block-scaled cast (Fp8Spec::block) has no stages, no amax pass and no "
                                "recipe state, and writes E4M3");
  if (spec.cols <= 0 || spec.cols % 128 != 0)
    throw std::invalid_argument("codegen: a block-scaled cast needs cols a positive multiple of 128 (got " +
                                std::to_string(spec.cols) + ")");
  const bool weight = q.block == 2;
  Generated g;
  g.kernel = kernel_name(spec);
  g.headers = headers_for(spec);
  // block (16, 32), one tile column per grid.x, 4 rows per thread: 128 rows per block iteration.
  g.launch = {16, 32, spec.cols / 128, 4};

  Args args;
  args.ptr(Arg::Role::in, -1, "in", "in", "ST", false);
  args.ptr(Arg::Role::out, -1, "out", "out", "unsigned char", true);
  const std::string pre = fmt::format("q{}", q.op), tensor = q.tensor.empty() ? "" : "_" + q.tensor;
  const std::string colwise = q.colwise ? fp8_colwise_arg(args, spec) : "nullptr";
  args.ptr(Arg::Role::fp8_scale_inv, q.op, "scale_inv" + tensor, pre + "_scale_inv", "float", true);
  if (q.colwise)
    args.ptr(Arg::Role::fp8_colwise_scale_inv, q.op, "col_scale_inv" + tensor, pre + "_col_scale_inv", "float", true);
  args.scalar(Arg::Role::rows, -1, "rows", "rows", "jf_i64");

  Writer w;
  emit_prelude(w, spec, g.headers);
  w.line("// op {}: the E4M3 codes of the FP8 GEMM {}, one scale per {} block{}", q.op,
         q.tensor.empty() ? std::string("output") : q.tensor, weight ? "128x128" : "1x128",
         q.colwise ? (weight ? "; transposed with the same scales" : "; transposed with one scale per 128x1 block")
                   : "");
  w.line("// launch: block (16, 32), grid.x = cols / 128, blocks loop over tiles of 128 rows (grid.y)");
  w.line("// vector variant: rows % 16 == 0 (16-byte transposed stores)");
  w.line("extern \"C\" __global__ void __launch_bounds__(512) {}({}) {{", g.kernel, args.decl());
  w.open();
  w.line("__shared__ __align__(16) JfBlockSmem jf_sm;");
  w.line("const int c0 = blockIdx.x * 128 + threadIdx.x * 8;");
  w.line("for (jf_i64 r0 = (jf_i64)blockIdx.y * 128; r0 < rows; r0 += (jf_i64)gridDim.y * 128) {{");
  w.open();
  w.line("float x[4][8];");
  w.line("#pragma unroll");
  w.line("for (int u = 0; u < 4; ++u) {{");
  w.open();
  w.line("const jf_i64 r = r0 + threadIdx.y * 4 + u;");
  w.line("if (r < rows) jf_load8<DT, JF_VEC>(in + r * {} + c0, x[u]);", spec.cols);
  w.line("else for (int e = 0; e < 8; ++e) x[u][e] = 0.f;");
  w.close();
  w.line("}}");
  w.line("jf_block_cast_tile<JF_VEC, {}, {}>(x, out, {}, {}_scale_inv, {}, rows, {}, r0, blockIdx.x, jf_sm);",
         weight ? "true" : "false", q.colwise ? "true" : "false", colwise, pre,
         q.colwise ? pre + "_col_scale_inv" : std::string("nullptr"), spec.cols);
  w.close();
  w.line("}}");
  w.close();
  w.line("}}");
  Setup setup;
  finish(w, setup, args, g, spec);
  return g;
}

}  // namespace jitfuse::codegen::detail
