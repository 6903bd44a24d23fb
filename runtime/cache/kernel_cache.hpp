// The kernel cache: a thread-safe memory tier over a disk tier of self-contained entry files.
// Pure CPU: it stores CUBIN bytes; loading them into a CUDA module is exec/'s job.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace jitfuse::cache {

// One kernel to compile. Everything in the key is here; `meta` is descriptive only.
struct KernelRequest {
  std::string source;                // complete CUDA C++ source (templates already inlined)
  std::vector<std::string> options;  // NVRTC options, in the order they are passed
  std::string arch;                  // target with suffix, e.g. "sm_90a", "sm_80"
  std::string nvrtc_version;         // e.g. "13.0"
  nlohmann::json meta;               // rule, ops, recipe, dtypes, shape, kernels: NOT part of the key
  // Relative compile cost (NOT part of the key): a batch starts its costliest requests first, so that on a
  // few cores the longest compile does not start last and run alone (get_or_compile_all).
  double cost_hint = 0;
};

struct CompileResult {
  std::string cubin;  // binary image
  std::string log;    // compiler log (may be empty)
  double compile_ms = 0;
};

// Throws jitfuse::Error(Status::compile_error, ...) when the source does not compile.
using CompileFn = std::function<CompileResult(const KernelRequest&)>;

struct Entry {
  std::string key;       // 64 hex chars
  nlohmann::json meta;   // request.meta + arch, nvrtc_version, options, compile_ms, created, last_used, hits
  std::string source;
  std::string cubin;
};

enum class Origin { memory, disk, compiled };

struct Config {
  std::optional<std::string> dir;  // nullopt: memory only
  uint64_t max_bytes = 0;          // 0: unbounded
  // How long to wait for another process compiling the same key before compiling it too
  // (a dead holder releases at once; this only bounds a hung one).
  double lock_timeout_s = 600;
};

// JITFUSE_CACHE_DIR / XDG_CACHE_HOME / HOME and JITFUSE_CACHE_MAX_BYTES.
Config config_from_env();

// sha256 over canonically ordered fields: source, options, nvrtc version, arch, format version.
std::string cache_key(const KernelRequest& request);
// Indices of the first request of each distinct key, in order: what a batch compiles (and reports) once.
std::vector<size_t> distinct(const std::vector<KernelRequest>& requests);

// misses: requests found neither in memory nor on disk at first look; some of them end as disk hits
// after waiting for another process that was compiling the same key. Waiting on another thread of
// this cache counts as a memory hit.
struct Stats {
  uint64_t memory_hits = 0, disk_hits = 0, misses = 0, compiled = 0;
};

class KernelCache {
 public:
  explicit KernelCache(Config config);
  ~KernelCache();
  KernelCache(const KernelCache&) = delete;
  KernelCache& operator=(const KernelCache&) = delete;

  // memory -> disk -> compile (under a per-key inter-process lock). Never returns null.
  std::shared_ptr<const Entry> get_or_compile(const KernelRequest& request, const CompileFn& compile,
                                              Origin* origin = nullptr);

  // Many kernels on a bounded thread pool, the highest cost_hint first (ties in request order); results in
  // request order. `progress(done, total)` may be null;
  // it is called from worker threads, one call at a time. threads == 0: one per hardware thread.
  // Every request is attempted; then the first failure (in request order) is rethrown.
  std::vector<std::shared_ptr<const Entry>> get_or_compile_all(
      const std::vector<KernelRequest>& requests, const CompileFn& compile, unsigned threads,
      std::vector<Origin>* origins = nullptr, const std::function<void(size_t, size_t)>& progress = {});

  Stats stats() const;
  bool disk_enabled() const;          // false after falling back to memory only
  std::optional<std::string> dir() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace jitfuse::cache
