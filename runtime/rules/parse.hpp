// Internal to rules/: the pieces of the "jitfuse.rules/1" parser. Each turns one JSON value into a typed
// field or throws Invalid with the JSON pointer of the offending value, which rule_set.cpp turns into file:line:col.
#pragma once
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "ops/op.hpp"
#include "rules/rule.hpp"

namespace jitfuse::rules::detail {

// Never leaves rules/: load_text catches it per rule/op and records a LoadError.
struct Invalid : std::runtime_error {
  Invalid(std::string ptr, const std::string& message) : std::runtime_error(message), pointer(std::move(ptr)) {}
  std::string pointer;
};

[[noreturn]] void invalid(const std::string& pointer, const std::string& message);

// Limits that keep a hostile or mistaken file from costing more than it is worth (and keep the matcher cheap).
inline constexpr size_t kMaxPattern = 8;        // elements per pattern (optional ones make 2^k matches)
inline constexpr size_t kMaxNameLen = 64;
inline constexpr size_t kMaxTemplateBytes = 256u << 10;  // 256 KiB per template file

// [A-Za-z_][A-Za-z0-9_]*: names that may safely appear in logs, kernel names and generated identifiers.
bool is_identifier(const std::string& s, size_t max_len = kMaxNameLen);
// Printable, quoted, truncated: for echoing untrusted strings in messages.
std::string show(const std::string& s);
std::string show(const nlohmann::json& v);
std::string join(const std::vector<std::string>& items, const char* sep = ", ");

// Unknown keys are errors (a typo like "priorty" must not be silently ignored).
void check_keys(const nlohmann::json& obj, const std::string& ptr, std::initializer_list<const char*> known,
                const char* what);
std::string need_string(const nlohmann::json& obj, const char* key, const std::string& ptr, const char* hint);
std::string need_math(const nlohmann::json& obj, const std::string& ptr, const char* what);
int need_int(const nlohmann::json& v, const std::string& ptr, int lo, int hi, const char* what);

std::string unknown_op_message(const std::string& kind, const ops::Registry& reg);

Rule parse_rule(const nlohmann::json& j, const std::string& ptr, const ops::Registry& reg);

struct DeclaredOp {
  ops::OpKind kind;
  std::string template_key;   // "user/softplus.cuh"
  std::string template_text;  // the file's content
};
// `dir` is where the rules file lives; templates are resolved relative to it.
DeclaredOp parse_op(const nlohmann::json& j, const std::string& ptr, const std::string& dir,
                    const ops::Registry& reg);

}  // namespace jitfuse::rules::detail
