// Generated skeleton "gated": [pointwise ops...] swiglu|geglu|reglu [pointwise ops...] (no dropout before the gate) in one kernel.
#include "exec/lower/impl/generated_chain.hpp"
#include "exec/lower/impl/registrar.hpp"

namespace jitfuse::exec {
namespace {

class GeneratedGated final : public GeneratedChain {
 public:
  GeneratedGated() : GeneratedChain(codegen::Skeleton::gated) {}
  std::string covers_text() const override { return "[pointwise ops...] swiglu|geglu|reglu [pointwise ops...] (no dropout before the gate)"; }
};

const Registrar kRegistered(std::make_unique<GeneratedGated>());

}  // namespace
}  // namespace jitfuse::exec
