// Number attributes become float constants in kernels: at sequence parse time they are checked for float
// range (finite, |x| <= FLT_MAX, no nonzero value that float would flush) and the op's own domain, and the
// error names file:line:col of the attribute, the op and the attribute. Built-in and user-declared ops.
#include <catch2/catch.hpp>

#include "common/error.hpp"
#include "ops/sequence.hpp"
#include "unit/rules/rules_test_util.hpp"

using namespace jitfuse;

namespace {

std::string error_of(const std::string& text, const ops::Registry& reg) {
  try {
    ops::parse_sequence(text, "seq.json", reg);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

std::string seq(const std::string& op) { return "{\"format\": \"jitfuse.sequence/1\", \"ops\": [\n  " + op + "\n]}"; }

}  // namespace

TEST_CASE("built-in number attributes are range-checked with file:line:col, op and attribute", "[ops][trust]") {
  ops::Registry reg;
  struct Case {
    const char* op;
    const char* needle;  // where the error must point
    const char* what;
  } cases[] = {
      {R"({"op": "scale", "value": 1e40})", "1e40", "within float range"},
      {R"({"op": "scale", "value": -3.5e38})", "-3.5e38", "within float range"},
      {R"({"op": "scale", "value": 1e-50})", "1e-50", "flushed to zero"},
      {R"({"op": "layernorm", "eps": 1e-50})", "1e-50", "flushed to zero"},
      {R"({"op": "rmsnorm", "eps": 0})", "0}", "a value > 0"},
      {R"({"op": "rmsnorm", "eps": -1e-5})", "-1e-5", "a value > 0"},
      {R"({"op": "dropout", "p": 1})", "1}", "a value < 1"},
      {R"({"op": "dropout", "p": 1e-45})", "1e-45", "flushed to zero"},
  };
  for (const auto& c : cases) {
    std::string text = seq(c.op);
    std::string err = error_of(text, reg);
    INFO(text << "\n" << err);
    CHECK_THAT(err, Catch::StartsWith(jf_test::loc("seq.json", text, c.needle) + ": op 0 ("));
    CHECK_THAT(err, Catch::Contains("attribute '") && Catch::Contains(c.what));
  }
  // In range: fine, including 0 and the float extremes.
  for (const char* ok : {R"({"op": "scale", "value": 0})", R"({"op": "scale", "value": 3.4e38})",
                         R"({"op": "scale", "value": -1.2e-38})", R"({"op": "layernorm", "eps": 1e-12})",
                         R"({"op": "dropout", "p": 0})"})
    CHECK(error_of(seq(ok), reg) == "");
}

TEST_CASE("user-declared op attributes: defaults checked at load, values at sequence parse", "[ops][trust]") {
  jf_test::TempDir dir;
  dir.write("t.cuh",
            "struct jf_op_t {\n"
            "  static __device__ __forceinline__ float fwd(float x, float a) { return a * x; }\n"
            "  static __device__ __forceinline__ float bwd(float x, float dy, float a) { return a * dy; }\n"
            "};\n");
  std::string text =
      "{\"format\": \"jitfuse.rules/1\", \"ops\": [\n"
      "  {\"name\": \"t\", \"math\": \"y = a x\", \"template\": \"t.cuh\", \"functor\": \"jf_op_t\", \"attrs\": "
      "[{\"name\": \"a\", \"type\": \"number\", \"default\": 1.0}]},\n"
      "  {\"name\": \"u\", \"math\": \"y = a x\", \"template\": \"t.cuh\", \"functor\": \"jf_op_t\", \"attrs\": "
      "[{\"name\": \"a\", \"type\": \"number\", \"default\": 1e39}]}\n"
      "]}\n";
  std::string file = dir.write("rules.json", text);
  rules::RuleSet rs = rules::RuleSet::with_builtins();
  auto errs = rs.load_path(dir.path());
  REQUIRE(errs.size() == 1);
  CHECK(errs[0].where == jf_test::loc(file, text, "1e39"));
  CHECK_THAT(errs[0].message, Catch::Contains("\"default\" of attribute 'a' must be a number within float range"));

  std::string s = seq(R"({"op": "t", "a": 1e40})");
  std::string err = error_of(s, rs.registry());
  CHECK_THAT(err, Catch::StartsWith(jf_test::loc("seq.json", s, "1e40") + ": op 0 (t): attribute 'a' of op 't'"));
  CHECK_THAT(err, Catch::Contains("within float range"));
  CHECK(error_of(seq(R"({"op": "t", "a": 2.5})"), rs.registry()) == "");
}

TEST_CASE("duplicate keys in a sequence file are an error", "[ops][trust]") {
  ops::Registry reg;
  std::string text = seq(R"({"op": "dropout", "p": 0.1, "p": 0.9})");
  CHECK_THAT(error_of(text, reg), Catch::StartsWith(jf_test::loc("seq.json", text, "\"p\": 0.9") +
                                                    ": duplicate key 'p' (first at line 2, column"));
}
