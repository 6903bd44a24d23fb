// The rule loader's question to the execution layer: can a rule's implementation run any window its
// pattern matches? rules/ asks it through this interface and the implementations answer it
// (runtime/exec/lower/impl/registry.cpp registers the answer), so rules/ depends on nothing in exec/.
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "rules/rule.hpp"

namespace jitfuse::rules {

struct Refusal {
  std::string field;  // the impl field the error points at ("epilogue", "skeleton", "strategy"), or ""
  std::string message;
};

class Implementability {
 public:
  virtual ~Implementability() = default;
  // Why no window that `pattern` matches can run on `impl` in `pass`; nullopt when some window can.
  virtual std::optional<Refusal> refuse(const Impl& impl, const std::vector<PatternElem>& pattern, Pass pass,
                                        const ops::Registry& reg) const = 0;
};

// The answer the loader asks, or null while none is registered: then the loader checks a rule's syntax
// and ops only. libjitfuse registers the implementations' answer before main (exec/lower/impl/registry.cpp).
const Implementability* implementability();
// Makes `answer` (it must outlive every later load; null: none) the loader's; returns the previous one.
const Implementability* set_implementability(const Implementability* answer);

}  // namespace jitfuse::rules
