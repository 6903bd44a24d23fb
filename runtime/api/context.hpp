// The objects behind the C ABI's handles: a Context (rules, templates, kernel cache, cuBLASLt,
// allocator) and a Sequence (parsed ops, recipe, programs prepared per shape). Parameters are per call.
#pragma once
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>

#include "cache/kernel_cache.hpp"
#include "cuda/nccl.hpp"
#include "exec/run/executor.hpp"
#include "exec/run/fp8/recipe_state.hpp"
#include "exec/run/kernels.hpp"
#include "exec/run/verify.hpp"
#include "jitfuse/jitfuse.h"
#include "ops/sequence.hpp"
#include "rules/rule.hpp"

namespace jitfuse::api {

class Context {
 public:
  Context();  // built-in rules, then JITFUSE_RULE_PATH
  ~Context();
  std::vector<rules::LoadError> load_rules(const std::string& path);
  rules::RuleSet rules_snapshot() const;
  const ops::Registry& registry() const { return rules_.registry(); }
  uint64_t rules_generation() const;
  exec::Runtime& runtime();  // creates cuBLASLt and the kernel library on first use (needs a GPU)
  exec::KernelLibrary& kernels() { return *kernels_; }
  exec::TemplateStore& templates() { return templates_; }
  cache::KernelCache& cache() { return *cache_; }
  void set_allocator(const exec::Allocator& a);
  std::mutex& mutex() { return mu_; }
  // JITFUSE_VERIFY=1: what the shadow runs of this context's sequences found (null when off).
  exec::VerifyLog* verify_log() { return verify_.get(); }

 private:
  void sync_templates();
  mutable std::mutex mu_;
  rules::RuleSet rules_;
  exec::TemplateStore templates_;
  std::unique_ptr<cache::KernelCache> cache_;
  std::unique_ptr<exec::KernelLibrary> kernels_;
  std::unique_ptr<cuda::Blas> blas_;
  exec::Runtime runtime_;
  std::unique_ptr<exec::VerifyLog> verify_;
};

// What jf_sequence_info hands out for one prepared (shape, training): arrays and strings that live as long
// as the sequence.
struct ProgramInfo {
  std::deque<std::string> names;  // backing store of the infos' name pointers (a deque: they never move)
  std::vector<jf_tensor_info> outputs, params, saved;
  std::vector<jf_grad_alias> grad_aliases;  // jf_program_grad_aliases
  jf_program_info info{};
};

class Sequence {
 public:
  Sequence(Context& ctx, ops::SequenceDef def, ops::Recipe recipe);
  ~Sequence();
  Sequence(const Sequence&) = delete;
  Sequence& operator=(const Sequence&) = delete;
  // The prepared program for an input shape (cached per shape, training flag, rule-set generation and
  // device). Preparing compiles and loads, which a CUDA-graph capture must not see: when `stream` is
  // capturing and the shape is not prepared yet, this fails with Status::not_prepared and touches nothing.
  std::shared_ptr<const exec::Prepared> prepared_for(const ops::Shape& input, bool training, CUstream stream);
  // The Program for `ops` (shapes inferred) on SM version `arch`, planned with the context's rules: what
  // prepare runs and explain prints. Needs no GPU.
  std::shared_ptr<const exec::Program> compile(std::vector<ops::Op> ops, bool training, int arch,
                                               bool disable_fusion) const;
  // The ops with shapes inferred for an input shape (cached; needs no GPU): what a call's arguments are
  // checked against before anything is prepared.
  std::shared_ptr<const std::vector<ops::Op>> ops_for(const ops::Shape& input);
  // jf_sequence_info's answer for a prepared program (built once per program).
  const jf_program_info& info(const std::shared_ptr<const exec::Prepared>& pp);
  const ProgramInfo& program_info(const std::shared_ptr<const exec::Prepared>& pp);  // info and grad aliases

  // Tensor parallelism: the communicator of the sequence's group (jf_sequence_set_comm), fixed before the
  // first prepare; its world size and rank are what shapes are inferred for.
  void set_comm(const std::string& group, std::shared_ptr<cuda::Communicator> comm);
  ops::Parallel parallel() const;

  Context& ctx;
  ops::SequenceDef def;
  ops::Recipe recipe;
  std::string explain_buffer;
  // jf_sequence_wiring's answer: made once with the sequence (immutable, so any thread may read it).
  std::string wiring;

  // The output tensor's dtype: E4M3 when an FP8 recipe ends the sequence in quantize, else the recipe's.
  ops::DType output_dtype() const;
  // FP8 recipes: the FP8 state on the current device, allocated and initialised on first use (uploaded on
  // `stream`, synchronised: a one-time setup; nullptr: the legacy stream, for the C ABI's accessors).
  exec::fp8::RecipeState& fp8_state(CUstream stream = nullptr);

  // JITFUSE_VERIFY: a training forward's shadow run, kept (by its saved block) for the backward.
  void keep_shadow(const void* saved, std::shared_ptr<exec::Shadow> shadow);
  std::shared_ptr<exec::Shadow> take_shadow(const void* saved);

 private:
  // Fails with Status::not_prepared when `stream` is capturing a CUDA graph (prepare compiles and loads).
  void refuse_inside_capture(CUstream stream, const ops::Shape& input, bool training) const;
  std::map<int, std::unique_ptr<exec::fp8::RecipeState>> fp8_;  // device ordinal -> FP8 state
  std::shared_ptr<cuda::Communicator> comm_;
  mutable std::mutex mu_;
  // What a prepared program is for: input shape, training, rule-set generation, the fusion kill switch,
  // device ordinal (a struct, not a formatted string: looked up on every call).
  struct ProgramKey {
    ops::Shape shape;
    bool training = false;
    uint64_t generation = 0;
    bool fusion_disabled = false;
    int device = 0;
    bool operator<(const ProgramKey& o) const {
      return std::tie(shape, training, generation, fusion_disabled, device) <
             std::tie(o.shape, o.training, o.generation, o.fusion_disabled, o.device);
    }
  };
  std::map<ProgramKey, std::shared_ptr<const exec::Prepared>> programs_;
  std::map<const exec::Prepared*, std::unique_ptr<ProgramInfo>> infos_;
  std::map<const void*, std::shared_ptr<exec::Shadow>> shadows_;
  std::map<ops::Shape, std::shared_ptr<const std::vector<ops::Op>>> ops_;
};

}  // namespace jitfuse::api
