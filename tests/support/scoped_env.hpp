// Sets (or unsets) an environment variable for a scope, restoring the old value afterwards (unit tests of
// variables the library reads: docs/environment.md).
#pragma once
#include <cstdlib>
#include <optional>
#include <string>

namespace jitfuse::test {

struct ScopedEnv {
  std::string name;
  std::optional<std::string> old;
  ScopedEnv(const char* n, const char* value) : name(n) {
    if (const char* v = std::getenv(n)) old = v;
    if (value)
      ::setenv(n, value, 1);
    else
      ::unsetenv(n);
  }
  ~ScopedEnv() {
    if (old)
      ::setenv(name.c_str(), old->c_str(), 1);
    else
      ::unsetenv(name.c_str());
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;
};

}  // namespace jitfuse::test
