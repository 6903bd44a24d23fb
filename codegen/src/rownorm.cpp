// The row-wise norm skeleton: one block per row (grid-stride), the row held in registers (hidden size
// is a compile-time constant), statistics by block reduction, then the stage chain. Backward keeps each
// thread's columns fixed across rows so dgamma/dbeta accumulate in registers, flushed as partials.
#include <algorithm>
#include <stdexcept>

#include "stages.hpp"

namespace jitfuse::codegen::detail {

// Chunks of 8 elements each thread keeps in registers. 8 per thread in the forward (64 threads for a
// 4096-wide row, more rows in flight) measured slower on an H200 (layernorm 57.9 % of copy bandwidth
// vs 74.5 % with 4). The backward takes 4 with gamma held in registers for the whole kernel (16-bit
// dtypes, see backward_row): H100, bf16 row kernel alone, % of copy at hidden 4096 / 1024 / 2048 / 8192 /
// 12288 (tools/microbench/norm_bwd.cu, session 30): layernorm 83.0 / 86.4 / 86.4 / 71.4 / 77.6 against
// 74.0 / 84.7 / 83.2 / 68.0 / 73.2 for the 2 chunks and gamma re-read per pass it replaces; rmsnorm
// 82.0 / 86.9 / 82.7 / 81.9 / 83.7 against 84.1 / 76.6 / 82.9 / 82.2 / 75.6 (docs/benchmarks.md).
constexpr int64_t kChunksPerThreadFwd = 4, kChunksPerThreadBwd = 4;

namespace {

// One rownorm kernel being emitted: the shared geometry (threads, chunks per thread), argument list and
// the helpers both directions use. The forward and backward row bodies are separate members.
class Rownorm {
 public:
  explicit Rownorm(const KernelSpec& spec)
      : spec_(spec), ns_(*spec.norm), fwd_(spec.dir == Direction::forward), cols_(spec.cols), peers_(spec.peers != 0) {
    const int64_t chunks = (cols_ + 7) / 8;
    const int64_t per_thread = fwd_ ? kChunksPerThreadFwd : kChunksPerThreadBwd;
    threads_ = static_cast<int>(std::clamp<int64_t>(((chunks + per_thread - 1) / per_thread + 31) / 32 * 32, 32, 1024));
    nch_ = (chunks + threads_ - 1) / threads_;
    gamma_ = fmt::format("p{}_weight", ns_.op);
    beta_ = fmt::format("p{}_bias", ns_.op);
    mean_ = fmt::format("s{}_mean", ns_.op);
    prefetch_ = !fwd_ && spec.dtype != "fp32";
    rstd_ = fmt::format("s{}_rstd", ns_.op);
  }

  Generated generate() {
    Generated g;
    g.kernel = kernel_name(spec_);
    g.headers = headers_for(spec_);
    g.launch = {threads_, 1, 0, 1};
    g.launch.persistent = !fwd_;  // the backward writes dgamma/dbeta partials per block
    args_.ptr(Arg::Role::in, -1, "in", "in", "ST", false);
    if (spec_.fp8 && !fwd_) throw std::invalid_argument("codegen: an FP8 cast ends forward kernels only");
    if (peers_) peer_args(g);
    if (ns_.stats_only && (!fwd_ || spec_.fp8 || !spec_.post.empty() || !ns_.save_stats))
      throw std::invalid_argument("codegen: a stats-only norm kernel is a forward without post stages or FP8 cast "
                                  "that saves its statistics");
    if (!ns_.stats_only) args_.ptr(Arg::Role::out, -1, "out", "out", out_type(spec_), true);
    args_.scalar(Arg::Role::rows, -1, "rows", "rows", "jf_i64");
    if (!ns_.stats_only) {
      args_.ptr(Arg::Role::param, ns_.op, Key::weight, gamma_, "ST", false);
      if (!ns_.rms) args_.ptr(Arg::Role::param, ns_.op, Key::bias, beta_, "ST", false);
    }

    Writer w;
    emit_prelude(w, spec_, g.headers);
    Writer k;  // kernel body
    k.open();
    k.line("__shared__ float jf_sm[64];");
    emit_fp8_prologue(k, args_, spec_);
    if (!fwd_) {
      k.line("float dgam[{}][8], dbet[{}][8];", nch_, nch_);
      k.line("#pragma unroll");
      k.line("for (int k = 0; k < {}; ++k) for (int e = 0; e < 8; ++e) {{ dgam[k][e] = 0.f; dbet[k][e] = 0.f; }}", nch_);
      if (prefetch_) {
        // gamma in its storage dtype for the whole kernel (re-reading it per pass measured 3-10 points of
        // copy bandwidth slower: two dependent L1 round trips per row).
        k.line("jf_raw8<DT> jf_gr[{}];", nch_);
        chunk_loop_open(k);
        k.line("if (active) jf_load_raw8<DT, JF_VEC>({} + c0, jf_gr[k], n); else jf_zero_raw8<DT>(jf_gr[k]);", gamma_);
        chunk_loop_close(k);
        // The first row of this block; each iteration then loads the next one (backward_row).
        k.line("jf_raw8<DT> jf_pg[{0}], jf_px[{0}];", nch_);
        k.line("if (blockIdx.x < rows) {{");
        k.open();
        k.line("const jf_i64 rn = blockIdx.x;");
        load_row_raw(k, "rn", "jf_pg", "jf_px");
        k.close();
        k.line("}}");
      }
    }
    if (peers_) stage_for_peers(k);
    k.line("for (jf_i64 r = blockIdx.x; r < rows; r += gridDim.x) {{");
    k.open();
    if (fwd_)
      forward_row(k);
    else
      backward_row(k);
    k.close();
    k.line("}}");
    emit_fp8_epilogue(k, spec_);
    if (!fwd_) flush_param_partials(k);
    k.close();

    // Forward: ask for 1024 / threads resident blocks (at most 16), which caps registers at 64 per thread
    // when threads divides 1024: on an H200 the compiler otherwise used 72-95 and fit 5-7 rows per SM
    // (layernorm 82 % of copy bandwidth capped vs 76 %). Backward: dgamma/dbeta accumulate in registers;
    // layernorm's is capped at 168 registers (3 blocks of 128 threads per SM instead of 2 at the 189-196
    // ptxas picks; a 24-byte spill), rmsnorm's 154-161 fit 3 blocks uncapped. H100, bf16, % of copy at
    // hidden 4096 / 1024 / 2048 / 8192 / 12288 (session 32, with jf_raw8's packed words and constant
    // chunk bounds): layernorm 65.2 / 69.4 / 68.4 / 59.3 / 67.9 -> 75.7 / 78.0 / 78.9 / 69.4 / 68.5.
    const int bwd_regs = ns_.rms ? 255 : 168;
    const int min_blocks = std::clamp(65536 / (threads_ * (fwd_ ? 64 : bwd_regs)), 1, 16);
    const std::string bounds = fmt::format("{}, {}", threads_, min_blocks);
    w.line("extern \"C\" __global__ void __launch_bounds__({}) {}({}) {{", bounds, g.kernel, args_.decl());
    w.raw(k.str());
    w.line("}}");
    // Stage accumulators (a bias stage) have no flush here; the legality predicate keeps bias out of
    // rownorm groups, so one arriving is a lowering bug.
    if (!setup_.accs.empty()) throw std::invalid_argument("codegen: a rownorm kernel cannot reduce a bias stage");
    finish(w, setup_, args_, g, spec_);
    return g;
  }

 private:
  ChunkCtx ctx(const std::string& var) const {
    ChunkCtx c;
    c.var = var;
    c.width = cols_;
    c.col_off = "0";
    c.col = "c0";
    c.base = fmt::format("r * {} + c0", cols_);
    return c;
  }
  void chunk_loop_open(Writer& w) const {
    w.line("#pragma unroll");
    w.line("for (int k = 0; k < {}; ++k) {{", nch_);
    w.open();
    w.line("const int c0 = (k * {} + (int)threadIdx.x) * 8;", threads_);
    w.line("const bool active = c0 < {};", cols_);
    // Whole chunks when the width is a multiple of 8: within `active` n is then the constant 8 and the
    // per-element bounds fold away. Inactive chunks keep n = 0: layernorm's statistics loop runs on them
    // (their zeroed registers minus the shift K must not count).
    if (cols_ % 8 == 0)
      w.line("const int n = active ? 8 : 0;");
    else
      w.line("const int n = active ? min(8, {} - c0) : 0;", cols_);
  }
  static void chunk_loop_close(Writer& w) {
    w.close();
    w.line("}}");
  }
  // gamma (and beta) as floats for chunk k. The forward re-reads them per row: they stay in L1/L2, and
  // keeping them in registers across rows costs occupancy that the row loads need more. The backward of
  // 16-bit dtypes holds gamma in registers (jf_gr, loaded once per block): there the per-pass loads sat
  // in the dependent chain of every row.
  void load_gamma(Writer& w, const char* var) const {
    w.line("float {}[8];", var);
    if (!fwd_ && prefetch_)
      w.line("jf_unpack8<DT>(jf_gr[k], {});", var);  // held in registers (generate)
    else
      w.line("jf_load8<DT, JF_VEC>({} + c0, {}, n);", gamma_, var);
    if (ns_.zero_centered) w.line("for (int e = 0; e < 8; ++e) {}[e] += 1.f;", var);
  }
  // Backward: row `row`'s dy (into g[k]) and saved input (into x[k]) in the storage dtype; chunks past the
  // row's end are zero.
  void load_row_raw(Writer& w, const char* row, const char* g, const char* x) const {
    chunk_loop_open(w);
    w.line("if (active) {{");
    w.line("  jf_load_raw8<DT, JF_VEC>(in + {} * {} + c0, {}[k], n);", row, cols_, g);
    w.line("  jf_load_raw8<DT, JF_VEC>(s{}_input + {} * {} + c0, {}[k], n);", ns_.op, row, cols_, x);
    w.line("}} else {{ jf_zero_raw8<DT>({}[k]); jf_zero_raw8<DT>({}[k]); }}", g, x);
    chunk_loop_close(w);
  }
  std::string inv_cols() const { return num(1.0 / static_cast<double>(cols_)); }

  // Peers: the jf_peers table argument, and a grid whose blocks are all resident (each waits for its twins).
  void peer_args(Generated& g) {
    if (!fwd_ || spec_.fp8 || ns_.stats_only || spec_.peers < 2 || spec_.peers > kMaxPeers)
      throw std::invalid_argument("codegen: a norm reducing over peers is a forward of 2 to 8 ranks without FP8 cast");
    args_.scalar(Arg::Role::peers, -1, "peers", "peers", "jf_peers");  // by value: no dependent load of the table
    g.launch.max_grid = kPeerMaxBlocks;
  }
  // Peers: this block's rows of the input pushed into its slot of every rank's staging buffer, then the meeting
  // with the same block of every rank (templates/skeletons/peer.cuh); the row loop then reads every rank's rows
  // from this rank's staging buffer.
  void stage_for_peers(Writer& k) const {
    const int w = spec_.peers;
    k.line("const unsigned jf_parity = jf_peer_parity(peers);");
    k.line("for (jf_i64 r = blockIdx.x, j = 0; r < rows; r += gridDim.x, ++j) {{");
    k.open();
    chunk_loop_open(k);
    k.line("if (active) {{");
    k.line("  float v[8];");
    k.line("  jf_load8<DT, JF_VEC>(in + r * {} + c0, v, n);", cols_);
    k.line("  #pragma unroll");
    k.line("  for (int w = 0; w < {}; ++w)  // into slot (block, parity, this rank) of every rank's staging buffer", w);
    k.line("    jf_store8<DT, JF_VEC>(jf_peer_row<{}, ST>(peers, w, jf_parity, peers.rank, j, {}) + c0, v, n);", w, cols_);
    k.line("}}");
    chunk_loop_close(k);
    k.close();
    k.line("}}");
    k.line("jf_peer_barrier<{}>(peers);  // every rank's rows are staged", w);
  }

  // y = norm(pre(x)) * gamma (+ beta), then the post stages; saves pre's output and the row statistics.
  // Without pre stages the row stays in registers in its storage dtype (jf_raw8: half the registers of
  // floats for fp16/bf16, so more rows are in flight per SM) and is unpacked in each pass; layernorm's
  // statistics take one block reduction of sums shifted by the row's first input element (K):
  //   mu = K + S1/n,  var = S2/n - (S1/n)^2,  S1 = sum(x - K), S2 = sum((x - K)^2)
  // which is as exact as the two-pass form when K lies within a few standard deviations of the mean
  // (any element of the row does) and saves a pair of barriers per row. H100, 8192x4096 bf16: layernorm
  // 67 % -> see docs/benchmarks.md for the measured variants.
  void forward_row(Writer& k) {
    const bool packed = spec_.pre.empty() && !peers_;
    load_row_fwd(k, packed);
    row_statistics(k, packed);
    if (!ns_.stats_only) normalize_row(k, packed);  // stats_only: a block-scaled cast normalises (fp8_block)
  }
  // The row into registers (packed: in its storage dtype; else as floats through the pre stages, with
  // columns past the end zeroed so they add nothing to the statistics), saving the norm's input.
  void load_row_fwd(Writer& k, bool packed) {
    if (packed) {
      k.line("jf_raw8<DT> xr[{}];", nch_);
      chunk_loop_open(k);
      k.line("if (active) jf_load_raw8<DT, JF_VEC>(in + r * {} + c0, xr[k], n); else jf_zero_raw8<DT>(xr[k]);", cols_);
      if (ns_.save_input) {
        std::string sp = fmt::format("s{}_input", ns_.op);
        args_.ptr(Arg::Role::saved, ns_.op, Key::input, sp, "ST", true);
        k.line("if (active) {{ float v[8]; jf_unpack8<DT>(xr[k], v); jf_store8<DT, JF_VEC>({} + r * {} + c0, v, n); }}", sp, cols_);
      }
      chunk_loop_close(k);
      return;
    }
    k.line("float x[{}][8];", nch_);
    chunk_loop_open(k);
    if (peers_) {
      k.line("for (int e = 0; e < 8; ++e) x[k][e] = 0.f;");
      k.line("if (active) {{");
      k.line("  #pragma unroll");
      k.line("  for (int w = 0; w < {}; ++w) {{  // rank order: every rank sums the same bits", spec_.peers);
      k.line("    float t[8];");
      k.line("    jf_load8<DT, JF_VEC>(jf_peer_row<{}, ST>(peers, peers.rank, jf_parity, w, r / gridDim.x, {}) + c0, t, n);", spec_.peers, cols_);
      k.line("    for (int e = 0; e < 8; ++e) x[k][e] += t[e];");
      k.line("  }}");
      k.line("}}");
    } else {
      k.line("if (active) jf_load8<DT, JF_VEC>(in + r * {} + c0, x[k], n); else for (int e = 0; e < 8; ++e) x[k][e] = 0.f;", cols_);
    }
    k.line("if (active) {{");
    k.open();
    k.line("float (&v)[8] = x[k];");
    for (auto& s : spec_.pre) emit_stage_fwd(k, args_, setup_, s, ctx("v"));
    if (ns_.save_input) {
      std::string sp = fmt::format("s{}_input", ns_.op);
      args_.ptr(Arg::Role::saved, ns_.op, Key::input, sp, "ST", true);
      k.line("jf_store8<DT, JF_VEC>({} + r * {} + c0, v, n);", sp, cols_);
    }
    k.line("#pragma unroll");
    k.line("for (int e = 0; e < 8; ++e) if (e >= n) v[e] = 0.f;");
    k.close();
    k.line("}}");
    chunk_loop_close(k);
  }
  // xv(k): the row's chunk k as floats (unpacked from registers, or the float row itself).
  static void row_chunk(Writer& w, bool packed) {
    if (packed)
      w.line("float xv[8]; jf_unpack8<DT>(xr[k], xv);");
    else
      w.line("const float (&xv)[8] = x[k];");
  }
  // mu and rs of the row (layernorm: the shifted sums above; rmsnorm: mu = 0), saved when asked.
  void row_statistics(Writer& k, bool packed) {
    k.line("// op {} {}: statistics over {} columns", ns_.op, ns_.rms ? "rmsnorm" : "layernorm", cols_);
    if (!ns_.rms) {
      if (peers_) {
        k.line("float jf_k = 0.f;");
        k.line("for (int w = 0; w < {0}; ++w) jf_k += DT::load(*jf_peer_row<{0}, ST>(peers, peers.rank, jf_parity, w, r / gridDim.x, {1}));", spec_.peers, cols_);
      } else {
        k.line("const float jf_k = DT::load(in[r * {}]);", cols_);
      }
      k.line("float s1 = 0.f, s2 = 0.f;");
      chunk_loop_open(k);
      row_chunk(k, packed);
      k.line("#pragma unroll");
      k.line("for (int e = 0; e < 8; ++e) if (e < n) {{ const float d = xv[e] - jf_k; s1 += d; s2 += d * d; }}");
      chunk_loop_close(k);
      k.line("const float2 jf_s = jf_block_sum2(s1, s2, jf_sm);");
      k.line("const float m1 = jf_s.x * {};", inv_cols());
      k.line("const float mu = jf_k + m1;");
      k.line("const float rs = rsqrtf(fmaxf(jf_s.y * {} - m1 * m1, 0.f) + {});", inv_cols(), num(ns_.eps));
    } else {
      k.line("float s2 = 0.f;");
      chunk_loop_open(k);
      row_chunk(k, packed);
      k.line("#pragma unroll");
      k.line("for (int e = 0; e < 8; ++e) s2 += xv[e] * xv[e];");
      chunk_loop_close(k);
      k.line("const float mu = 0.f;");
      k.line("const float rs = rsqrtf(jf_block_sum(s2, jf_sm) * {} + {});", inv_cols(), num(ns_.eps));
    }
    if (ns_.save_stats) {
      args_.ptr(Arg::Role::saved, ns_.op, Key::mean, mean_, "float", true);
      args_.ptr(Arg::Role::saved, ns_.op, Key::rstd, rstd_, "float", true);
      k.line("if (threadIdx.x == 0) {{ {}[r] = mu; {}[r] = rs; }}", mean_, rstd_);
    }
  }
  // y = (x - mu) * rs * gamma + beta (rmsnorm: x * rs * gamma), the post stages, the store.
  void normalize_row(Writer& k, bool packed) {
    chunk_loop_open(k);
    k.line("if (active) {{");
    k.open();
    row_chunk(k, packed);
    load_gamma(k, "gw");
    k.line("float v[8];");
    if (ns_.rms) {
      k.line("for (int e = 0; e < 8; ++e) v[e] = xv[e] * rs * gw[e];");
    } else {
      k.line("float bw[8];");
      k.line("jf_load8<DT, JF_VEC>({} + c0, bw, n);", beta_);
      k.line("for (int e = 0; e < 8; ++e) v[e] = (xv[e] - mu) * rs * gw[e] + bw[e];");
    }
    for (auto& s : spec_.post) emit_stage_fwd(k, args_, setup_, s, ctx("v"));
    emit_out_store(k, spec_, fmt::format("r * {} + c0", cols_), "v");
    k.close();
    k.line("}}");
    chunk_loop_close(k);
  }

  // dx from the saved input and statistics (post stages' backward first, pre stages' after); dgamma and
  // dbeta accumulate in registers across this block's rows (the grid is persistent). The row's dy and x
  // stay in registers in their storage dtype (jf_raw8) and are unpacked per pass (dy as floats only when
  // post stages rewrite it); for fp16/bf16 the next row's dy and x are loaded before this row's block
  // reduction, so a row's loads overlap the previous row's reduction and stores. layernorm's two sums
  // take one reduction. H100, 8192x4096 bf16: see docs/benchmarks.md "Backward" for what was measured.
  void backward_row(Writer& k) {
    std::string sp = fmt::format("s{}_input", ns_.op);
    args_.ptr(Arg::Role::saved, ns_.op, Key::input, sp, "ST", false);
    args_.ptr(Arg::Role::saved, ns_.op, Key::mean, mean_, "float", false);
    args_.ptr(Arg::Role::saved, ns_.op, Key::rstd, rstd_, "float", false);
    const bool float_dy = !spec_.post.empty();
    if (prefetch_) {
      k.line("jf_raw8<DT> gq[{0}], xq[{0}];", nch_);
      k.line("#pragma unroll");
      k.line("for (int k = 0; k < {}; ++k) {{ gq[k] = jf_pg[k]; xq[k] = jf_px[k]; }}", nch_);
      k.line("if (r + gridDim.x < rows) {{");
      k.open();
      k.line("const jf_i64 rn = r + gridDim.x;");
      load_row_raw(k, "rn", "jf_pg", "jf_px");
      k.close();
      k.line("}}");
    } else {
      k.line("jf_raw8<DT> gq[{0}], xq[{0}];", nch_);
      load_row_raw(k, "r", "gq", "xq");
    }
    if (float_dy) k.line("float gr[{}][8];", nch_);
    k.line("const float mu = {}[r], rs = {}[r];", mean_, rstd_);
    k.line("float s1 = 0.f, s2 = 0.f;");
    chunk_loop_open(k);
    k.line("if (active) {{");
    k.open();
    if (float_dy) {
      k.line("jf_unpack8<DT>(gq[k], gr[k]);");
      k.line("float (&g)[8] = gr[k];");
      for (auto it = spec_.post.rbegin(); it != spec_.post.rend(); ++it) emit_stage_bwd(k, args_, setup_, *it, ctx("g"));
    } else {
      k.line("float g[8]; jf_unpack8<DT>(gq[k], g);");
    }
    k.line("float xv[8]; jf_unpack8<DT>(xq[k], xv);");
    load_gamma(k, "gw");
    k.line("#pragma unroll");
    k.line("for (int e = 0; e < 8; ++e) if (e < n) {{");
    k.open();
    k.line("const float xh = (xv[e] - mu) * rs;");
    k.line("const float wdy = gw[e] * g[e];");
    k.line("s1 += wdy * xh;");
    k.line("s2 += wdy;");
    k.line("dgam[k][e] += g[e] * xh;");
    if (!ns_.rms) k.line("dbet[k][e] += g[e];");
    k.close();
    k.line("}}");
    k.close();
    k.line("}}");
    chunk_loop_close(k);
    if (!ns_.rms) {
      k.line("const float2 jf_c = jf_block_sum2(s1, s2, jf_sm);");
      k.line("const float c1 = jf_c.x * {}, c2 = jf_c.y * {};", inv_cols(), inv_cols());
    } else {
      k.line("const float c1 = jf_block_sum(s1, jf_sm) * {};", inv_cols());
      k.line("const float c2 = 0.f;");
    }
    chunk_loop_open(k);
    k.line("if (active) {{");
    k.open();
    load_gamma(k, "gw");
    if (float_dy)
      k.line("const float (&g)[8] = gr[k];");
    else
      k.line("float g[8]; jf_unpack8<DT>(gq[k], g);");
    k.line("float xv[8]; jf_unpack8<DT>(xq[k], xv);");
    k.line("float dx[8];");
    k.line("for (int e = 0; e < 8; ++e) dx[e] = rs * (gw[e] * g[e] - (xv[e] - mu) * rs * c1 - c2);");
    for (auto it = spec_.pre.rbegin(); it != spec_.pre.rend(); ++it) emit_stage_bwd(k, args_, setup_, *it, ctx("dx"));
    k.line("jf_store8<DT, JF_VEC>(out + r * {} + c0, dx, n);", cols_);
    k.close();
    k.line("}}");
    chunk_loop_close(k);
  }

  // Parameter-grad partials: one row per block; this thread's columns are fixed across rows.
  void flush_param_partials(Writer& k) {
    std::string pg = fmt::format("part{}_weight", ns_.op);
    args_.ptr(Arg::Role::partials, ns_.op, Key::weight, pg, "float", true);
    setup_.finalize.push_back({"", ns_.op, Key::weight, cols_});
    std::string pb = fmt::format("part{}_bias", ns_.op);
    if (!ns_.rms) {
      args_.ptr(Arg::Role::partials, ns_.op, Key::bias, pb, "float", true);
      setup_.finalize.push_back({"", ns_.op, Key::bias, cols_});
    }
    // 8 consecutive floats per chunk: two 16-byte stores on the vector path (cols % 8 == 0 there and the
    // partials buffer is 256-byte aligned), bounded scalar stores otherwise.
    chunk_loop_open(k);
    k.line("if (active) {{");
    k.line("  jf_store8<jf_f32, JF_VEC>({} + (jf_i64)blockIdx.x * {} + c0, dgam[k], n);", pg, cols_);
    if (!ns_.rms) k.line("  jf_store8<jf_f32, JF_VEC>({} + (jf_i64)blockIdx.x * {} + c0, dbet[k], n);", pb, cols_);
    k.line("}}");
    chunk_loop_close(k);
  }

  const KernelSpec& spec_;
  const NormSpec& ns_;
  const bool fwd_;
  const int64_t cols_;
  const bool peers_;  // the input is the sum over the ranks' staged rows (templates/skeletons/peer.cuh)
  int threads_ = 32;
  int64_t nch_ = 1;
  bool prefetch_ = false;  // backward, 16-bit dtypes: the next row's dy and x are loaded a row ahead
  std::string gamma_, beta_, mean_, rstd_;
  Args args_;
  Setup setup_;
};

}  // namespace

Generated generate_rownorm(const KernelSpec& spec) { return Rownorm(spec).generate(); }

}  // namespace jitfuse::codegen::detail
