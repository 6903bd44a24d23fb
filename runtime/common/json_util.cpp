// A small JSON walker that maps a JSON pointer back to line:col in the source text. nlohmann::json keeps
// no positions, and "rules.json:41:7: rule 'x': unknown op 'gelux'" is worth the 100 lines.
#include "common/json_util.hpp"

#include <fstream>
#include <sstream>
#include <vector>

#include "common/error.hpp"

namespace jitfuse::json_util {
namespace {

Location offset_to_location(const std::string& text, size_t offset) {
  Location loc{1, 1};
  for (size_t i = 0; i < offset && i < text.size(); ++i) {
    if (text[i] == '\n') {
      ++loc.line;
      loc.col = 1;
    } else {
      ++loc.col;
    }
  }
  return loc;
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
  // Moves to the start of the child named `token` of the value at i; false if absent.
  bool descend(const std::string& token) {
    ws();
    if (i >= s.size()) return false;
    if (s[i] == '{') {
      ++i;
      while (true) {
        ws();
        if (i >= s.size() || s[i] != '"') return false;
        std::string key = string_token();
        ws();
        if (i >= s.size() || s[i] != ':') return false;
        ++i;
        ws();
        if (key == token) return true;
        if (!skip_value()) return false;
        ws();
        if (i < s.size() && s[i] == ',') {
          ++i;
          continue;
        }
        return false;
      }
    }
    if (s[i] == '[') {
      size_t idx = 0;
      try {
        idx = std::stoul(token);
      } catch (...) {
        return false;
      }
      ++i;
      for (size_t k = 0;; ++k) {
        ws();
        if (k == idx) return i < s.size() && s[i] != ']';
        if (!skip_value()) return false;
        ws();
        if (i < s.size() && s[i] == ',') {
          ++i;
          continue;
        }
        return false;
      }
    }
    return false;
  }
};

}  // namespace

nlohmann::json parse(const std::string& text, const std::string& where) {
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    Location loc = offset_to_location(text, e.byte > 0 ? e.byte - 1 : 0);
    std::string what = e.what();
    auto pos = what.find("parse error");
    if (pos != std::string::npos) what = what.substr(pos);
    fail(Status::parse_error, "{}:{}:{}: invalid JSON: {}", where, loc.line, loc.col, what);
  } catch (const nlohmann::json::exception& e) {  // e.g. out_of_range 406 "number overflow parsing '1e999'"
    fail(Status::parse_error, "{}: invalid JSON: {}", where, e.what());
  }
}

Location locate(const std::string& text, const std::string& pointer) {
  Walker w{text};
  std::stringstream ss(pointer);
  std::string token;
  std::getline(ss, token, '/');  // leading empty token
  while (std::getline(ss, token, '/')) {
    if (!w.descend(token)) return {};
  }
  w.ws();
  return offset_to_location(text, w.i);
}

std::string where(const std::string& file, const std::string& text, const std::string& pointer) {
  Location loc = locate(text, pointer);
  if (loc.line == 0) return file;
  return fmt::format("{}:{}:{}", file, loc.line, loc.col);
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(Status::io_error, "cannot read '{}': check that the file exists and is readable", path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace jitfuse::json_util
