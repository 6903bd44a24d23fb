// Template files of user ops are code jitfuse compiles and runs: they must really lie inside the declaring
// rules directory, be regular files and small. Symlinks, FIFOs and directories are made at test time.
#include <sys/stat.h>

#include <filesystem>

#include "unit/rules/rules_test_util.hpp"

using jf_test::loc;
using jitfuse::rules::RuleSet;

namespace {

const char* kFunctor =
    "struct jf_op_t {\n"
    "  static __device__ __forceinline__ float fwd(float x) { return x; }\n"
    "  static __device__ __forceinline__ float bwd(float x, float dy) { return dy; }\n"
    "};\n";

std::string rules_text(const std::string& tpl) {
  return "{\"format\": \"jitfuse.rules/1\", \"ops\": [\n  {\"name\": \"t\", \"math\": \"y = x\", \"template\": \"" + tpl +
         "\", \"functor\": \"jf_op_t\"}\n]}\n";
}

// Loads rules.json (declaring op t with template `tpl`) from `dir` and returns its errors.
std::vector<jitfuse::rules::LoadError> load(const jf_test::TempDir& dir, const std::string& tpl, RuleSet& rs,
                                            std::string* text_out = nullptr, std::string* file_out = nullptr) {
  std::string text = rules_text(tpl);
  std::string file = dir.write("rules/rules.json", text);
  if (text_out) *text_out = text;
  if (file_out) *file_out = file;
  return rs.load_path(dir.path() + "/rules");
}

}  // namespace

TEST_CASE("templates: a symlink out of the rules directory is refused, with file:line:col", "[rules][trust]") {
  jf_test::TempDir dir;
  dir.write("outside/secret.cuh", kFunctor);  // even a valid template: it is not in the declaring directory
  std::filesystem::create_directories(dir.path() + "/rules");
  std::filesystem::create_symlink(dir.path() + "/outside/secret.cuh", dir.path() + "/rules/t.cuh");
  std::filesystem::create_symlink("/etc/passwd", dir.path() + "/rules/passwd.cuh");
  for (std::string tpl : {"t.cuh", "passwd.cuh"}) {
    RuleSet rs;
    std::string text, file;
    auto errs = load(dir, tpl, rs, &text, &file);
    INFO(tpl);
    REQUIRE(errs.size() == 1);
    CHECK(errs[0].where == loc(file, text, "\"" + tpl + "\""));
    CHECK_THAT(errs[0].message, Catch::Contains("outside the rules directory"));
    CHECK(rs.registry().find("t") == nullptr);
    CHECK(rs.user_templates().empty());  // nothing of the target was read into the rule set
  }
}

TEST_CASE("templates: a symlink that stays inside the directory is fine", "[rules][trust]") {
  jf_test::TempDir dir;
  dir.write("rules/impl/real.cuh", kFunctor);
  std::filesystem::create_symlink("impl/real.cuh", dir.path() + "/rules/t.cuh");
  RuleSet rs;
  auto errs = load(dir, "t.cuh", rs);
  CHECK(errs.empty());
  REQUIRE(rs.registry().find("t") != nullptr);
  CHECK(rs.registry().find("t")->template_path ==
        std::filesystem::canonical(dir.path() + "/rules/impl/real.cuh").string());
}

TEST_CASE("templates: FIFOs, devices and directories are refused without blocking", "[rules][trust]") {
  jf_test::TempDir dir;
  std::filesystem::create_directories(dir.path() + "/rules/dir.cuh");
  REQUIRE(::mkfifo((dir.path() + "/rules/fifo.cuh").c_str(), 0600) == 0);  // opening it blocking would hang
  std::filesystem::create_symlink("/dev/zero", dir.path() + "/rules/zero.cuh");
  struct Case {
    const char* tpl;
    const char* what;
  };
  for (auto c : {Case{"fifo.cuh", "is not a regular file"}, Case{"dir.cuh", "is not a regular file"},
                 Case{"zero.cuh", "outside the rules directory"}}) {
    RuleSet rs;
    std::string text, file;
    auto errs = load(dir, c.tpl, rs, &text, &file);
    INFO(c.tpl);
    REQUIRE(errs.size() == 1);
    CHECK(errs[0].where == loc(file, text, std::string("\"") + c.tpl + "\""));
    CHECK_THAT(errs[0].message, Catch::Contains(c.what));
  }
}

TEST_CASE("templates: size cap (256 KiB) and binary content", "[rules][trust]") {
  jf_test::TempDir dir;
  std::string big = kFunctor + std::string(256 * 1024, ' ');
  dir.write("rules/big.cuh", big);
  dir.write("rules/nul.cuh", std::string(kFunctor) + std::string(1, '\0'));
  dir.write("rules/edge.cuh", std::string(kFunctor) + std::string(256 * 1024 - std::string(kFunctor).size(), ' '));
  RuleSet rs;
  auto errs = load(dir, "big.cuh", rs);
  REQUIRE(errs.size() == 1);
  CHECK_THAT(errs[0].message, Catch::Contains("more than the limit of 262144 bytes"));
  RuleSet rs2;
  errs = load(dir, "nul.cuh", rs2);
  REQUIRE(errs.size() == 1);
  CHECK_THAT(errs[0].message, Catch::Contains("NUL"));
  RuleSet rs3;
  errs = load(dir, "edge.cuh", rs3);  // exactly at the cap: accepted
  CHECK(errs.empty());
}

TEST_CASE("rule paths: a FIFO or device given as a rules file is refused, not read", "[rules][trust]") {
  jf_test::TempDir dir;
  REQUIRE(::mkfifo((dir.path() + "/rules.json").c_str(), 0600) == 0);
  RuleSet rs;
  auto errs = rs.load_path(dir.path() + "/rules.json");
  REQUIRE(errs.size() == 1);
  CHECK_THAT(errs[0].message, Catch::Contains("rules.json': it is a FIFO, not a regular file"));
  errs = rs.load_path("/dev/zero");
  REQUIRE(errs.size() == 1);
  CHECK_THAT(errs[0].message, Catch::Contains("'/dev/zero': it is a character device, not a regular file"));
}
