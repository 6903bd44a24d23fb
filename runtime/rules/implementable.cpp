// Where the rule loader finds the answer to "can this rule's implementation ever run?" (implementable.hpp).
// One pointer, constant-initialised, so a registration from another file's static initialiser is safe.
#include "rules/implementable.hpp"

#include <atomic>

namespace jitfuse::rules {
namespace {
std::atomic<const Implementability*> g_answer{nullptr};
}  // namespace

const Implementability* implementability() { return g_answer.load(std::memory_order_acquire); }

const Implementability* set_implementability(const Implementability* answer) {
  return g_answer.exchange(answer, std::memory_order_acq_rel);
}

}  // namespace jitfuse::rules
