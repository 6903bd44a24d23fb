// A linear's weight as the model stores it (issue 42: unmodified models without a per-step weight copy):
// weight_layout "in_out" (GPT-2's Conv1D, [in, out]) read by the GEMMs as it lies, and split_weight (a gated
// MLP's gate and up projections as two parameters) run as two GEMMs over the outputs' halves. The programs
// they plan, the float64 reference against the layouts it replaces, and every refusal with its reason.
#include <catch2/catch.hpp>

#include <random>

#include "exec/lower/compile.hpp"
#include "exec/ir/program.hpp"
#include "ops/sequence.hpp"
#include "reference/sequence.hpp"
#include "rules/rule.hpp"

using namespace jitfuse;

namespace {

const rules::RuleSet& builtins() {
  static const rules::RuleSet rs = rules::RuleSet::with_builtins();
  return rs;
}

std::vector<ops::Op> ops_of(const std::string& ops_json, const ops::Shape& shape, const char* recipe = "bf16") {
  auto def = ops::parse_sequence(R"({"ops": )" + ops_json + "}", "<layouts>", builtins().registry());
  auto r = ops::parse_recipe(recipe);
  ops::apply_recipe(def, r);
  return ops::infer(def, shape, {});
}

std::shared_ptr<const exec::Program> program_of(const std::string& ops_json, const ops::Shape& shape,
                                                bool training = true) {
  exec::CompileOptions o;
  o.arch = 90;
  o.training = training;
  return exec::compile(ops_of(ops_json, shape), "t", ops::parse_recipe("bf16"), o, builtins());
}

std::vector<const exec::GemmStep*> gemms(const std::vector<exec::Step>& steps) {
  std::vector<const exec::GemmStep*> out;
  for (const auto& s : steps)
    if (s.kind == exec::Step::Kind::gemm) out.push_back(&s.gemm);
  return out;
}

std::vector<std::string> rules_of(const std::vector<fuser::Group>& groups) {
  std::vector<std::string> out;
  for (const auto& g : groups) out.push_back(g.rule);
  return out;
}

reference::Vec random_vec(size_t n, std::mt19937_64& g) {
  std::uniform_real_distribution<double> u(-1, 1);
  reference::Vec v(n);
  for (auto& e : v) e = u(g);
  return v;
}

reference::Vec transposed(const reference::Vec& a, int64_t rows, int64_t cols) {
  reference::Vec t(a.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[static_cast<size_t>(c * rows + r)] = a[static_cast<size_t>(r * cols + c)];
  return t;
}

void require_close(const reference::Vec& a, const reference::Vec& b) {
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) REQUIRE(a[i] == Approx(b[i]).epsilon(1e-12).margin(1e-12));
}

const char* kGpt2Mlp = R"([
  {"op": "linear", "in_features": 64, "out_features": 256 %s},
  {"op": "bias"}, {"op": "gelu", "approximate": "tanh"},
  {"op": "linear", "in_features": 256, "out_features": 64 %s},
  {"op": "bias"}, {"op": "add_extra_input"}])";

std::string gpt2_mlp(bool in_out) {
  std::string s = kGpt2Mlp;
  const std::string attr = in_out ? R"(, "weight_layout": "in_out")" : "";
  for (int i = 0; i < 2; ++i) s.replace(s.find("%s"), 2, attr);
  return s;
}

}  // namespace

TEST_CASE("weight_layout in_out: the GEMMs read an [in, out] weight as it lies, with the same fusions",
          "[exec][linear]") {
  const auto ops = ops_of(R"([{"op": "linear", "in_features": 64, "out_features": 48, "weight_layout": "in_out"}])",
                          {16, 64});
  REQUIRE(ops[0].params.size() == 1);
  CHECK(ops[0].params[0].shape == ops::Shape{64, 48});
  auto p = program_of(R"([{"op": "linear", "in_features": 64, "out_features": 48, "weight_layout": "in_out"}])", {16, 64});
  const auto f = gemms(p->forward), b = gemms(p->backward);
  REQUIRE(f.size() == 1);
  REQUIRE(b.size() == 2);
  for (const auto* g : {f[0], b[0], b[1]}) CHECK(g->call.weight_t);
  CHECK((f[0]->call.m == 16 && f[0]->call.n == 48 && f[0]->call.k == 64));

  // GPT-2's MLP: the same rules fire as with [out, in] weights (GELU_AUX_BIAS, DGELU_BGRAD, BGRADB, RESIDUAL),
  // every GEMM reading the weight transposed.
  auto conv = program_of(gpt2_mlp(true), {32, 64});
  auto lin = program_of(gpt2_mlp(false), {32, 64});
  CHECK(rules_of(conv->plan.forward) == rules_of(lin->plan.forward));
  CHECK(rules_of(conv->plan.backward) == rules_of(lin->plan.backward));
  const auto cf = gemms(conv->forward), cb = gemms(conv->backward);
  CHECK(cf.size() == gemms(lin->forward).size());
  CHECK(cb.size() == gemms(lin->backward).size());
  for (const auto* g : cf) CHECK(g->call.weight_t);
  for (const auto* g : cb) CHECK(g->call.weight_t);
  for (const auto* g : gemms(lin->backward)) CHECK_FALSE(g->call.weight_t);
}

TEST_CASE("split_weight: two parameters, two GEMMs per product over the outputs' halves", "[exec][linear]") {
  const std::string seq = R"([{"op": "linear", "in_features": 64, "out_features": 96, "split_weight": true},
                              {"op": "swiglu"}, {"op": "linear", "in_features": 48, "out_features": 64}])";
  const auto ops = ops_of(seq, {16, 64});
  REQUIRE(ops[0].params.size() == 2);
  CHECK(ops[0].params[0].name == "weight");
  CHECK(ops[0].params[1].name == "weight2");
  CHECK(ops[0].params[0].shape == ops::Shape{48, 64});
  CHECK(ops[0].params[1].shape == ops::Shape{48, 64});
  auto p = program_of(seq, {16, 64});
  const auto f = gemms(p->forward);
  REQUIRE(f.size() == 3);
  // y[:, :48] = x W^T, y[:, 48:] = x W2^T: n = 48 each, rows of 96, the second 48 elements in.
  CHECK((f[0]->call.n == 48 && f[0]->call.ldy == 96 && f[0]->d_offset == 0));
  CHECK((f[1]->call.n == 48 && f[1]->call.ldy == 96 && f[1]->d_offset == 48));
  CHECK(f[0]->d == f[1]->d);
  CHECK(f[0]->b != f[1]->b);
  CHECK(p->buffer(f[0]->b).name == "op0.weight");
  CHECK(p->buffer(f[1]->b).name == "op0.weight2");
  // Backward: the gated op's backward, FC2's dgrad/wgrad, then FC1's: dx = dy1 W + dy2 W2 (beta 1 on the
  // second), dW = dy1^T x, dW2 = dy2^T x.
  std::vector<const exec::GemmStep*> fc1;
  for (const auto* g : gemms(p->backward))
    if (g->call.n == 48 && g->call.ldy == 96) fc1.push_back(g);
  REQUIRE(fc1.size() == 4);
  CHECK((fc1[0]->call.kind == cuda::GemmKind::dgrad && fc1[0]->call.beta == 0.f && fc1[0]->a_offset == 0));
  CHECK((fc1[1]->call.kind == cuda::GemmKind::dgrad && fc1[1]->call.beta == 1.f && fc1[1]->a_offset == 48));
  CHECK(fc1[0]->d == fc1[1]->d);
  CHECK((fc1[2]->call.kind == cuda::GemmKind::wgrad && fc1[2]->a_offset == 0));
  CHECK((fc1[3]->call.kind == cuda::GemmKind::wgrad && fc1[3]->a_offset == 48));
  CHECK(p->buffer(fc1[2]->d).name == "grad op0.weight");
  CHECK(p->buffer(fc1[3]->d).name == "grad op0.weight2");
  for (const auto& s : p->forward) CHECK(s.gemm.b2 < 0);
  for (const auto& s : p->backward) CHECK(s.gemm.b2 < 0);
}

TEST_CASE("split_weight keeps a rule that would fuse an epilogue off its linear, with the reason", "[exec][linear]") {
  const std::string seq = R"([{"op": "linear", "in_features": 64, "out_features": 64, "split_weight": true},
                              {"op": "bias"}, {"op": "gelu", "approximate": "tanh"}])";
  auto p = program_of(seq, {16, 64});
  for (const auto& g : p->plan.forward) CHECK(g.rule.find("gelu_aux_bias") == std::string::npos);
  bool named = false;
  for (const auto& d : p->plan.decisions)
    named |= d.reason.find("split_weight") != std::string::npos;
  CHECK(named);
  for (const auto* g : gemms(p->forward)) CHECK(g->call.epilogue == cuda::Epilogue::none);
}

TEST_CASE("the float64 reference of both layouts equals the plain linear's on the same numbers", "[reference][linear]") {
  std::mt19937_64 g(7);
  const int64_t m = 6, k = 10, n = 8;
  const auto plain = ops_of(R"([{"op": "linear", "in_features": 10, "out_features": 8}])", {m, k});
  const auto in_out = ops_of(R"([{"op": "linear", "in_features": 10, "out_features": 8, "weight_layout": "in_out"}])", {m, k});
  const auto split = ops_of(R"([{"op": "linear", "in_features": 10, "out_features": 8, "split_weight": true}])", {m, k});
  reference::SeqInputs a;
  a.input = random_vec(static_cast<size_t>(m * k), g);
  a.params[{0, "weight"}] = random_vec(static_cast<size_t>(n * k), g);
  const auto dy = random_vec(static_cast<size_t>(m * n), g);
  const auto fa = reference::sequence_forward(plain, a);
  const auto ga = reference::sequence_backward(plain, a, fa, dy, {});

  reference::SeqInputs t = a;
  t.params[{0, "weight"}] = transposed(a.params[{0, "weight"}], n, k);
  const auto ft = reference::sequence_forward(in_out, t);
  const auto gt = reference::sequence_backward(in_out, t, ft, dy, {});
  require_close(ft.values.back(), fa.values.back());
  require_close(gt.grad_input, ga.grad_input);
  require_close(gt.grad_params.at({0, "weight"}), transposed(ga.grad_params.at({0, "weight"}), n, k));

  reference::SeqInputs s = a;
  const auto& w = a.params[{0, "weight"}];
  const auto mid = w.begin() + static_cast<std::ptrdiff_t>(w.size() / 2);
  s.params[{0, "weight"}] = reference::Vec(w.begin(), mid);
  s.params[{0, "weight2"}] = reference::Vec(mid, w.end());
  const auto fs = reference::sequence_forward(split, s);
  const auto gs = reference::sequence_backward(split, s, fs, dy, {});
  require_close(fs.values.back(), fa.values.back());
  require_close(gs.grad_input, ga.grad_input);
  const auto& dw = ga.grad_params.at({0, "weight"});
  const auto dmid = dw.begin() + static_cast<std::ptrdiff_t>(dw.size() / 2);
  require_close(gs.grad_params.at({0, "weight"}), reference::Vec(dw.begin(), dmid));
  require_close(gs.grad_params.at({0, "weight2"}), reference::Vec(dmid, dw.end()));
}

TEST_CASE("the layouts refuse what they cannot run, naming the op and the fix", "[exec][linear]") {
  CHECK_THROWS_WITH(ops_of(R"([{"op": "linear", "in_features": 64, "out_features": 63, "split_weight": true}])", {8, 64}),
                    Catch::Contains("split_weight needs an even out_features (it is 63)"));
  CHECK_THROWS_WITH(ops_of(R"([{"op": "linear", "in_features": 64, "out_features": 64, "split_weight": true,
                                "weight_layout": "in_out"}])", {8, 64}),
                    Catch::Contains("weight_layout \"out_in\""));
  CHECK_THROWS_WITH(ops_of(R"([{"op": "linear", "in_features": 64, "out_features": 64, "weight_layout": "in_out",
                                "tensor_parallel": "column"}])", {8, 64}),
                    Catch::Contains("weight_layout \"in_out\" with tensor_parallel \"column\""));
  CHECK_THROWS_WITH(ops_of(R"([{"op": "linear", "in_features": 64, "out_features": 64, "weight_layout": "sideways"}])",
                           {8, 64}),
                    Catch::Contains("weight_layout"));
  for (const char* recipe : {"fp8_current", "fp8_delayed", "fp8_block"}) {
    CHECK_THROWS_WITH(ops_of(R"([{"op": "linear", "in_features": 128, "out_features": 128, "weight_layout": "in_out"}])",
                             {128, 128}, recipe),
                      Catch::Contains("weight_layout \"in_out\" has no FP8 form"));
    CHECK_THROWS_WITH(ops_of(R"([{"op": "linear", "in_features": 128, "out_features": 128, "split_weight": true}])",
                             {128, 128}, recipe),
                      Catch::Contains("split_weight has no FP8 form"));
  }
  // The chunked LM head pads an [out, in] weight: an [in, out] head runs unfused, and says why.
  auto p = program_of(R"([{"op": "linear", "in_features": 64, "out_features": 1000, "weight_layout": "in_out"},
                          {"op": "cross_entropy"}])", {32, 64});
  bool said = false;
  for (const auto& d : p->plan.decisions) {
    CHECK_FALSE((d.taken && d.rule.find("chunked") != std::string::npos));
    said |= d.reason.find("weight_layout in_out") != std::string::npos;
  }
  CHECK(said);
}
