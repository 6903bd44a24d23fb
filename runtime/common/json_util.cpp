// A small JSON walker that maps a JSON pointer back to line:col in the source text. nlohmann::json keeps
// no positions, and "rules.json:41:7: rule 'x': unknown op 'gelux'" is worth the 100 lines.
#include "common/json_util.hpp"

#include <algorithm>
#include <sstream>
#include <vector>

#include "common/error.hpp"
#include "common/file_read.hpp"
#include "common/text.hpp"

namespace jitfuse::json_util {
namespace {

// Offsets of the first character of every line: offset -> line:col is then a binary search.
std::vector<size_t> line_starts(const std::string& text) {
  std::vector<size_t> starts{0};
  for (size_t i = 0; i < text.size(); ++i)
    if (text[i] == '\n') starts.push_back(i + 1);
  return starts;
}

Location offset_to_location(const std::vector<size_t>& starts, size_t offset) {
  auto it = std::upper_bound(starts.begin(), starts.end(), offset);  // first line starting after offset
  size_t line = static_cast<size_t>(it - starts.begin());            // >= 1: starts[0] == 0
  return {static_cast<int>(line), static_cast<int>(offset - starts[line - 1] + 1)};
}

Location offset_to_location(const std::string& text, size_t offset) {
  return offset_to_location(line_starts(text), std::min(offset, text.size()));
}

// "~1" -> "/", "~0" -> "~" (RFC 6901).
std::string unescape_token(const std::string& t) {
  std::string out;
  for (size_t i = 0; i < t.size(); ++i) {
    if (t[i] == '~' && i + 1 < t.size() && (t[i + 1] == '0' || t[i + 1] == '1')) {
      out += t[i + 1] == '0' ? '~' : '/';
      ++i;
    } else {
      out += t[i];
    }
  }
  return out;
}

struct Walker {
  const std::string& s;
  size_t i = 0;

  void ws() {
    while (i < s.size() && (s[i] == ' ' || s[i] == '\n' || s[i] == '\r' || s[i] == '\t')) ++i;
  }
  std::string string_token() {  // at '"'
    std::string out;
    ++i;
    while (i < s.size() && s[i] != '"') {
      if (s[i] == '\\' && i + 1 < s.size()) {
        out += s[i + 1];
        i += 2;
      } else {
        out += s[i++];
      }
    }
    ++i;
    return out;
  }
  bool skip_value() {
    ws();
    if (i >= s.size()) return false;
    char c = s[i];
    if (c == '"') {
      string_token();
      return true;
    }
    if (c == '{' || c == '[') {
      char close = c == '{' ? '}' : ']';
      ++i;
      ws();
      if (i < s.size() && s[i] == close) {
        ++i;
        return true;
      }
      while (i < s.size()) {
        if (c == '{') {
          ws();
          if (i >= s.size() || s[i] != '"') return false;
          string_token();
          ws();
          if (i >= s.size() || s[i] != ':') return false;
          ++i;
        }
        if (!skip_value()) return false;
        ws();
        if (i < s.size() && s[i] == ',') {
          ++i;
          continue;
        }
        if (i < s.size() && s[i] == close) {
          ++i;
          return true;
        }
        return false;
      }
      return false;
    }
    while (i < s.size() && s[i] != ',' && s[i] != '}' && s[i] != ']' && s[i] != ' ' && s[i] != '\n' &&
           s[i] != '\r' && s[i] != '\t')
      ++i;
    return true;
  }
};

}  // namespace

void check_limits(const std::string& text, const std::string& where) {
  if (text.size() > kMaxTextBytes)
    fail(Status::parse_error, "{}: the JSON text is {} bytes, more than the limit of {} bytes", where, text.size(),
         kMaxTextBytes);
  // A flat scan (no recursion, strings skipped) so that a 1M-deep value is refused before any recursive
  // code (nlohmann's parser, the location walker, destructors) sees it.
  size_t depth = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    char c = text[i];
    if (c == '"') {
      for (++i; i < text.size() && text[i] != '"'; ++i)
        if (text[i] == '\\') ++i;
    } else if (c == '{' || c == '[') {
      if (++depth > kMaxDepth) {
        Location loc = offset_to_location(text, i);
        fail(Status::parse_error, "{}:{}:{}: JSON nested more than {} levels deep; jitfuse files need a handful",
             where, loc.line, loc.col, kMaxDepth);
      }
    } else if ((c == '}' || c == ']') && depth > 0) {
      --depth;
    }
  }
}

nlohmann::json parse(const std::string& text, const std::string& where) {
  check_limits(text, where);
  try {
    nlohmann::json j = nlohmann::json::parse(text);
    check_duplicate_keys(text, where);
    return j;
  } catch (const nlohmann::json::parse_error& e) {
    Location loc = offset_to_location(text, e.byte > 0 ? e.byte - 1 : 0);
    std::string what = e.what();
    auto pos = what.find("parse error");
    if (pos != std::string::npos) what = what.substr(pos);
    // nlohmann quotes the token it last read, which can be a whole (long, non-UTF-8) string.
    fail(Status::parse_error, "{}:{}:{}: invalid JSON: {}", where, loc.line, loc.col, text::shorten(what, 240));
  } catch (const nlohmann::json::exception& e) {  // e.g. out_of_range 406 "number overflow parsing '1e999'"
    fail(Status::parse_error, "{}: invalid JSON: {}", where, text::shorten(e.what(), 240));
  }
}

Locator::Locator(const std::string& text) : text_(text), line_starts_(line_starts(text)) {}

Location Locator::at_offset(size_t offset) const {
  return offset_to_location(line_starts_, std::min(offset, text_.size()));
}

const std::vector<Locator::Child>* Locator::children(size_t container) {
  if (auto it = children_.find(container); it != children_.end()) return &it->second;
  if (container >= text_.size() || (text_[container] != '{' && text_[container] != '[')) return nullptr;
  std::vector<Child> out;
  Walker w{text_, container + 1};
  char close = text_[container] == '{' ? '}' : ']';
  w.ws();
  bool ok = true;
  while (w.i < text_.size() && text_[w.i] != close) {
    Child c;
    if (close == '}') {
      if (text_[w.i] != '"') break;
      c.key = w.string_token();
      w.ws();
      if (w.i >= text_.size() || text_[w.i] != ':') break;
      ++w.i;
      w.ws();
    }
    c.offset = w.i;
    ok = w.skip_value();
    if (!ok) break;
    out.push_back(std::move(c));
    w.ws();
    if (w.i < text_.size() && text_[w.i] == ',') {
      ++w.i;
      w.ws();
    }
  }
  return &(children_[container] = std::move(out));
}

Location Locator::locate(const std::string& pointer) {
  size_t at = 0;
  while (at < text_.size() && (text_[at] == ' ' || text_[at] == '\n' || text_[at] == '\r' || text_[at] == '\t')) ++at;
  size_t pos = 0;
  if (!pointer.empty() && pointer[0] == '/') pos = 1;
  while (pos <= pointer.size() && !pointer.empty()) {
    size_t slash = pointer.find('/', pos);
    std::string token = unescape_token(pointer.substr(pos, slash == std::string::npos ? std::string::npos : slash - pos));
    const std::vector<Child>* kids = children(at);
    if (!kids) return {};
    bool found = false;
    if (text_[at] == '{') {
      for (const auto& c : *kids)
        if (c.key == token) {
          at = c.offset;
          found = true;
          break;
        }
    } else {
      size_t idx = 0;
      bool digits = !token.empty() && token.size() < 19 &&
                    std::all_of(token.begin(), token.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
      if (digits) idx = std::stoull(token);
      if (digits && idx < kids->size()) {
        at = (*kids)[idx].offset;
        found = true;
      }
    }
    if (!found) return {};
    if (slash == std::string::npos) break;
    pos = slash + 1;
  }
  return at_offset(at);
}

std::string Locator::where(const std::string& file, const std::string& pointer) {
  Location loc = locate(pointer);
  if (loc.line == 0) return file;
  return fmt::format("{}:{}:{}", file, loc.line, loc.col);
}

Location locate(const std::string& text, const std::string& pointer) { return Locator(text).locate(pointer); }

std::string where(const std::string& file, const std::string& text, const std::string& pointer) {
  return Locator(text).where(file, pointer);
}

void check_duplicate_keys(const std::string& text, const std::string& where) {
  // `text` is valid JSON (nlohmann parsed it), so a flat scan with a stack of open containers suffices:
  // a string right after '{' or ',' inside an object is a key.
  struct Frame {
    bool object;
    bool expect_key;
    std::unordered_map<std::string, size_t> keys;  // key -> offset of its first occurrence
  };
  std::vector<Frame> stack;
  Walker w{text};
  while (w.i < text.size()) {
    char c = text[w.i];
    if (c == '{' || c == '[') {
      stack.push_back({c == '{', c == '{', {}});
      ++w.i;
    } else if (c == '}' || c == ']') {
      if (!stack.empty()) stack.pop_back();
      ++w.i;
    } else if (c == ',') {
      if (!stack.empty() && stack.back().object) stack.back().expect_key = true;
      ++w.i;
    } else if (c == '"') {
      size_t at = w.i;
      std::string s = w.string_token();
      if (!stack.empty() && stack.back().expect_key) {
        Frame& f = stack.back();
        f.expect_key = false;
        auto [it, fresh] = f.keys.emplace(std::move(s), at);
        if (!fresh) {
          Location first = offset_to_location(text, it->second), dup = offset_to_location(text, at);
          std::string shown;
          for (size_t k = 0; k < it->first.size() && k < 80; ++k) {
            unsigned char ch = static_cast<unsigned char>(it->first[k]);
            shown += (ch >= 0x20 && ch < 0x7f) ? static_cast<char>(ch) : '?';
          }
          fail(Status::parse_error, "{}:{}:{}: duplicate key '{}' (first at line {}, column {}); a key may appear "
               "once per object: remove or rename one of them", where, dup.line, dup.col, shown, first.line, first.col);
        }
      }
    } else {
      ++w.i;
    }
  }
}

std::string read_file(const std::string& path) {
  return files::read_regular(path, std::min<uint64_t>(files::kMaxJsonFileBytes, kMaxTextBytes), "JSON file");
}

}  // namespace jitfuse::json_util
