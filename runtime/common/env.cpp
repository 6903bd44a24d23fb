// Reading jitfuse's environment variables.
#include "common/env.hpp"

#include <cstdlib>

namespace jitfuse::env {

std::optional<std::string> get(const char* name) {
  const char* v = std::getenv(name);
  if (!v) return std::nullopt;
  return std::string(v);
}

bool falsy(const std::string& value) { return value == "0" || value == "false" || value == "off"; }

bool flag(const char* name) {
  auto v = get(name);
  return v && !v->empty() && !falsy(*v);
}

std::vector<std::string> split_path(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    size_t end = s.find(':', start);
    if (end == std::string::npos) end = s.size();
    if (end > start) out.push_back(s.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

}  // namespace jitfuse::env
