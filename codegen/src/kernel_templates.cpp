// Sections of the embedded kernel text templates and the ${name} substitution (kernel_templates.hpp).
// The templates are split once per process; a missing section or value is a bug in jitfuse, not user input.
#include "kernel_templates.hpp"

#include <stdexcept>

namespace jitfuse::codegen::detail {
namespace {

constexpr std::string_view kMarker = "// @section ";

using Sections = std::map<std::pair<std::string, std::string>, std::string>;

Sections split(std::span<const KernelTemplate> files) {
  Sections out;
  for (const auto& f : files) {
    std::string* cur = nullptr;  // the text before the first marker is the file's own comment
    size_t at = 0;
    while (at < f.content.size()) {
      size_t end = f.content.find('\n', at);
      end = end == std::string_view::npos ? f.content.size() : end + 1;
      const std::string_view line = f.content.substr(at, end - at);
      if (line.substr(0, kMarker.size()) == kMarker) {
        std::string name(line.substr(kMarker.size()));
        while (!name.empty() && (name.back() == '\n' || name.back() == '\r' || name.back() == ' ')) name.pop_back();
        cur = &out[{std::string(f.path), name}];
      } else if (cur) {
        cur->append(line);
      }
      at = end;
    }
  }
  for (auto& [key, text] : out)
    while (text.size() >= 2 && text[text.size() - 1] == '\n' && text[text.size() - 2] == '\n') text.pop_back();
  return out;
}

}  // namespace

const std::string& template_section(const std::string& path, const std::string& section) {
  static const Sections sections = split(embedded::kernel_templates);
  auto it = sections.find({path, section});
  if (it == sections.end())
    throw std::logic_error("codegen: kernel template " + path + " has no section '" + section + "'");
  return it->second;
}

std::string fill_template(const std::string& text, const std::map<std::string, std::string>& values) {
  std::string out;
  size_t at = 0;
  for (size_t open; (open = text.find("${", at)) != std::string::npos;) {
    const size_t close = text.find('}', open);
    if (close == std::string::npos) throw std::logic_error("codegen: unterminated ${ in a kernel template");
    const std::string name = text.substr(open + 2, close - open - 2);
    auto v = values.find(name);
    if (v == values.end()) throw std::logic_error("codegen: no value for ${" + name + "} in a kernel template");
    out.append(text, at, open - at);
    out += v->second;
    at = close + 1;
  }
  out.append(text, at, std::string::npos);
  return out;
}

}  // namespace jitfuse::codegen::detail
