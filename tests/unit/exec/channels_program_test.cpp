// Channels through planning and lowering: the Llama- and GPT-2-style MLP blocks (tools/examples/*_block.json,
// one sequence each with a hidden "residual" channel) planned under bf16 / fp8_delayed / fp8_current,
// training and inference, against golden plans (tests/golden/plans/blocks.txt; JITFUSE_UPDATE_GOLDEN=1
// rewrites it); a channel's buffers; the fusions a channel must not take.
#include <catch2/catch.hpp>

#include <fstream>
#include <sstream>

#include "common/env.hpp"
#include "exec/lower/compile.hpp"
#include "fuser/explain.hpp"
#include "rules/rule.hpp"

using namespace jitfuse;

namespace {

const rules::RuleSet& builtins() {
  static const rules::RuleSet rs = rules::RuleSet::with_builtins();
  return rs;
}

std::string read(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

std::shared_ptr<const exec::Program> program_of(const std::string& text, const std::string& recipe, bool training,
                                                const ops::Shape& shape) {
  auto def = ops::parse_sequence(text, "<test>", builtins().registry());
  exec::CompileOptions o;
  o.arch = 90;
  o.training = training;
  return exec::compile(def, ops::parse_recipe(recipe), shape, o, builtins());
}

std::string groups_text(const exec::Program& p) {
  std::string out;
  for (const auto* dir : {&p.plan.forward, &p.plan.backward}) {
    if (dir == &p.plan.backward && !p.training) break;  // inference runs the forward only
    out += dir == &p.plan.forward ? "  forward:" : "  backward:";
    for (const auto& g : *dir)
      out += " [" + fuser::group_ops(g, p.ops) + (g.rule.empty() ? "" : " = " + g.rule) + "]";
    out += "\n";
  }
  return out;
}

std::string seq(const std::string& ops_json) {
  return R"({"format": "jitfuse.sequence/1", "name": "t", "ops": )" + ops_json + "}";
}

bool has_group(const std::vector<fuser::Group>& gs, const std::string& rule) {
  for (const auto& g : gs)
    if (g.rule == rule) return true;
  return false;
}

}  // namespace

TEST_CASE("the Llama and GPT-2 MLP blocks plan as their golden plans in every recipe", "[exec][channels][golden]") {
  const std::string golden_path = JF_SOURCE_DIR "/tests/golden/plans/blocks.txt";
  std::string text;
  for (const char* block : {"llama_mlp_block", "gpt2_mlp_block"}) {
    const std::string src = read(std::string(JF_SOURCE_DIR) + "/tools/examples/" + block + ".json");
    REQUIRE_FALSE(src.empty());
    for (const char* recipe : {"bf16", "fp8_delayed", "fp8_current"})
      for (bool training : {true, false}) {
        auto p = program_of(src, recipe, training, {512, 1024});
        text += std::string("===== ") + block + " " + recipe + (training ? " training" : " inference") + "\n" +
                groups_text(*p);
      }
  }
  if (env::flag("JITFUSE_UPDATE_GOLDEN")) {
    std::ofstream(golden_path, std::ios::binary) << text;
    WARN("golden plans rewritten: " << golden_path);
    return;
  }
  INFO(text);
  CHECK(read(golden_path) == text);
}

TEST_CASE("a block's channel is the program's own buffer and its fusions are taken", "[exec][channels]") {
  const std::string src = read(JF_SOURCE_DIR "/tools/examples/llama_mlp_block.json");
  auto p = program_of(src, "bf16", true, {512, 1024});
  // One input, one output: no caller extra tensor at all.
  CHECK(p->extra_in.empty());
  CHECK(p->extra_out.empty());
  int value = -1, grad = -1;
  for (const auto& b : p->buffers) {
    if (b.name == "channel residual") value = b.id;
    if (b.name == "grad channel residual") grad = b.id;
  }
  REQUIRE(value >= 0);
  CHECK(p->buffer(value).storage == exec::Storage::fwd_arena);
  // The channel's only reader passes its gradient through (as PyTorch's residual add): the channel's
  // gradient is grad_output itself, and no kernel runs the add's backward.
  CHECK(grad < 0);
  for (const auto& s : p->backward)
    CHECK((s.kind != exec::Step::Kind::kernel || s.kernel->gen.kernel.find("add_extra_input") == std::string::npos));
  CHECK(p->gradients[5] == p->grad_output);
  // Two readers: their gradients are summed into the channel's own gradient buffer.
  auto q = program_of(seq(R"([{"op": "make_extra_output", "channel": "r"}, {"op": "gelu"},
                              {"op": "add_extra_input", "channel": "r"}, {"op": "silu"},
                              {"op": "add_extra_input", "channel": "r"}])"),
                      "bf16", true, {16, 64});
  int qgrad = -1;
  for (const auto& b : q->buffers)
    if (b.name == "grad channel r") qgrad = b.id;
  REQUIRE(qgrad >= 0);
  CHECK(q->buffer(qgrad).storage == exec::Storage::bwd_arena);
  CHECK(has_group(p->plan.forward, "fork_norm"));        // fork + rmsnorm: one kernel writes both
  CHECK(has_group(p->plan.forward, "linear_residual"));  // down_proj + add: C = the channel, beta = 1
  CHECK(has_group(p->plan.backward, "norm_residual_bwd"));
  bool residual_reads_channel = false;
  for (const auto& s : p->forward)
    if (s.kind == exec::Step::Kind::gemm && s.gemm.c == value) residual_reads_channel = true;
  CHECK(residual_reads_channel);
}

TEST_CASE("one kernel never both writes and reads a channel, and its refusal is explained", "[exec][channels]") {
  // Two readers of one channel side by side: pointwise_chain would put both in one kernel (aliasing pointers).
  auto p = program_of(seq(R"([{"op": "make_extra_output", "channel": "r"}, {"op": "gelu"},
                              {"op": "add_extra_input", "channel": "r"}, {"op": "add_extra_input", "channel": "r"}])"),
                      "bf16", true, {16, 64});
  bool refused = false;
  for (const auto& d : p->plan.decisions)
    if (!d.taken && d.reason.find("use channel 'r'") != std::string::npos) refused = true;
  CHECK(refused);
  for (const auto* dir : {&p->plan.forward, &p->plan.backward})
    for (const auto& g : *dir) {
      int uses = 0;
      for (int i = g.begin; i < g.end; ++i) uses += p->ops[i].channel == "r";
      CHECK(uses <= 1);
    }
}

TEST_CASE("a returned channel that is also read keeps its backward off DGRAD_ACCUMULATE", "[exec][channels]") {
  auto p = program_of(seq(R"([{"op": "make_extra_output", "channel": "r", "returned": true},
                              {"op": "linear", "in_features": 64, "out_features": 64},
                              {"op": "add_extra_input", "channel": "r"}])"),
                      "bf16", true, {16, 64});
  CHECK_FALSE(has_group(p->plan.backward, "extra_output_linear"));
  bool explained = false;
  for (const auto& d : p->plan.decisions)
    if (d.rule == "extra_output_linear" && !d.taken && d.reason.find("two parts") != std::string::npos) explained = true;
  CHECK(explained);
  // Without "returned", the fork's gradient is the readers' alone: cuBLASLt accumulates it.
  auto q = program_of(seq(R"([{"op": "make_extra_output", "channel": "r"},
                              {"op": "linear", "in_features": 64, "out_features": 64},
                              {"op": "add_extra_input", "channel": "r"}])"),
                      "bf16", true, {16, 64});
  CHECK(has_group(q->plan.backward, "extra_output_linear"));
}
