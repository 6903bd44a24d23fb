// The cross_entropy op (runtime/ops/cross_entropy.cpp): attributes with their defaults and domains (bad values refused
// with the op, the attribute and what was expected), the last-op rule, FP8 refused, shapes inferred per reduction, and
// the labels' extra input (its slot, dtype and shape).
#include <catch2/catch.hpp>

#include "common/error.hpp"
#include "ops/sequence.hpp"

using namespace jitfuse;

namespace {

std::string seq(const std::string& ops) {
  return R"({"format": "jitfuse.sequence/1", "name": "ce", "ops": )" + ops + "}";
}

std::string error_of(const std::string& text, Status* st = nullptr) {
  try {
    ops::Registry reg;
    auto def = ops::parse_sequence(text, "seq.json", reg);
    ops::Recipe r = ops::parse_recipe("bf16");
    ops::apply_recipe(def, r);
    ops::infer(def, {4, 10});
  } catch (const Error& e) {
    if (st) *st = e.status();
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("cross_entropy: attributes, their defaults and the labels' extra input", "[ops][cross_entropy]") {
  ops::Registry reg;
  auto def = ops::parse_sequence(seq(R"([{"op": "cross_entropy"}])"), "seq.json", reg);
  REQUIRE(def.ops.size() == 1);
  const auto& a = def.ops[0].attrs;
  CHECK(a["reduction"] == "mean");
  CHECK(a["ignore_index"] == -100);
  CHECK(a["label_smoothing"] == 0.0);
  CHECK(a["z_loss"] == 0.0);
  CHECK(a["softcap"] == 0.0);
  CHECK(a["label_dtype"] == "int64");
  CHECK(def.extra_inputs == 1);
  CHECK(def.nograd_extra_inputs == std::vector<int>{0});

  auto ops = ops::infer(def, {7, 50257});
  CHECK(ops[0].family == ops::Family::loss);
  CHECK(ops[0].out == ops::Shape{1});
  CHECK(ops[0].params.empty());
  CHECK(ops[0].extra_slot == 0);
  REQUIRE(ops[0].extra_input);
  CHECK(ops[0].extra_input->name == "labels");
  CHECK(ops[0].extra_input->dtype == ops::DType::i64);
  CHECK(ops[0].extra_input->shape == ops::Shape{7});
  CHECK(ops[0].saved == std::vector<ops::SavedKind>{ops::SavedKind::input, ops::SavedKind::logsumexp});
}

TEST_CASE("cross_entropy: shapes per reduction, labels after the residual inputs", "[ops][cross_entropy]") {
  ops::Registry reg;
  auto def = ops::parse_sequence(
      seq(R"([{"op": "add_extra_input"}, {"op": "cross_entropy", "reduction": "none", "label_dtype": "int32"}])"),
      "seq.json", reg);
  CHECK(def.extra_inputs == 2);
  CHECK(def.nograd_extra_inputs == std::vector<int>{1});
  auto ops = ops::infer(def, {2, 3, 10});
  CHECK(ops[1].out == ops::Shape{2, 3});  // one loss per row, the input's shape without its last dim
  CHECK(ops[1].extra_slot == 1);
  CHECK(ops[1].extra_input->dtype == ops::DType::i32);
  CHECK(ops[1].extra_input->shape == ops::Shape{2, 3});
  // A single row of logits: one label, one loss.
  auto one = ops::infer(ops::parse_sequence(seq(R"([{"op": "cross_entropy", "reduction": "none"}])"), "s", reg), {10});
  CHECK(one[0].out == ops::Shape{1});
  CHECK(one[0].extra_input->shape == ops::Shape{1});
  for (const char* red : {"mean", "sum"}) {
    auto o = ops::infer(
        ops::parse_sequence(seq(std::string(R"([{"op": "cross_entropy", "reduction": ")") + red + "\"}]"), "s", reg),
        {5, 1, 33});
    CHECK(o[0].out == ops::Shape{1});
    CHECK(o[0].extra_input->shape == ops::Shape{5, 1});
  }
}

TEST_CASE(
    "cross_entropy: bad attribute values are refused naming the op and "
    "the attribute",
    "[ops][cross_entropy]") {
  struct Case {
    const char* op;
    const char* want;
  } cases[] = {
      {R"({"op": "cross_entropy", "reduction": "avg"})",
       "attribute 'reduction' of op 'cross_entropy': expected one of "
       "mean|sum|none, got \"avg\""},
      {R"({"op": "cross_entropy", "label_smoothing": 1})",
       "attribute 'label_smoothing' of op 'cross_entropy': expected a value < "
       "1, got 1"},
      {R"({"op": "cross_entropy", "label_smoothing": -0.1})",
       "attribute 'label_smoothing' of op 'cross_entropy': expected a value >= "
       "0, got -0.1"},
      {R"({"op": "cross_entropy", "z_loss": -1e-4})",
       "attribute 'z_loss' of op 'cross_entropy': expected a value >= 0"},
      {R"({"op": "cross_entropy", "softcap": -30})",
       "attribute 'softcap' of op 'cross_entropy': expected a value >= 0"},
      {R"({"op": "cross_entropy", "softcap": 1e-40})",
       "attribute 'softcap' of op 'cross_entropy': expected 0 or a number of "
       "magnitude"},
      {R"({"op": "cross_entropy", "z_loss": 1e39})",
       "attribute 'z_loss' of op 'cross_entropy': expected a number within "
       "float range"},
      {R"({"op": "cross_entropy", "ignore_index": 1.5})",
       "attribute 'ignore_index' of op 'cross_entropy': expected an integer, "
       "got 1.5"},
      {R"({"op": "cross_entropy", "ignore_index": "-100"})",
       "attribute 'ignore_index' of op 'cross_entropy': expected an integer"},
      {R"({"op": "cross_entropy", "label_dtype": "int8"})",
       "attribute 'label_dtype' of op 'cross_entropy': expected one of "
       "int64|int32, got \"int8\""},
      {R"({"op": "cross_entropy", "reducton": "sum"})",
       "unknown attribute 'reducton' for op 'cross_entropy'; known attributes: "
       "reduction, ignore_index"},
      {R"({"op": "cross_entropy", "label_dtype": "int32", "ignore_index": 3000000000})",
       "op 0 (cross_entropy): ignore_index = 3000000000 does not fit the int32 "
       "labels"},
  };
  for (const auto& c : cases) {
    Status st = Status::ok;
    const std::string err = error_of(seq(std::string("[") + c.op + "]"), &st);
    INFO(c.op << "\n" << err);
    CHECK_THAT(err, Catch::Contains(c.want));
    CHECK(st == Status::invalid_argument);
  }
  CHECK(error_of(seq(
            R"([{"op": "cross_entropy", "reduction": "sum", "ignore_index": 0, "label_smoothing": 0.1,
                          "z_loss": 1e-4, "softcap": 30, "label_dtype": "int32"}])")) == "");
}

TEST_CASE("cross_entropy must be the last op, and has no FP8 form", "[ops][cross_entropy]") {
  Status st = Status::ok;
  std::string err = error_of(seq(R"([{"op": "gelu"}, {"op": "cross_entropy"}, {"op": "identity"}])"), &st);
  CHECK(st == Status::invalid_argument);
  CHECK_THAT(err, Catch::StartsWith("seq.json:1:") &&
                      Catch::Contains("op 1 (cross_entropy) must be the sequence's last op") &&
                      Catch::Contains("op 2 (identity) follows it: end the sequence at op 1"));
  ops::Registry reg;
  for (const char* r : {"fp8_delayed", "fp8_current"}) {
    auto def = ops::parse_sequence(seq(R"([{"op": "layernorm"}, {"op": "cross_entropy"}])"), "seq.json", reg);
    ops::Recipe recipe = ops::parse_recipe(r);
    try {
      ops::apply_recipe(def, recipe);
      FAIL("no error under " << r);
    } catch (const Error& e) {
      CHECK(e.status() == Status::unsupported);
      CHECK_THAT(e.what(), Catch::Contains("op 1 (cross_entropy) under recipe " + std::string(r)) &&
                               Catch::Contains("a loss has no FP8 form"));
    }
  }
}
