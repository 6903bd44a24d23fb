// Shared by the gpu tests: run a sequence through the C ABI against the float64 reference and
// assert every tensor passes (printing the error table either way).
#pragma once
#include <catch2/catch.hpp>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>

#include "api/handles.hpp"
#include "harness/check.hpp"
#include "rules/rule.hpp"
#include "support/gpu.hpp"

namespace jitfuse::test {

inline std::string seq_json(const std::string& ops_json, const std::string& name = "t") {
  return R"({"format": "jitfuse.sequence/1", "name": ")" + name + R"(", "ops": )" + ops_json + "}";
}

inline const ops::Registry& builtin_registry() {
  static rules::RuleSet rs = rules::RuleSet::with_builtins();
  return rs.registry();
}

// Largest error seen per (label, recipe): max over tensors of max|err| / max|ref|, and of err/tol.
struct AccuracyLog {
  std::map<std::pair<std::string, std::string>, std::pair<double, double>> worst;
  void add(const std::string& label, const std::string& recipe, const harness::CheckReport& rep) {
    auto& w = worst[{label, recipe}];
    for (const auto& t : rep.tensors) {
      if (t.max_ref > 0) w.first = std::max(w.first, t.max_abs_err / t.max_ref);
      w.second = std::max(w.second, t.worst);
    }
  }
  ~AccuracyLog() {
    if (worst.empty()) return;
    std::printf("\naccuracy: largest max|err|/max|ref| (and err/tol) per op and recipe\n");
    for (auto& [k, v] : worst)
      std::printf("  %-70s %-5s %.2e (%.3f)\n", k.first.c_str(), k.second.c_str(), v.first, v.second);
  }
};
inline AccuracyLog& accuracy_log() {
  static AccuracyLog log;
  return log;
}

inline harness::CheckReport run_check(const std::string& json, const std::string& recipe, const ops::Shape& shape,
                                        bool backward = true, bool misalign = false, uint64_t seed = 1,
                                        jf_context ctx = nullptr) {
  harness::CheckOptions o;
  o.recipe = recipe;
  o.shape = shape;
  o.backward = backward;
  o.misalign = misalign;
  o.seed = seed;
  auto rep = harness::check_sequence(ctx ? ctx : shared_context(), builtin_registry(), json, o);
  INFO(json << " recipe " << recipe << " shape " << ops::shape_str(shape) << (misalign ? " misaligned" : "") << "\n"
            << rep.table());
  CHECK(rep.pass());
  accuracy_log().add(json.substr(json.find("\"ops\"")), recipe, rep);
  return rep;
}

// Sets an environment variable for the scope (fusion kill switch etc.).
struct ScopedEnv {
  std::string name;
  ScopedEnv(const char* n, const char* v) : name(n) { setenv(n, v, 1); }
  ~ScopedEnv() { unsetenv(name.c_str()); }
};

// A context of its own with an empty disk cache (a temporary JITFUSE_CACHE_DIR, removed with it), so that a
// test can count what it compiles: cache().stats().compiled.
struct FreshContext {
  jf_context ctx = nullptr;
  std::string dir;
  FreshContext() {
    char tmpl[] = "/tmp/jf_gpu_cache_XXXXXX";
    REQUIRE(mkdtemp(tmpl));
    dir = tmpl;
    const char* old = std::getenv("JITFUSE_CACHE_DIR");
    const std::string saved = old ? old : "";
    setenv("JITFUSE_CACHE_DIR", dir.c_str(), 1);  // read when the context is created
    const jf_status st = jf_context_create(&ctx);
    if (old) setenv("JITFUSE_CACHE_DIR", saved.c_str(), 1); else unsetenv("JITFUSE_CACHE_DIR");
    REQUIRE(st == JF_OK);
  }
  ~FreshContext() {
    jf_context_destroy(ctx);
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
  FreshContext(const FreshContext&) = delete;
  FreshContext& operator=(const FreshContext&) = delete;
  // Kernel programs this context compiled with NVRTC so far.
  uint64_t compiled() const { return api::context_of(ctx).cache().stats().compiled; }
};

}  // namespace jitfuse::test
