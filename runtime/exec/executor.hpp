// Running a Plan: forward (saving each op's context), backward (reading it), on the caller's stream,
// with memory from the caller's stream-ordered allocator and no host synchronisation.
#pragma once
#include <cuda.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cuda/cublaslt.hpp"
#include "cuda/driver.hpp"
#include "exec/kernels.hpp"
#include "fuser/plan.hpp"
#include "ops/recipe.hpp"

namespace jitfuse::exec {

struct Allocator {
  void* (*alloc)(size_t bytes, CUstream stream, void* user) = nullptr;  // null: cuMemAllocAsync
  void (*free)(void* ptr, size_t bytes, CUstream stream, void* user) = nullptr;
  void* user = nullptr;
};

using Key = std::pair<int, std::string>;  // (op index, name)

struct SavedContext {
  std::map<Key, void*> tensors;                  // "input", "output", "mean", "rstd", "mask"
  std::vector<std::pair<void*, size_t>> owned;   // freed by release()
  uint64_t rng_offset = 0;
  Allocator allocator;
  std::shared_ptr<const struct CompiledPlan> plan;
  bool released = false;
};

// The device buffers of a quantize op's FP8 recipe state (owned by the sequence, kept across calls).
struct Fp8State {
  float* scale = nullptr;      // [1] the factor applied before the cast
  float* scale_inv = nullptr;  // [1] dequantizes the last forward's output
  float* history = nullptr;    // [len] amax history, newest first (fp8_current: len 1, this call's amax)
  int len = 0;
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

// One generated kernel of a plan: its spec, plus the vector and scalar variants loaded on demand.
struct KernelStep {
  codegen::KernelSpec spec;  // spec.vec = what the shape allows
  nlohmann::json meta;
  const LoadedKernel* vec = nullptr;
  const LoadedKernel* scalar = nullptr;
};

struct GroupExec {
  fuser::Group group;
  int gemm_ops = 0;                    // leading ops run by cuBLASLt (0: none)
  std::unique_ptr<KernelStep> kernel;  // the generated part ([begin + gemm_ops, end)), if any
  std::unique_ptr<KernelStep> amax_pass;  // fp8_current: the same chain reducing amax(output) first
  // The group's generated kernels in launch order.
  std::vector<KernelStep*> steps() const;
};

struct CompiledPlan {
  std::vector<ops::Op> ops;
  fuser::Plan plan;
  ops::Recipe recipe;
  bool training = true;
  cuda::DeviceInfo device;
  Target target;
  std::vector<GroupExec> fwd, bwd;
  mutable std::mutex mu;  // guards lazy loading of kernel variants
};

struct Runtime {  // what a context lends to plans
  KernelLibrary* kernels = nullptr;
  cuda::Blas* blas = nullptr;
  Allocator allocator;
};

// Builds the executable form of `plan` and compiles/loads its kernels (vector variants eagerly).
std::shared_ptr<CompiledPlan> compile_plan(std::vector<ops::Op> ops, fuser::Plan plan, const ops::Recipe& recipe,
                                           bool training, const std::string& sequence_name, Runtime& rt);

// The specs of every kernel a plan needs (for warmup and codegen; no GPU needed).
std::vector<std::pair<codegen::KernelSpec, nlohmann::json>> plan_kernel_specs(const std::vector<ops::Op>& ops,
                                                                              const fuser::Plan& plan,
                                                                              const ops::Recipe& recipe, bool training,
                                                                              const std::string& sequence_name);

using ParamMap = std::map<Key, const void*>;
using GradMap = std::map<Key, void*>;

void run_forward(const CompiledPlan& cp, Runtime& rt, const ParamMap& params, const ForwardArgs& args,
                 SavedContext* saved);
void run_backward(const CompiledPlan& cp, Runtime& rt, const ParamMap& params, const GradMap& grads,
                  SavedContext& saved, const BackwardArgs& args);
void release_saved(SavedContext& saved, CUstream stream);

}  // namespace jitfuse::exec
