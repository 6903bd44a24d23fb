// Stage 5 of 5 (Sequence -> Plan -> Program -> Prepared -> call; docs/architecture.md): running a Prepared
// program: forward (leaving the saved context) and backward (reading it) as loops over steps on the
// caller's stream: bind buffer ids to pointers, launch.
// Memory is the host's (saved block, workspace) or one allocation per call through the allocator; no host
// synchronisation, no compile, no module load (but a misaligned tensor's first call loading a kernel's
// scalar fallback): a prepared program's calls can be captured in a CUDA graph.
#pragma once
#include <cuda.h>

#include <climits>
#include <functional>
#include <memory>
#include <vector>

#include "exec/run/prepare.hpp"

namespace jitfuse::exec {

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
};

// Watches a call from above the executor (JITFUSE_VERIFY's shadow run, verify.hpp, which the API layer
// attaches): the call's buffer pointers once bound, then each group before and after its steps. The
// executor knows no more of it than this.
class CallObserver {
 public:
  virtual ~CallObserver() = default;
  virtual void bound(const std::vector<void*>& ptr) = 0;
  virtual void group(int g, bool before, const std::vector<void*>& ptr, CUstream stream) = 0;
};

ForwardResult run_forward(const std::shared_ptr<const Prepared>& pp, Runtime& rt, const ForwardArgs& args,
                          CallObserver* observer = nullptr);
void run_backward(const Prepared& pp, Runtime& rt, const BackwardArgs& args, CallObserver* observer = nullptr);
void free_block(const Allocator& a, CUstream stream, void* p, size_t bytes);

// Which steps of a pass run_steps runs: those of groups [group_begin, group_end), the weight casts left out
// when the weights did not change.
struct StepFilter {
  int group_begin = 0, group_end = INT_MAX;
  bool skip_weight_casts = false;
};
// Runs the forward (or backward) steps of `pp` with buffer pointers `ptr`; `hook(g, true)` (if given)
// before the first step of each group g and `hook(g, false)` after its last.
using GroupHook = std::function<void(int group, bool before)>;
void run_steps(const Prepared& pp, Runtime& rt, bool forward, const std::vector<void*>& ptr, CUstream stream,
               const GroupHook& hook = {}, const StepFilter& filter = {});

}  // namespace jitfuse::exec
