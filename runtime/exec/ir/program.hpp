// Stage 3 of 5 (Sequence -> Plan -> Program -> Prepared -> call; docs/architecture.md): a Program is what
// exactly runs for one (sequence, recipe, shape, training, arch) — an ordered list of typed steps (cuBLASLt
// GEMMs, generated kernels) over a table of typed buffers. Device-free and immutable once make_program (or
// compile, compile.hpp) returns it: what `jitfuse explain --program` prints, laid out for an estimated
// device. prepare (prepare.hpp) makes a Prepared of it per device; the executor binds and launches.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cuda/cublaslt.hpp"
#include "exec/ir/fp8/names.hpp"
#include "fuser/plan.hpp"
#include "jitfuse/codegen/kernel_spec.hpp"
#include "ops/op.hpp"
#include "ops/recipe.hpp"

namespace jitfuse::exec {

// Every buffer in an arena or the saved block starts at a multiple of this (and so must the host's
// workspace and saved buffers).
inline constexpr size_t kArenaAlignment = 256;

// Who provides a buffer's memory, and for how long it lives.
enum class Storage {
  caller,     // a tensor the caller passes with the call (input, output, extras, params, grads, recipe state)
  saved_block,  // the saved-for-backward block: written by the forward, read by the backward, freed on release
  fwd_arena,  // the forward call's arena, packed by lifetime
  bwd_arena,  // the backward call's arena, packed by lifetime
  persistent, // owned by the sequence, kept across calls (FP8 copies of the weights, cast once per step)
};

enum class BufferRole {
  input, output, extra_in, extra_out,                       // forward tensors of the caller
  grad_output, grad_input, grad_extra_out, grad_extra_in,   // backward tensors of the caller
  param, grad,                                              // (op, key) parameters and their gradients
  recipe_state,                                             // (op, operand, scale|scale_inv|history) FP8 state
  rng_state,                                                // the call's Philox {seed, offset}, copied in first
  activation,                                               // a value between two forward groups
  gradient,                                                 // a gradient between two backward groups
  saved_context,                                            // (op, key) context a forward kernel or GEMM writes
  fp8,                                                      // (linear, operand, row|col|scale_inv)
                                                            // an FP8 copy of a GEMM operand, or its scale_inv
  temp,                                                     // scratch: partial sums, recomputed values, masks
};
std::string role_name(BufferRole r);
std::string storage_name(Storage s);

struct Buffer {
  int id = 0;
  BufferRole role = BufferRole::temp;
  Storage storage = Storage::fwd_arena;
  std::string name;         // "input", "op3.bias", "op2.mask", "act4", "partials op1.bias"
  int op = -1;              // the op it belongs to (params, grads, saved, extras), else -1
  std::string key;          // params, grads, saved, recipe state: the name within the op ("bias", "mean", "scale")
  int slot = -1;            // extra_in / extra_out / grad_extra_* index
  // Recipe state and FP8 copies: whose (a quantize op's own: none, or the linear operand it scales) and
  // which part. What the FP8 state binds by (fp8::RecipeState::bind); `key` only names it.
  fp8::Operand fp8_operand = fp8::Operand::none;
  fp8::Part fp8_part = fp8::Part::scale;
  ops::DType dtype = ops::DType::f32;
  int64_t rows = 0, cols = 0;  // elements = rows * cols (bit masks and byte blobs use dtype u8)
  size_t bytes = 0;
  size_t offset = 0;        // saved / arena storage: byte offset in its block
  int first = -1, last = -1;  // first and last step (of its pass) that touches it
  bool needs_align16 = true;  // a misaligned pointer selects the scalar variant of the kernels using it
};

// How one kernel argument is bound at launch.
struct KArg {
  // peers: the communicator's jf_peers table (cuda::Communicator::peer_table), bound by prepare.
  // staging: the pointer to this rank's staging slot that rank `value` fills (cuda::PeerStaging), bound per call.
  enum class Kind { buffer, rows, u64_const, int_const, peers, staging } kind = Kind::buffer;
  int buffer = -1;
  uint64_t value = 0;
};

struct KernelLaunch {
  unsigned gx = 1, gy = 1, bx = 1, by = 1;
  int parts = 1;  // per-block partial rows the kernel writes (column reductions, FP8 amax)
};
// A kernel step's launch for each variant: the scalar one always, the vector one where spec.vec.
struct Launches {
  KernelLaunch vec, scalar;
};

// One generated kernel: what to generate and how its arguments bind. Which variant is loaded, and its
// launch on a real device, are the Prepared's. Its finalize kernels and FP8 recipe-state update run as
// steps of their own after it (FinalizeStep, Fp8UpdateStep).
struct KernelStep {
  codegen::KernelSpec spec;  // spec.vec: the shape allows the vector variant
  nlohmann::json meta;       // cache metadata (rule, ops, recipe, ...)
  codegen::Generated gen;    // args, launch shape, entry points of both variants, follow-up kernels
  std::vector<KArg> args;    // in gen.args order
  Launches launch;           // for the program's DeviceModel (estimated occupancy): what explain prints
  std::vector<int> align_buffers;  // caller buffers whose misalignment selects the scalar variant
  struct Follow {                  // a finalize kernel's gradient: grad(op,name) = sum of the partials
    int partials = -1, grad = -1;
    int64_t cols = 0;
    std::string key;  // the finalize kernel's name (the same at any depth): explain and tests
    int slot = 0, count = 1;  // codegen::Finalize: this gradient's place in its kernel's one launch
    int index = 0;            // its place in gen.finalize: the loaded module's LoadedKernel::finalize[index]
  };
  std::vector<Follow> finalize;  // what sizes the partials (layout.cpp); the launches are FinalizeSteps
  int amax_partials = -1;        // FP8: the per-block amax partials the kernel writes (-1: none)
  int64_t rows = 0;
  // Expert parallelism: a kernel over the rows a moe_dispatch received (between it and its combine) runs over the
  // rows this rank's experts got this call, min(rows, routing[rows_route_total]) of the dispatch's host routing
  // (exec/run/routes.hpp; the rows past them are read by nobody); -1: always `rows`.
  int rows_route = -1;
  int64_t rows_route_total = 0;
  int64_t bytes_read = 0, bytes_written = 0;  // napkin traffic of the main kernel
};

// One finalize kernel's launch, right after the kernel step whose partials it sums (resolved when the
// program is built: a call matches no names): its function is LoadedKernel::finalize[index] of the module
// of the variant that step launched, and the partial rows that launch wrote are its `parts`.
struct FinalizeStep {
  int kernel_step = -1;    // the kernel step (of this pass) it follows
  int index = 0, count = 0;
  int64_t cols = 0;
  std::string kernel;      // the finalize kernel's name (explain)
  std::vector<int> pairs;  // partials_0, grad_0, partials_1, grad_1, ... (2 x count)
};

// An FP8 recipe-state update: the amax partials a cast (per block) or an FP8 GEMM (one float) wrote, reduced
// into the state they roll. Per cast right after it (current scaling's amax pass, a quantize op's delayed
// update), or batched: one step at the end of the pass for its fp8_delayed operand casts and FP8 GEMM outputs
// (codegen::Fp8BatchParams, kFp8Batch states per launch). An entry whose step did not run in this call (a
// skipped weight cast, a verify run of other groups) is left out.
struct Fp8UpdateStep {
  struct Entry {
    int step = -1;          // the step that wrote the partials (its launch gives their count; a GEMM's: 1)
    int partials = -1, history = -1, scale = -1;
    int scale_inv = -1;     // -1: a cast wrote its copy's own
  };
  bool batched = false;     // the update kernel: the module's of each entry's cast (one format per pass)
  int history_len = 1;
  std::vector<Entry> entries;  // one per cast update
};

// The buffers a GEMM step binds, by role. GemmStep names them as fields (what implementations write);
// every consumer (the builder's lifetimes, the binder, prepare, the tuner, explain, the saved set) walks
// them as data through this enum and one table (gemm_operand: name, field, kind, setter).
enum class GemmOperand { a, b, c, d, bias, aux, a_scale_inv, b_scale_inv, d_scale, d_amax, d_history, d_scale_inv,
                         workspace, ones, route };
inline constexpr int kGemmOperands = 15;

struct GemmStep {
  cuda::GemmCall call;  // dims, kind, epilogue, alpha/beta, dtype; pointers are bound per call from:
  int a = -1, b = -1, c = -1, d = -1, bias = -1, aux = -1;
  int a_scale_inv = -1, b_scale_inv = -1;  // FP8 operands (call.fp8 set): their scale_inv buffers
  // FP8 output (call.dtype E4M3; fp8_delayed): D = fp8(d_scale * result) with the state's stored scale,
  // max |result| into d_amax (one float, live to the pass's end), and the state's history and scale_inv,
  // which the pass's batched update rolls and records (codegen::Fp8BatchParams).
  int d_scale = -1, d_amax = -1, d_history = -1, d_scale_inv = -1;
  int workspace = -1;  // the cuBLASLt workspace: scratch of the call's arena, live for this step only
  // BGRADB may have no cuBLASLt algorithm for a problem: then the plain wgrad and db = ones^T dy.
  int ones = -1;
  bool bias_grad_fallback = false;  // the fallback is possible (ones is allocated); prepare decides
  // Elements into a and d: a row chunk of a GEMM pipelined with its collective (docs/parallel.md).
  int64_t a_offset = 0, d_offset = 0;
  // Elements into b: the row chunk of x a chunked wgrad reads (exec/lower/impl/joint_chunked_linear_cross_entropy.cpp).
  int64_t b_offset = 0;
  // A grouped_linear after a packed (dropless) moe_permute: one step per pass and kind runs every expert's GEMM.
  // `route` is that permute's routing (int32, codegen::MoeSpec's layout); expert g's rows are [starts[g], starts[g]
  // + splits[g]), read on the host when the pass reaches its first such step (one copy and one stream
  // synchronisation per routing and pass; refused under CUDA-graph capture). call.m is the rows' static bound
  // (T k: explain's FLOPs for a dropless block); a/b/d_row are the elements per row of a, b, d at an expert's
  // rows, 0 for the weight operand, which advances route_weight elements per expert. fwd and dgrad zero their
  // d's rows past starts[E]; an empty expert's wgrad zeroes its dW_g. The executor runs the experts' GEMMs one
  // cuBLASLt call each, or all in one cuBLAS grouped call (docs/ops.md#mixture-of-experts).
  int route = -1;
  int64_t route_experts = 0, route_splits = 0;  // E, the int index of splits[0] in the routing
  int64_t route_weight = 0;
  int64_t a_row = 0, b_row = 0, d_row = 0;
  // A split_weight linear (builder only: Builder::gemm emits it as two GEMMs over the outputs' halves, and no
  // step of a program has it set): fwd/dgrad its second weight, wgrad that weight's gradient.
  int b2 = -1;
  bool routed() const { return route >= 0; }
  int64_t flops() const { return 2 * call.m * call.n * call.k * call.batch; }
  int operand(GemmOperand o) const;  // its buffer id, -1: none
};
// Who takes a GEMM operand's pointer, and what it is.
enum class GemmOperandKind {
  tensor,       // a matrix or vector cuBLASLt reads or writes (a, b, c, d, bias, aux)
  fp8_input,    // one float cuBLASLt reads on every FP8 GEMM: a_scale_inv, b_scale_inv
  fp8_output,   // one float of an FP8 output cuBLASLt reads or writes: d_scale, d_amax
  workspace,    // cuBLASLt's workspace
  executor,     // the executor's, not cuBLASLt's: d_history, d_scale_inv (the batched update), ones, route
                // (a dropless grouped GEMM's routing)
};
// The one table of GEMM operands (kGemmOperands rows, in GemmOperand order): its name, its GemmStep field
// and its kind; the setter points a GemmCall's pointer at it (no-op for the executor's).
struct GemmOperandInfo {
  GemmOperand operand;
  const char* name;  // "a", "bias", "d_scale", ...
  int GemmStep::*field;
  GemmOperandKind kind;
  void (*set)(cuda::GemmCall& call, void* ptr);
};
const GemmOperandInfo& gemm_operand(GemmOperand o);
inline const char* gemm_operand_name(GemmOperand o) { return gemm_operand(o).name; }
// Points `call`'s pointer for operand `o` at `ptr` (the executor's operands: no-op; FP8 ones only on an FP8 call).
inline void set_operand(cuda::GemmCall& call, GemmOperand o, void* ptr) { gemm_operand(o).set(call, ptr); }

// A collective over the group's ranks, run by NCCL on the caller's stream (docs/parallel.md). Counts are
// elements of `dtype`; offsets are elements into the buffers (a chunk of a pipelined GEMM's operand).
// peer_push / peer_wait / peer_ack / peer_take: collectives by copy engines (no NCCL, no SM; cuda::PeerStaging,
// docs/parallel.md). push copies `count` elements from send + send_offset into rank `root`'s staging slot for this
// rank (after root's ack that it read the last one) and raises root's flag for this rank; wait holds the stream
// until every other rank's flag is up; ack lowers those flags and raises this rank's ack at every other rank; take
// waits for rank root's flag, copies its slot (`count` elements) to recv + recv_offset, lowers the flag and raises
// this rank's ack at root (root = this rank: copies send + send_offset there, no flag).
enum class Collective { all_gather, reduce_scatter, all_reduce, broadcast, reduce, all_to_all, peer_push, peer_wait,
                        peer_ack, peer_take };
const char* collective_name(Collective c);
// What explain's link times assume: NVLink 4 on an H100/H200, 18 links x 25 GB/s, one direction.
inline constexpr double kNvlinkGbs = 450.0;
struct CommStep {
  Collective op = Collective::all_reduce;
  int send = -1, recv = -1;
  int64_t send_offset = 0, recv_offset = 0;
  // NCCL's count: all_gather the elements each rank sends (its shard), reduce_scatter those each rank
  // receives, all_reduce / broadcast / reduce the whole buffer (chunk).
  int64_t count = 0;
  ops::DType dtype = ops::DType::f32;
  int root = -1;  // broadcast / reduce: the rank that sends / receives
  int op_index = -1;  // the comm op it runs for
  // all_to_all (moe_dispatch / moe_combine, expert parallelism; docs/parallel.md#expert-parallelism): rows between
  // this rank's permuted rows (the token side, expert-contiguous over all E experts) and the rows of the E / W
  // experts it owns (the expert side: expert-major, then source rank), each expert's rows one NCCL send/recv in
  // one group (no sort kernel on either side). Dropless (a packed permute), how many rows go where is known per call
  // only: the executor reads every rank's rows per expert on the host (one copy and one synchronisation per call;
  // no CUDA-graph capture). Padded (counts -1): `capacity` rows per (rank, expert), fixed: nothing read, capturable.
  // count: the token side's elements (the bound).
  struct AllToAll {
    bool to_experts = true;  // send the token side, receive the expert side (dispatch forward, combine backward)
    int counts = -1;         // the dispatch's int32 routing: every rank's rows per expert and its two bounds (its
                             // permuted rows, the rows its experts may receive) [W (E + 2)], then this rank's
                             // experts' splits [E / W] and starts [E / W + 1] (what its grouped linears read);
                             // -1: padded (token_rows / experts rows per rank and expert)
    int route = -1;          // >= 0 (dispatch forward): first all-gather this permute routing's splits (and this
                             // rank's bounds) into counts
    int64_t route_splits = 0;  // the int index of the splits in `route`
    int64_t experts = 0;       // E, over every rank
    int64_t row = 0;           // elements per row
    int64_t token_rows = 0, expert_rows = 0;  // the two sides' rows (bounds)
  } a2a;
  // Bytes over the links per rank, by NCCL's bus-bandwidth convention ((W-1)/W of the data for gathers and
  // scatters, twice that for all-reduce); 0 at world size 1 (a local copy).
  int64_t wire_bytes(int world_size) const;
};

struct Step {
  enum class Kind { gemm, kernel, comm, finalize, fp8_update } kind = Kind::gemm;
  int group = -1;              // index into the pass's groups (-1: a batched FP8 update at the pass's end)
  std::string what;            // "linear_bias_gelu: cublaslt GELU_AUX_BIAS" (explain only; never dispatched on)
  GemmStep gemm;
  std::shared_ptr<KernelStep> kernel;  // written by make_program only
  CommStep comm;
  FinalizeStep finalize;
  Fp8UpdateStep fp8_update;
  // Casts a weight into its persistent FP8 copies: skipped by a call that says the weights did not change
  // since the last cast (ForwardArgs::weights_unchanged).
  bool weight_cast = false;
  // 0: the caller's stream; 1: the prepared program's side stream, where a collective pipelined with GEMMs
  // runs (docs/parallel.md). A group's side-stream steps start after everything before the group on the
  // caller's stream and the caller's stream waits for them at the group's end.
  int stream = 0;
  std::vector<int> waits;  // steps of this pass, on the other stream, that must finish before this one
  // A group with two ways to run (an all_reduce + residual + norm): 1, the step runs when the prepared program
  // has the communicator's peer workspace (the one-shot kernel); -1, when it has not (NCCL, then the norm
  // kernel); 0, always.
  int peer_path = 0;
  // The buffers it reads or writes (every operand, argument, pair and state): lifetimes, the saved set.
  std::vector<int> buffers() const;
};
const char* step_kind_name(Step::Kind k);  // "gemm", "kernel", "comm", "finalize", "fp8_update"

struct Program {
  std::vector<ops::Op> ops;
  fuser::Plan plan;
  ops::Recipe recipe;
  bool training = true;
  std::string arch;  // "sm_90a"
  // Tensor parallelism: the communicator group its comm steps run on ("" if none), and the world size and
  // rank it was planned for (a prepare binds a communicator of the same size).
  std::string group;
  int world_size = 1, rank = 0;
  std::vector<Buffer> buffers;
  std::vector<Step> forward, backward;  // the backward in execution order
  size_t fwd_arena = 0, bwd_arena = 0, saved_bytes = 0;
  // Buffer ids of the caller's tensors, by role.
  int input = -1, output = -1, grad_output = -1, grad_input = -1;
  int rng = -1;  // the Philox state a forward copies in first (saved block when training), -1 without dropout
  std::vector<int> extra_in, extra_out, grad_extra_out, grad_extra_in;
  std::vector<int> values, gradients;  // by op boundary i (0..n): the forward value / its gradient, -1 if none
  // By op: the buffer holding the gradient of the channel a make_extra_output writes (what its readers'
  // backwards write or pass through, and its own backward reads); -1 for other ops and channels unread.
  std::vector<int> channel_grads;
  // The saved set: ids of the buffers a training forward leaves for the backward (in the saved block, or
  // the caller's forward tensors). "Saved" names four things, each its own word: Storage::saved_block (the
  // memory), BufferRole::saved_context (an op's (op, key) context), Builder::saved_context (its lookup),
  // this set; jf_program_info.saved lists the saved block's tensors (the C ABI's name, unchanged).
  std::vector<int> saved_set() const;
  // Backward: a caller's gradient (grad_input or a parameter's grad) the program may write in place over
  // a saved-block tensor of the same bytes, which it reads only to write that gradient (the chunked LM
  // head's backward scales the dx and dW its forward computed). The host may pass the gradient as that
  // part of the saved buffer, so the backward allocates nothing (jf_program_grad_aliases); the saved
  // buffer then holds gradients, not context, and serves no second backward.
  struct GradAlias {
    int grad = -1;   // the caller's gradient buffer
    int saved = -1;  // the saved-block buffer it may occupy
  };
  std::vector<GradAlias> grad_aliases;

  const Buffer& buffer(int id) const { return buffers.at(static_cast<size_t>(id)); }
  bool has_comm() const;  // any comm step, either direction
  int find(BufferRole role, int op, const std::string& name) const;  // -1 if absent
};

// The device model a program is laid out for: grids of persistent kernels and the partial-sum buffers
// they size depend on the SM count and on each kernel's occupancy.
struct DeviceModel {
  std::string arch = "sm_90a";
  int sm_count = 132;
  bool estimated = true;  // no GPU: occupancy estimated from the block size
};

// Every distinct kernel (spec + cache metadata) a program launches, once however many groups share it:
// what prepare loads and warmup compiles. One source (one NVRTC program, one cache entry, one module) holds
// every variant a launch may select.
std::vector<std::pair<codegen::KernelSpec, nlohmann::json>> program_kernels(const Program& p);

// A call's parameters (and their gradients) are passed by slot: op o's j-th parameter (its ops::Op::params
// order) is at slot param_slot(ops, o, name) = (parameters of the ops before o) + j. A flat array built per
// call by the C ABI, read by the prepared program's bindings (Prepared::params).
int param_slot(const std::vector<ops::Op>& ops, int op, const std::string& name);  // -1: no such parameter
size_t param_slot_count(const std::vector<ops::Op>& ops);

// The JSON and text forms `jitfuse explain --program` prints.
nlohmann::json program_json(const Program& p, double bandwidth_gbs);
std::string program_text(const Program& p, double bandwidth_gbs);

}  // namespace jitfuse::exec
