// Running a Program: prepare (compile, load, lay out) once, then forward (leaving the saved context) and
// backward (reading it) as loops over steps on the caller's stream: bind buffer ids to pointers, launch.
// Memory is the host's (saved block, workspace) or one allocation per call through the allocator; no host
// synchronisation, no compile, no module load (but a misaligned tensor's first call loading a kernel's
// scalar fallback): a prepared program's calls can be captured in a CUDA graph.
#pragma once
#include <cuda.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cuda/cublaslt.hpp"
#include "cuda/driver.hpp"
#include "exec/kernels.hpp"
#include "exec/program.hpp"
#include "exec/verify.hpp"

namespace jitfuse::exec {

struct Allocator {
  void* (*alloc)(size_t bytes, CUstream stream, void* user) = nullptr;  // null: jitfuse's stream-ordered pool
  void (*free)(void* ptr, size_t bytes, CUstream stream, void* user) = nullptr;
  void* user = nullptr;
};

using Key = std::pair<int, std::string>;  // (op index, name)

// A call's parameters (and their gradients) are passed by slot: op o's j-th parameter (its ops::Op::params
// order) is at slot param_slot(ops, o, name) = (parameters of the ops before o) + j. A flat array built per
// call by the C ABI, read by the prepared program's bindings (Prepared::params).
int param_slot(const std::vector<ops::Op>& ops, int op, const std::string& name);  // -1: no such parameter
size_t param_slot_count(const std::vector<ops::Op>& ops);

// The device buffers of one FP8 recipe state (owned by the sequence, kept across calls): a quantize op's
// (key (op, "")) or one operand of an FP8 linear's GEMMs (key (op, "input" | "weight" | "grad_output")).
struct Fp8State {
  float* scale = nullptr;      // [1] the factor applied before the cast
  float* scale_inv = nullptr;  // [1] dequantizes the last cast (an operand's GEMM reads its copy's own)
  float* history = nullptr;    // [len] amax history, newest first (fp8_current: len 1, this call's amax)
  int len = 0;
};
using Fp8StateMap = std::map<Key, Fp8State>;
// Storage::persistent buffers by (op, key): the FP8 weight copies a sequence keeps across calls.
using PersistentMap = std::map<Key, void*>;

// A program ready to run on one device: the kernel variants its plan launches loaded (all of them with
// Variants::all), launch shapes from real occupancy.
struct Prepared {
  std::shared_ptr<Program> program;
  cuda::DeviceInfo device;
  Target target;
  std::shared_ptr<const Prepared> reference;  // JITFUSE_VERIFY: the unfused program of the same ops
  // What a call binds without looking anything up (prepare_program, bind_sequence_state):
  struct SlotBind {
    int buffer = -1;
    int slot = -1;  // -1: the program's parameter is none the ops declare (a call then fails, naming it)
  };
  std::vector<SlotBind> params, grads;  // param / grad buffers <- the call's parameter slots
  // FP8 recipe state and persistent buffers: fixed per (sequence, device), so bound once.
  std::vector<std::pair<int, void*>> sequence_state;
};

// Resolves the program's recipe-state and persistent buffers against the sequence's (throws internal if
// one is missing): what every call of `pp` then binds. Before `pp` is handed to any call.
void bind_sequence_state(Prepared& pp, const Fp8StateMap& fp8, const PersistentMap& persistent);

struct Runtime {  // what a context lends to programs
  KernelLibrary* kernels = nullptr;
  cuda::Blas* blas = nullptr;
  Allocator allocator;
  VerifyLog* verify = nullptr;  // JITFUSE_VERIFY: where shadow runs report
  // What prepare compiles and loads: the variants the plan launches (a misaligned tensor's call then loads
  // the scalar fallback), or all of them (JITFUSE_ALL_VARIANTS=1: no call ever compiles).
  Variants variants = Variants::needed;
};

// Where a forward's dropout draws from: the host's device state {seed, offset} (read when the forward
// runs: graph-safe), or values given with the call.
struct RngSource {
  const uint64_t* state = nullptr;
  uint64_t seed = 0, offset = 0;
};

struct ForwardArgs {
  const void* input = nullptr;
  std::vector<const void*> extra_in;
  void* output = nullptr;
  std::vector<void*> extra_out;
  std::vector<const void*> params;  // by slot (param_slot)
  RngSource rng;
  bool training = false;    // write the saved block
  void* saved = nullptr;    // the host's saved block (training), or null: allocated (ForwardResult)
  void* workspace = nullptr;  // the host's arena, or null: allocated and freed stream-ordered
  CUstream stream = nullptr;
  // FP8 recipes: the weights are the ones of the last forward that cast them (no optimizer step since):
  // their casts are skipped and the persistent FP8 copies reused. The host's promise; the sequence turns
  // it off by itself while a copy was never written or a weight pointer moved.
  bool weights_unchanged = false;
};

// The backward of a forward: that forward's tensors and saved block (everything it left lives there or
// in the caller's tensors), and the gradients.
struct BackwardArgs {
  const void* input = nullptr;
  std::vector<const void*> extra_in;
  const void* output = nullptr;
  std::vector<const void*> extra_out;
  std::vector<const void*> params;  // by slot (param_slot)
  std::vector<void*> grads;         // by the slot of their parameter
  const void* saved = nullptr;
  const void* grad_output = nullptr;
  std::vector<const void*> grad_extra_out;
  void* grad_input = nullptr;
  std::vector<void*> grad_extra_in;
  void* workspace = nullptr;
  CUstream stream = nullptr;
};

// A saved block the forward allocated through the allocator (the host frees it with free_block).
struct ForwardResult {
  void* saved = nullptr;
  size_t saved_bytes = 0;
  std::shared_ptr<Shadow> shadow;  // JITFUSE_VERIFY: the unfused run's memory, for the backward's comparison
};

// Compiles (in parallel, through the cache) and loads the kernel variants `rt.variants` asks for, looks up
// every GEMM's cuBLASLt algorithm, then lays the program out for the current device. Everything a call
// needs happens here, except the scalar fallback of a vector-capable kernel under Variants::needed, which
// the first call with a misaligned tensor loads (inside a CUDA-graph capture too).
std::shared_ptr<const Prepared> prepare_program(std::shared_ptr<Program> program, Runtime& rt);

ForwardResult run_forward(const std::shared_ptr<const Prepared>& pp, Runtime& rt, const ForwardArgs& args);
void run_backward(const Prepared& pp, Runtime& rt, const BackwardArgs& args, Shadow* shadow);
void free_block(const Allocator& a, CUstream stream, void* p, size_t bytes);

// Runs `steps` with buffer pointers `ptr`; `hook(g, true)` (if given) before the first step of each group g
// and `hook(g, false)` after its last. skip_weight_casts: leave out the steps that cast weights to FP8.
using GroupHook = std::function<void(int group, bool before)>;
void run_steps(const Prepared& pp, Runtime& rt, const std::vector<Step>& steps, const std::vector<void*>& ptr,
               CUstream stream, const GroupHook& hook = {}, bool skip_weight_casts = false);

}  // namespace jitfuse::exec
