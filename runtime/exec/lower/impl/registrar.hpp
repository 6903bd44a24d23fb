// Self-registration of an implementation: each implementation file holds one `static Registrar`, so adding
// an implementation is one file (plus its rules and tests), not an edit of a central list.
#pragma once
#include <memory>

#include "exec/lower/impl/implementation.hpp"

namespace jitfuse::exec {

struct Registrar {
  explicit Registrar(std::unique_ptr<Implementation> impl);
};

}  // namespace jitfuse::exec
