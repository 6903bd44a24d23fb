// JSON helpers for error messages that point at the text: parse with line:col, and locate a JSON
// pointer (/rules/3/pattern/1) in the original text so semantic errors can name file:line:col.
#pragma once
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

namespace jitfuse::json_util {

// Limits on any JSON text jitfuse parses (rules, sequences, builder attributes): deeper or larger input
// is refused with file:line:col before it is parsed. Counts (ops per sequence, rules per file) are
// checked by the readers of each format.
inline constexpr size_t kMaxDepth = 64;
inline constexpr size_t kMaxTextBytes = 64u << 20;

struct Location {
  int line = 0, col = 0;  // 1-based; 0 when unknown
};

// Parses `text`; a syntax error throws Error(parse_error) "<where>:line:col: <what>", and so does a key
// that appears twice in one object (JSON allows it, but the last one silently winning hides mistakes).
nlohmann::json parse(const std::string& text, const std::string& where);

// Throws Error(parse_error) when `text` is larger than kMaxTextBytes or nests deeper than kMaxDepth
// (linear, no recursion). parse() calls it first.
void check_limits(const std::string& text, const std::string& where);

// Locates many pointers in one text in time linear in the text overall: line starts are indexed once
// (offset -> line:col is a binary search) and each container's children are scanned at most once, so
// locating every rule of a 50k-rule file costs one pass, not one pass per rule. Keeps a reference to
// `text`, which must outlive it.
class Locator {
 public:
  explicit Locator(const std::string& text);
  Location locate(const std::string& pointer);  // {0,0} if it cannot be found
  std::string where(const std::string& file, const std::string& pointer);  // "file:line:col" or "file"
  Location at_offset(size_t offset) const;

 private:
  struct Child {
    std::string key;  // object member name; empty for array elements
    size_t offset;    // where the value starts
  };
  const std::vector<Child>* children(size_t container);  // nullptr if `container` is not at '{' or '['

  const std::string& text_;
  std::vector<size_t> line_starts_;
  std::unordered_map<size_t, std::vector<Child>> children_;
};

// Position of the value at `pointer` in `text`, or {0,0} if it cannot be found. One-off: for many
// lookups in the same text use a Locator.
Location locate(const std::string& text, const std::string& pointer);

std::string where(const std::string& file, const std::string& text, const std::string& pointer);

// Throws Error(parse_error) "<where>:line:col: duplicate key ..." for the first key that appears twice
// in one object of `text` (which must be valid JSON). Linear time, no recursion.
void check_duplicate_keys(const std::string& text, const std::string& where);

// A regular file of at most kMaxTextBytes (files::read_regular); throws Error(io_error) naming the path.
std::string read_file(const std::string& path);

}  // namespace jitfuse::json_util
