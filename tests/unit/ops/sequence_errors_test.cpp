// Every bad attribute and shape mismatch of the op vocabulary produces an error that names the op,
// the attribute or shape, what was expected and what was given.
#include <catch2/catch.hpp>

#include "common/error.hpp"
#include "ops/sequence.hpp"

using namespace jitfuse;

namespace {

std::string error_of(const std::string& ops_json, const ops::Shape& shape = {4, 8}) {
  ops::Registry reg;
  try {
    auto def = ops::parse_sequence(R"({"format": "jitfuse.sequence/1", "ops": )" + ops_json + "}", "seq.json", reg);
    ops::infer(def, shape);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("attribute errors name the op index, the attribute, expected and got", "[ops]") {
  struct Case {
    const char* ops;
    std::vector<const char*> needles;
  } cases[] = {
      {R"([{"op": "gelu", "aproximate": "tanh"}])", {"op 0", "unknown attribute 'aproximate'", "known attributes: approximate"}},
      {R"([{"op": "gelu", "approximate": "fast"}])", {"op 0", "'approximate'", "one of tanh|none", "\"fast\""}},
      {R"([{"op": "bias"}, {"op": "dropout", "p": 1.0}])", {"op 1", "'p'", "< 1", "1.0"}},
      {R"([{"op": "dropout", "p": -0.1}])", {"op 0", "'p'", ">= 0"}},
      {R"([{"op": "dropout", "p": "0.1"}])", {"op 0", "'p'", "a number", "\"0.1\""}},
      {R"([{"op": "dropout", "p": 0.1, "seed": 1.5}])", {"'seed'", "an integer"}},
      {R"([{"op": "dropout", "p": 0.1, "training": 1}])", {"'training'", "true or false"}},
      {R"([{"op": "linear", "out_features": 4}])", {"op 0", "needs attribute 'in_features'"}},
      {R"([{"op": "linear", "in_features": 0, "out_features": 4}])", {"'in_features'", ">= 1"}},
      {R"([{"op": "scale"}])", {"needs attribute 'value'"}},
      {R"([{"op": "layernorm", "eps": -1}])", {"'eps'", "> 0"}},
      {R"([{"op": "layernorm", "zero_centered_gamma": "yes"}])", {"'zero_centered_gamma'", "true or false"}},
      {R"([{"op": "reshape", "shape": []}])", {"'shape'", "an array of integers"}},
      {R"([{"op": "reshape", "shape": [0, 8]}])", {"'shape'", "positive integers"}},
      {R"([{"op": "geluu"}])", {"op 0", "unknown op 'geluu'", "known ops:"}},
      {R"([{"kind": "gelu"}])", {"op 0", "string \"op\""}},
      {R"([])", {"non-empty array"}},
  };
  for (const auto& c : cases) {
    std::string msg = error_of(c.ops);
    INFO(c.ops << " -> " << msg);
    REQUIRE(!msg.empty());
    CHECK(msg.find("seq.json:1:") != std::string::npos);
    for (auto* n : c.needles) CHECK(msg.find(n) != std::string::npos);
  }
}

TEST_CASE("shape mismatches name the op where shapes stop fitting", "[ops]") {
  CHECK(error_of(R"([{"op": "bias"}, {"op": "linear", "in_features": 16, "out_features": 4}])").find(
            "op 1 (linear): shape mismatch: in_features = 16 but the input's last dim is 8") != std::string::npos);
  CHECK(error_of(R"([{"op": "swiglu"}])", {4, 7}).find("op 0 (swiglu): shape mismatch") != std::string::npos);
  CHECK(error_of(R"([{"op": "swiglu"}])", {4, 7}).find("(odd)") != std::string::npos);
  CHECK(error_of(R"([{"op": "reshape", "shape": [3, -1]}])", {4, 8}).find("cannot reshape 32 elements") != std::string::npos);
  CHECK(error_of(R"([{"op": "reshape", "shape": [-1, -1]}])").find("at most one -1") != std::string::npos);
  CHECK(error_of(R"([{"op": "reshape", "shape": [5, 5]}])").find("has 25 elements, the input has 32") != std::string::npos);
  CHECK(error_of(R"([{"op": "layernorm", "eps": 0}])").find("expected a value > 0") != std::string::npos);  // at parse time
  CHECK(error_of(R"([{"op": "gelu"}])", {}).find("input shape") != std::string::npos);
  // A valid sequence infers shapes op by op.
  ops::Registry reg;
  auto def = ops::parse_sequence(R"({"ops": [{"op": "linear", "in_features": 8, "out_features": 6}, {"op": "swiglu"},
                                              {"op": "reshape", "shape": [-1]}]})", "ok.json", reg);
  auto ops = ops::infer(def, {2, 3, 8});
  CHECK(ops[1].in == ops::Shape{2, 3, 6});
  CHECK(ops[1].out == ops::Shape{2, 3, 3});
  CHECK(ops[2].out == ops::Shape{18});
  CHECK(ops[0].params[0].shape == ops::Shape{6, 8});
}

TEST_CASE("shape strings parse or say what is wrong", "[ops]") {
  CHECK(ops::parse_shape("8192x4096") == ops::Shape{8192, 4096});
  CHECK(ops::parse_shape("5,1,8") == ops::Shape{5, 1, 8});
  CHECK_THROWS_WITH(ops::parse_shape("8192xx4096"), Catch::Contains("expected dims like 8192x4096"));
  CHECK_THROWS_WITH(ops::parse_shape("8192x-1"), Catch::Contains("'-1' is not a positive integer"));
}

TEST_CASE("redeclaring a user op keeps the kind earlier sequences point at", "[ops]") {
  ops::Registry reg;
  ops::OpKind k;
  k.name = "softplus";
  k.family = ops::Family::pointwise;
  k.math = "first declaration";
  k.user_declared = true;
  reg.add(k);
  const ops::OpKind* first = reg.find("softplus");
  k.math = "second declaration";
  reg.add(k);
  CHECK(reg.find("softplus")->math == "second declaration");
  CHECK(first->math == "first declaration");
  ops::OpKind builtin;
  builtin.name = "gelu";
  builtin.declared_in = "mine.json";
  CHECK_THROWS_WITH(reg.add(builtin), Catch::Contains("mine.json: op 'gelu' is built in and cannot be redeclared"));
}
