// Helpers for the rules and fuser tests: scratch directories, locating text in a file (to pin file:line:col),
// sequences built from JSON, and running the `jitfuse` CLI.
#pragma once
#include "support/run_command.hpp"
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "ops/sequence.hpp"
#include "rules/rule.hpp"

namespace jf_test {

// A fresh directory under the system temp dir, removed with everything in it when the object dies.
class TempDir {
 public:
  TempDir() {
    static std::atomic<int> counter{0};
    path_ = std::filesystem::temp_directory_path() /
            ("jf_rules_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string path() const { return path_.string(); }
  std::string write(const std::string& name, const std::string& text) const {
    auto p = path_ / name;
    std::filesystem::create_directories(p.parent_path());
    std::ofstream(p, std::ios::binary) << text;
    return p.string();
  }

 private:
  std::filesystem::path path_;
};

// "file:line:col" of the first occurrence of `needle` in `text` (1-based, as the loader reports). An '@' in
// the needle marks the exact spot within it ("\"impl\": @{" points at the brace).
inline std::string loc(const std::string& file, const std::string& text, std::string needle) {
  size_t mark = needle.find('@');
  if (mark == std::string::npos) mark = 0;
  else needle.erase(mark, 1);
  size_t at = text.find(needle);
  REQUIRE(at != std::string::npos);
  at += mark;
  int line = 1, col = 1;
  for (size_t i = 0; i < at; ++i) {
    if (text[i] == '\n') {
      ++line;
      col = 1;
    } else {
      ++col;
    }
  }
  return file + ":" + std::to_string(line) + ":" + std::to_string(col);
}

inline const jitfuse::rules::Rule* find_rule(const jitfuse::rules::RuleSet& rs, const std::string& name) {
  for (const auto& r : rs.rules())
    if (r.name == name) return &r;
  return nullptr;
}

// Ops from a JSON list of op objects, shape-inferred for `shape`.
inline std::vector<jitfuse::ops::Op> make_ops(const jitfuse::rules::RuleSet& rs, const nlohmann::json& ops,
                                              const jitfuse::ops::Shape& shape) {
  nlohmann::json seq = {{"format", "jitfuse.sequence/1"}, {"name", "test"}, {"ops", ops}};
  return jitfuse::ops::infer(jitfuse::ops::parse_sequence(seq.dump(), "<test>", rs.registry()), shape);
}

using CliResult = jitfuse::test::CommandResult;

// Runs the jitfuse CLI built beside the tests, without the caller's rule path or kill switch. With
// `stdout_only`, stderr is dropped (for --json output that must parse).
inline CliResult run_cli(const std::string& args, const std::string& env = "", bool stdout_only = false) {
  return jitfuse::test::run_command("env -u JITFUSE_RULE_PATH -u JITFUSE_DISABLE_FUSION -u JITFUSE_LOG_LEVEL " + env +
                                    " '" + std::string(JF_CLI_PATH) + "' " + args +
                                    (stdout_only ? " 2>/dev/null" : " 2>&1"));
}

inline std::string src(const std::string& rel) { return std::string(JF_SOURCE_DIR) + "/" + rel; }

}  // namespace jf_test
