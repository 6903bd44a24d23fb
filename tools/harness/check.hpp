// Running a sequence on the GPU through the C ABI on fresh random inputs, with every output poisoned
// first, and comparing forward and backward results with the float64 reference. Used by the gpu
// tests and by `jitfuse check`.
#pragma once
#include <string>
#include <vector>

#include "jitfuse/jitfuse.h"
#include "ops/op.hpp"
#include "ops/recipe.hpp"

namespace jitfuse::harness {

struct CheckOptions {
  std::string recipe = "fp32";
  ops::Shape shape;
  bool backward = true;
  uint64_t seed = 1;          // inputs are drawn from this seed
  uint64_t rng_offset = 12345;
  uint64_t rng_seed = 0x5eed;  // the call's Philox seed (XORed into each dropout's seed attribute)
  // ABI 2's two ways of passing memory and randomness: the host's saved buffer and workspaces (sized from
  // jf_sequence_info) and a device {seed, offset} state, or the allocator and host values.
  bool host_memory = false;
  bool device_rng = false;
  bool misalign = false;      // offset every tensor by one element: the scalar path must be taken
  // No float64 reference (user-declared ops): only check that every output was written; the numerics are
  // compared with the unfused run by JITFUSE_VERIFY instead.
  bool no_reference = false;
  // Forward (+ backward) calls before the compared one, same inputs (FP8: the recipe state advances).
  int calls = 1;
  // Sequences with collectives (docs/parallel.md): the communicator the sequence runs on, a world size of
  // one (the float64 reference holds one rank).
  jf_comm comm = nullptr;
};

struct TensorCheck {
  std::string name;
  int64_t n = 0;
  double max_abs_err = 0;
  double max_ref = 0;
  double worst = 0;           // max over elements of err / (atol + rtol * (|ref| + rms(ref)))
  int64_t unwritten = 0;      // NaN left from the poison (or produced)
  int64_t failures = 0;
  double atol = 0, rtol = 0;
  bool pass() const { return failures == 0 && unwritten == 0; }
};

struct CheckReport {
  std::vector<TensorCheck> tensors;
  bool pass() const;
  std::string table() const;
};

// The tolerance of DESIGN.md per dtype (fp32 GEMMs use fp16's), scaled by the number of ops.
void tolerance(const std::string& recipe, bool has_gemm, size_t n_ops, double* atol, double* rtol);

// Throws jitfuse::Error on any C ABI failure (with jf_last_error's message).
CheckReport check_sequence(jf_context ctx, const ops::Registry& registry, const std::string& sequence_json,
                           const CheckOptions& opt);

}  // namespace jitfuse::harness
