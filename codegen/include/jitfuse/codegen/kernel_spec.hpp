// KernelSpec: everything codegen needs to emit one generated kernel (skeleton, ordered op stages,
// dtype, specialised constants) and the description of its arguments that the executor binds.
// Specs hold no CUDA source; templates hold no matching logic.
#pragma once
#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace jitfuse::codegen {

enum class Skeleton { elementwise, gated, rownorm, cast_transpose, cross_entropy, moe };
enum class Direction { forward, backward };
std::string skeleton_name(Skeleton s);

// One op inside a generated kernel.
struct Stage {
  enum class Kind {
    unary,      // v = F::fwd(v, consts...);   g = F::bwd(saved, g, consts...)
    bias,       // v += b[col];                db = sum_rows g
    extra_add,  // v += e;                     de = g
    extra_tap,  // extra = v;                  g += d_extra
    dropout,    // v *= keep / (1-p);          g *= keep / (1-p)
    normalize,  // v = (v - mean[row]) * rstd[row] * gamma + beta (forward only): a norm op's affine part
                // with the statistics a NormSpec::stats_only kernel saved (fp8_block's norm -> block cast)
    staged_add, // v += staged_<slot> (forward only): another rank's partial sums of these rows, which its copy
                // engine pushed into this rank's peer staging (the collectives by copy engines, docs/parallel.md)
  } kind = Kind::unary;
  int slot = 0;           // staged_add: which staged tensor (Arg::slot); the builder binds it to a rank's slot
  int op = -1;            // op index in the sequence (see KernelSpec: the source numbers ops by position)
  std::string op_kind;    // "gelu": comments only
  std::string math;       // one-line math comment
  std::string functor;    // unary
  std::vector<double> consts;
  bool save_input = false;   // forward: write the stage's input as saved context
  bool save_output = false;  // forward: write the stage's output as saved context
  bool saved_is_output = false;  // backward unary: the saved tensor is the op's output
  double dropout_p = 0;
  bool dropout_regenerate = false;  // backward: regenerate the mask from (seed, offset) (joint groups)
  bool dropout_save_mask = false;   // forward: write the bit-packed mask
  bool grad_accumulate = false;  // extra_add backward: de += g (a channel's readers but its last one)
  bool grad_two_parts = false;   // extra_tap backward: g += d_extra + d_channel (a returned channel also read:
                                 // the second tensor is the Role::grad_extra_out argument named "channel")
  bool norm_rms = false;         // normalize: rmsnorm (no mean, no beta)
  bool norm_zero_centered = false;  // normalize: gamma + 1
};

struct NormSpec {
  int op = -1;
  bool rms = false;
  double eps = 1e-5;
  bool zero_centered = false;
  bool save_stats = false;  // forward: write mean/rstd
  bool save_input = false;  // forward: write the norm's input (when pre-stages changed it)
  // forward: the row statistics (saved) and the pre stages' writes only, no output: a block-scaled cast
  // with a Stage::Kind::normalize stage reads the norm's input again and normalises in its tiles (fp8_block).
  bool stats_only = false;
};

struct GatedSpec {
  int op = -1;
  std::string functor;  // activation of the first half
  bool save_input = false;
};

// What an (op, key) tensor is, typed: a parameter of the op, or context a forward saves for its backward
// (a joint strategy's own too). The program builder binds parameters, saved context, partial sums and a
// channel's gradient by (op, Key), never by a string; key_name is what sources, buffers and explain print.
enum class Key : uint8_t {
  none,
  input, output, mean, rstd, mask, lse, scale,  // saved context
  dx, dW, db,                                   // the chunked loss's gradients, computed in its forward
  weight, bias,                                 // parameters (ops::Op::params names), and their partials
  channel,                                      // grad_extra_out: the gradient a channel's readers summed
  route,                                        // a moe_permute's token routing (int32, moe_route_ints)
  stats,                                        // a vocab-parallel cross_entropy's gathered row statistics
  weight2,                                      // a split_weight linear's second weight (its outputs' second half)
};
const char* key_name(Key k);                      // "input", "weight", ...; "" for none
std::optional<Key> parse_key(std::string_view name);  // a parameter's name (ops::Op::params) -> its key

// A trailing FP8 cast of the kernel's output and the per-tensor amax reduction its scale comes from.
// Two kinds of owner:
//  - a quantize op (tensor empty): E4M3, the recipe state of op `op` ({scale, scale_inv, amax_history});
//    the cast's scale_inv goes to that state (current: the cast pass; delayed: the update kernel).
//  - an FP8 GEMM operand (tensor "input" | "weight" | "grad_output" of linear `op`): the recipe state of
//    (op, tensor) holds {scale, amax_history}; the cast kernel itself writes the scale_inv it used
//    (1 / scale, block (0,0) thread 0) to the Role::fp8_scale_inv argument, which the executor binds to
//    the FP8 tensor's own scale_inv (a buffer beside it, saved with it), never to shared state.
struct Fp8Spec {
  int op = -1;             // the quantize op, or the linear whose operand this is
  std::string tensor;      // "" (quantize) | "input" | "weight" | "grad_output"
  bool e5m2 = false;       // E5M2 (gradients; max 57344) instead of E4M3 (max 448)
  bool delayed = false;    // fp8_delayed: cast with the stored scale, fold amax into the history after
  bool amax_only = false;  // fp8_current, first pass: reduce amax(output), store nothing
  // cast_transpose only: `in` already holds this tensor's row-major codes (a norm kernel wrote them with
  // this scale); the kernel writes their transpose to the fp8_colwise argument and nothing else (no
  // stages, no scale, no amax: the kernel that wrote the codes did those).
  bool codes_in = false;
  double margin = 0;       // scale = fp8_max / amax / 2^margin
  // fp8_block (issue 44; cast_transpose skeleton, no stages): scales per block from each block's own amax,
  // no recipe state. 1: an activation or gradient, one scale per 1x128 block of a row for the row-major
  // codes and per 128x1 block of a column for the transposed ones; 2: a weight, one scale per 128x128 block
  // for both. The scales go to the Role::fp8_scale_inv and Role::fp8_colwise_scale_inv arguments in the
  // layouts templates/skeletons/block_cast.cuh gives.
  int block = 0;
  bool colwise = true;     // block: write the transposed codes and their scales too (training)
};
// The kernels of the cross_entropy skeleton (codegen/src/cross_entropy.cpp, templates/skeletons/cross_entropy.cuh).
// KernelSpec::cols is V (the logits' columns) for the row kernels, the tensor's columns for `scale`. A row
// kernel runs one block per row of `in`; its `rows` argument is the row just past those it handles, which
// are the last gridDim.x rows of the labels (a chunk of them in the joint strategy, all of them unfused).
struct CrossEntropySpec {
  enum class Kernel {
    rows_fwd,   // loss_r (out: the output's row r for "none", else fp32 per-row losses) and the fp32 lse (saved)
    reduce,     // one block: out[0] = sum of the fp32 per-row losses `in` (over the rows not ignored for
                // "mean"); saves the backward's scale (1 / count, or 1)
    rows_bwd,   // dlogits (out) of g = in[r] ("none") or in[0] * scale; the saved logits and lse
    fused,      // a chunk of rows: loss_r into the fp32 out[r] and dlogits for g = 1 in place of `in`
    scale,      // out (+)= in[0] * scale[0] * src: the joint strategy's backward (src: saved (src_op, src))
    fill_ones,  // out[r] = 1 for r < rows (the column of ones of a column-sum GEMM)
    count,      // one block: saves the scale (1 / rows not ignored for "mean", else 1) from the labels alone
    pad_rows,   // out [rows, cols] = in [pad_from, cols] and zero rows after (the head's weight padded to 8 rows)
    stats,      // vocab-parallel: this rank's statistics of each row (max, sum of exp, sum of z, z[y] or 0),
                // float [rows, 4] into out, for the all_gather over the group
  } kernel = Kernel::rows_fwd;
  int op = -1;                // the cross_entropy op (labels, saved lse and scale)
  int src_op = -1;            // scale: the saved tensor (src_op, src) it reads
  Key src = Key::none;
  std::string reduction = "mean";
  int64_t ignore_index = -100;
  double label_smoothing = 0, z_loss = 0, softcap = 0;
  bool labels_i32 = false;
  bool save = false;          // rows_fwd: write the lse; reduce: write the scale
  bool accumulate = false;    // scale: out += (linear accumulate_grad)
  int64_t grid_rows = 0;      // row kernels: blocks, one per row of `in` (0: the call's rows)
  int64_t ld = 0;             // fused: the logits' row stride in elements (0: the vocabulary, cols)
  // fused: dlogits for g = scale[0] (the saved scale, written by count first); scale: src is already
  // scaled, out (+)= g[0] * src, and nothing runs where g[0] is 1 and out is src (in place).
  bool prescaled = false;
  int64_t pad_from = 0;       // pad_rows: the rows of `in`
  // Vocab-parallel (the op's "vocab_parallel" at world > 1): `cols` are this rank's columns [vocab_start,
  // vocab_start + cols) of vocab_total; labels index vocab_total. rows_fwd and fused read every rank's row
  // statistics, gathered ([world][grid rows][4] floats, saved key stats), instead of their row's alone;
  // rows_bwd and fused compare the labels with their own columns.
  int world = 1;
  int64_t vocab_start = 0, vocab_total = 0;
  bool vocab_parallel() const { return world > 1; }
};

// The kernels of the moe skeleton (issue 43; codegen/src/moe.cpp, templates/skeletons/moe.cuh): top-k token
// routing to expert-contiguous rows without a host synchronisation, and the row permutations both ways.
// The routing lives in one int32 buffer per moe_permute op (saved, Key::route) laid out by moe_route_ints:
// dest [T k] ((t, j) -> permuted row, -1 dropped), src [T k] (permuted row -> token; rows past the kept
// ones unused), splits [E] (kept rows per expert), starts [E + 1] (their exclusive scan; starts[E] = rows),
// then per chunk of 1024 (t, j) entries the count and the rank base of each expert. Rows of a permuted
// tensor: T k (the static bound); rows past starts[E] are zero. KernelSpec::cols is the hidden size for
// the row kernels; `rows` is T for every kernel.
struct MoeSpec {
  enum class Kernel {
    count,          // per chunk of entries: how many route to each expert (out-of-range ids: none, dropped)
    scan,           // one block: each chunk's rank base per expert, splits (capped by the capacity), starts
    scatter,        // per chunk: each entry's row (stable: expert, then token, then slot), dest and src
    permute,        // out [T k, H]: row p = in[src[p]] (zero past starts[E])
    permute_bwd,    // out [T, H]: dx[t] = sum_j dy[dest(t, j)]
    unpermute,      // out [T, H]: sum_j probs[t, j] in[dest(t, j)] (+ the residual, extra input "residual")
    unpermute_bwd,  // out [T k, H]: dy[dest(t, j)] = probs[t, j] dout[t] (rows not kept zero); dprobs [T, k]
  } kernel = Kernel::count;
  int op = -1;            // the op the kernel runs for (extra inputs idx / probs / residual, its outputs)
  int route_op = -1;      // the moe_permute whose routing (saved, Key::route) it writes or reads
  int64_t experts = 0, topk = 0;
  int64_t capacity = -1;  // rows kept per expert, first come; -1: all (dropless)
  bool idx_i64 = true;    // routing indices int64 (torch.topk's) or int32
  bool probs_f32 = true;  // probabilities fp32, else the storage dtype
  bool residual = false;  // unpermute: + the extra input "residual"
  int residual_op = -1;   // the add_extra_input whose extra input (or channel) the residual is (-1: op)
  // The capacity layout (needs capacity >= 1): expert e's rows are [e C, e C + splits[e]) of E C rows, zero rows
  // after each expert's kept ones, so that every expert has C rows (the grouped linears' equal groups).
  bool padded = false;
};
// Ints of a routing buffer for T tokens, top-k of E experts (MoeSpec's layout); src holds `src_rows` ints (the
// permuted rows: T k packed, E x capacity padded; -1: T k).
inline int64_t moe_route_ints(int64_t tokens, int64_t topk, int64_t experts, int64_t src_rows = -1) {
  const int64_t n = tokens * topk, chunks = (n + 1023) / 1024;
  return n + (src_rows < 0 ? n : src_rows) + 2 * experts + 1 + 2 * chunks * experts;
}

// The peer workspace of a communicator (runtime/cuda/peers.hpp; templates/skeletons/peer.cuh's jf_peers, whose
// JF_PEER_MAX_RANKS, JF_PEER_MAX_BLOCKS and JF_PEER_BLOCK_BYTES are these): at most kMaxPeers ranks; a kernel
// reducing over them (KernelSpec::peers) runs at most kPeerMaxBlocks blocks, each with its own flags per rank and
// two regions of kPeerBlockBytes (by epoch parity) for its rows in every rank's staging buffer.
inline constexpr int kMaxPeers = 8, kPeerMaxBlocks = 128;
inline constexpr int64_t kPeerBlockBytes = 32768;
// Whether `rows` rows of `row_bytes` fit the regions of a grid of min(rows, kPeerMaxBlocks, sm_count) blocks.
inline bool peer_rows_fit(int64_t rows, int64_t row_bytes, int64_t sm_count = kPeerMaxBlocks) {
  const int64_t grid = std::max<int64_t>(1, std::min<int64_t>({rows, int64_t{kPeerMaxBlocks}, sm_count}));
  return (rows + grid - 1) / grid * row_bytes <= kPeerBlockBytes;
}

// Op indices in a spec are the sequence's (the Builder binds arguments by them); generate() numbers the
// ops by their position in the kernel instead (0, 1, ... in stage order) in every name and comment, so the
// source depends only on what the kernel computes, never on where its group sits in a sequence.
struct KernelSpec {
  Skeleton skeleton = Skeleton::elementwise;
  Direction dir = Direction::forward;
  std::string dtype = "fp32";  // fp32 | fp16 | bf16
  int64_t cols = 0;            // columns of the anchor (norm: hidden; gated: output n; elementwise: cols)
  bool vec = true;             // the shape allows the 16-byte vector path (cols % 8 == 0): emit its entry point
  std::vector<Stage> pre;      // stages before the anchor (elementwise: all stages)
  std::optional<NormSpec> norm;
  std::optional<GatedSpec> gated;
  std::vector<Stage> post;     // stages after the anchor
  // The output is cast to FP8. elementwise / rownorm / gated: forward only, the row-major codes to `out`.
  // cast_transpose: forward or backward, the row-major codes to `out` [rows, cols] AND the transposed
  // codes to the Role::fp8_colwise argument [cols, rows] (both with the same scale), with the stages'
  // column sums (dbias) as in the elementwise skeleton; required there.
  std::optional<Fp8Spec> fp8;
  std::optional<CrossEntropySpec> ce;  // Skeleton::cross_entropy
  std::optional<MoeSpec> moe;          // Skeleton::moe
  // rownorm forward only: the kernel's input is the sum over `peers` ranks (2..kMaxPeers) of each rank's
  // input, read through buffers mapped from every rank (the one-shot all-reduce of an all_reduce +
  // residual + norm group, docs/parallel.md). 0: the input is this rank's alone.
  int peers = 0;
  std::map<std::string, std::string> headers;  // template files the stages need (name -> "" until filled)
  std::string label;           // "bias_gelu": kernel name stem
  std::string rule;            // provenance for comments and cache metadata
};

// What a kernel argument is bound to. Pointers first, then scalars, in `Generated::args` order.
struct Arg {
  enum class Role {
    in,            // forward: group input; backward: grad of group output
    out,           // forward: group output; backward: grad of group input
    param,         // (op, name) parameter
    saved,         // (op, name: "input"|"output"|"mean"|"rstd"|"mask") saved context
    extra_in,      // (op) add_extra_input's tensor (forward)
    extra_out,     // (op) make_extra_output's tensor (forward)
    grad_extra_out,  // (op) grad of make_extra_output's extra output (backward, read); name "channel": the
                     //      gradient its channel's readers summed (Stage::grad_two_parts)
    grad_extra_in,   // (op) grad of add_extra_input's extra input (backward, write; read too when
                     //      Stage::grad_accumulate)
    partials,      // (op, name) fp32 [parts, cols] partial column sums of a parameter grad
    rows,          // jf_i64
    seed,          // jf_u64 (dropout op): the op's seed attribute
    rng,           // const jf_u64[2]: the call's Philox state {seed, offset} (one per kernel)
    parts,         // int: number of partial rows
    fp8_scale,     // (op) float[1]: delayed: read; current: written by the cast pass
    fp8_scale_inv, // (op) float[1]: written. Quantize: the state's (current: cast pass; delayed: update
                   //      kernel). Operand casts (Fp8Spec::tensor): the FP8 tensor's own, by the cast kernel
    fp8_amax,      // (op) writes: float[grid blocks], one partial amax per block; reads (current scaling's
                   //      cast pass): amax_history[0]
    fp8_colwise,   // (op) cast_transpose: the transposed FP8 codes, unsigned char [cols, rows] (written)
    fp8_colwise_scale_inv,  // (op) a block-scaled cast (Fp8Spec::block): the transposed codes' block scales
    peers,         // const jf_peers*: the communicator's peer-mapped buffers (KernelSpec::peers)
    staged,        // const ST*: staged tensor `slot` (Stage::Kind::staged_add) in this rank's peer staging
  } role;
  int op = -1;       // the op's index in the sequence (the source names it by its position in the kernel)
  std::string name;  // what it is ("in", "rows", "scale_input", ...); for keyed roles key_name(key)
  bool writes = false;
  Key key = Key::none;  // param, saved, partials, grad_extra_out (channel): what the builder binds it by
  int slot = -1;        // staged: Stage::slot
};

struct Launch {
  // elementwise/gated: block (bx, by), grid.x fixed, grid.y chosen at run time; threads loop over
  // rows. cross_entropy: block bx, grid.x = grid_x, or the call's rows where grid_x is 0. cast_transpose: the same, block (8, 32), grid.x = column tiles of 64, by * rows_per_thread_iter =
  // 64 rows per block iteration. rownorm: block (bx), grid.x = rows or fewer (grid-stride).
  int bx = 256, by = 1;
  int64_t grid_x = 1;
  int rows_per_thread_iter = 1;  // unroll over rows
  // true: the kernel writes one partial row per block (column reductions), so the grid is sized to
  // the blocks that fit on the device at once and blocks loop over rows. false: every row slab gets
  // its own block (measured faster on an H200 than a device-sized grid-stride loop: bias+gelu 96 % vs
  // 88 % of copy bandwidth, layernorm 83 % vs 79 %).
  bool persistent = false;
  // At most this many blocks (0: no cap beyond the skeleton's): a kernel whose blocks wait for the same
  // block of the other ranks (KernelSpec::peers) runs at most one block per SM, all resident at once.
  int64_t max_grid = 0;
};

// A finalize kernel sums [parts, cols] fp32 partials into a parameter grad. The gradients of one kernel
// with the same width share one launch (a layernorm's dgamma and dbeta): `count` of them, this one at
// `slot`, its (partials, grad) pair the slot-th of the kernel's arguments and blockIdx.y == slot.
// Launch: grid (ceil(cols / kCols), count), block kThreads; arguments (part_0, grad_0, ..., parts,
// accumulate).
struct Finalize {
  static constexpr int kCols = 16, kThreads = 256, kMaxCount = 8;
  std::string kernel;  // "<kernel>_fin<position>_<name>[_<position>_<name>...]": unique in its module, the
                       // same at any depth
  int op = -1;         // the op's index in the sequence
  Key key = Key::none;  // the parameter: Key::bias, Key::weight
  int64_t cols = 0;
  int slot = 0, count = 1;
};

// The NVRTC option that compiles a source's scalar variant instead of its vector one.
inline constexpr const char* kScalarOption = "-DJF_SCALAR";

// One source per kernel, two NVRTC programs: the 16-byte vector variant (aligned pointers; what a plan
// runs) is the source compiled as it is, the scalar variant (any pointer; a fallback for misaligned
// tensors) the same source compiled with kScalarOption. Each program holds its variant's entry point and
// the kernel's finalize and FP8 update kernels, so either module has everything a launch needs, and a
// plan compiles the scalar one only when a call selects it. A shape without a vector path (spec.vec
// false) has only the scalar variant.
struct Generated {
  std::string source;
  std::string kernel;         // extern "C" name of the vector entry point; every other name extends it
  std::string scalar_kernel;  // kernel + "_scalar": the scalar entry point (every source has one)
  bool vec = true;            // the source has the vector entry point (KernelSpec::vec)
  const std::string& entry(bool vector) const { return vector ? kernel : scalar_kernel; }
  // The options (after the target's) that select a variant: none for the vector one.
  static std::vector<std::string> options(bool vector) {
    return vector ? std::vector<std::string>{} : std::vector<std::string>{kScalarOption};
  }
  std::vector<Arg> args;
  Launch launch;
  std::vector<Finalize> finalize;  // same module
  // One block of 1024 threads after a kernel that wrote per-block amax partials. fp8_current's amax pass:
  // (partials, count, history) sets history[0]. fp8_delayed: (partials, count, history, len, scale,
  // scale_inv) rolls the history, records amax, writes scale_inv = 1 / the scale used and the next scale; an
  // operand cast's (Fp8Spec::tensor) is (partials, count, history, len, scale): its cast wrote the scale_inv.
  std::string fp8_update;
  // fp8_delayed casts of FP8 GEMM operands (Fp8Spec::tensor set): fp8_update is instead the per-pass
  // batch update, (JfFp8Batch by value: part[], hist[], scale[], scale_inv[], count[] for kFp8Batch states,
  // n, len), one block per state; the executor launches it once after the pass for every such cast that
  // ran and every FP8 GEMM output (GemmStep::d_amax) of the pass.
  bool fp8_batched = false;
  std::vector<std::string> headers;  // template files included, in order
};

// The most operand states one batch update launch takes, and the host's mirror of the kernel's
// JfFp8Batch parameter (same members, same order).
inline constexpr int kFp8Batch = 16;
struct Fp8BatchParams {
  const float* part[kFp8Batch];  // per state: the cast's per-block amax partials
  float* hist[kFp8Batch];        // its amax history [len]
  float* scale[kFp8Batch];       // its scale (written for the next call)
  float* scale_inv[kFp8Batch];   // null, or (an FP8 GEMM output's state) 1 / the scale used, written first
  int count[kFp8Batch];          // its number of partials
  int n;                         // states in this launch (grid.x)
  int len;                       // history length (the same for every state of a sequence)
};

// Emits the kernel for `spec`. Deterministic: the same spec gives byte-identical source.
// The source #includes the template files listed in Generated::headers (NVRTC resolves them).
Generated generate(const KernelSpec& spec);

}  // namespace jitfuse::codegen
