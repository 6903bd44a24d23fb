// The program builder that implementations lower groups with: value, parameter, saved and scratch
// buffers by role, GEMM and kernel steps. Parameters and saved context are keyed by (op, codegen::Key)
// here, once, at build time.
#pragma once
#include <map>
#include <tuple>
#include <string>
#include <utility>
#include <vector>

#include "exec/ir/program.hpp"

namespace jitfuse::exec {

using Key = codegen::Key;  // what a parameter or saved context is within its op

class Builder {
 public:
  Builder(Program& p, const std::string& sequence_name);

  const std::vector<ops::Op>& ops() const { return p_.ops; }
  const ops::Recipe& recipe() const { return p_.recipe; }
  bool training() const { return p_.training; }
  int world_size() const { return p_.world_size; }

  // Starts lowering group `gi` of the forward (or backward) pass; steps added next belong to it.
  void begin_group(bool forward, int gi, const fuser::Group& g);

  // The forward value entering op i (0: the caller's input, n: the caller's output).
  int act(int i);
  // The gradient of the value entering op i (n: the caller's grad_output, 0: the caller's grad_input).
  int grad_of(int i);
  int param(int op, codegen::Key key);
  int grad(int op, codegen::Key key);
  // The caller's extra tensors of op `op` (an add_extra_input's or make_extra_output's), by role:
  // extra_in, extra_out, grad_extra_out or grad_extra_in.
  int extra(BufferRole role, int op);
  int extra_in(int op) { return extra(BufferRole::extra_in, op); }
  int extra_out(int op) { return extra(BufferRole::extra_out, op); }
  int grad_extra_out(int op) { return extra(BufferRole::grad_extra_out, op); }
  int grad_extra_in(int op) { return extra(BufferRole::grad_extra_in, op); }
  // The gradient of the channel make_extra_output `fork` writes: what its readers' backwards write and
  // add into (ops::Op::grad_accumulate) and its own backward reads (a hidden channel's grad_extra_out).
  int channel_grad(int fork);
  // Backward: op i, the only reader of a fork's channel, passes its gradient through — dx = d_channel = dy
  // are the same buffer and no kernel runs (PyTorch's residual add costs no kernel either). False (nothing
  // done) for any other op: a caller's extra input, a channel with several readers (their sum is written).
  bool pass_through_grad(int i);
  // Op i is the identity in this direction (a comm op's other half): the value after it is the value
  // before it (forward), or the gradient before it is the one after it (backward) — one buffer, no step.
  // False (nothing done) where a caller's tensor must be written (the output, grad_input) or the buffer
  // exists already.
  bool pass_through(int i);
  // FP8 recipe state of (op, operand) (none: a quantize op's): part scale, scale_inv or history.
  int fp8_state(int op, fp8::Operand operand, fp8::Part part);
  // An FP8 copy of linear `lin`'s operand: row-major codes, the transposed codes (training;
  // -1 otherwise) and the scale_inv its cast used. Where it lives follows from the operand: the input's
  // row-major copy in the forward arena, its transposed copy and scale_inv in the saved block (the wgrad
  // reads them); the weight's in persistent storage (cast once per optimizer step); the gradient's in the
  // backward arena. Made once per (lin, tensor); `ready` says whether a kernel already writes it.
  // Under fp8_block scale_inv holds the row-major codes' block scales and col_scale_inv the transposed
  // codes' (training; both beside their codes).
  struct Fp8Operand {
    int row = -1, col = -1, scale_inv = -1, col_scale_inv = -1;
    int64_t rows = 0, cols = 0;  // the row-major copy's shape (the transposed one is [cols, rows])
    bool ready = false;
  };
  Fp8Operand& fp8_operand(int lin, fp8::Operand operand);
  int rng_state();  // the call's Philox state (Program::rng), created on first use

  // Forward: saved context (op, key) written into the saved block by a kernel or a GEMM epilogue.
  int saved_new(int op, codegen::Key key, ops::DType dtype, int64_t rows, int64_t cols, size_t bytes);
  // Forward: saved context (op, key) is the value buffer `id` (kept alive in the saved block if scratch).
  void save_alias(int op, codegen::Key key, int id);
  // Backward: the caller's gradient `grad` may be written in place over saved context (op, key), which
  // only the step writing it reads (Program::grad_aliases). Nothing recorded for a gradient that is not
  // the caller's (an internal buffer) or whose size differs.
  void alias_saved(int grad, int op, codegen::Key key);
  // Forward: what ops [b, e) of a group save at its boundaries (an op's input at b, its output at e);
  // context inside the group is written by the group's own kernels.
  void boundary_saves(int b, int e);
  void forget_saved(int op, codegen::Key key);
  // Backward: the buffer holding saved context (op, key); throws if the forward did not save it.
  int saved_context(int op, codegen::Key key) const;
  // Backward: (op, key) is provided by a buffer the backward itself computed (recompute strategies).
  void provide_saved(int op, codegen::Key key, int id);

  int temp(const std::string& name, ops::DType dtype, int64_t rows, int64_t cols, size_t bytes = 0);

  // A cuBLASLt GEMM for linear op `lin` (dims from its shapes, dtype from the recipe).
  GemmStep linear_gemm(int lin, cuda::GemmKind kind) const;
  void gemm(const GemmStep& g, const std::string& what);  // g.b2 set: as two GEMMs (split_gemm)
  // A collective on the program's communicator (docs/parallel.md).
  void comm(const CommStep& c, const std::string& what);
  // Puts the step added last on `stream` (0: the caller's, 1: the side stream) after steps `waits`.
  void place_last(int stream, std::vector<int> waits);
  // A generated kernel: `spec` over `rows` rows reading buffer `in` and writing buffer `out`.
  void kernel(const codegen::KernelSpec& spec, const nlohmann::json& meta, int in, int out, int64_t rows,
              const std::string& what);
  // The moe_dispatch whose received rows the current group runs over (strictly between the dispatch and its
  // combine, over its max_rows rows, no channel op): that dispatch's index, else -1 (KernelStep::rows_route).
  int received_rows_of(int64_t rows) const;

  // The number of steps of the current direction so far, and marking steps [from, end) as weight casts
  // (skipped by a call whose weights did not change).
  size_t steps() const { return (forward_ ? p_.forward : p_.backward).size(); }
  // Appends "; <text>" to what the pass's last step says (explain): e.g. the memory a joint strategy saves.
  void note_last(const std::string& text);
  // After the last group of a pass: the pass's batched FP8 update (fp8_delayed operand casts, FP8 GEMM
  // outputs) as its last step, which keeps their amax partials alive to the end.
  void end_pass();
  void mark_weight_casts(size_t from);
  // Marks steps [from, end) of the current pass as one of a group's two ways (Step::peer_path: 1 or -1).
  void mark_peer_path(size_t from, int path);

  // Cache metadata of a kernel that runs ops [b, group end).
  nlohmann::json kernel_meta(int b, const char* pass) const;
  const fuser::Group& group() const { return g_; }
  // The group's rule, or "(unfused)" for a single op: what step descriptions and cache metadata name.
  std::string rule_or_unfused() const { return g_.rule.empty() ? std::string("(unfused)") : g_.rule; }
  bool forward() const { return forward_; }

 private:
  void split_gemm(const GemmStep& g, const std::string& what);
  static constexpr int kNotRouted = -2;
  int channel_route(BufferRole role, const ops::Op& o);  // kNotRouted: the op's own caller tensor
  int channel_buffer(const ops::Op& fork, BufferRole role, Storage storage, const char* prefix);
  KArg bind_arg(const codegen::Arg& a, KernelStep& ks, int in, int out, fp8::Operand fp8_tensor);
  int add(Buffer b);
  int caller(BufferRole role, const std::string& name, int op, int slot, ops::DType dt, int64_t rows, int64_t cols);
  int keyed(int id, codegen::Key key);
  void touch(int id);
  size_t dtype_bytes_of(int64_t rows, int64_t cols) const;
  size_t saved_size(int op, codegen::Key key) const;

  Program& p_;
  std::string seq_;
  bool forward_ = true;
  int group_ = -1;
  fuser::Group g_;
  std::vector<int> act_, grad_;
  std::map<std::pair<int, codegen::Key>, int> params_, grads_, saved_;  // by (op, key), typed
  std::map<std::pair<int, BufferRole>, int> extra_;
  std::map<std::pair<int, fp8::Operand>, Fp8Operand> fp8_;
  Fp8UpdateStep batch_;  // the current pass's batched FP8 update, added as a step by end_pass
  void push(Step s);     // a step of the current pass, its buffers touched
  void follow_ups(const KernelStep& ks, int fp8_q, fp8::Operand fp8_tensor);  // finalize / FP8 update steps
  std::vector<int> side_buffers_;  // touched by the current group's side-stream steps: live to its end
  int side_first_ = -1;            // the current group's first side-stream step (the fork), -1: none yet
  void end_side_lifetimes();
  std::map<std::tuple<int, fp8::Operand, fp8::Part>, int> state_;
};

}  // namespace jitfuse::exec
