// Files embedded into the library at build time (templates/, fusion_rules/, templates/kernels/ for codegen),
// so the .so needs nothing beside it. One generator for all of them: jf_embed (tools/cmake/Embed.cmake).
#pragma once
#include <span>
#include <string_view>

namespace jitfuse {
struct EmbeddedFile {
  std::string_view path;  // relative to templates/ or fusion_rules/
  std::string_view content;
};
namespace embedded {
extern const std::span<const EmbeddedFile> templates;
extern const std::span<const EmbeddedFile> rules;
extern const std::span<const EmbeddedFile> kernel_templates;  // templates/kernels/*.cu: codegen's (jf_codegen)
}  // namespace embedded
}  // namespace jitfuse
