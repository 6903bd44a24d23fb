// What the C ABI's opaque handles hold. Internal: the CLI and the tests reach a context's internals
// (its JITFUSE_VERIFY log, say) through context_of, never through the public header.
#pragma once
#include <memory>

#include "api/context.hpp"
#include "jitfuse/jitfuse.h"

struct jf_context_s {
  jitfuse::api::Context impl;
};
struct jf_sequence_s {
  std::shared_ptr<jitfuse::api::Sequence> impl;  // shared with the jf_program handles opened on it
};
// A prepared program held by the host: its sequence (kept alive) and the Prepared for one (shape, training).
struct jf_program_s {
  std::shared_ptr<jitfuse::api::Sequence> seq;
  std::shared_ptr<const jitfuse::exec::Prepared> prepared;
  bool training = false;
};
// A communicator the host holds (sequences bound to it share it).
struct jf_comm_s {
  std::shared_ptr<jitfuse::cuda::Communicator> impl;
};
// A saved block jf_forward allocated through the allocator (a host that passes its own has no handle).
struct jf_saved_s {
  void* block = nullptr;
  size_t bytes = 0;
  jitfuse::exec::Allocator allocator;
  bool released = false;
};

namespace jitfuse::api {
inline Context& context_of(jf_context ctx) { return ctx->impl; }
}  // namespace jitfuse::api
