// Generated skeleton "rownorm": [pointwise ops...] layernorm|rmsnorm [pointwise ops...] (no bias, no linear) in one kernel.
#include "exec/lower/impl/generated_chain.hpp"
#include "exec/lower/impl/registrar.hpp"

namespace jitfuse::exec {
namespace {

class GeneratedRownorm final : public GeneratedChain {
 public:
  GeneratedRownorm() : GeneratedChain(codegen::Skeleton::rownorm) {}
  std::string covers_text() const override { return "[pointwise ops...] layernorm|rmsnorm [pointwise ops...] (no bias, no linear)"; }
};

const Registrar kRegistered(std::make_unique<GeneratedRownorm>());

}  // namespace
}  // namespace jitfuse::exec
