// From KernelSpec to a launchable CUfunction: codegen, stitching the templates into one
// self-contained source (so the cache key covers template contents), the kernel cache (memory ->
// disk -> NVRTC), and module loading per device.
#pragma once
#include <cuda.h>

#include <array>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cache/kernel_cache.hpp"
#include "jitfuse/codegen/kernel_spec.hpp"

namespace jitfuse::exec {

// Built-in templates (embedded) plus user templates from rule directories.
class TemplateStore {
 public:
  TemplateStore();  // the embedded templates/
  void add(const std::string& name, const std::string& content);
  const std::string& get(const std::string& name) const;  // throws naming the missing template
  // Replaces each `#include "x"` of `source` by x's text (once per file, recursively).
  std::string stitch(const std::string& source) const;
  // Changes whenever a template's text does: what a generated source stitches to is fixed within one.
  uint64_t generation() const { return generation_; }

 private:
  std::map<std::string, std::string> files_;
  uint64_t generation_ = 0;
};

struct Target {
  std::string arch;  // "sm_90a": what the cache key and metadata record
  std::vector<std::string> options;
  std::string nvrtc_version;
};
Target target_for_arch(const std::string& arch);  // CUBIN if NVRTC knows the arch, else PTX

// Which variants of its kernels a program compiles and loads when it is prepared (or warmed up):
// `needed`, the one its plan launches (the vector variant where the shape allows it, else the scalar one),
// the scalar fallback then compiled by the first call that selects it (a misaligned tensor); `all`, every
// variant, so that no call ever compiles (JITFUSE_ALL_VARIANTS=1, `jitfuse warmup --all-variants`).
enum class Variants { needed, all };
// The variants of a kernel with this spec that `v` asks for: true = vector, false = scalar.
std::vector<bool> variants_of(const codegen::KernelSpec& spec, Variants v);

// One variant of a kernel loaded on a device: its module's entry point, with the finalize and FP8 update
// kernels of the same module (each variant's module has its own).
struct LoadedKernel {
  // Of the first spec loaded: a kernel is shared by every group that generates its source, so gen.args[].op
  // are that group's ops. Steps bind their own arguments (KernelStep::args).
  codegen::Generated gen;
  std::string key;
  bool vector = true;      // which entry point `fn` is (gen.entry(vector))
  CUfunction fn = nullptr;
  int blocks_per_sm = 1;  // resident blocks of `fn` per SM at its block size (the driver's occupancy)
  // By position in gen.finalize (a source's list is the same for every group sharing it); the gradients
  // of one launch share one function.
  std::vector<CUfunction> finalize;
  CUfunction fp8_update = nullptr;             // fp8_delayed: the recipe-state update after the kernel
};

class KernelLibrary {
 public:
  // `compile`: what compiler() hands the cache; empty: NVRTC (tests count compiles with their own).
  KernelLibrary(cache::KernelCache& cache, const TemplateStore& templates, cache::CompileFn compile = {});
  ~KernelLibrary();

  // The cache request of one variant of a kernel (vector: the source as it is; scalar: with
  // codegen::kScalarOption): its own NVRTC program, cache key and entry.
  cache::KernelRequest request(const codegen::KernelSpec& spec, const Target& target, const nlohmann::json& meta,
                               bool vector) const;
  // The same for a kernel already generated (codegen::generate(spec)).
  cache::KernelRequest request(const codegen::Generated& gen, const codegen::KernelSpec& spec,
                               const Target& target, const nlohmann::json& meta, bool vector) const;
  // The compile function handed to the cache.
  cache::CompileFn compiler() const;
  // Compiles the `variants` of every distinct kernel of `specs` not yet in the cache, once, in parallel on a
  // bounded pool (no GPU needed).
  void prefetch(const std::vector<std::pair<codegen::KernelSpec, nlohmann::json>>& specs, const Target& target,
                unsigned threads, Variants variants);
  // The cache entry of one variant of `gen` (= generate(spec)): memory -> disk -> NVRTC. What load does
  // before the driver.
  std::shared_ptr<const cache::Entry> entry(const codegen::Generated& gen, const codegen::KernelSpec& spec,
                                            const Target& target, const nlohmann::json& meta, bool vector);
  // Compiles (through the cache) and loads on the current device the module of one variant of `gen`
  // (= generate(spec)). Thread-safe; memoized per source, variant, target and device, so groups (and
  // sequences) generating the same source share one module, and a kernel shared by many layers costs a map
  // lookup (no stitching, no hashing). Loading one variant never compiles the other.
  const LoadedKernel& load(const codegen::Generated& gen, const codegen::KernelSpec& spec, const Target& target,
                           const nlohmann::json& meta, bool vector);

 private:
  struct Module {  // one variant's
    CUmodule mod = nullptr;
    std::unique_ptr<LoadedKernel> kernel;
  };
  cache::KernelCache& cache_;
  const TemplateStore& templates_;
  cache::CompileFn compile_;
  std::mutex mu_;
  // target options, template generation @ device -> generated source (before stitching) -> each variant's
  // module (index 1: vector, 0: scalar)
  std::map<std::string, std::map<std::string, std::array<Module, 2>, std::less<>>> modules_;
};

}  // namespace jitfuse::exec
