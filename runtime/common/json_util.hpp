// JSON helpers for error messages that point at the text: parse with line:col, and locate a JSON
// pointer (/rules/3/pattern/1) in the original text so semantic errors can name file:line:col.
#pragma once
#include <string>

#include <nlohmann/json.hpp>

namespace jitfuse::json_util {

struct Location {
  int line = 0, col = 0;  // 1-based; 0 when unknown
};

// Parses `text`; a syntax error throws Error(parse_error) "<where>:line:col: <what>".
nlohmann::json parse(const std::string& text, const std::string& where);

// Position of the value at `pointer` in `text`, or {0,0} if it cannot be found.
Location locate(const std::string& text, const std::string& pointer);

std::string where(const std::string& file, const std::string& text, const std::string& pointer);

std::string read_file(const std::string& path);  // throws Error(io_error) naming the path

}  // namespace jitfuse::json_util
