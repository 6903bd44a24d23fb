// Shared by the gpu tests: run a sequence through the C ABI against the float64 reference and
// assert every tensor passes (printing the error table either way).
#pragma once
#include <catch2/catch.hpp>

#include <cstdlib>
#include <string>

#include "reference/check.hpp"
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

inline reference::CheckReport run_check(const std::string& json, const std::string& recipe, const ops::Shape& shape,
                                        bool backward = true, bool misalign = false, uint64_t seed = 1,
                                        jf_context ctx = nullptr) {
  reference::CheckOptions o;
  o.recipe = recipe;
  o.shape = shape;
  o.backward = backward;
  o.misalign = misalign;
  o.seed = seed;
  auto rep = reference::check_sequence(ctx ? ctx : shared_context(), builtin_registry(), json, o);
  INFO(json << " recipe " << recipe << " shape " << ops::shape_str(shape) << (misalign ? " misaligned" : "") << "\n"
            << rep.table());
  CHECK(rep.pass());
  return rep;
}

// Sets an environment variable for the scope (fusion kill switch etc.).
struct ScopedEnv {
  std::string name;
  ScopedEnv(const char* n, const char* v) : name(n) { setenv(n, v, 1); }
  ~ScopedEnv() { unsetenv(name.c_str()); }
};

}  // namespace jitfuse::test
