// libFuzzer target for loading a rules directory with templates (RuleSet::load_path): the input is split
// at "\n===\n" into rules.json and template files t0.cuh, t1.cuh, ..., written to a scratch directory.
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "common/error.hpp"
#include "rules/rule.hpp"

namespace {

namespace fs = std::filesystem;
std::string g_dir;

void write(const fs::path& p, const std::string& bytes) {
  std::ofstream(p, std::ios::binary | std::ios::trunc) << bytes;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  setenv("JITFUSE_LOG_LEVEL", "off", 1);
  char tmpl[] = "/tmp/jf_fuzz_rule_dir.XXXXXX";
  if (!mkdtemp(tmpl)) std::abort();
  g_dir = tmpl;
  std::atexit([] {
    std::error_code ec;
    fs::remove_all(g_dir, ec);
  });
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using jitfuse::rules::RuleSet;
  static const RuleSet base = RuleSet::with_builtins();
  std::string text(reinterpret_cast<const char*>(data), size);
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(g_dir, ec)) fs::remove_all(e.path(), ec);
  size_t start = 0;
  for (int n = 0;; ++n) {
    size_t sep = text.find("\n===\n", start);
    std::string part = text.substr(start, sep == std::string::npos ? std::string::npos : sep - start);
    write(fs::path(g_dir) / (n == 0 ? std::string("rules.json") : "t" + std::to_string(n - 1) + ".cuh"), part);
    if (sep == std::string::npos || n > 16) break;
    start = sep + 5;
  }
  // Hostile neighbours that must be refused, never followed: a template that is a directory, one that
  // is a symlink leaving the directory, and a rules file that is a symlink to a template.
  fs::create_directory(fs::path(g_dir) / "dir.cuh", ec);
  fs::create_symlink("/etc/hostname", fs::path(g_dir) / "outside.cuh", ec);
  RuleSet rs = base;
  auto errs = rs.load_path(g_dir);
  for (const auto& e : errs)
    if (e.to_string().empty()) std::abort();
  return 0;
}
