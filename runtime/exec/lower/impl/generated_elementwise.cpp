// Generated skeleton "elementwise": [pointwise, bias, dropout, scale, extra input/output ops...] (no norm, no gated op, no linear) in one kernel.
#include "exec/lower/impl/generated_chain.hpp"
#include "exec/lower/impl/registrar.hpp"

namespace jitfuse::exec {
namespace {

class GeneratedElementwise final : public GeneratedChain {
 public:
  GeneratedElementwise() : GeneratedChain(codegen::Skeleton::elementwise) {}
  std::string covers_text() const override { return "[pointwise, bias, dropout, scale, extra input/output ops...] (no norm, no gated op, no linear)"; }
};

const Registrar kRegistered(std::make_unique<GeneratedElementwise>());

}  // namespace
}  // namespace jitfuse::exec
