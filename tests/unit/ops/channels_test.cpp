// Named channels in the sequence format (docs/ops.md#channels): parsing, every refusal with its
// file:line:col and op index, the caller's slots, and the wiring infer gives each op.
#include <catch2/catch.hpp>

#include <chrono>

#include "common/error.hpp"
#include "ops/sequence.hpp"

using namespace jitfuse;

namespace {

std::string seq(const std::string& ops_json, const std::string& top = "") {
  return "{\"format\": \"jitfuse.sequence/1\",\n" + top + "\"ops\": " + ops_json + "}";
}

std::string error_of(const std::string& text, const ops::Shape& shape = {4, 8}) {
  ops::Registry reg;
  try {
    auto def = ops::parse_sequence(text, "seq.json", reg);
    ops::infer(def, shape);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

std::vector<ops::Op> wired(const std::string& text, ops::SequenceDef* out = nullptr, ops::Shape shape = {4, 8}) {
  ops::Registry reg;
  auto def = ops::parse_sequence(text, "seq.json", reg);
  if (out) *out = def;
  return ops::infer(def, shape);
}

}  // namespace

TEST_CASE("a hidden channel: one input, one output, its reader wired to its fork", "[ops][channels]") {
  ops::SequenceDef def;
  auto ops = wired(seq(R"([{"op": "make_extra_output", "channel": "residual"}, {"op": "gelu"},
                           {"op": "add_extra_input", "channel": "residual"}])"), &def);
  CHECK(def.extra_inputs == 0);
  CHECK(def.extra_outputs == 0);
  CHECK(ops[0].channel == "residual");
  CHECK(ops[0].extra_slot == -1);
  CHECK_FALSE(ops[0].grad_two_parts);
  CHECK(ops[2].channel_src == 0);
  CHECK(ops[2].extra_slot == -1);
  CHECK_FALSE(ops[2].grad_accumulate);
  CHECK(def.canonical.find("\"channel\":\"residual\"") != std::string::npos);
}

TEST_CASE("fan-out, returned and caller channels number the caller's slots as documented", "[ops][channels]") {
  ops::SequenceDef def;
  // ops: 0 add(skip: caller, slot 0) 1 fork r (returned: extra output 0) 2 fork (plain: extra output 1)
  //      3 gelu 4 add r 5 add (plain: extra input 1) 6 add r 7 add skip
  auto ops = wired(seq(R"([{"op": "add_extra_input", "channel": "skip"},
                           {"op": "make_extra_output", "channel": "r", "returned": true},
                           {"op": "make_extra_output"}, {"op": "gelu"},
                           {"op": "add_extra_input", "channel": "r"}, {"op": "add_extra_input"},
                           {"op": "add_extra_input", "channel": "r"},
                           {"op": "add_extra_input", "channel": "skip"}])",
                       R"("input_channels": ["skip"],)"),
                   &def);
  CHECK(def.extra_inputs == 2);
  CHECK(def.extra_outputs == 2);
  CHECK(ops[0].extra_slot == 0);
  CHECK(ops[0].channel_src == 0);       // the caller's channel: its first reader owns the slot
  CHECK(ops[0].grad_accumulate);        // op 7 writes the gradient first, op 0 adds to it
  CHECK(ops[1].extra_slot == 0);
  CHECK(ops[1].returned);
  CHECK(ops[1].grad_two_parts);         // returned and read: the caller's gradient and the readers'
  CHECK(ops[2].extra_slot == 1);
  CHECK(ops[4].channel_src == 1);
  CHECK(ops[4].grad_accumulate);
  CHECK(ops[5].extra_slot == 1);
  CHECK(ops[6].channel_src == 1);
  CHECK_FALSE(ops[6].grad_accumulate);  // the last reader: first in the backward
  CHECK(ops[7].channel_src == 0);
  CHECK(ops[7].extra_slot == -1);
  CHECK_FALSE(ops[7].grad_accumulate);
}

TEST_CASE("the parser records the wiring it numbered: slots with their kinds, channels with readers",
          "[ops][channels]") {
  ops::SequenceDef def;
  // The ops of the test above, then cross_entropy's labels as the last extra input.
  auto ops = wired(seq(R"([{"op": "add_extra_input", "channel": "skip"},
                           {"op": "make_extra_output", "channel": "r", "returned": true},
                           {"op": "make_extra_output"}, {"op": "gelu"},
                           {"op": "add_extra_input", "channel": "r"}, {"op": "add_extra_input"},
                           {"op": "add_extra_input", "channel": "r"},
                           {"op": "add_extra_input", "channel": "skip"}, {"op": "cross_entropy"}])",
                       R"("input_channels": ["skip"],)"),
                   &def, {4, 8});
  REQUIRE(def.extra_input_slots.size() == 3);
  REQUIRE(def.extra_output_slots.size() == 2);
  CHECK(def.extra_inputs == 3);
  CHECK(def.extra_outputs == 2);
  auto is = [](const ops::WiringSlot& s, int op, const char* kind, const char* channel) {
    return s.op == op && s.index == op && s.kind == kind && s.channel == channel;
  };
  CHECK(is(def.extra_input_slots[0], 0, "channel", "skip"));
  CHECK(is(def.extra_input_slots[1], 5, "add", ""));
  CHECK(is(def.extra_input_slots[2], 8, "labels", ""));
  CHECK(def.nograd_extra_inputs == std::vector<int>{2});
  CHECK(is(def.extra_output_slots[0], 1, "returned", "r"));
  CHECK(is(def.extra_output_slots[1], 2, "output", ""));
  // The numbering infer gives each op is the recorded one.
  for (size_t k = 0; k < def.extra_input_slots.size(); ++k)
    CHECK(ops[static_cast<size_t>(def.extra_input_slots[k].index)].extra_slot == static_cast<int>(k));
  for (size_t k = 0; k < def.extra_output_slots.size(); ++k)
    CHECK(ops[static_cast<size_t>(def.extra_output_slots[k].index)].extra_slot == static_cast<int>(k));
  REQUIRE(def.channels.size() == 2);  // the input channel first, then by source
  CHECK(def.channels[0].name == "skip");
  CHECK(def.channels[0].source == -1);
  CHECK(def.channels[0].readers == std::vector<int>{0, 7});
  CHECK_FALSE(def.channels[0].returned);
  CHECK(def.channels[1].name == "r");
  CHECK(def.channels[1].source == 1);
  CHECK(def.channels[1].readers == std::vector<int>{4, 6});
  CHECK(def.channels[1].returned);
  const auto j = ops::wiring_json(def);
  CHECK(j["extra_inputs"][0] == nlohmann::json{{"slot", 0}, {"op", 0}, {"index", 0}, {"kind", "channel"},
                                               {"channel", "skip"}});
  CHECK(j["extra_inputs"][1]["channel"].is_null());
  CHECK(j["extra_inputs"][2]["kind"] == "labels");
  CHECK(j["extra_outputs"][0]["kind"] == "returned");
  CHECK(j["channels"][1] == nlohmann::json{{"name", "r"}, {"source", 1}, {"readers", {4, 6}}, {"returned", true}});
  CHECK(j["input_channels"] == nlohmann::json{"skip"});
}

TEST_CASE("the wiring counts document ops and sequence ops apart after an inserted collective", "[ops][channels]") {
  ops::SequenceDef def;
  ops::Registry reg;
  // A row-parallel linear is followed by the all_reduce the parser inserts: op 1 of the document is op 2.
  def = ops::parse_sequence(seq(R"([{"op": "linear", "in_features": 8, "out_features": 8, "tensor_parallel": "row"},
                                    {"op": "add_extra_input"}])"),
                            "seq.json", reg);
  REQUIRE(def.ops.size() == 3);
  REQUIRE(def.extra_input_slots.size() == 1);
  CHECK(def.extra_input_slots[0].op == 1);
  CHECK(def.extra_input_slots[0].index == 2);
  CHECK(def.extra_input_slots[0].kind == "add");
  const auto empty = ops::wiring_json(ops::parse_sequence(seq(R"([{"op": "gelu"}])"), "seq.json", reg));
  CHECK(empty == nlohmann::json{{"extra_inputs", nlohmann::json::array()}, {"extra_outputs", nlohmann::json::array()},
                                {"channels", nlohmann::json::array()}, {"input_channels", nlohmann::json::array()}});
}

TEST_CASE("sequences without channels parse exactly as before", "[ops][channels]") {
  ops::SequenceDef def;
  auto ops = wired(seq(R"([{"op": "make_extra_output"}, {"op": "add_extra_input"}, {"op": "add_extra_input"}])"), &def);
  CHECK(def.extra_inputs == 2);
  CHECK(def.extra_outputs == 1);
  CHECK(ops[1].extra_slot == 0);
  CHECK(ops[2].extra_slot == 1);
  CHECK(ops[1].channel_src == -1);
  CHECK(def.canonical.find("channel") == std::string::npos);
}

TEST_CASE("every channel refusal names the file:line:col, the op and what to do", "[ops][channels]") {
  struct Case {
    std::string text;
    std::vector<const char*> needles;
  } cases[] = {
      {seq(R"([{"op": "gelu"}, {"op": "add_extra_input", "channel": "r"}])"),
       {"seq.json:2:", "op 1 (add_extra_input)", "channel 'r' is read before anything writes it", "input_channels"}},
      {seq(R"([{"op": "add_extra_input", "channel": "r"}, {"op": "make_extra_output", "channel": "r", "returned": true}])"),
       {"op 0 (add_extra_input)", "its make_extra_output is op 1, after this reader"}},
      {seq(R"([{"op": "make_extra_output", "channel": "r"}, {"op": "make_extra_output", "channel": "r"},
               {"op": "add_extra_input", "channel": "r"}])"),
       {"op 1 (make_extra_output)", "channel 'r' already has a source (op 0)", "one source"}},
      {seq(R"([{"op": "make_extra_output", "channel": "skip"}, {"op": "add_extra_input", "channel": "skip"}])",
           R"("input_channels": ["skip"],)"),
       {"op 0 (make_extra_output)", "already has a source (\"input_channels\")"}},
      {seq(R"([{"op": "make_extra_output", "channel": "r"}, {"op": "gelu"}])"),
       {"op 0 (make_extra_output)", "channel 'r' is never read", "\"returned\": true"}},
      {seq(R"([{"op": "gelu"}])", R"("input_channels": ["skip"],)"),
       {"seq.json:2:", "input channel 'skip' is never read"}},
      {seq(R"([{"op": "add_extra_input", "channel": "a"}])", R"("input_channels": ["a", "a"],)"),
       {"channel 'a' is declared twice"}},
      {seq(R"([{"op": "add_extra_input", "channel": "a"}])", R"("input_channels": "a",)"),
       {"\"input_channels\" must be an array"}},
      {seq(R"([{"op": "make_extra_output", "channel": "bad name"}, {"op": "add_extra_input", "channel": "bad name"}])"),
       {"op 0 (make_extra_output)", "a channel name is a string of 1 to 64 characters", "\"bad name\""}},
      {seq(R"([{"op": "make_extra_output", "channel": 3}])"), {"op 0", "a channel name", "3"}},
      {seq(R"([{"op": "make_extra_output", "channel": ""}])"), {"op 0", "a channel name"}},
      {seq(R"([{"op": "make_extra_output", "channel": ")" + std::string(65, 'x') + R"("}])"), {"a channel name"}},
      {seq(R"([{"op": "gelu", "channel": "r"}])"),
       {"op 0 (gelu)", "\"channel\" belongs to make_extra_output", "not to gelu"}},
      {seq(R"([{"op": "add_extra_input", "returned": true}])"), {"op 0 (add_extra_input)", "\"returned\" belongs to make_extra_output"}},
      {seq(R"([{"op": "make_extra_output", "returned": true}])"), {"op 0 (make_extra_output)", "\"returned\" needs a \"channel\""}},
      {seq(R"([{"op": "make_extra_output", "channel": "r", "returned": 1}])"), {"\"returned\" must be true or false"}},
      {seq(R"([{"op": "make_extra_output", "channel": "r"}, {"op": "linear", "in_features": 8, "out_features": 4},
               {"op": "add_extra_input", "channel": "r"}])"),
       {"op 2 (add_extra_input)", "channel 'r' holds 4x8 (from op 0 (make_extra_output)), this op's input is 4x4"}},
  };
  for (const auto& c : cases) {
    const std::string e = error_of(c.text);
    INFO(c.text << "\n-> " << e);
    REQUIRE_FALSE(e.empty());
    for (const char* n : c.needles) CHECK(e.find(n) != std::string::npos);
  }
}

TEST_CASE("wiring stays linear in the number of a channel's readers", "[ops][channels]") {
  // One fork and 40,000 readers of its channel: each reader is wired with one lookup (a quadratic scan
  // over the earlier ops would take minutes here).
  std::string ops = R"([{"op": "make_extra_output", "channel": "r"})";
  for (int i = 0; i < 40000; ++i) ops += R"(, {"op": "add_extra_input", "channel": "r"})";
  ops += "]";
  const auto t0 = std::chrono::steady_clock::now();
  ops::SequenceDef def;
  auto wired_ops = wired(seq(ops), &def);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  REQUIRE(wired_ops.size() == 40001);
  CHECK(wired_ops[0].channel_readers == 40000);
  CHECK(wired_ops[1].grad_accumulate);
  CHECK_FALSE(wired_ops[40000].grad_accumulate);
  CHECK(wired_ops[40000].channel_src == 0);
  WARN("parse + infer of 40,001 channel ops: " << s << " s");
  CHECK(s < 20.0);  // a loaded 2-core CI machine; measured well under a second
}
