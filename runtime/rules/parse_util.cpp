// Small checked accessors shared by the rule and op parsers. Every failure names the JSON pointer of the
// value at fault, what was expected, and what was found, so the message can point at file:line:col.
#include <algorithm>

#include <fmt/format.h>

#include "rules/parse.hpp"

namespace jitfuse::rules::detail {

void invalid(const std::string& pointer, const std::string& message) { throw Invalid(pointer, message); }

bool is_identifier(const std::string& s, size_t max_len) {
  if (s.empty() || s.size() > max_len) return false;
  auto alpha = [](char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; };
  if (!alpha(s[0])) return false;
  return std::all_of(s.begin(), s.end(), [&](char c) { return alpha(c) || (c >= '0' && c <= '9'); });
}

std::string show(const std::string& s) {
  // Untrusted text goes into messages that reach terminals and logs: keep it printable and short.
  std::string out = "'";
  for (size_t i = 0; i < s.size() && i < 80; ++i) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    out += (c >= 0x20 && c < 0x7f) ? static_cast<char>(c) : '?';
  }
  if (s.size() > 80) out += "...";
  return out + "'";
}

std::string show(const nlohmann::json& v) {
  if (v.is_string()) return show(v.get<std::string>());
  // dump() of a deep or huge value is both slow and useless in a message: describe big values by type.
  if ((v.is_array() || v.is_object()) && !v.empty()) return v.is_array() ? "an array" : "an object";
  std::string d = v.dump(-1, ' ', true, nlohmann::json::error_handler_t::replace);
  return d.size() > 80 ? d.substr(0, 80) + "..." : d;
}

std::string join(const std::vector<std::string>& items, const char* sep) {
  std::string out;
  for (const auto& s : items) out += (out.empty() ? "" : sep) + s;
  return out;
}

void check_keys(const nlohmann::json& obj, const std::string& ptr, std::initializer_list<const char*> known,
                const char* what) {
  for (const auto& item : obj.items()) {
    const std::string& key = item.key();  // not a structured binding: clang 14 cannot capture those
    if (std::any_of(known.begin(), known.end(), [&](const char* k) { return key == k; })) continue;
    std::vector<std::string> names;
    for (const char* k : known) names.push_back(k);
    // A key containing '/' or '~' cannot be located by json_util's plain pointer walk: point at the object.
    bool plain = key.find_first_of("/~") == std::string::npos;
    invalid(plain ? ptr + "/" + key : ptr,
            fmt::format("unknown key {} in {}; known keys: {}", show(key), what, join(names)));
  }
}

std::string need_string(const nlohmann::json& obj, const char* key, const std::string& ptr, const char* hint) {
  if (!obj.contains(key)) invalid(ptr, fmt::format("missing \"{}\" ({})", key, hint));
  const auto& v = obj.at(key);
  if (!v.is_string()) invalid(ptr + "/" + key, fmt::format("\"{}\" must be a string ({}), got {}", key, hint, show(v)));
  return v.get<std::string>();
}

std::string need_math(const nlohmann::json& obj, const std::string& ptr, const char* what) {
  // The math line is what explain prints and what reviewers read: required, one line, short.
  std::string m = need_string(obj, "math", ptr, "one line saying what it computes, e.g. \"y = gelu_tanh(x + b)\"");
  if (m.find_first_not_of(" \t") == std::string::npos)
    invalid(ptr + "/math", fmt::format("\"math\" of a {} must say what it computes, e.g. \"y = gelu_tanh(x + b)\"", what));
  if (m.find_first_of("\n\r") != std::string::npos || m.size() > 200)
    invalid(ptr + "/math", fmt::format("\"math\" of a {} must be a single line of at most 200 characters", what));
  return m;
}

int need_int(const nlohmann::json& v, const std::string& ptr, int lo, int hi, const char* what) {
  if (!v.is_number_integer())
    invalid(ptr, fmt::format("{} must be an integer in [{}, {}], got {}", what, lo, hi, show(v)));
  // Compare in the widest types: a non-negative value is stored as an unsigned 64-bit number.
  bool in_range = false;
  if (v.is_number_unsigned()) {
    uint64_t u = v.get<uint64_t>();
    in_range = hi >= 0 && u <= static_cast<uint64_t>(hi) && (lo <= 0 || u >= static_cast<uint64_t>(lo));
  } else {
    int64_t i = v.get<int64_t>();
    in_range = i >= lo && i <= hi;
  }
  if (!in_range) invalid(ptr, fmt::format("{} must be an integer in [{}, {}], got {}", what, lo, hi, show(v)));
  return static_cast<int>(v.get<int64_t>());
}

std::string unknown_op_message(const std::string& kind, const ops::Registry& reg) {
  return fmt::format("unknown op {}; known ops: {} (new pointwise ops are declared in the file's \"ops\")",
                     show(kind), join(reg.names()));
}

}  // namespace jitfuse::rules::detail
