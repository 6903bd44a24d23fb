// Files embedded into the library at build time (templates/, fusion_rules/), so the .so needs nothing beside it.
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
}  // namespace embedded
}  // namespace jitfuse
