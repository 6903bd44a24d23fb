// A sequence's "fp8" settings (amax history length, margin): parsed with file:line:col errors for bad
// values, applied to the FP8 recipes only.
#include <catch2/catch.hpp>

#include "common/error.hpp"
#include "ops/sequence.hpp"

using namespace jitfuse;

namespace {

ops::SequenceDef parse(const std::string& fp8) {
  // A SequenceDef's ops point at their kinds in the registry they were parsed with (OpDef::info), which
  // must outlive it, as a context's does: apply_recipe reads them (ASan found the old local registry).
  static const ops::Registry reg;
  return ops::parse_sequence(R"({"ops": [{"op": "gelu"}], "fp8": )" + fp8 + "}", "seq.json", reg);
}

std::string error_of(const std::string& fp8) {
  try {
    parse(fp8);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("sequence fp8 settings: amax history length and margin per sequence", "[ops][fp8]") {
  auto def = parse(R"({"amax_history_len": 16, "margin": 2})");
  CHECK(def.fp8_amax_history == 16);
  CHECK(def.fp8_margin == 2);
  ops::Recipe delayed = ops::parse_recipe("fp8_delayed");
  ops::apply_recipe(def, delayed);
  CHECK(delayed.amax_history == 16);
  CHECK(delayed.margin == 2);
  ops::Recipe current = ops::parse_recipe("fp8_current");
  ops::apply_recipe(def, current);
  CHECK(current.amax_history == 1);  // current scaling: this call's amax only
  CHECK(current.margin == 2);
  ops::Recipe bf16 = ops::parse_recipe("bf16");
  ops::apply_recipe(def, bf16);
  CHECK(bf16.margin == 0);
  // Defaults as TransformerEngine's: 1024 and 0.
  ops::Recipe dflt = ops::parse_recipe("fp8_delayed");
  ops::apply_recipe(parse("{}"), dflt);
  CHECK(dflt.amax_history == 1024);
  CHECK(dflt.margin == 0);
}

TEST_CASE("sequence fp8 settings: bad values are refused with file:line:col and the range", "[ops][fp8]") {
  struct Case {
    const char* fp8;
    std::vector<const char*> needles;
  } cases[] = {
      {R"([16])", {"seq.json:1:", "\"fp8\" must be an object"}},
      {R"({"amax_history": 16})", {"unknown key 'amax_history'", "amax_history_len, margin"}},
      {R"({"amax_history_len": 0})", {"\"amax_history_len\" must be an integer from 1 to 1024, not 0"}},
      {R"({"amax_history_len": 1025})", {"from 1 to 1024, not 1025"}},
      {R"({"amax_history_len": 2.5})", {"not 2.5"}},
      {R"({"margin": -1})", {"\"margin\" must be an integer from 0 to 32, not -1"}},
      {R"({"margin": "1"})", {"not \"1\""}},
      {R"({"margin": 99999999999999999999})", {"\"margin\" must be an integer"}},
  };
  for (const auto& c : cases) {
    const std::string err = error_of(c.fp8);
    INFO(c.fp8 << " -> " << err);
    for (const char* n : c.needles) CHECK(err.find(n) != std::string::npos);
  }
}
