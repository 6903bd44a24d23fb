// The row-wise norm skeleton: one block per row (grid-stride), the row held in registers (hidden size
// is a compile-time constant), statistics by block reduction, then the stage chain. Backward keeps each
// thread's columns fixed across rows so dgamma/dbeta accumulate in registers, flushed as partials.
#include <algorithm>
#include <stdexcept>

#include "stages.hpp"

namespace jitfuse::codegen::detail {

// Chunks of 8 elements each thread keeps in registers. 8 per thread in the forward (64 threads for a
// 4096-wide row, more rows in flight) measured slower on an H200 (layernorm 57.9 % of copy bandwidth
// vs 74.5 % with 4); the backward also keeps dgamma/dbeta accumulators, where 8 would spill.
constexpr int64_t kChunksPerThreadFwd = 4, kChunksPerThreadBwd = 4;

Generated generate_rownorm(const KernelSpec& spec) {
  const bool fwd = spec.dir == Direction::forward;
  const auto& ns = *spec.norm;
  const int64_t cols = spec.cols;
  const int64_t chunks = (cols + 7) / 8;
  const int64_t per_thread = fwd ? kChunksPerThreadFwd : kChunksPerThreadBwd;
  int threads = static_cast<int>(std::clamp<int64_t>(((chunks + per_thread - 1) / per_thread + 31) / 32 * 32, 32, 1024));
  const int64_t nch = (chunks + threads - 1) / threads;

  Generated g;
  g.kernel = kernel_name(spec);
  g.headers = headers_for(spec);
  g.launch = {threads, 1, 0, 1};
  g.launch.persistent = !fwd;  // the backward writes dgamma/dbeta partials per block

  Args args;
  Setup setup;
  args.ptr(Arg::Role::in, -1, "in", "in", "ST", false);
  if (spec.fp8 && !fwd) throw std::invalid_argument("codegen: an FP8 cast ends forward kernels only");
  args.ptr(Arg::Role::out, -1, "out", "out", out_type(spec), true);
  args.scalar(Arg::Role::rows, -1, "rows", "rows", "jf_i64");
  const std::string gamma = fmt::format("p{}_weight", ns.op), beta = fmt::format("p{}_bias", ns.op);
  args.ptr(Arg::Role::param, ns.op, "weight", gamma, "ST", false);
  if (!ns.rms) args.ptr(Arg::Role::param, ns.op, "bias", beta, "ST", false);
  const std::string mean = fmt::format("s{}_mean", ns.op), rstd = fmt::format("s{}_rstd", ns.op);

  auto ctx = [&](const std::string& var) {
    ChunkCtx c;
    c.var = var;
    c.width = cols;
    c.col_off = "0";
    c.col = "c0";
    c.base = fmt::format("r * {} + c0", cols);
    return c;
  };
  auto chunk_loop_open = [&](Writer& w) {
    w.line("#pragma unroll");
    w.line("for (int k = 0; k < {}; ++k) {{", nch);
    w.open();
    w.line("const int c0 = (k * {} + (int)threadIdx.x) * 8;", threads);
    w.line("const bool active = c0 < {};", cols);
    w.line("const int n = active ? min(8, {} - c0) : 0;", cols);
  };
  auto chunk_loop_close = [&](Writer& w) {
    w.close();
    w.line("}}");
  };

  // gamma (and beta) are re-read per row: they stay in L1/L2, and keeping them in registers across rows
  // costs occupancy that the row loads need more.
  auto load_gamma = [&](Writer& w, const char* var) {
    w.line("float {}[8];", var);
    w.line("jf_load8<DT, JF_VEC>({} + c0, {}, n);", gamma, var);
    if (ns.zero_centered) w.line("for (int e = 0; e < 8; ++e) {}[e] += 1.f;", var);
  };
  Writer w;
  emit_prelude(w, spec, g.headers);
  Writer k;  // kernel body
  k.open();
  k.line("__shared__ float jf_sm[33];");
  emit_fp8_prologue(k, args, spec);
  if (!fwd) {
    k.line("float dgam[{}][8], dbet[{}][8];", nch, nch);
    k.line("#pragma unroll");
    k.line("for (int k = 0; k < {}; ++k) for (int e = 0; e < 8; ++e) {{ dgam[k][e] = 0.f; dbet[k][e] = 0.f; }}", nch);
  }
  k.line("for (jf_i64 r = blockIdx.x; r < rows; r += gridDim.x) {{");
  k.open();
  k.line("float x[{}][8];", nch);
  if (fwd) {
    chunk_loop_open(k);
    k.line("if (active) jf_load8<DT, JF_VEC>(in + r * {} + c0, x[k], n); else for (int e = 0; e < 8; ++e) x[k][e] = 0.f;", cols);
    k.line("if (active) {{");
    k.open();
    k.line("float (&v)[8] = x[k];");
    for (auto& s : spec.pre) emit_stage_fwd(k, args, setup, s, ctx("v"));
    if (ns.save_input) {
      std::string sp = fmt::format("s{}_input", ns.op);
      args.ptr(Arg::Role::saved, ns.op, "input", sp, "ST", true);
      k.line("jf_store8<DT, JF_VEC>({} + r * {} + c0, v, n);", sp, cols);
    }
    k.line("#pragma unroll");
    k.line("for (int e = 0; e < 8; ++e) if (e >= n) v[e] = 0.f;");
    k.close();
    k.line("}}");
    chunk_loop_close(k);
    k.line("// op {} {}: statistics over {} columns", ns.op, ns.rms ? "rmsnorm" : "layernorm", cols);
    if (!ns.rms) {
      k.line("float s1 = 0.f;");
      k.line("#pragma unroll");
      k.line("for (int k = 0; k < {}; ++k) for (int e = 0; e < 8; ++e) s1 += x[k][e];", nch);
      k.line("const float mu = jf_block_sum(s1, jf_sm) * {};", num(1.0 / static_cast<double>(cols)));
      k.line("float s2 = 0.f;");
      chunk_loop_open(k);
      k.line("#pragma unroll");
      k.line("for (int e = 0; e < 8; ++e) if (e < n) {{ const float d = x[k][e] - mu; s2 += d * d; }}");
      chunk_loop_close(k);
      k.line("const float rs = rsqrtf(jf_block_sum(s2, jf_sm) * {} + {});", num(1.0 / static_cast<double>(cols)), num(ns.eps));
    } else {
      k.line("float s2 = 0.f;");
      k.line("#pragma unroll");
      k.line("for (int k = 0; k < {}; ++k) for (int e = 0; e < 8; ++e) s2 += x[k][e] * x[k][e];", nch);
      k.line("const float mu = 0.f;");
      k.line("const float rs = rsqrtf(jf_block_sum(s2, jf_sm) * {} + {});", num(1.0 / static_cast<double>(cols)), num(ns.eps));
    }
    if (ns.save_stats) {
      args.ptr(Arg::Role::saved, ns.op, "mean", mean, "float", true);
      args.ptr(Arg::Role::saved, ns.op, "rstd", rstd, "float", true);
      k.line("if (threadIdx.x == 0) {{ {}[r] = mu; {}[r] = rs; }}", mean, rstd);
    }
    chunk_loop_open(k);
    k.line("if (active) {{");
    k.open();
    load_gamma(k, "gw");
    k.line("float v[8];");
    if (ns.rms) {
      k.line("for (int e = 0; e < 8; ++e) v[e] = x[k][e] * rs * gw[e];");
    } else {
      k.line("float bw[8];");
      k.line("jf_load8<DT, JF_VEC>({} + c0, bw, n);", beta);
      k.line("for (int e = 0; e < 8; ++e) v[e] = (x[k][e] - mu) * rs * gw[e] + bw[e];");
    }
    for (auto& s : spec.post) emit_stage_fwd(k, args, setup, s, ctx("v"));
    emit_out_store(k, spec, fmt::format("r * {} + c0", cols), "v");
    k.close();
    k.line("}}");
    chunk_loop_close(k);
  } else {
    std::string sp = fmt::format("s{}_input", ns.op);
    args.ptr(Arg::Role::saved, ns.op, "input", sp, "ST", false);
    args.ptr(Arg::Role::saved, ns.op, "mean", mean, "float", false);
    args.ptr(Arg::Role::saved, ns.op, "rstd", rstd, "float", false);
    k.line("float gr[{}][8];", nch);
    k.line("const float mu = {}[r], rs = {}[r];", mean, rstd);
    k.line("float s1 = 0.f, s2 = 0.f;");
    chunk_loop_open(k);
    k.line("for (int e = 0; e < 8; ++e) {{ gr[k][e] = 0.f; x[k][e] = 0.f; }}");
    k.line("if (active) {{");
    k.open();
    k.line("jf_load8<DT, JF_VEC>(in + r * {} + c0, gr[k], n);", cols);
    k.line("float (&g)[8] = gr[k];");
    for (auto it = spec.post.rbegin(); it != spec.post.rend(); ++it) emit_stage_bwd(k, args, setup, *it, ctx("g"));
    k.line("jf_load8<DT, JF_VEC>({} + r * {} + c0, x[k], n);", sp, cols);
    load_gamma(k, "gw");
    k.line("#pragma unroll");
    k.line("for (int e = 0; e < 8; ++e) if (e < n) {{");
    k.open();
    k.line("const float xh = (x[k][e] - mu) * rs;");
    k.line("const float wdy = gw[e] * g[e];");
    k.line("s1 += wdy * xh;");
    k.line("s2 += wdy;");
    k.line("dgam[k][e] += g[e] * xh;");
    k.line("dbet[k][e] += g[e];");
    k.close();
    k.line("}}");
    k.close();
    k.line("}}");
    chunk_loop_close(k);
    k.line("const float c1 = jf_block_sum(s1, jf_sm) * {};", num(1.0 / static_cast<double>(cols)));
    if (!ns.rms)
      k.line("const float c2 = jf_block_sum(s2, jf_sm) * {};", num(1.0 / static_cast<double>(cols)));
    else
      k.line("const float c2 = 0.f;");
    chunk_loop_open(k);
    k.line("if (active) {{");
    k.open();
    load_gamma(k, "gw");
    k.line("float dx[8];");
    k.line("for (int e = 0; e < 8; ++e) dx[e] = rs * (gw[e] * gr[k][e] - (x[k][e] - mu) * rs * c1 - c2);");
    for (auto it = spec.pre.rbegin(); it != spec.pre.rend(); ++it) emit_stage_bwd(k, args, setup, *it, ctx("dx"));
    k.line("jf_store8<DT, JF_VEC>(out + r * {} + c0, dx, n);", cols);
    k.close();
    k.line("}}");
    chunk_loop_close(k);
  }
  k.close();
  k.line("}}");
  emit_fp8_epilogue(k, spec);
  if (!fwd) {
    // Parameter-grad partials: one row per block; this thread's columns are fixed across rows.
    std::string pg = fmt::format("part{}_weight", ns.op);
    args.ptr(Arg::Role::partials, ns.op, "weight", pg, "float", true);
    setup.finalize.push_back({"", ns.op, "weight", cols});
    std::string pb = fmt::format("part{}_bias", ns.op);
    if (!ns.rms) {
      args.ptr(Arg::Role::partials, ns.op, "bias", pb, "float", true);
      setup.finalize.push_back({"", ns.op, "bias", cols});
    }
    chunk_loop_open(k);
    k.line("#pragma unroll");
    k.line("for (int e = 0; e < 8; ++e) if (e < n) {{");
    k.open();
    k.line("{}[(jf_i64)blockIdx.x * {} + c0 + e] = dgam[k][e];", pg, cols);
    if (!ns.rms) k.line("{}[(jf_i64)blockIdx.x * {} + c0 + e] = dbet[k][e];", pb, cols);
    k.close();
    k.line("}}");
    chunk_loop_close(k);
  }
  k.close();

  // Forward: ask for 1024 / threads resident blocks (at most 16), which caps registers at 64 per thread
  // when threads divides 1024: on an H200 the compiler otherwise used 72-95 and fit 5-7 rows per SM
  // (layernorm 82 % of copy bandwidth capped vs 76 %). The backward keeps dgamma/dbeta accumulators in
  // registers and is not capped.
  const int min_blocks = std::clamp(65536 / (threads * 64), 1, 16);
  const std::string bounds = fwd ? fmt::format("{}, {}", threads, min_blocks) : std::to_string(threads);
  w.line("extern \"C\" __global__ void __launch_bounds__({}) {}({}) {{", bounds, g.kernel, args.decl());
  w.raw(k.str());
  w.line("}}");
  // Stage accumulators (a bias stage) have no flush here; the legality predicate keeps bias out of
  // rownorm groups, so one arriving is a lowering bug.
  if (!setup.accs.empty()) throw std::invalid_argument("codegen: a rownorm kernel cannot reduce a bias stage");
  finish(w, setup, args, g, spec);
  return g;
}

Generated generate_elementwise(const KernelSpec& spec);

}  // namespace jitfuse::codegen::detail

namespace jitfuse::codegen {

Generated generate(const KernelSpec& spec) {
  if (spec.skeleton == Skeleton::rownorm) {
    if (!spec.norm) throw std::invalid_argument("codegen: rownorm spec without a norm");
    return detail::generate_rownorm(spec);
  }
  if (spec.skeleton == Skeleton::gated && !spec.gated) throw std::invalid_argument("codegen: gated spec without a gate");
  return detail::generate_elementwise(spec);
}

}  // namespace jitfuse::codegen
