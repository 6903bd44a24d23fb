// From KernelSpec to a launchable CUfunction: codegen, stitching the templates into one
// self-contained source (so the cache key covers template contents), the kernel cache (memory ->
// disk -> NVRTC), and module loading per device.
#pragma once
#include <cuda.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>

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

 private:
  std::map<std::string, std::string> files_;
};

struct Target {
  std::string arch;  // "sm_90a": what the cache key and metadata record
  std::vector<std::string> options;
  std::string nvrtc_version;
};
Target target_for_arch(const std::string& arch);  // CUBIN if NVRTC knows the arch, else PTX

struct LoadedKernel {
  // Of the first spec loaded: a kernel is shared by every group that generates its source, so gen.args[].op
  // are that group's ops. Steps bind their own arguments (KernelStep::args).
  codegen::Generated gen;
  std::string key;
  CUfunction fn = nullptr;
  int blocks_per_sm = 1;  // resident blocks of `fn` per SM at its block size (the driver's occupancy)
  std::map<std::string, CUfunction> finalize;  // finalize kernel name (Finalize::kernel) -> kernel
  CUfunction fp8_update = nullptr;             // fp8_delayed: the recipe-state update after the kernel
};

class KernelLibrary {
 public:
  KernelLibrary(cache::KernelCache& cache, const TemplateStore& templates);
  ~KernelLibrary();

  cache::KernelRequest request(const codegen::KernelSpec& spec, const Target& target,
                               const nlohmann::json& meta) const;
  // The compile function handed to the cache.
  cache::CompileFn compiler() const;
  // Compiles every distinct kernel of `specs` not yet in the cache, once, in parallel on a bounded pool (no GPU
  // needed).
  void prefetch(const std::vector<std::pair<codegen::KernelSpec, nlohmann::json>>& specs, const Target& target,
                unsigned threads);
  // Compiles (through the cache) and loads on the current device. Thread-safe; memoized per cache key, so
  // groups (and sequences) generating the same source share one module.
  const LoadedKernel& load(const codegen::KernelSpec& spec, const Target& target, const nlohmann::json& meta);

 private:
  cache::KernelCache& cache_;
  const TemplateStore& templates_;
  std::mutex mu_;
  std::map<std::string, std::unique_ptr<LoadedKernel>> loaded_;  // by cache key @ device
  std::map<std::string, CUmodule> modules_;
};

}  // namespace jitfuse::exec
