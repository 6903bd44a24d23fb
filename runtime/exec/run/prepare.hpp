// Stage 4 of 5 (Sequence -> Plan -> Program -> Prepared -> call; docs/architecture.md): a Prepared is one
// Program made ready on one device — the kernel variants its plan launches loaded, launch shapes and the
// memory layout from their real occupancy, cuBLASLt's algorithm for every GEMM, the bindings of parameters
// and sequence state. Built by one `prepare`, then shared read-only by every call (any thread); the only
// thing a call may add is the lazily loaded scalar variant of a kernel step (LateVariant).
#pragma once
#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "cuda/cublaslt.hpp"
#include "cuda/driver.hpp"
#include "cuda/nccl.hpp"
#include "exec/run/fp8/recipe_state.hpp"
#include "exec/run/kernels.hpp"
#include "exec/lower/layout.hpp"
#include "exec/ir/program.hpp"

namespace jitfuse::exec {

struct VerifyLog;  // verify.hpp: JITFUSE_VERIFY's findings, a layer above the executor

struct Allocator {
  void* (*alloc)(size_t bytes, CUstream stream, void* user) = nullptr;  // null: jitfuse's stream-ordered pool
  void (*free)(void* ptr, size_t bytes, CUstream stream, void* user) = nullptr;
  void* user = nullptr;
};

struct Runtime {  // what a context lends to programs
  KernelLibrary* kernels = nullptr;
  cuda::Blas* blas = nullptr;
  Allocator allocator;
  VerifyLog* verify = nullptr;  // JITFUSE_VERIFY: where shadow runs report
  // What prepare compiles and loads: the variants the plan launches (a misaligned tensor's call then loads
  // the scalar fallback), or all of them (JITFUSE_ALL_VARIANTS=1: no call ever compiles).
  Variants variants = Variants::needed;
};

// One loaded variant of a kernel step and its launch on the device.
struct Variant {
  const LoadedKernel* kernel = nullptr;
  KernelLaunch launch;
};

// The scalar variant of a vector-capable step prepared without it (Variants::needed): the first call that
// selects it (a misaligned tensor) compiles or loads it under the lock and publishes it; later calls read
// the pointer. A `make` that throws publishes nothing, so the next call tries again.
class LateVariant {
 public:
  const Variant& get(const std::function<Variant()>& make) const;
  const Variant* ready() const { return ready_.load(std::memory_order_acquire); }

 private:
  mutable std::mutex mu_;
  mutable std::atomic<const Variant*> ready_{nullptr};
  mutable std::unique_ptr<Variant> owned_;
};

// What prepare resolved for one step of the program (same index as the Program's step).
struct PreparedStep {
  Variant vec, scalar;                // kernel steps: the variants loaded (kernel null: not loaded)
  std::unique_ptr<LateVariant> late;  // kernel steps whose scalar variant a call may load later
  // GEMM steps: cuBLASLt's algorithm for 256-byte aligned operands (a call with a less aligned tensor looks
  // up its own), and whether the BGRADB fallback is taken (prepare found no algorithm with the epilogue).
  std::shared_ptr<const cuda::GemmPlan> plan;
  bool use_fallback = false;
};

// The side stream of a program whose collectives are pipelined with GEMMs (docs/parallel.md), and one event
// per step of each pass (recorded after the step, waited on by the steps that name it and at the group's
// end) plus the fork event a group's first side-stream step waits on. Calls of such a program come from one
// thread at a time, as NCCL requires of a communicator anyway.
struct SideStream {
  CUstream stream = nullptr;
  std::vector<CUevent> forward, backward;
  CUevent fork = nullptr;
  SideStream() = default;
  SideStream(const SideStream&) = delete;
  SideStream& operator=(const SideStream&) = delete;
  ~SideStream();
};

// A parameter or gradient buffer and the slot of the call's arrays it is bound from.
struct SlotBind {
  int buffer = -1;
  int slot = -1;  // -1: the program's parameter is none the ops declare (a call then fails, naming it)
};

struct Prepared {
  std::shared_ptr<const Program> program;
  cuda::DeviceInfo device;
  Target target;
  Layout layout;  // for this device: what a call places its memory by and what jf_sequence_info reports
  std::vector<PreparedStep> forward, backward;
  std::vector<SlotBind> params, grads;  // param / grad buffers <- the call's parameter slots
  // FP8 recipe state and persistent buffers: fixed per (sequence, device), so bound once.
  std::vector<std::pair<int, void*>> sequence_state;
  fp8::WeightCopies weight_copies;  // FP8: the weight copies its forward casts, by parameter slot
  std::shared_ptr<const Prepared> reference;  // JITFUSE_VERIFY: the unfused program of the same ops
  std::shared_ptr<cuda::Communicator> comm;  // the program's comm steps run on it (null: it has none)
  // The communicator's jf_peers table (a kernel's by-value parameter) when the program's one-shot all-reduce
  // kernels run (Step::peer_path 1); null: their NCCL path runs (-1).
  const void* peers = nullptr;
  // The staging of the program's copy-engine collectives (Collective::peer_push ...; null: none, or their
  // NCCL path runs).
  std::shared_ptr<const cuda::PeerStaging> staging;
  // Which of a two-way group's paths runs (Step::peer_path): 1 when every peer resource the program's peer
  // steps need was made (the table, the staging), else -1 (NCCL).
  int peer_path = -1;
  std::shared_ptr<SideStream> side;          // null unless a step runs on the side stream
  CUmemoryPool temp_pool = nullptr;  // the device's pool for calls with the default allocator (no lookup)

  const std::vector<PreparedStep>& steps(bool fwd) const { return fwd ? forward : backward; }
};

// What prepare binds besides the program: the sequence's state buffers (FP8 recipe state and weight copies,
// by buffer id, and the copies' parameter slots: fp8::RecipeState::bind) and the unfused reference program of JITFUSE_VERIFY.
struct PrepareWith {
  fp8::Binding sequence_state;
  std::shared_ptr<const Prepared> reference;
  std::shared_ptr<cuda::Communicator> comm;  // the sequence's communicator (jf_sequence_set_comm)
};

// Compiles (in parallel, through the cache) and loads the kernel variants `rt.variants` asks for, looks up
// every GEMM's cuBLASLt algorithm, then lays the program out for the current device. Everything a call
// needs happens here, except the scalar fallback of a vector-capable kernel under Variants::needed, which
// the first call with a misaligned tensor loads (inside a CUDA-graph capture too).
std::shared_ptr<const Prepared> prepare(std::shared_ptr<const Program> program, Runtime& rt, PrepareWith with = {});

}  // namespace jitfuse::exec
