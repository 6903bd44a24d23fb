// The moe ops in sequences (issue 43; docs/ops.md#mixture-of-experts), planned without GPUs: moe_permute's routing
// kernels and permutation, moe_unpermute's combine and their backwards as program steps; the routing saved in
// training and in the forward's arena in inference; the extra inputs' dtypes and shapes (int indices without a
// gradient, fp32 probabilities with one); explain's wiring; and every error of the pairing, the shapes and the
// recipe, each naming the op.
#include <algorithm>

#include <catch2/catch.hpp>

#include "common/error.hpp"
#include "common/json_util.hpp"
#include "exec/lower/compile.hpp"
#include "fuser/explain.hpp"
#include "rules/rule.hpp"

using namespace jitfuse;

namespace {

const rules::RuleSet& builtins() {
  static const rules::RuleSet rs = rules::RuleSet::with_builtins();
  return rs;
}

std::string block(const std::string& permute = R"("num_experts": 8, "top_k": 2)", const std::string& middle = R"({"op": "gelu"},)") {
  return R"({"ops": [{"op": "moe_permute", )" + permute + "}, " + middle + R"({"op": "moe_unpermute"}]})";
}

std::shared_ptr<const exec::Program> program_of(const std::string& text, const ops::Shape& shape, bool training = true,
                                                const char* recipe = "bf16") {
  auto def = ops::parse_sequence(text, "<moe>", builtins().registry());
  auto r = ops::parse_recipe(recipe);
  ops::apply_recipe(def, r);
  exec::CompileOptions o;
  o.arch = 90;
  o.training = training;
  return exec::compile(ops::infer(def, shape, {}), def.name, r, o, builtins());
}

std::vector<std::string> kernels(const std::vector<exec::Step>& steps) {
  std::vector<std::string> out;
  for (const auto& s : steps)
    if (s.kind == exec::Step::Kind::kernel) out.push_back(s.kernel->gen.kernel);
  return out;
}

}  // namespace

TEST_CASE("moe_permute and moe_unpermute lower to the routing kernels and their backwards", "[exec][moe]") {
  auto p = program_of(block(R"("num_experts": 8, "top_k": 2, "capacity": 100, "index_dtype": "int32")"), {300, 256});
  CHECK(p->ops[0].out == ops::Shape{600, 256});
  CHECK(p->ops[2].out == ops::Shape{300, 256});
  CHECK(kernels(p->forward) == std::vector<std::string>{"jf_moe_count_fwd", "jf_moe_scan_fwd", "jf_moe_scatter_fwd",
                                                        "jf_moe_permute_fwd", "jf_gelu_fwd", "jf_moe_unpermute_fwd"});
  CHECK(kernels(p->backward) ==
        std::vector<std::string>{"jf_moe_unpermute_bwd", "jf_gelu_bwd", "jf_moe_permute_bwd"});
  for (const auto& s : p->forward) {
    if (s.kind != exec::Step::Kind::kernel || !s.kernel->spec.moe) continue;
    const auto& m = *s.kernel->spec.moe;
    CHECK(m.route_op == 0);
    CHECK(m.experts == 8);
    CHECK(m.capacity == 100);
    CHECK_FALSE(m.idx_i64);
    CHECK(s.kernel->rows == 300);  // every moe kernel's rows: the tokens
  }
  // The routing: int32, saved for the backward; the indices (int32, no gradient), the probabilities (fp32) and
  // their gradient (fp32), each [tokens, top_k].
  bool route = false;
  for (int id : p->saved_set()) {
    const auto& b = p->buffer(id);
    if (b.name != "op0.route") continue;
    route = true;
    CHECK(b.dtype == ops::DType::i32);
    CHECK(b.bytes >= static_cast<size_t>(codegen::moe_route_ints(300, 2, 8)) * 4);
  }
  CHECK(route);
  REQUIRE(p->extra_in.size() == 2);
  CHECK(p->buffer(p->extra_in[0]).dtype == ops::DType::i32);
  CHECK(p->buffer(p->extra_in[0]).rows * p->buffer(p->extra_in[0]).cols == 600);
  CHECK(p->buffer(p->extra_in[1]).dtype == ops::DType::f32);
  REQUIRE(p->grad_extra_in.size() == 2);
  CHECK(p->grad_extra_in[0] < 0);  // the indices have no gradient
  CHECK(p->buffer(p->grad_extra_in[1]).dtype == ops::DType::f32);
  CHECK(p->buffer(p->grad_extra_in[1]).rows * p->buffer(p->grad_extra_in[1]).cols == 600);
  // Inference: the routing lives in the forward's arena; nothing is saved.
  auto inf = program_of(block(), {300, 256}, false);
  CHECK(inf->saved_set().empty());
  CHECK(kernels(inf->forward).size() == 6);
}

TEST_CASE("explain shows the routing inputs and which one takes a gradient", "[exec][moe]") {
  auto def = ops::parse_sequence(block(), "<moe>", builtins().registry());
  CHECK(def.nograd_extra_inputs == std::vector<int>{0});
  auto ops = ops::infer(def, {300, 256}, {});
  CHECK(fuser::op_wiring(ops[0], ops) == "<- indices: extra input 0 (int64 300x2, no gradient)");
  CHECK(fuser::op_wiring(ops[2], ops) == "<- probs: extra input 1 (fp32 300x2, with a gradient, the routing of op 0)");
}

TEST_CASE("moe sequences that cannot run are refused with the op and the fix", "[exec][moe]") {
  auto infer = [](const std::string& text, ops::Shape shape = {300, 256}) {
    auto def = ops::parse_sequence(text, "<moe>", builtins().registry());
    return ops::infer(def, shape, {});
  };
  CHECK_THROWS_WITH(infer(R"({"ops": [{"op": "gelu"}, {"op": "moe_unpermute"}]})"),
                    Catch::Contains("op 1 (moe_unpermute): no moe_permute before it"));
  CHECK_THROWS_WITH(infer(block(R"("num_experts": 8, "top_k": 2)", R"({"op": "moe_unpermute"},)")),
                    Catch::Contains("is combined by op 1 (moe_unpermute) already"));
  CHECK_THROWS_WITH(infer(block(R"("num_experts": 4, "top_k": 5)")),
                    Catch::Contains("top_k = 5 is more than num_experts = 4"));
  CHECK_THROWS_WITH(infer(block(), {300, 100}), Catch::Contains("pad it to a multiple of 8"));
  CHECK_THROWS_WITH(infer(block(R"("num_experts": 8, "top_k": 2)", R"({"op": "reshape", "shape": [300, 512]},)")),
                    Catch::Contains("its input has 300 rows; the routing of op 0 (moe_permute) has 300 tokens and permutes them to 600 rows"));
  CHECK_THROWS_WITH(ops::parse_sequence(block(R"("num_experts": 8, "top_k": 2, "index_dtype": "int16")"), "<moe>",
                                        builtins().registry()),
                    Catch::Contains("index_dtype"));
  CHECK_THROWS_WITH(program_of(block(), {300, 256}, true, "fp8_current"),
                    Catch::Contains("the token routing has no FP8 form yet"));
}

TEST_CASE("moe_unpermute_residual: the combine adds the residual channel in the same kernel", "[exec][moe]") {
  auto p = program_of(R"({"ops": [{"op": "make_extra_output", "channel": "res"},
      {"op": "moe_permute", "num_experts": 8, "top_k": 2}, {"op": "gelu"}, {"op": "moe_unpermute"},
      {"op": "add_extra_input", "channel": "res"}]})", {300, 256});
  REQUIRE(p->plan.forward.back().rule == "moe_unpermute_residual");
  CHECK(p->plan.forward.back().begin == 3);
  const auto& last = p->forward.back();
  REQUIRE(last.kind == exec::Step::Kind::kernel);
  CHECK(last.kernel->spec.moe->residual);
  CHECK(last.kernel->spec.moe->residual_op == 4);
  CHECK_THAT(last.kernel->gen.source, Catch::Contains("jf_load8<DT, JF_VEC>(residual + t * 256 + c0, s);"));
  bool reads_channel = false;  // the residual argument is the fork's channel buffer
  for (const auto& a : last.kernel->args)
    if (a.kind == exec::KArg::Kind::buffer && a.buffer >= 0 && p->buffer(a.buffer).name.find("res") != std::string::npos)
      reads_channel = true;
  CHECK(reads_channel);
  // The backward: the ops alone (the add's gradient into the channel, the unpermute's backward).
  for (const auto& g : p->plan.backward) CHECK(g.rule != "moe_unpermute_residual");
}

TEST_CASE("the expert block: padded routing, grouped linears as one strided-batched GEMM per pass and kind", "[exec][moe]") {
  auto p = program_of(R"({"ops": [{"op": "make_extra_output", "channel": "res"}, {"op": "rmsnorm"},
      {"op": "moe_permute", "num_experts": 8, "top_k": 2, "capacity": 96, "layout": "padded"},
      {"op": "grouped_linear", "num_groups": 8, "in_features": 256, "out_features": 1024}, {"op": "swiglu"},
      {"op": "grouped_linear", "num_groups": 8, "in_features": 512, "out_features": 256},
      {"op": "moe_unpermute"}, {"op": "add_extra_input", "channel": "res"}]})", {300, 256});
  CHECK(p->ops[2].out == ops::Shape{768, 256});  // 8 experts x capacity 96
  CHECK(p->ops[3].params.at(0).shape == ops::Shape{8, 1024, 256});
  int fwd = 0, dgrad = 0, wgrad = 0;
  for (const auto* pass : {&p->forward, &p->backward})
    for (const auto& s : *pass) {
      if (s.kind != exec::Step::Kind::gemm) continue;
      const auto& c = s.gemm.call;
      CHECK(c.m == 96);       // one expert's rows
      CHECK(c.batch == 8);    // every expert in one strided-batched GEMM
      CHECK(s.gemm.a_offset == 0);
      CHECK(s.gemm.d_offset == 0);
      fwd += c.kind == cuda::GemmKind::fwd;
      dgrad += c.kind == cuda::GemmKind::dgrad;
      wgrad += c.kind == cuda::GemmKind::wgrad;
      const int64_t rows_a = 96 * (c.kind == cuda::GemmKind::fwd ? c.k : c.n), wt = c.n * c.k;
      CHECK(c.stride_a == rows_a);
      CHECK(c.stride_b == (c.kind == cuda::GemmKind::wgrad ? 96 * c.k : wt));
      CHECK(c.stride_d == (c.kind == cuda::GemmKind::fwd ? 96 * c.n : c.kind == cuda::GemmKind::dgrad ? 96 * c.k : wt));
      CHECK(s.gemm.flops() == 2 * 8 * 96 * c.n * c.k);
    }
  CHECK(fwd == 2);
  CHECK(dgrad == 2);
  CHECK(wgrad == 2);
  for (const auto& s : p->forward)
    if (s.kind == exec::Step::Kind::kernel && s.kernel->spec.moe) CHECK(s.kernel->spec.moe->padded);
  // The routing holds one src per padded row.
  for (int id : p->saved_set())
    if (p->buffer(id).name == "op2.route")
      CHECK(p->buffer(id).bytes >= static_cast<size_t>(codegen::moe_route_ints(300, 2, 8, 768)) * 4);
}

TEST_CASE("grouped_linear and the padded layout refuse what cannot run", "[exec][moe]") {
  auto infer = [](const std::string& text, ops::Shape shape = {300, 256}) {
    auto def = ops::parse_sequence(text, "<moe>", builtins().registry());
    return ops::infer(def, shape, {});
  };
  CHECK_THROWS_WITH(infer(R"({"ops": [{"op": "moe_permute", "num_experts": 8, "top_k": 2, "layout": "padded"},
      {"op": "moe_unpermute"}]})"), Catch::Contains("\"layout\": \"padded\" gives each expert `capacity` rows"));
  CHECK_THROWS_WITH(infer(R"({"ops": [{"op": "grouped_linear", "num_groups": 7, "in_features": 256,
      "out_features": 64}]})"), Catch::Contains("its 300 rows are not 7 equal groups"));
  CHECK_THROWS_WITH(infer(R"({"ops": [{"op": "grouped_linear", "num_groups": 3, "in_features": 128,
      "out_features": 64}]})"), Catch::Contains("in_features = 128 but the input's last dim is 256"));
  CHECK_THROWS_WITH(program_of(R"({"ops": [{"op": "grouped_linear", "num_groups": 3, "in_features": 256,
      "out_features": 64}]})", {300, 256}, true, "fp8_delayed"), Catch::Contains("no FP8 form yet"));
}

TEST_CASE("tools/examples/moe_block.json: Mixtral's expert block at 8192 tokens plans as one sequence", "[exec][moe]") {
  const auto text = json_util::read_file(std::string(JF_SOURCE_DIR) + "/tools/examples/moe_block.json");
  auto p = program_of(text, {8192, 4096});
  CHECK(p->ops[2].out == ops::Shape{8 * 2560, 4096});  // capacity 2560: 1.25 x 8192 x 2 / 8
  REQUIRE(p->plan.forward.size() == 4);  // fork_norm, permute, the grouped MLP (joint), unpermute + residual
  CHECK(p->plan.forward.front().rule == "fork_norm");
  CHECK(p->plan.forward[2].rule == "grouped_mlp_recompute");
  CHECK(p->plan.forward.back().rule == "moe_unpermute_residual");
  int gemms = 0;
  for (const auto* pass : {&p->forward, &p->backward})
    for (const auto& s : *pass) gemms += s.kind == exec::Step::Kind::gemm;
  CHECK(gemms == 2 * 3);  // two grouped linears x (forward, dgrad, wgrad), each one batched GEMM of the 8 experts
}

TEST_CASE("the dropless expert block: grouped linears after a packed permute read each expert's rows per call",
          "[exec][moe]") {
  const std::string text = R"({"ops": [{"op": "moe_permute", "num_experts": 4, "top_k": 2},
      {"op": "grouped_linear", "num_groups": 4, "in_features": 256, "out_features": 1024}, {"op": "swiglu"},
      {"op": "grouped_linear", "num_groups": 4, "in_features": 512, "out_features": 256},
      {"op": "moe_unpermute"}]})";
  for (const bool training : {true, false}) {
    auto p = program_of(text, {301, 256}, training);  // 602 routed rows: no multiple of the 4 groups needed
    CHECK(p->ops[1].out == ops::Shape{602, 1024});
    CHECK(p->ops[1].route_op == 0);
    CHECK(p->ops[1].route_packed);
    int route = -1, routed = 0;
    for (const auto* pass : {&p->forward, &p->backward})
      for (const auto& s : *pass) {
        if (s.kind != exec::Step::Kind::gemm) continue;
        const auto& g = s.gemm;
        REQUIRE(g.routed());
        ++routed;
        if (route < 0) route = g.route;
        CHECK(g.route == route);  // the permute's routing, in both passes
        CHECK(g.route_experts == 4);
        CHECK(g.route_splits == 2 * 602);  // after dest [T k] and src [T k]
        CHECK(g.call.m == 602);            // every expert's rows: the T k bound (explain's FLOPs)
        CHECK(g.route_weight == g.call.n * g.call.k);
        CHECK(g.a_offset == 0);
        CHECK(g.b_offset == 0);
        CHECK(g.d_offset == 0);
        switch (g.call.kind) {  // rows move with each expert's first row; the weight by expert
          case cuda::GemmKind::fwd:
            CHECK((g.a_row == g.call.k && g.b_row == 0 && g.d_row == g.call.n));
            break;
          case cuda::GemmKind::dgrad:
            CHECK((g.a_row == g.call.n && g.b_row == 0 && g.d_row == g.call.k));
            break;
          case cuda::GemmKind::wgrad:
            CHECK((g.a_row == g.call.n && g.b_row == g.call.k && g.d_row == 0));
            break;
        }
        CHECK_THAT(s.what, Catch::Contains("4 experts, each over its rows of op 0's routing"));
      }
    CHECK(routed == (training ? 2 * 3 : 2));  // one step per grouped linear and kind
    REQUIRE(route >= 0);
    CHECK(p->buffer(route).name == (training ? "op0.route" : "routing op0"));
    if (training) {  // the backward's GEMMs read the saved routing
      const auto saved = p->saved_set();
      CHECK(std::find(saved.begin(), saved.end(), route) != saved.end());
    }
  }
}

TEST_CASE("a grouped_linear inside an expert block has one group per expert", "[exec][moe]") {
  auto infer = [](const std::string& permute, int64_t groups) {
    auto def = ops::parse_sequence(R"({"ops": [{"op": "moe_permute", )" + permute +
                                       R"(}, {"op": "grouped_linear", "num_groups": )" + std::to_string(groups) +
                                       R"(, "in_features": 256, "out_features": 64}, {"op": "moe_unpermute"}]})",
                                   "<moe>", builtins().registry());
    return ops::infer(def, {300, 256}, {});
  };
  CHECK_THROWS_WITH(infer(R"("num_experts": 8, "top_k": 2)", 4),
                    Catch::Contains("num_groups = 4 but op 0 (moe_permute) routes to 8 experts"));
  CHECK_THROWS_WITH(infer(R"("num_experts": 8, "top_k": 2, "capacity": 90, "layout": "padded")", 6),
                    Catch::Contains("one group per expert"));
  CHECK_NOTHROW(infer(R"("num_experts": 8, "top_k": 2)", 8));
  // After the unpermute a grouped_linear is on its own again: equal groups.
  auto def = ops::parse_sequence(R"({"ops": [{"op": "moe_permute", "num_experts": 8, "top_k": 2},
      {"op": "moe_unpermute"}, {"op": "grouped_linear", "num_groups": 3, "in_features": 256, "out_features": 64}]})",
                                 "<moe>", builtins().registry());
  CHECK(ops::infer(def, {300, 256}, {})[2].route_op == -1);
}

TEST_CASE("grouped_mlp_recompute: the expert MLP saves no FC2 input and the backward recomputes it", "[exec][moe]") {
  const std::string text = R"({"ops": [{"op": "moe_permute", "num_experts": 4, "top_k": 2},
      {"op": "grouped_linear", "num_groups": 4, "in_features": 256, "out_features": 1024}, {"op": "swiglu"},
      {"op": "grouped_linear", "num_groups": 4, "in_features": 512, "out_features": 256},
      {"op": "moe_unpermute"}]})";
  auto p = program_of(text, {300, 256});
  REQUIRE(p->plan.forward.size() == 3);
  CHECK(p->plan.forward[1].rule == "grouped_mlp_recompute");
  CHECK(p->plan.backward.size() == 3);
  // Saved: x (FC1's input, op 1) and h (the swiglu's input, op 2), not a (FC2's input, boundary 3).
  bool saves_h = false;
  for (int id : p->saved_set()) {
    CHECK(id != p->values.at(3));
    saves_h = saves_h || id == p->values.at(2);
  }
  CHECK(saves_h);
  // The backward's first step after the unpermute's recomputes a from h with the swiglu's forward kernel.
  std::vector<std::string> k = kernels(p->backward);
  REQUIRE(k.size() >= 3);
  CHECK(k[0] == "jf_moe_unpermute_bwd");
  CHECK(k[1] == "jf_swiglu_fwd");
  CHECK(k[2] == "jf_swiglu_bwd");
  bool noted = false;
  for (const auto& s : p->forward)
    noted = noted || s.what.find("FC2's input (600 x 512) not saved, recomputed in the backward: saves 0.6 MiB") !=
                         std::string::npos;
  CHECK(noted);
  // Without the rule (inference, or the rule's condition) the plan saves a: compare the saved bytes.
  CHECK(p->saved_bytes > 0);
}
