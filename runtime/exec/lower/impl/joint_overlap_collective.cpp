// Joint strategy overlap_collective ([all_gather, linear], [linear, reduce_scatter], [all_reduce, linear];
// docs/parallel.md): the collective runs on the program's side stream beside GEMMs that do not need its result.
// The all-gather and reduce-scatter windows run one of two ways, by world size (JITFUSE_OVERLAP overrides; every
// rank must set the same value):
//
// "chunks" (one rank; JITFUSE_OVERLAP=chunks at any world size): the GEMM runs in row chunks, each chunk's transfer
// on the side stream, so chunk i's transfer overlaps chunk i+1's GEMM. The all-gather becomes one broadcast per
// chunk (rank r's rows land where the gather puts them) and the reduce-scatter one reduce per chunk (to the rank
// that owns the rows):
//   forward  all_gather + linear:  bcast(c0) | bcast(c1) GEMM(c0) | bcast(c2) GEMM(c1) | ...
//   backward (dgrad + reduce-scatter): dgrad(c0) | reduce(c0) dgrad(c1) | ... then wgrad beside the last reduces
//   forward  linear + reduce_scatter: GEMM(c0) | reduce(c0) GEMM(c1) | ...
//   backward (all-gather of dy + dgrad): bcast(c0) | bcast(c1) dgrad(c0) | ... then wgrad
// Chunks: max(W, 4) in all, W per rank shard times 4 / W (at least 1).
//
// "local" (2 ranks and more; at 4 ranks the chunked pipeline measured slower than the GEMMs and NCCL's collectives
// apart: the chunked GEMMs lose efficiency and W x chunks NCCL kernels take their SMs; at 2 local runs level with
// it or ahead): one NCCL collective, whole GEMMs except where this rank's own rows need no transfer:
//   forward  all_gather + linear:  GEMM(own rows, read from the shard itself) beside all_gather | GEMM(the rest)
//   backward (dgrad + reduce-scatter): dgrad | reduce_scatter beside wgrad
//   forward  linear + reduce_scatter: GEMM | reduce_scatter (nothing to overlap inside the window)
//   backward (all-gather of dy + dgrad): dgrad and wgrad(own rows) beside all_gather | dgrad, wgrad(the rest)
//
// "copy" (from 2 to 8 ranks, the default there): every collective of both windows by copy engines from and into
// the peer staging (cuda::PeerStaging: cuMemcpyDtoDAsync over NVLink, stream-memop flags and acks; no NCCL, no SM).
// A reduce-scatter: the GEMM in W row blocks, the other ranks' first (rank + 1, rank + 2, ...); each block goes to
// the rank that owns those rows (a push, side stream) while the next block's GEMM runs; this rank's own block last,
// then one generated kernel adds the W - 1 staged blocks to it (in rank order) once every rank's flag is up:
//   GEMM(rows of r+1) | push(r+1) GEMM(rows of r+2) | ... | push(r-1) GEMM(own rows) | [wgrad] | wait, sum, ack
// An all-gather: this rank's shard pushed to every other rank first (side stream), this rank's rows' GEMM from its
// shard meanwhile, then each other rank's rows as they arrive (taken from the staging into the gathered buffer):
//   push(r+1) push(r+2) ... | GEMM(own rows) [own wgrad] | take(r-1) GEMM(rows of r-1) | take(r-2) ... [wgrads]
// So: forward all-gather + linear, and its backward's reduce-scatter of dx (the dgrad in blocks, the wgrad before
// the sum); forward linear + reduce-scatter, and its backward's all-gather of dy (the own rows' dgrad and wgrad from
// the shard, the other rows' dgrad as they arrive, their wgrad after). Each window keeps local's NCCL way beside it
// (Step::peer_path): prepare picks it where the ranks cannot map each other's staging (or JITFUSE_PEER_COPY=0).
// A third way, each all-gather as W - 1 NCCL send/recv steps (one per peer) with each peer's rows' GEMM after its
// step, measured 12 % slower than local at 4 ranks and level at 2 (session 45), and was dropped.
// Either way the saved context is the unfused ops'. Under per-tensor FP8 (fp8_current, fp8_delayed; copy and local
// mode) the operand of the row-block GEMMs is local and cast once, so each block reads its rows of the codes with
// the one scale: the reduce-scatter halves keep their overlap (forward linear + reduce-scatter, the all-gather
// window's backward); a gathered operand (x, dy) is cast as a whole after its all-gather, which then runs alone.
//
// [all_reduce, linear] (tensor parallelism without SP: the all-reduce that sums a column-parallel linear's dx in
// the backward, the identity in the forward): forward: the GEMM; backward: dgrad | all_reduce beside wgrad. Not
// where a bias follows the linear (its epilogues would be lost: the check says so).
// [linear, all_reduce] (the row-parallel linear's partial sums) is not a window: its GEMM in 4 row chunks with each
// chunk's all-reduce beside the next chunk's GEMM measured 1.5 % slower at 4 ranks and 0.8 % at 2 than the GEMM and
// the all-reduce apart (docs/benchmarks.md, session 45).
#include <atomic>
#include <functional>

#include "common/env.hpp"
#include "common/error.hpp"
#include "common/log.hpp"
#include "common/text.hpp"
#include "exec/lower/impl/comm.hpp"
#include "exec/lower/impl/registrar.hpp"
#include "exec/lower/lowering.hpp"

namespace jitfuse::exec {
namespace {

constexpr int kTargetChunks = 4;

// How the window overlaps its collective (the comment above): JITFUSE_OVERLAP = auto (the default: local from 2
// ranks, chunks at one), chunks or local for both windows, or "<all_gather window>,<reduce_scatter window>" (e.g.
// "local,chunks"). Read when a program is planned.
enum class Mode { automatic, chunks, local, copy };
std::optional<Mode> mode_word(const std::string& w) {
  if (w == "auto" || w.empty()) return Mode::automatic;
  if (w == "chunks") return Mode::chunks;
  if (w == "local") return Mode::local;
  if (w == "copy") return Mode::copy;
  return std::nullopt;
}
Mode mode_of(int world, bool gather) {
  Mode m = Mode::automatic;
  if (const std::optional<std::string> v = env::get("JITFUSE_OVERLAP")) {
    const size_t comma = v->find(',');
    const std::optional<Mode> g = mode_word(v->substr(0, comma));
    const std::optional<Mode> sc = comma == std::string::npos ? g : mode_word(v->substr(comma + 1));
    static std::atomic<bool> warned{false};
    if (g && sc)
      m = gather ? *g : *sc;
    else if (!warned.exchange(true))
      log().warn("JITFUSE_OVERLAP='{}' is not auto, chunks, local, copy or two of them separated by a comma: using "
                 "auto", text::shorten(*v, 40));
  }
  // copy runs from 2 to kMaxPeers ranks.
  if (m == Mode::copy && (world < 2 || world > codegen::kMaxPeers)) m = world >= 2 ? Mode::local : Mode::chunks;
  if (m != Mode::automatic) return m;
  // Measured (H200 x2 / x4, the Llama MLP, 8192 tokens: docs/benchmarks.md "Several GPUs", sessions 42 and 45): at
  // 4 ranks the chunked pipeline was slower than the GEMM and NCCL's collectives apart, local hides 38-44 %; at 2
  // local ran level with the chunks or 1.6 % ahead (7.31-7.39 against 7.39-7.64 ms).
  if (world < 2) return Mode::chunks;
  return world > codegen::kMaxPeers ? Mode::local : Mode::copy;
}

// Chunks per rank shard of `shard_rows` rows at world size `w`: 4 / W (at least 1), halved until it divides.
int64_t chunks_per_rank(int64_t shard_rows, int w) {
  int64_t c = std::max<int64_t>(1, kTargetChunks / std::max(1, w));
  while (c > 1 && shard_rows % c != 0) c /= 2;
  return c;
}

class OverlapCollective final : public Implementation {
 public:
  rules::Impl::Kind kind() const override { return rules::Impl::Kind::joint; }
  std::string name() const override { return "overlap_collective"; }
  std::string covers_text() const override {
    return "[all_gather, linear], [linear, reduce_scatter] (joint pass; plain and per-tensor FP8 recipes) or "
           "[all_reduce (summing in the backward), linear] (plain recipes)";
  }
  std::optional<std::string> check(const std::vector<OpUse>& w, const rules::Impl& impl,
                                   rules::Pass pass) const override {
    if (pass != rules::Pass::joint) return "joint strategies run in the joint pass";
    const bool gather = w.size() == 2 && w[0].name() == "all_gather" && w[1].family() == ops::Family::linear;
    const bool scatter = w.size() == 2 && w[0].family() == ops::Family::linear && w[1].name() == "reduce_scatter";
    const bool reduce = w.size() == 2 && w[0].name() == "all_reduce" && w[1].family() == ops::Family::linear;
    // [gated, linear, reduce_scatter]: FP8 recipes only (the rule's condition; check_fp8), the gated op in the cast.
    if (w.size() == 3 && w[0].family() == ops::Family::gated)
      return check(std::vector<OpUse>(w.begin() + 1, w.end()), impl, pass);
    if (!gather && !scatter && !reduce)
      return "the window is neither [all_gather, linear], [linear, reduce_scatter], [gated, linear, reduce_scatter] "
             "nor [all_reduce, linear]";
    if (reduce) {
      if (w[0].str("direction", "backward") != "backward")
        return "the all_reduce sums in the forward: nothing of the linear's can run beside it";
      if (!w[0].op) return std::nullopt;  // the loader
      // Measured only where the linear's output goes to a generated op (the Llama MLP, docs/benchmarks.md): a bias
      // after it folds into its GEMMs' epilogues (linear_bias*, linear_bias_bwd), which this window would undo.
      if (w[1].next && w[1].next->family == ops::Family::bias)
        return "the linear's bias folds into its GEMMs' epilogues (rules linear_bias*, linear_bias_bwd), which "
               "this window would give up";
      return std::nullopt;
    }
    if (!w[0].op) return std::nullopt;  // the loader: the pattern can run
    const ops::Op& comm = gather ? *w[0].op : *w[1].op;
    if (comm.in.size() != 2) return "the pipelined GEMM takes 2-D activations (its rows are dim 0)";
    const int64_t shard = gather ? comm.in.at(0) : comm.out.at(0);
    if (mode_of(comm.world_size, gather) != Mode::chunks) {
      if (comm.world_size < 2) return "one rank: nothing to overlap";
      return std::nullopt;
    }
    if (comm.world_size * chunks_per_rank(shard, comm.world_size) < 2) return "one chunk: nothing to overlap";
    return std::nullopt;
  }
  // Per-tensor FP8 (fp8_current, fp8_delayed; fp8_block is refused by the registry's block check): copy and local
  // mode (at one rank, local's whole collectives). The operand a window's row-block GEMMs read is local and cast
  // once (one scale: each block is the codes' rows at an offset), so the reduce-scatter halves keep their overlap;
  // a gathered operand is cast after its all-gather, which then has nothing beside it (docs/parallel.md).
  std::optional<std::string> check_fp8(const std::vector<OpUse>& w, const rules::Impl& impl,
                                       rules::Pass pass) const override {
    if (w.size() == 3) return check_fp8(std::vector<OpUse>(w.begin() + 1, w.end()), impl, pass);
    if (w.size() == 2 && w[0].name() == "all_reduce")
      return "the [all_reduce, linear] window is not built for FP8 GEMMs (the unfused linear takes it)";
    if (!w[0].op) return std::nullopt;  // the loader
    const bool gather = w[0].family() == ops::Family::comm;
    const ops::Op& comm = gather ? *w[0].op : *w[1].op;
    if (mode_of(comm.world_size, gather) == Mode::chunks && comm.world_size > 1)
      return "the chunked pipeline would cast each chunk with its own scale (not built for FP8; copy and local are)";
    const int64_t shard = gather ? comm.in.at(0) : comm.out.at(0);
    if (shard % 16 != 0)
      return fmt::format("FP8 GEMMs over one rank's rows need a multiple of 16 rows (the shard has {})", shard);
    return std::nullopt;
  }
  void lower(Builder& b, const rules::Impl&) const override {
    const auto& g = b.group();
    if (b.ops()[g.begin].kind == "all_reduce") return reduce_linear(b, g.begin, g.begin + 1);
    const bool gather = b.ops()[g.begin].family == ops::Family::comm;
    const int comm = gather ? g.begin : g.end - 1, lin = gather ? g.begin + 1 : g.end - 2;
    const bool gated = g.end - g.begin == 3;  // [gated, linear, reduce_scatter]
    const Mode m = mode_of(b.ops()[comm].world_size, gather);
    if (b.recipe().is_fp8()) {  // copy or local (at one rank: the whole collectives; check_fp8)
      if (gather)
        fp8_gather(b, comm, lin, m == Mode::copy);
      else
        fp8_scatter(b, comm, lin, m == Mode::copy, gated ? g.begin : -1);
      return;
    }
    if (gated)
      fail(Status::unsupported, "rule '{}': overlap_collective runs [gated, linear, reduce_scatter] under the FP8 "
           "recipes only (give the rule \"recipes\": [\"fp8_delayed\", \"fp8_current\"])", g.rule);
    if (m != Mode::chunks) {
      if (gather)
        local_gather(b, g.begin, g.begin + 1, m == Mode::copy);
      else
        local_scatter(b, g.begin + 1, g.begin, m == Mode::copy);
      return;
    }
    if (gather)
      lower_gather(b, g.begin, g.begin + 1);
    else
      lower_scatter(b, g.begin + 1, g.begin);
  }

 private:
  struct Chunks {
    int world = 1, rank = 0;
    int64_t shard = 0, per_rank = 1, rows = 0;  // rows per chunk
    int64_t row0(int r, int64_t j) const { return r * shard + j * rows; }
  };
  static Chunks chunks_of(const ops::Op& comm, int64_t shard) {
    Chunks c;
    c.world = comm.world_size;
    c.rank = comm.rank;
    c.shard = shard;
    c.per_rank = chunks_per_rank(shard, comm.world_size);
    c.rows = shard / c.per_rank;
    return c;
  }
  static std::string who(const Builder& b) { return b.group().rule + ": overlap_collective"; }

  // A comm step of op `comm_op` on `stream` after `waits`: `count` elements from `send` (at element offset
  // send_off) to `recv` (at recv_off); `root` as CommStep says (-1: none).
  static int comm_step(Builder& b, Collective kind, int comm_op, int send, int64_t send_off, int recv, int64_t recv_off,
                       int64_t count, int root, int stream, std::vector<int> waits, const std::string& what) {
    CommStep c;
    c.op = kind;
    c.root = root;
    c.op_index = comm_op;
    c.dtype = b.recipe().dtype;
    c.send = send;
    c.send_offset = send_off;
    c.recv = recv;
    c.recv_offset = recv_off;
    c.count = count;
    b.comm(c, what);
    b.place_last(stream, std::move(waits));
    return static_cast<int>(b.steps()) - 1;
  }
  // One chunk's transfer on the side stream after `waits`: a broadcast from rank `root` (the all-gather's rows
  // it owns) or a reduce to it (the reduce-scatter's), `count` elements, at the given element offsets.
  static int transfer(Builder& b, Collective kind, int comm_op, int root, int send, int64_t send_off, int recv,
                      int64_t recv_off, int64_t count, std::vector<int> waits) {
    return comm_step(b, kind, comm_op, send, send_off, recv, recv_off, count, root, 1, std::move(waits),
                     fmt::format("{} ({} of rows owned by rank {})", who(b), collective_name(kind), root));
  }
  // A GEMM of `kind` over one row chunk: A rows from `a_off`, D rows from `d_off` (elements). `proto`: the whole
  // GEMM as built for an FP8 recipe (linear_forward, fp8_backward_gemms: A and B its FP8 copies, their scales), of
  // which this is the rows' block (A is proto's; `a` unused).
  static int chunk_gemm(Builder& b, int lin, cuda::GemmKind kind, int a, int64_t a_off, int d, int64_t d_off,
                        int64_t rows, std::vector<int> waits, const std::string& what,
                        const GemmStep* proto = nullptr) {
    GemmStep gs = proto ? *proto : b.linear_gemm(lin, kind);
    gs.call.m = rows;
    if (!proto) {
      gs.a = a;
      gs.b = b.param(lin, Key::weight);
    }
    gs.d = d;
    gs.a_offset = a_off;
    gs.d_offset = d_off;
    b.gemm(gs, what);
    b.place_last(0, std::move(waits));
    return static_cast<int>(b.steps()) - 1;
  }
  // The whole wgrad: dW (+)= dy^T x over every row.
  static void wgrad(Builder& b, int lin, int dy, int x) {
    const auto& op = b.ops()[lin];
    wgrad_rows(b, lin, dy, 0, x, 0, ops::rows_of(op.in), true, {}, who(b) + ": wgrad " + op.label());
  }
  // The wgrad over `rows` rows only: dW (+)= dy[rows]^T x[rows] from element offsets dy_off and x_off; the first
  // part of a split wgrad writes dW (or adds to it under accumulate_grad), the later parts add (beta 1; C is D).
  static void wgrad_rows(Builder& b, int lin, int dy, int64_t dy_off, int x, int64_t x_off, int64_t rows, bool first,
                         std::vector<int> waits, const std::string& what) {
    const auto& op = b.ops()[lin];
    GemmStep wg = b.linear_gemm(lin, cuda::GemmKind::wgrad);
    wg.call.m = rows;
    wg.a = dy;
    wg.a_offset = dy_off;
    wg.b = x;
    wg.b_offset = x_off;
    wg.d = b.grad(lin, Key::weight);
    wg.call.beta = !first || op.flag("accumulate_grad") ? 1.f : 0.f;
    b.gemm(wg, what);
    b.place_last(0, std::move(waits));
  }

  // The whole collective of op `comm_op` on `stream` after `waits` (local mode).
  static int whole(Builder& b, Collective kind, int comm_op, int send, int recv, int64_t count, int stream,
                   std::vector<int> waits, const std::string& what) {
    return comm_step(b, kind, comm_op, send, 0, recv, 0, count, -1, stream, std::move(waits),
                     fmt::format("{} ({} of {}{})", who(b), collective_name(kind), b.ops()[comm_op].label(), what));
  }
  // The all-gather of `src` (this rank's shard, [n, a_cols]) into `full` ([W n, a_cols]), one NCCL all-gather on the
  // side stream, beside GEMMs of `kind` from those rows into `d` ([W n, d_cols]): this rank's rows from its shard
  // first (no transfer), the other rows after the all-gather (at most two GEMMs).
  static void gather_beside(Builder& b, int comm_op, int lin, cuda::GemmKind kind, const Chunks& c, int src,
                            int full, int64_t a_cols, int d, int64_t d_cols) {
    const int64_t own0 = c.row0(c.rank, 0), n = c.shard;
    const char* what = kind == cuda::GemmKind::fwd ? "" : "dgrad ";
    // The collective first: the side stream forks from the caller's where its first step is issued, so a GEMM
    // issued before it would run before it.
    const int g = whole(b, Collective::all_gather, comm_op, src, full, n * a_cols, 1, {},
                        ", beside this rank's rows' GEMM");
    chunk_gemm(b, lin, kind, src, 0, d, own0 * d_cols, n, {},
               fmt::format("{}: {}rows {}..{} of {} (this rank's, from its shard: no transfer)", who(b), what, own0,
                           own0 + n, b.ops()[lin].label()));
    other_rows(b, lin, kind, c, full, a_cols, d, d_cols, g, what);
  }
  // GEMMs of `kind` over the gathered rows other than this rank's ([0, rank n) and [(rank + 1) n, W n)), after
  // the collective `after`: A and D are both [W n, .] buffers.
  static void other_rows(Builder& b, int lin, cuda::GemmKind kind, const Chunks& c, int a, int64_t a_cols, int d,
                         int64_t d_cols, int after, const char* what) {
    const int64_t own0 = c.row0(c.rank, 0), own1 = own0 + c.shard, all = c.world * c.shard;
    for (auto [r0, r1] : {std::pair<int64_t, int64_t>{0, own0}, std::pair<int64_t, int64_t>{own1, all}})
      if (r1 > r0)
        chunk_gemm(b, lin, kind, a, r0 * a_cols, d, r0 * d_cols, r1 - r0, {after},
                   fmt::format("{}: {}rows {}..{} of {} (the other ranks' rows, after the all-gather)", who(b), what,
                               r0, r1, b.ops()[lin].label()));
  }

  // The all-gather of `src` ([n, a_cols]) into `full` ([W n, a_cols]) with nothing beside it: NCCL's, on the
  // caller's stream (one copy engine's pushes, one peer after another, measured slower where nothing hides them).
  static void gather_only(Builder& b, int comm_op, const Chunks& c, int src, int full, int64_t a_cols) {
    whole(b, Collective::all_gather, comm_op, src, full, c.shard * a_cols, 0, {}, "");
  }

  // Per-tensor FP8, [all_gather ag, linear lin] (check_fp8). Forward: the all-gather, then the gathered input cast
  // once and the whole FP8 GEMM. Backward: dy (local) cast once; the dgrad in row blocks of its codes, each
  // block reduce-scattered as in copy mode (or the whole dgrad and NCCL's reduce-scatter), the wgrad beside.
  static void fp8_gather(Builder& b, int ag, int lin, bool copy) {
    const ops::Op& comm = b.ops()[ag];
    const int64_t k = ops::cols_of(comm.in), n_out = ops::cols_of(b.ops()[lin].out);
    const Chunks c = chunks_of(comm, comm.in.at(0));
    if (b.forward()) {
      const int full = b.act(lin);
      gather_only(b, ag, c, b.act(ag), full, k);
      b.gemm(linear_forward(b, lin, full, b.act(lin + 1)),
             fmt::format("{}: FP8 {} (the gathered input cast once: E4M3 x E4M3)", who(b), b.ops()[lin].label()));
      b.boundary_saves(ag, lin + 1);  // the wgrad reads the input's transposed FP8 copy, which its cast saved
      return;
    }
    const int dy = b.grad_of(lin + 1), dfull = b.grad_of(lin), dx = b.grad_of(ag);
    LinearBackward lb;
    lb.dy = dy;
    lb.dx = dfull;
    const Fp8BackwardGemms g = fp8_backward_gemms(b, lin, lb);  // dy's cast: before both ways
    auto wgrad_now = [&] {
      b.gemm(g.wgrad, g.wgrad_what);
      b.place_last(0, {});
    };
    if (copy) copy_scatter(b, ag, lin, cuda::GemmKind::dgrad, c, dy, n_out, dfull, dx, k, wgrad_now, &g.dgrad);
    const size_t nccl_from = b.steps();
    const int gm = chunk_gemm(b, lin, cuda::GemmKind::dgrad, dy, 0, dfull, 0, c.world * c.shard, {}, g.dgrad_what,
                              &g.dgrad);
    whole(b, Collective::reduce_scatter, ag, dfull, dx, ops::numel(comm.in), 1, {gm}, ", beside the wgrad");
    wgrad_now();
    if (copy) nccl_way(b, nccl_from);
  }

  // Per-tensor FP8, [gated?, linear lin, reduce_scatter rs] (check_fp8). Forward: x and W cast once (a gated op
  // `gated` >= 0 runs in x's cast: no bf16 x); the GEMM in row blocks of x's codes, each block reduce-scattered as
  // in copy mode (or the whole GEMM and NCCL's reduce-scatter). Backward: the all-gather of dy, then the FP8
  // backward of the gathered dy (cast once), then the gated op's.
  static void fp8_scatter(Builder& b, int rs, int lin, bool copy, int gated = -1) {
    const ops::Op& comm = b.ops()[rs];
    const int64_t k = ops::cols_of(b.ops()[lin].in), n_out = ops::cols_of(comm.in);
    const Chunks c = chunks_of(comm, comm.out.at(0));
    if (b.forward()) {
      const int x = b.act(lin), partial = b.act(rs), y = b.act(rs + 1);
      if (gated >= 0) fp8_cast_operand(b, lin, fp8::Operand::input, b.act(gated), gated, lin);
      const GemmStep g = linear_forward(b, lin, x, partial);  // the casts: before both ways
      if (copy) copy_scatter(b, rs, lin, cuda::GemmKind::fwd, c, x, k, partial, y, n_out, nullptr, &g);
      const size_t nccl_from = b.steps();
      chunk_gemm(b, lin, cuda::GemmKind::fwd, x, 0, partial, 0, c.world * c.shard, {},
                 fmt::format("{}: FP8 {}", who(b), b.ops()[lin].label()), &g);
      whole(b, Collective::reduce_scatter, rs, partial, y, ops::numel(comm.out), 0, {}, "");
      if (copy) nccl_way(b, nccl_from);
      b.boundary_saves(gated >= 0 ? gated : lin, rs + 1);  // the gated op's input for its backward
      return;
    }
    const int dfull = b.grad_of(rs);
    gather_only(b, rs, c, b.grad_of(rs + 1), dfull, n_out);
    LinearBackward lb;
    lb.dy = dfull;
    lb.dx = b.grad_of(lin);
    linear_backward(b, lin, lb);
    if (gated >= 0) lower_chain(b, gated, lin, chain_options(b), ops::rows_of(b.ops()[gated].in));
  }

  // Local mode, [all_gather ag, linear lin]. Forward: this rank's rows of y from its own shard while the
  // all-gather runs; the other rows after it. Backward: dgrad, then the reduce-scatter beside the wgrad.
  static void local_gather(Builder& b, int ag, int lin, bool copy) {
    const ops::Op& comm = b.ops()[ag];
    const int64_t k = ops::cols_of(comm.in), n_out = ops::cols_of(b.ops()[lin].out);
    const Chunks c = chunks_of(comm, comm.in.at(0));
    if (b.forward()) {
      const int x = b.act(ag), full = b.act(lin), y = b.act(lin + 1);
      if (copy) copy_gather(b, ag, lin, cuda::GemmKind::fwd, c, x, full, k, y, n_out, true, nullptr);
      const size_t nccl_from = b.steps();
      gather_beside(b, ag, lin, cuda::GemmKind::fwd, c, x, full, k, y, n_out);
      if (copy) nccl_way(b, nccl_from);
      b.boundary_saves(ag, lin + 1);
      b.save_alias(lin, Key::input, full);  // the gathered input: inside the group, so the group saves it
      return;
    }
    const int dy = b.grad_of(lin + 1), dfull = b.grad_of(lin), dx = b.grad_of(ag);
    const int x = b.saved_context(lin, Key::input);
    if (copy)
      copy_scatter(b, ag, lin, cuda::GemmKind::dgrad, c, dy, n_out, dfull, dx, k, [&] { wgrad(b, lin, dy, x); });
    const size_t nccl_from = b.steps();
    const int gm = chunk_gemm(b, lin, cuda::GemmKind::dgrad, dy, 0, dfull, 0, c.world * c.shard, {},
                              fmt::format("{}: dgrad {}", who(b), b.ops()[lin].label()));
    whole(b, Collective::reduce_scatter, ag, dfull, dx, ops::numel(comm.in), 1, {gm}, ", beside the wgrad");
    wgrad(b, lin, dy, x);
    if (copy) nccl_way(b, nccl_from);
  }
  // Marks steps [from, end) as the copy way's NCCL alternative (Step::peer_path -1).
  static void nccl_way(Builder& b, size_t from) {
    b.note_last("NCCL's way, where the ranks cannot map each other's staging (or JITFUSE_PEER_COPY=0)");
    b.mark_peer_path(from, -1);
  }

  // Local mode, [linear lin, reduce_scatter rs]. Forward: the GEMM, then the reduce-scatter. Backward: this rank's
  // rows of dx from its own shard of dy while the all-gather of dy runs; the other rows after it; the wgrad.
  static void local_scatter(Builder& b, int rs, int lin, bool copy) {
    const ops::Op& comm = b.ops()[rs];
    const int64_t k = ops::cols_of(b.ops()[lin].in), n_out = ops::cols_of(comm.in);
    const Chunks c = chunks_of(comm, comm.out.at(0));
    if (b.forward()) {
      const int x = b.act(lin), partial = b.act(rs), y = b.act(rs + 1);
      if (copy) copy_scatter(b, rs, lin, cuda::GemmKind::fwd, c, x, k, partial, y, n_out, nullptr);
      const size_t nccl_from = b.steps();
      chunk_gemm(b, lin, cuda::GemmKind::fwd, x, 0, partial, 0, c.world * c.shard, {},
                 fmt::format("{}: {}", who(b), b.ops()[lin].label()));
      whole(b, Collective::reduce_scatter, rs, partial, y, ops::numel(comm.out), 0, {}, "");
      if (copy) nccl_way(b, nccl_from);
      b.boundary_saves(lin, rs + 1);
      return;
    }
    // Backward: the all-gather of dy beside this rank's rows' dgrad AND wgrad (both from its own shard of dy), then
    // the other rows' dgrad and wgrad (adding to dW).
    const int dy = b.grad_of(rs + 1), dfull = b.grad_of(rs), dx = b.grad_of(lin);
    const int x = b.saved_context(lin, Key::input);
    const int64_t own0 = c.row0(c.rank, 0), own1 = own0 + c.shard, all = c.world * c.shard;
    auto own_wgrad = [&] {
      wgrad_rows(b, lin, dy, 0, x, own0 * k, c.shard, true, {},
                 fmt::format("{}: wgrad {} over rows {}..{} (this rank's, from its shard)", who(b),
                             b.ops()[lin].label(), own0, own1));
    };
    auto other_wgrads = [&](int after) {
      for (auto [r0, r1] : {std::pair<int64_t, int64_t>{0, own0}, std::pair<int64_t, int64_t>{own1, all}})
        if (r1 > r0)
          wgrad_rows(b, lin, dfull, r0 * n_out, x, r0 * k, r1 - r0, false, after >= 0 ? std::vector<int>{after}
                                                                                      : std::vector<int>{},
                     fmt::format("{}: wgrad {} += rows {}..{} (the other ranks', after the all-gather)", who(b),
                                 b.ops()[lin].label(), r0, r1));
    };
    if (copy) {
      const size_t from = b.steps();
      copy_gather(b, rs, lin, cuda::GemmKind::dgrad, c, dy, dfull, n_out, dx, k, false, own_wgrad);
      other_wgrads(-1);  // after the last rows' dgrad, which waited for the last take
      b.mark_peer_path(from, 1);
    }
    const size_t nccl_from = b.steps();
    const int g = whole(b, Collective::all_gather, rs, dy, dfull, c.shard * n_out, 1, {},
                        ", beside this rank's rows' dgrad and wgrad");
    chunk_gemm(b, lin, cuda::GemmKind::dgrad, dy, 0, dx, own0 * k, c.shard, {},
               fmt::format("{}: dgrad rows {}..{} of {} (this rank's, from its shard: no transfer)", who(b), own0,
                           own1, b.ops()[lin].label()));
    own_wgrad();
    other_rows(b, lin, cuda::GemmKind::dgrad, c, dfull, n_out, dx, k, g, "dgrad ");
    other_wgrads(g);
    if (copy) nccl_way(b, nccl_from);
  }

  // Copy mode's reduce-scatter (the comment at the top): GEMMs of `kind` from A `a` ([W n, a_cols]) into the other
  // ranks' blocks of `d_full` ([W n, d_cols]), each pushed to its owner; this rank's block into a scratch [n, d_cols];
  // `before_wait` (the backward's wgrad); then out = that + the staged blocks.
  static void copy_scatter(Builder& b, int comm_op, int lin, cuda::GemmKind kind, const Chunks& c, int a,
                           int64_t a_cols, int d_full, int out, int64_t d_cols,
                           const std::function<void()>& before_wait, const GemmStep* proto = nullptr) {
    const size_t from = b.steps();
    const int64_t n = c.shard;
    const char* what = kind == cuda::GemmKind::fwd ? "" : "dgrad ";
    for (int j = 1; j < c.world; ++j) {
      const int p = (c.rank + j) % c.world;
      const int gm = chunk_gemm(b, lin, kind, a, p * n * a_cols, d_full, p * n * d_cols, n, {},
                                fmt::format("{}: {}rows {}..{} of {} (rank {}'s)", who(b), what, p * n, (p + 1) * n,
                                            b.ops()[lin].label(), p), proto);
      comm_step(b, Collective::peer_push, comm_op, d_full, p * n * d_cols, -1, 0, n * d_cols, p, 1, {gm},
                fmt::format("{}: rank {}'s rows to its staging by a copy engine (no SM)", who(b), p));
    }
    const int own = b.temp("own rows op" + std::to_string(lin), b.recipe().dtype, n, d_cols);
    chunk_gemm(b, lin, kind, a, c.rank * n * a_cols, own, 0, n, {},
               fmt::format("{}: {}rows {}..{} of {} (this rank's)", who(b), what, c.rank * n, (c.rank + 1) * n,
                           b.ops()[lin].label()), proto);
    if (before_wait) before_wait();
    comm_step(b, Collective::peer_wait, comm_op, -1, 0, -1, 0, 0, -1, 0, {},
              fmt::format("{}: wait until every other rank's block is staged", who(b)));
    codegen::KernelSpec spec;
    spec.skeleton = codegen::Skeleton::elementwise;
    spec.dir = codegen::Direction::forward;
    spec.dtype = ops::dtype_name(b.recipe().dtype);
    spec.cols = d_cols;
    spec.vec = d_cols % 8 == 0;
    for (int j = 0; j + 1 < c.world; ++j) {
      codegen::Stage st;
      st.kind = codegen::Stage::Kind::staged_add;
      st.op = comm_op;
      st.op_kind = b.ops()[comm_op].kind;
      st.math = fmt::format("v += staged block {}: the partial sums of the {}-th other rank in rank order", j, j + 1);
      st.slot = j;
      spec.pre.push_back(st);
    }
    spec.label = "peer_sum";
    spec.rule = b.group().rule;
    b.kernel(spec, b.kernel_meta(comm_op, "forward"), own, out, n,
             fmt::format("{}: generated elementwise: this rank's rows + the {} staged blocks (rank order)", who(b),
                         c.world - 1));
    comm_step(b, Collective::peer_ack, comm_op, -1, 0, -1, 0, 0, -1, 0, {},
              fmt::format("{}: the staging read: lower the flags, raise this rank's ack at the others", who(b)));
    b.mark_peer_path(from, 1);
  }

  // Copy mode's all-gather (the comment at the top) of `src` ([n, a_cols], this rank's shard) into `full`
  // ([W n, a_cols]), beside GEMMs of `kind` from those rows into `d` ([W n, d_cols]): this rank's shard pushed to
  // every other rank, its rows' GEMM from the shard (`own_into_full`: also copied into `full`, which the forward
  // saves), `after_own` (the backward's own rows' wgrad), then each other rank's rows taken from the staging into
  // `full` as they arrive, and their GEMM.
  static void copy_gather(Builder& b, int comm_op, int lin, cuda::GemmKind kind, const Chunks& c, int src, int full,
                          int64_t a_cols, int d, int64_t d_cols, bool own_into_full,
                          const std::function<void()>& after_own) {
    const size_t from = b.steps();
    const int64_t n = c.shard, own0 = c.row0(c.rank, 0);
    const char* what = kind == cuda::GemmKind::fwd ? "" : "dgrad ";
    for (int j = 1; j < c.world; ++j) {
      const int p = (c.rank + j) % c.world;
      comm_step(b, Collective::peer_push, comm_op, src, 0, -1, 0, n * a_cols, p, 1, {},
                fmt::format("{}: this rank's rows to rank {}'s staging by a copy engine (no SM)", who(b), p));
    }
    if (own_into_full)
      comm_step(b, Collective::peer_take, comm_op, src, 0, full, own0 * a_cols, n * a_cols, c.rank, 1, {},
                fmt::format("{}: this rank's rows into the gathered buffer (a local copy)", who(b)));
    chunk_gemm(b, lin, kind, src, 0, d, own0 * d_cols, n, {},
               fmt::format("{}: {}rows {}..{} of {} (this rank's, from its shard: no transfer)", who(b), what, own0,
                           own0 + n, b.ops()[lin].label()));
    if (after_own) after_own();
    for (int j = 1; j < c.world; ++j) {
      const int q = (c.rank - j + c.world) % c.world;
      const int t = comm_step(b, Collective::peer_take, comm_op, -1, 0, full, q * n * a_cols, n * a_cols, q, 1, {},
                              fmt::format("{}: rank {}'s rows from the staging (a copy engine)", who(b), q));
      chunk_gemm(b, lin, kind, full, q * n * a_cols, d, q * n * d_cols, n, {t},
                 fmt::format("{}: {}rows {}..{} of {} (rank {}'s, as they arrive)", who(b), what, q * n, (q + 1) * n,
                             b.ops()[lin].label(), q));
    }
    b.mark_peer_path(from, 1);
  }

  // [all_reduce ar (summing in the backward: a column-parallel linear's input), linear lin]. Forward: the
  // all-reduce's identity, the GEMM. Backward: the dgrad, then the all-reduce of dx beside the wgrad.
  static void reduce_linear(Builder& b, int ar, int lin) {
    const ops::Op& op = b.ops()[lin];
    const int64_t rows = ops::rows_of(op.in);
    if (b.forward()) {
      lower_comm(b, ar);  // nothing, or the identity's copy into the linear's input
      chunk_gemm(b, lin, cuda::GemmKind::fwd, b.act(lin), 0, b.act(lin + 1), 0, rows, {},
                 fmt::format("{}: {}", who(b), op.label()));
      b.boundary_saves(ar, lin + 1);
      if (b.training()) b.save_alias(lin, Key::input, b.act(lin));  // inside the group, so the group saves it
      return;
    }
    const int dy = b.grad_of(lin + 1), dfull = b.grad_of(lin), dx = b.grad_of(ar);
    const int gm = chunk_gemm(b, lin, cuda::GemmKind::dgrad, dy, 0, dfull, 0, rows, {},
                              fmt::format("{}: dgrad {}", who(b), op.label()));
    whole(b, Collective::all_reduce, ar, dfull, dx, ops::numel(b.ops()[ar].in), 1, {gm}, ", beside the wgrad");
    wgrad(b, lin, dy, b.saved_context(lin, Key::input));
  }

  // [all_gather ag, linear lin]: x shard [n, k] -> gathered [W n, k] -> y [W n, N].
  static void lower_gather(Builder& b, int ag, int lin) {
    const ops::Op& comm = b.ops()[ag];
    const int64_t k = ops::cols_of(comm.in), n_out = ops::cols_of(b.ops()[lin].out);
    const Chunks c = chunks_of(comm, comm.in.at(0));
    if (b.forward()) {
      const int x = b.act(ag), full = b.act(lin), y = b.act(lin + 1);
      for (int r = 0; r < c.world; ++r)
        for (int64_t j = 0; j < c.per_rank; ++j) {
          const int64_t row0 = c.row0(r, j);
          const int bc = transfer(b, Collective::broadcast, ag, r, x, j * c.rows * k, full, row0 * k, c.rows * k, {});
          chunk_gemm(b, lin, cuda::GemmKind::fwd, full, row0 * k, y, row0 * n_out, c.rows, {bc},
                     fmt::format("{}: rows {}..{} of {}", who(b), row0, row0 + c.rows, b.ops()[lin].label()));
        }
      b.boundary_saves(ag, lin + 1);
      b.save_alias(lin, Key::input, full);  // the gathered input: inside the group, so the group saves it
      return;
    }
    const int dy = b.grad_of(lin + 1), dfull = b.grad_of(lin), dx = b.grad_of(ag);
    for (int r = 0; r < c.world; ++r)
      for (int64_t j = 0; j < c.per_rank; ++j) {
        const int64_t row0 = c.row0(r, j);
        const int gm = chunk_gemm(b, lin, cuda::GemmKind::dgrad, dy, row0 * n_out, dfull, row0 * k, c.rows, {},
                                  fmt::format("{}: dgrad rows {}..{} of {}", who(b), row0, row0 + c.rows,
                                              b.ops()[lin].label()));
        transfer(b, Collective::reduce, ag, r, dfull, row0 * k, dx, j * c.rows * k, c.rows * k, {gm});
      }
    wgrad(b, lin, dy, b.saved_context(lin, Key::input));
  }

  // [linear lin, reduce_scatter rs]: x [W n, k] -> partial [W n, N] -> y shard [n, N].
  static void lower_scatter(Builder& b, int rs, int lin) {
    const ops::Op& comm = b.ops()[rs];
    const int64_t k = ops::cols_of(b.ops()[lin].in), n_out = ops::cols_of(comm.in);
    const Chunks c = chunks_of(comm, comm.out.at(0));
    if (b.forward()) {
      const int x = b.act(lin), partial = b.act(rs), y = b.act(rs + 1);
      for (int r = 0; r < c.world; ++r)
        for (int64_t j = 0; j < c.per_rank; ++j) {
          const int64_t row0 = c.row0(r, j);
          const int gm = chunk_gemm(b, lin, cuda::GemmKind::fwd, x, row0 * k, partial, row0 * n_out, c.rows, {},
                                    fmt::format("{}: rows {}..{} of {}", who(b), row0, row0 + c.rows,
                                                b.ops()[lin].label()));
          transfer(b, Collective::reduce, rs, r, partial, row0 * n_out, y, j * c.rows * n_out, c.rows * n_out, {gm});
        }
      b.boundary_saves(lin, rs + 1);
      return;
    }
    const int dy = b.grad_of(rs + 1), dfull = b.grad_of(rs), dx = b.grad_of(lin);
    for (int r = 0; r < c.world; ++r)
      for (int64_t j = 0; j < c.per_rank; ++j) {
        const int64_t row0 = c.row0(r, j);
        const int bc = transfer(b, Collective::broadcast, rs, r, dy, j * c.rows * n_out, dfull, row0 * n_out, c.rows * n_out, {});
        chunk_gemm(b, lin, cuda::GemmKind::dgrad, dfull, row0 * n_out, dx, row0 * k, c.rows, {bc},
                   fmt::format("{}: dgrad rows {}..{} of {}", who(b), row0, row0 + c.rows, b.ops()[lin].label()));
      }
    wgrad(b, lin, dfull, b.saved_context(lin, Key::input));
  }
};

const Registrar kRegistered(std::make_unique<OverlapCollective>());

}  // namespace
}  // namespace jitfuse::exec
