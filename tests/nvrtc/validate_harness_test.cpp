// `rules validate`'s NVRTC harness (rules/template_check): a user op whose functor does not compile is
// reported at its declaration, with the error mapped to template.cuh:line and that line quoted; a good
// op (docs/examples/softplus) compiles. NVRTC runs on the CPU: no GPU needed.
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include <catch2/catch.hpp>

#include "rules/rule.hpp"
#include "rules/template_check.hpp"

using jitfuse::rules::RuleSet;

namespace {

struct Dir {
  std::filesystem::path path = std::filesystem::temp_directory_path() /
                               ("jf_validate_harness_" + std::to_string(::getpid()));
  Dir() { std::filesystem::create_directories(path); }
  ~Dir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  std::string write(const std::string& name, const std::string& text) const {
    std::ofstream(path / name, std::ios::binary) << text;
    return (path / name).string();
  }
};

}  // namespace

TEST_CASE("validate harness: a template with a CUDA error is reported as template.cuh:line", "[nvrtc][rules]") {
  Dir dir;
  std::string tpl = dir.write("broken.cuh",
                              "// a broken functor\n"
                              "struct jf_op_broken {\n"
                              "  static __device__ __forceinline__ float fwd(float x, float k) { return k * x; }\n"
                              "  static __device__ __forceinline__ float bwd(float x, float dy, float k) {\n"
                              "    return dy * no_such_function(x);\n"
                              "  }\n"
                              "};\n");
  dir.write("good.cuh",
            "struct jf_op_good {\n"
            "  static __device__ __forceinline__ float fwd(float x) { return x; }\n"
            "  static __device__ __forceinline__ float bwd(float x, float dy) { return dy; }\n"
            "};\n");
  std::string rules = dir.write(
      "rules.json",
      "{\"format\": \"jitfuse.rules/1\", \"ops\": [\n"
      "  {\"name\": \"broken\", \"math\": \"y = k x\", \"template\": \"broken.cuh\", \"functor\": \"jf_op_broken\", "
      "\"attrs\": [{\"name\": \"k\", \"type\": \"number\", \"default\": 1}]},\n"
      "  {\"name\": \"good\", \"math\": \"y = x\", \"template\": \"good.cuh\", \"functor\": \"jf_op_good\"}\n"
      "]}\n");
  RuleSet rs = RuleSet::with_builtins();
  REQUIRE(rs.load_path(dir.path.string()).empty());  // loading does not compile: both ops load
  auto errs = jitfuse::rules::compile_user_ops(rs, "sm_90a");
  REQUIRE(errs.size() == 1);
  INFO(errs[0].to_string());
  CHECK(errs[0].where == rules + ":2:3");
  CHECK_THAT(errs[0].message, Catch::StartsWith("op 'broken': functor jf_op_broken does not compile"));
  std::string real = std::filesystem::canonical(tpl).string();
  CHECK_THAT(errs[0].message, Catch::Contains(real + ":5: error") && Catch::Contains("no_such_function"));
  CHECK_THAT(errs[0].message, Catch::Contains("    5 |     return dy * no_such_function(x);"));
  CHECK(errs[0].message.find("jf_validate_broken.cu(") == std::string::npos);  // no harness line numbers

  // A filter selects which declarations are compiled.
  CHECK(jitfuse::rules::compile_user_ops(rs, "sm_90a", [](const std::string&) { return false; }).empty());
}

TEST_CASE("validate harness: a functor with the wrong signature is reported", "[nvrtc][rules]") {
  Dir dir;
  dir.write("sig.cuh",
            "struct jf_op_sig {\n"
            "  static __device__ __forceinline__ float fwd(float x) { return x; }\n"  // the op has one constant
            "  static __device__ __forceinline__ float bwd(float x, float dy) { return dy; }\n"
            "};\n");
  dir.write("rules.json",
            "{\"format\": \"jitfuse.rules/1\", \"ops\": [{\"name\": \"sig\", \"math\": \"y = x\", \"template\": "
            "\"sig.cuh\", \"functor\": \"jf_op_sig\", \"attrs\": [{\"name\": \"k\", \"type\": \"number\", "
            "\"default\": 1}]}]}\n");
  RuleSet rs = RuleSet::with_builtins();
  REQUIRE(rs.load_path(dir.path.string()).empty());
  auto errs = jitfuse::rules::compile_user_ops(rs, "sm_90a");
  REQUIRE(errs.size() == 1);
  CHECK_THAT(errs[0].message, Catch::Contains("fwd(float x, float constants...)"));
}

TEST_CASE("validate harness: the documented softplus example compiles", "[nvrtc][rules]") {
  RuleSet rs = RuleSet::with_builtins();
  REQUIRE(rs.load_path(std::string(JF_SOURCE_DIR) + "/docs/examples/softplus").empty());
  CHECK(jitfuse::rules::compile_user_ops(rs, "sm_90a").empty());
}

TEST_CASE("map_template_log rewrites template lines and quotes them", "[nvrtc][rules]") {
  std::string log = "user/x.cuh(2): error: identifier \"q\" is undefined\nother.cu(9): warning: w\n";
  std::string out = jitfuse::rules::map_template_log(log, "user/x.cuh", "/r/x.cuh", "line one\n  return q;\n");
  CHECK(out == "/r/x.cuh:2: error: identifier \"q\" is undefined\n    2 |   return q;\nother.cu(9): warning: w\n");
}
