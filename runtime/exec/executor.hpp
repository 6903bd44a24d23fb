// Running a Program: prepare (compile, load, lay out) once, then forward (leaving the saved context) and
// backward (reading it) as loops over steps on the caller's stream: bind buffer ids to pointers, launch.
// One arena allocation per call and one saved block per training forward; no host synchronisation.
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
using ParamMap = std::map<Key, const void*>;
using GradMap = std::map<Key, void*>;

// The device buffers of a quantize op's FP8 recipe state (owned by the sequence, kept across calls).
struct Fp8State {
  float* scale = nullptr;      // [1] the factor applied before the cast
  float* scale_inv = nullptr;  // [1] dequantizes the last forward's output
  float* history = nullptr;    // [len] amax history, newest first (fp8_current: len 1, this call's amax)
  int len = 0;
};

// A program ready to run on one device: every kernel variant loaded, launch shapes from real occupancy.
struct Prepared {
  std::shared_ptr<Program> program;
  cuda::DeviceInfo device;
  Target target;
  std::shared_ptr<const Prepared> reference;  // JITFUSE_VERIFY: the unfused program of the same ops
};

struct Runtime {  // what a context lends to programs
  KernelLibrary* kernels = nullptr;
  cuda::Blas* blas = nullptr;
  Allocator allocator;
  VerifyLog* verify = nullptr;  // JITFUSE_VERIFY: where shadow runs report
};

struct ForwardArgs {
  const void* input = nullptr;
  std::vector<const void*> extra_in;
  void* output = nullptr;
  std::vector<void*> extra_out;
  uint64_t rng_offset = 0;
  CUstream stream = nullptr;
  std::map<int, Fp8State> fp8;  // by quantize op index (FP8 recipes)
};

struct BackwardArgs {
  const void* grad_output = nullptr;
  std::vector<const void*> grad_extra_out;
  void* grad_input = nullptr;
  std::vector<void*> grad_extra_in;
  CUstream stream = nullptr;
};

// What a training forward leaves for its backward: the saved block (freed on release) and the pointers of
// the forward-side buffers the backward reads (saved inputs alias the caller's tensors).
struct SavedContext {
  std::shared_ptr<const Prepared> prepared;
  void* block = nullptr;
  size_t bytes = 0;
  std::vector<void*> ptrs;  // by buffer id; forward-side entries only
  uint64_t rng_offset = 0;
  Allocator allocator;
  std::shared_ptr<Shadow> shadow;  // JITFUSE_VERIFY: the unfused run's memory, for the backward's comparison
  bool released = false;
};

// Compiles (in parallel, through the cache) and loads every kernel variant, then lays the program out for
// the current device. Everything that cannot happen in a launch path happens here.
std::shared_ptr<const Prepared> prepare_program(std::shared_ptr<Program> program, Runtime& rt);

void run_forward(const std::shared_ptr<const Prepared>& pp, Runtime& rt, const ParamMap& params,
                 const ForwardArgs& args, SavedContext* saved);
void run_backward(const Prepared& pp, Runtime& rt, const ParamMap& params, const GradMap& grads,
                  const SavedContext& saved, const BackwardArgs& args);
void release_saved(SavedContext& saved, CUstream stream);

// Runs `steps` with buffer pointers `ptr`; `hook(g, true)` (if given) before the first step of each group g
// and `hook(g, false)` after its last.
using GroupHook = std::function<void(int group, bool before)>;
void run_steps(const Prepared& pp, Runtime& rt, const std::vector<Step>& steps, const std::vector<void*>& ptr,
               uint64_t rng_offset, CUstream stream, const GroupHook& hook = {});

}  // namespace jitfuse::exec
