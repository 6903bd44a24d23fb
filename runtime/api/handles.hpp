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
// A prepared program held by the host: its sequence (kept alive), the Prepared for one (shape, training) and
// the context's runtime, all resolved when it is opened. A call on it is that call and nothing else: no
// lookup, lock, environment read or driver query (FP8 too: the Prepared holds its recipe state and weight
// copies). jf_forward / jf_backward look one up (a temporary of this type) and make the same call.
struct jf_program_s {
  std::shared_ptr<jitfuse::api::Sequence> seq;
  std::shared_ptr<const jitfuse::exec::Prepared> prepared;
  jitfuse::exec::Runtime* rt = nullptr;
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
