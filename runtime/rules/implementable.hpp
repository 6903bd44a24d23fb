// The rule loader's question to the execution layer: can a rule's implementation run any window its
// pattern matches? Declared here, answered by the implementations (runtime/exec/impl/registry.cpp), so a
// rule that can never run is refused at load with the implementation's reason.
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

std::optional<Refusal> refuse_unimplementable(const Impl& impl, const std::vector<PatternElem>& pattern, Pass pass,
                                              const ops::Registry& reg);

}  // namespace jitfuse::rules
