// The moe skeleton (issue 43): the routing kernels and the row permutations of MoeSpec, as calls into
// templates/skeletons/moe.cuh (routing) and short row loops here (permutations), with the op's experts, top-k,
// capacity and hidden size as literals. Every grid is fixed (grid_x) and loops over its chunks or rows, so
// no launch depends on how many rows an expert got: no host synchronisation, and a CUDA graph replays it.
#include <stdexcept>

#include "stages.hpp"

namespace jitfuse::codegen::detail {
namespace {

using K = MoeSpec::Kernel;

constexpr int kRouteThreads = 256, kScanThreads = 1024, kRowThreads = 128;
constexpr int64_t kRowBlocks = 1024, kChunkBlocks = 512;

const char* kernel_text(K k) {
  switch (k) {
    case K::count: return "count";
    case K::scan: return "scan";
    case K::scatter: return "scatter";
    case K::permute: return "permute";
    case K::permute_bwd: return "permute_bwd";
    case K::unpermute: return "unpermute";
    case K::unpermute_bwd: return "unpermute_bwd";
  }
  return "?";
}

void check(const KernelSpec& spec) {
  const auto& m = *spec.moe;
  if (m.experts < 1 || m.experts > 4096 || m.topk < 1 || m.topk > m.experts)
    throw std::invalid_argument("codegen: a moe kernel needs 1 <= topk <= experts <= 4096 (got experts " +
                                std::to_string(m.experts) + ", topk " + std::to_string(m.topk) + ")");
  const bool rows = m.kernel == K::permute || m.kernel == K::permute_bwd || m.kernel == K::unpermute ||
                    m.kernel == K::unpermute_bwd;
  if (rows && (spec.cols < 1 || spec.cols % 8 != 0))
    throw std::invalid_argument("codegen: a moe row kernel needs the hidden size (cols) a positive multiple of 8 (got " +
                                std::to_string(spec.cols) + ")");
  if (m.route_op < 0) throw std::invalid_argument("codegen: a moe kernel names the moe_permute op of its routing");
  if (m.padded && m.capacity < 1) throw std::invalid_argument("codegen: the padded moe layout needs a capacity >= 1");
}

// The permuted tensor's rows: T k (packed, `rows` is T), or E x capacity (padded).
std::string permuted_rows(const MoeSpec& m) {
  return m.padded ? fmt::format("{}LL", m.experts * m.capacity) : fmt::format("rows * {}", m.topk);
}

// Whether permuted row p holds a kept slot: packed, the rows before starts[E]; padded, the first splits[e] rows of
// expert e's capacity.
std::string kept_row(const MoeSpec& m, const char* p) {
  return m.padded ? fmt::format("({0} % {1}) < rt.splits[{0} / {1}]", p, m.capacity)
                  : fmt::format("{} < rt.starts[{}]", p, m.experts);
}

// The route buffer and its views, declared first in every kernel.
void route_arg(Args& args, Writer& k, const MoeSpec& m, bool writes) {
  args.ptr(Arg::Role::saved, m.route_op, Key::route, "route", "int", writes);
  k.line("const JfMoeRoute rt = jf_moe_route(const_cast<int*>(route), rows, {}, {}, {});", m.topk, m.experts,
         permuted_rows(m));
}

std::string idx_arg(Args& args, const MoeSpec& m) {
  args.ptr(Arg::Role::extra_in, m.op, "idx", "idx", m.idx_i64 ? "long long" : "int", false);
  return "idx";
}

// The thread's columns of one row: chunks of 8 (16-byte loads), kRowThreads threads per row.
void col_loop(Writer& k, int64_t h) {
  k.line("for (int c0 = threadIdx.x * 8; c0 < {}; c0 += {}) {{", h, kRowThreads * 8);
  k.open();
}
void close(Writer& k) {
  k.close();
  k.line("}}");
}

void emit_routing(Writer& k, Args& args, const MoeSpec& m, Generated& g) {
  g.launch.bx = m.kernel == K::scan ? kScanThreads : kRouteThreads;
  g.launch.grid_x = m.kernel == K::scan ? 1 : kChunkBlocks;
  if (m.kernel == K::scan) {
    route_arg(args, k, m, true);
    k.line("jf_moe_scan(rt, {}, {}LL, {});", m.experts, m.capacity, m.padded ? "true" : "false");
    return;
  }
  const std::string idx = idx_arg(args, m);
  route_arg(args, k, m, true);
  if (m.kernel == K::count) {
    k.line("__shared__ int jf_hist[{}];", m.experts);
    k.line("for (jf_i64 c = blockIdx.x; c < rt.chunks; c += gridDim.x) {{");
    k.line("  jf_moe_count_chunk({}, rt, {}, jf_hist, c);", idx, m.experts);
    k.line("  __syncthreads();");
    k.line("}}");
  } else {
    k.line("__shared__ int jf_ids[JF_MOE_CHUNK];");
    k.line("for (jf_i64 c = blockIdx.x; c < rt.chunks; c += gridDim.x) {{");
    k.line("  jf_moe_scatter_chunk({}, rt, {}, {}, {}LL, jf_ids, c);", idx, m.topk, m.experts, m.capacity);
    k.line("  __syncthreads();");
    k.line("}}");
  }
}

// permute: row p of the output is the input's row src[p], zero past the kept rows.
void emit_permute(Writer& k, Args& args, const KernelSpec& spec, const MoeSpec& m) {
  const int64_t h = spec.cols;
  args.ptr(Arg::Role::in, -1, "in", "in", "ST", false);
  args.ptr(Arg::Role::out, -1, "out", "out", "ST", true);
  route_arg(args, k, m, false);
  k.line("for (jf_i64 p = blockIdx.x; p < {}; p += gridDim.x) {{", permuted_rows(m));
  k.open();
  k.line("const bool kept = {};", kept_row(m, "p"));
  k.line("const jf_i64 t = kept ? rt.src[p] : 0;");
  col_loop(k, h);
  k.line("float v[8];");
  k.line("if (kept) jf_load8<DT, JF_VEC>(in + t * {} + c0, v); else for (int e = 0; e < 8; ++e) v[e] = 0.f;", h);
  k.line("jf_store8<DT, JF_VEC>(out + p * {} + c0, v);", h);
  close(k);
  close(k);
}

// The routing probability of slot j of token t as a float (fp32 or the storage dtype).
std::string prob_of(Args& args, const MoeSpec& m) {
  args.ptr(Arg::Role::extra_in, m.op, "probs", "probs", m.probs_f32 ? "float" : "ST", false);
  return m.probs_f32 ? fmt::format("probs[t * {} + j]", m.topk) : fmt::format("DT::load(probs[t * {} + j])", m.topk);
}

// out[t] = sum_j w(t, j) in[dest(t, j)] (+ residual[t]), the dropped slots adding nothing: unpermute with
// w the routing probabilities, permute_bwd (dx[t] = sum_j dy[dest(t, j)]) with w = 1.
void emit_combine(Writer& k, Args& args, const KernelSpec& spec, const MoeSpec& m) {
  const int64_t h = spec.cols;
  args.ptr(Arg::Role::in, -1, "in", "in", "ST", false);
  args.ptr(Arg::Role::out, -1, "out", "out", "ST", true);
  route_arg(args, k, m, false);
  const bool unpermute = m.kernel == K::unpermute, residual = unpermute && m.residual;
  const std::string w = unpermute ? prob_of(args, m) : "1.f";
  if (residual) args.ptr(Arg::Role::extra_in, m.residual_op >= 0 ? m.residual_op : m.op, "residual", "residual", "ST", false);
  k.line("for (jf_i64 t = blockIdx.x; t < rows; t += gridDim.x) {{");
  k.open();
  col_loop(k, h);
  k.line("float s[8];");
  if (residual)
    k.line("jf_load8<DT, JF_VEC>(residual + t * {} + c0, s);", h);
  else
    k.line("for (int e = 0; e < 8; ++e) s[e] = 0.f;");
  k.line("for (int j = 0; j < {}; ++j) {{", m.topk);
  k.line("  const int q = rt.dest[t * {} + j];", m.topk);
  k.line("  if (q < 0) continue;");
  k.line("  const float w = {};", w);
  k.line("  float v[8];");
  k.line("  jf_load8<DT, JF_VEC>(in + (jf_i64)q * {} + c0, v);", h);
  k.line("  for (int e = 0; e < 8; ++e) s[e] += w * v[e];");
  k.line("}}");
  k.line("jf_store8<DT, JF_VEC>(out + t * {} + c0, s);", h);
  close(k);
  close(k);
}

// unpermute_bwd: dy[dest(t, j)] = probs[t, j] dout[t], dprobs[t, j] = <dout[t], y[dest(t, j)]> (a block sum per
// slot); the permuted rows no slot kept are zero (one more pass over the rows past starts[E]).
void emit_unpermute_bwd(Writer& k, Args& args, const KernelSpec& spec, const MoeSpec& m) {
  const int64_t h = spec.cols;
  args.ptr(Arg::Role::in, -1, "in", "in", "ST", false);
  args.ptr(Arg::Role::out, -1, "out", "out", "ST", true);
  route_arg(args, k, m, false);
  const std::string p = prob_of(args, m);
  // Backward: in = dout [T, H]; y (the forward's input, saved by the caller's plan) and dprobs.
  args.ptr(Arg::Role::saved, m.op, Key::input, "y", "ST", false);
  args.ptr(Arg::Role::grad_extra_in, m.op, "dprobs", "dprobs", "float", true);  // the probabilities' gradient
  k.line("__shared__ float jf_sm[64];");
  k.line("for (jf_i64 t = blockIdx.x; t < rows; t += gridDim.x) {{");
  k.open();
  k.line("for (int j = 0; j < {}; ++j) {{", m.topk);
  k.open();
  k.line("const int q = rt.dest[t * {} + j];", m.topk);
  k.line("if (q < 0) {{ if (threadIdx.x == 0) dprobs[t * {} + j] = 0.f; continue; }}", m.topk);
  k.line("const float w = {};", p);
  k.line("float dot = 0.f;");
  col_loop(k, h);
  k.line("float g[8], v[8];");
  k.line("jf_load8<DT, JF_VEC>(in + t * {} + c0, g);", h);
  k.line("jf_load8<DT, JF_VEC>(y + (jf_i64)q * {} + c0, v);", h);
  k.line("for (int e = 0; e < 8; ++e) {{ dot += g[e] * v[e]; g[e] *= w; }}");
  k.line("jf_store8<DT, JF_VEC>(out + (jf_i64)q * {} + c0, g);", h);
  close(k);
  k.line("dot = jf_block_sum(dot, jf_sm);");
  k.line("if (threadIdx.x == 0) dprobs[t * {} + j] = dot;", m.topk);
  close(k);
  close(k);
  if (m.padded) {
    k.line("for (jf_i64 q = blockIdx.x; q < {}; q += gridDim.x) {{", permuted_rows(m));
    k.open();
    k.line("if ({}) continue;", kept_row(m, "q"));
  } else {
    k.line("for (jf_i64 q = rt.starts[{}] + blockIdx.x; q < rt.n; q += gridDim.x) {{", m.experts);
    k.open();
  }
  col_loop(k, h);
  k.line("float z[8] = {{0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}};");
  k.line("jf_store8<DT, JF_VEC>(out + q * {} + c0, z);", h);
  close(k);
  close(k);
}

}  // namespace

Generated generate_moe(const KernelSpec& spec) {
  check(spec);
  const auto& m = *spec.moe;
  Generated g;
  g.kernel = kernel_name(spec);
  g.headers = headers_for(spec);
  g.launch.bx = kRowThreads;
  g.launch.grid_x = kRowBlocks;
  Args args;
  Writer k;
  k.open();
  switch (m.kernel) {
    case K::count:
    case K::scan:
    case K::scatter: emit_routing(k, args, m, g); break;
    case K::permute: emit_permute(k, args, spec, m); break;
    case K::permute_bwd:
    case K::unpermute: emit_combine(k, args, spec, m); break;
    case K::unpermute_bwd: emit_unpermute_bwd(k, args, spec, m); break;
  }
  args.scalar(Arg::Role::rows, -1, "rows", "rows", "jf_i64");
  Writer w;
  emit_prelude(w, spec, g.headers);
  w.line("// op {}: moe {} (experts {}, top-{}, capacity {}); rows = tokens", m.op, kernel_text(m.kernel), m.experts,
         m.topk, m.capacity < 0 ? std::string("none") : std::to_string(m.capacity));
  w.line("// launch: block ({}), grid.x = {} (fixed: the blocks loop over the chunks or rows)", g.launch.bx, g.launch.grid_x);
  w.line("extern \"C\" __global__ void __launch_bounds__({}) {}({}) {{", g.launch.bx, g.kernel, args.decl());
  w.raw(k.str());
  w.line("}}");
  Setup setup;
  finish(w, setup, args, g, spec);
  return g;
}

}  // namespace jitfuse::codegen::detail
