// Helpers for GPU tests: whether a GPU is present, and one shared context for a test program.
#pragma once
#include <string>

#include "cuda/driver.hpp"
#include "jitfuse/jitfuse.h"

namespace jitfuse::test {

inline bool gpu_available(std::string* why) { return cuda::try_driver(why) != nullptr; }

// One context for the whole test program (rules loaded once; kernels cached across tests).
inline jf_context shared_context() {
  static jf_context ctx = [] {
    jf_context c = nullptr;
    jf_context_create(&c);
    return c;
  }();
  return ctx;
}

}  // namespace jitfuse::test
