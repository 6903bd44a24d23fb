// Helpers for GPU tests: whether a GPU is present, and one shared context for a test program.
#pragma once
#include <string>
#include <vector>

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

namespace jitfuse::test {

// ABI 2 calls of a sequence without extra inputs or outputs: a forward (training leaves *saved) and the
// backward of that forward, parameters and gradients passed with each call.
inline jf_status forward_simple(jf_sequence seq, const DLTensor* x, DLTensor* y, const std::vector<jf_param>& params,
                                bool training, jf_saved* saved, jf_stream stream = nullptr, uint64_t rng_offset = 0) {
  jf_forward_args a{};
  a.input = x;
  a.output = y;
  a.params = params.data();
  a.n_params = static_cast<int>(params.size());
  a.training = training ? 1 : 0;
  a.rng_offset = rng_offset;
  return jf_forward(seq, &a, saved, stream);
}

inline jf_status backward_simple(jf_sequence seq, jf_saved saved, const DLTensor* x, const DLTensor* y,
                                 const DLTensor* dy, DLTensor* dx, const std::vector<jf_param>& params,
                                 const std::vector<jf_param>& grads, jf_stream stream = nullptr) {
  jf_backward_args a{};
  a.input = x;
  a.output = y;
  a.params = params.data();
  a.n_params = static_cast<int>(params.size());
  void* block = nullptr;
  if (jf_status st = jf_saved_buffer(saved, &block, &a.saved_bytes); st != JF_OK) return st;
  a.saved = block;
  a.grad_output = dy;
  a.grad_input = dx;
  a.grads = grads.data();
  a.n_grads = static_cast<int>(grads.size());
  return jf_backward(seq, &a, stream);
}

}  // namespace jitfuse::test
