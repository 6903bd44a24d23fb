// Whole kernels as text templates (templates/kernels/*.cu, embedded at build time): their sections and the
// ${name} substitution that fills them. Codegen's only text templating; device code lives in templates/ops.
#pragma once
#include <map>
#include <span>
#include <string>
#include <string_view>

namespace jitfuse::codegen::detail {

struct KernelTemplate {
  std::string_view path;  // relative to templates/ ("kernels/fp8_update.cu")
  std::string_view content;
};
extern const std::span<const KernelTemplate> kernel_templates;  // generated: kernel_templates.cpp

// The text of section `section` of template `path` (after its "// @section NAME" line, up to the next one,
// trailing blank lines dropped); throws std::logic_error naming what is missing.
const std::string& template_section(const std::string& path, const std::string& section);
// `text` with every ${name} replaced by values.at(name); throws std::logic_error on a name with no value.
std::string fill_template(const std::string& text, const std::map<std::string, std::string>& values);

}  // namespace jitfuse::codegen::detail
