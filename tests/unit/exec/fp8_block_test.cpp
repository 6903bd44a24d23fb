// fp8_block (issue 44) without a GPU: the recipe, the block-scaled cast kernel codegen makes (arguments,
// launch, the template it calls, the specs it refuses), the program a linear gets under it (which casts,
// which scale buffers of which shape, the GEMMs' scale modes, no epilogue rule taking a linear), and the
// errors a user meets (sizes that are not whole blocks, the recipe state it does not have, GEMM calls
// cuBLASLt refuses). The numerics are the gpu tier's (tests/gpu/fp8_block_test.cpp).
#include <catch2/catch.hpp>

#include <string>

#include "common/error.hpp"
#include "cuda/cublaslt.hpp"
#include "exec/lower/compile.hpp"
#include "exec/ir/program.hpp"
#include "jitfuse/codegen/kernel_spec.hpp"
#include "ops/recipe.hpp"
#include "ops/sequence.hpp"
#include "rules/rule.hpp"

using namespace jitfuse;
using codegen::Arg;

namespace {

const rules::RuleSet& builtins() {
  static const rules::RuleSet rs = rules::RuleSet::with_builtins();
  return rs;
}

std::shared_ptr<const exec::Program> program(const std::string& ops_json, const ops::Shape& shape, bool training,
                                             const char* recipe_name = "fp8_block") {
  const std::string text = std::string(R"({"format": "jitfuse.sequence/1", "name": "b", "ops": )") + ops_json + "}";
  auto def = ops::parse_sequence(text, "<fp8_block test>", builtins().registry());
  exec::CompileOptions o;
  o.arch = 90;
  o.training = training;
  auto recipe = ops::parse_recipe(recipe_name);
  ops::apply_recipe(def, recipe);
  return exec::compile(ops::infer(def, shape), "b", recipe, o, builtins());
}

codegen::KernelSpec cast_spec(int block, bool colwise, int64_t cols) {
  codegen::KernelSpec s;
  s.skeleton = codegen::Skeleton::cast_transpose;
  s.dtype = "bf16";
  s.cols = cols;
  s.label = "block_cast";
  codegen::Fp8Spec q;
  q.op = 3;
  q.tensor = block == 2 ? "weight" : "input";
  q.block = block;
  q.colwise = colwise;
  s.fp8 = q;
  return s;
}

bool has(const std::string& s, const std::string& t) { return s.find(t) != std::string::npos; }

const char* kMlp = R"([{"op": "layernorm"}, {"op": "linear", "in_features": 128, "out_features": 256}, {"op": "bias"},
  {"op": "gelu"}, {"op": "linear", "in_features": 256, "out_features": 128}, {"op": "bias"}, {"op": "add_extra_input"}])";

}  // namespace

TEST_CASE("fp8_block: the recipe", "[fp8_block]") {
  const auto r = ops::parse_recipe("fp8_block");
  CHECK(r.kind == ops::RecipeKind::fp8_block);
  CHECK(r.is_fp8());
  CHECK(r.is_block());
  CHECK(r.dtype == ops::DType::bf16);
  CHECK(ops::recipe_name(r.kind) == "fp8_block");
  CHECK_FALSE(ops::parse_recipe("fp8_current").is_block());
  try {
    ops::parse_recipe("fp8_blocks");
    FAIL("an unknown recipe was accepted");
  } catch (const Error& e) {
    CHECK(has(e.what(), "fp8_block"));  // the list of known recipes names it
  }
}

TEST_CASE("fp8_block: the block-scaled cast kernel's arguments, launch and template", "[fp8_block][codegen]") {
  using Role = Arg::Role;
  const auto g = codegen::generate(cast_spec(1, true, 512));
  std::vector<Role> roles;
  for (const auto& a : g.args) roles.push_back(a.role);
  CHECK(roles == std::vector<Role>{Role::in, Role::out, Role::fp8_colwise, Role::fp8_scale_inv,
                                   Role::fp8_colwise_scale_inv, Role::rows});
  for (const auto& a : g.args)
    if (a.role != Role::in && a.role != Role::rows) CHECK(a.writes);
  CHECK(g.launch.bx == 16);
  CHECK(g.launch.by == 32);
  CHECK(g.launch.grid_x == 4);
  CHECK(g.launch.rows_per_thread_iter == 4);  // 128 rows per block iteration
  CHECK(g.fp8_update.empty());                // no recipe state
  CHECK(g.headers.back() == "skeletons/block_cast.cuh");
  CHECK(has(g.source, "jf_block_cast_tile<JF_VEC, false, true>("));
  CHECK(has(g.source, "jf_load8<DT, JF_VEC>(in + r * 512 + c0, x[u]);"));
  CHECK(has(g.source, "one scale per 1x128 block; transposed with one scale per 128x1 block"));
  CHECK(has(g.source, "#ifndef JF_SCALAR"));  // both variants

  const auto w = codegen::generate(cast_spec(2, true, 256));
  CHECK(has(w.source, "jf_block_cast_tile<JF_VEC, true, true>("));
  CHECK(has(w.source, "one scale per 128x128 block; transposed with the same scales"));

  // Inference: the row-major codes and their scales only.
  const auto inf = codegen::generate(cast_spec(1, false, 256));
  roles.clear();
  for (const auto& a : inf.args) roles.push_back(a.role);
  CHECK(roles == std::vector<Role>{Role::in, Role::out, Role::fp8_scale_inv, Role::rows});
  CHECK(has(inf.source, "jf_block_cast_tile<JF_VEC, false, false>(x, out, nullptr, q0_scale_inv, nullptr,"));
}

TEST_CASE("fp8_block: block-scaled cast specs codegen refuses", "[fp8_block][codegen]") {
  CHECK_THROWS_AS(codegen::generate(cast_spec(1, true, 192)), std::invalid_argument);  // not whole blocks
  CHECK_THROWS_AS(codegen::generate(cast_spec(3, true, 256)), std::invalid_argument);
  auto e5 = cast_spec(1, true, 256);
  e5.fp8->e5m2 = true;
  CHECK_THROWS_AS(codegen::generate(e5), std::invalid_argument);
  auto delayed = cast_spec(1, true, 256);
  delayed.fp8->delayed = true;
  CHECK_THROWS_AS(codegen::generate(delayed), std::invalid_argument);
  codegen::Stage st;
  st.op = 1;
  st.functor = "jf_op_gelu";
  auto staged_weight = cast_spec(2, true, 256);  // a weight's cast takes no stages
  staged_weight.pre.push_back(st);
  CHECK_THROWS_AS(codegen::generate(staged_weight), std::invalid_argument);
  auto normed = cast_spec(1, true, 256);  // the norm skeleton's anchor is not a stage
  normed.norm = codegen::NormSpec{};
  CHECK_THROWS_AS(codegen::generate(normed), std::invalid_argument);
  auto normalize_bwd = cast_spec(1, true, 256);  // normalize runs forward only
  normalize_bwd.dir = codegen::Direction::backward;
  codegen::Stage ns;
  ns.kind = codegen::Stage::Kind::normalize;
  ns.op = 0;
  normalize_bwd.pre.push_back(ns);
  CHECK_THROWS_AS(codegen::generate(normalize_bwd), std::invalid_argument);
  auto elementwise = cast_spec(1, true, 256);
  elementwise.skeleton = codegen::Skeleton::elementwise;
  CHECK_THROWS_AS(codegen::generate(elementwise), std::invalid_argument);
}

TEST_CASE("fp8_block: a training MLP's casts, scale buffers and block-scaled GEMMs", "[fp8_block][exec]") {
  const auto p = program(kMlp, {256, 128}, true);
  int casts = 0, weight_casts = 0;
  for (const auto& s : p->forward)
    if (s.kind == exec::Step::Kind::kernel && s.kernel->spec.fp8 && s.kernel->spec.fp8->block) {
      ++casts;
      CHECK(s.kernel->spec.skeleton == codegen::Skeleton::cast_transpose);
      CHECK(s.kernel->spec.fp8->colwise);
      if (s.kernel->spec.fp8->block == 2) {
        ++weight_casts;
        CHECK(s.weight_cast);
      }
    }
  CHECK(casts == 4);  // each linear's input and weight
  CHECK(weight_casts == 2);
  int backward_casts = 0;
  for (const auto& s : p->backward)
    if (s.kind == exec::Step::Kind::kernel && s.kernel->spec.fp8) {
      ++backward_casts;
      CHECK(s.kernel->spec.fp8->block == 1);
      CHECK(s.kernel->spec.fp8->tensor == "grad_output");
      CHECK_FALSE(s.kernel->spec.fp8->e5m2);  // E4M3 gradients
    }
  CHECK(backward_casts == 2);
  // No FP8 recipe state, no update steps.
  for (const auto* steps : {&p->forward, &p->backward})
    for (const auto& s : *steps) CHECK(s.kind != exec::Step::Kind::fp8_update);
  // The scale buffers: linear 1 (op 1) input [256, 128]: 1x128 row scales [1, 256], 128x1 column scales
  // [2, 128]; its weight [256, 128]: 128x128 blocks [2, 1] and the transpose [1, 2], each dimension padded to
  // a multiple of 4 (cuBLASLt's leading dimension of block scales).
  auto shape_of = [&](const std::string& name) {
    for (const auto& b : p->buffers)
      if (b.name == name) return std::make_pair(b.rows, b.cols);
    FAIL("no buffer " << name);
    return std::make_pair(int64_t{-1}, int64_t{-1});
  };
  CHECK(shape_of("op1.input.scale_inv") == std::make_pair(int64_t{1}, int64_t{256}));
  CHECK(shape_of("op1.input.col_scale_inv") == std::make_pair(int64_t{2}, int64_t{128}));
  CHECK(shape_of("op1.weight.scale_inv") == std::make_pair(int64_t{4}, int64_t{4}));
  CHECK(shape_of("op1.weight.col_scale_inv") == std::make_pair(int64_t{4}, int64_t{4}));
  // The GEMMs: forward 1x128 x 128x128, dgrad 1x128 x 128x128 (W^T), wgrad 1x128 x 1x128; no epilogue, fp32
  // accumulation, E4M3 both sides.
  using cuda::Fp8Scaling;
  int fwd = 0, dgrad = 0, wgrad = 0;
  for (const auto* steps : {&p->forward, &p->backward})
    for (const auto& s : *steps) {
      if (s.kind != exec::Step::Kind::gemm) continue;
      INFO(s.what);
      REQUIRE(s.gemm.call.fp8);
      const auto& f = *s.gemm.call.fp8;
      CHECK(f.a == ops::DType::e4m3);
      CHECK(f.b == ops::DType::e4m3);
      CHECK_FALSE(f.fast_accum);
      CHECK(s.gemm.call.epilogue == cuda::Epilogue::none);
      CHECK(f.a_scaling == Fp8Scaling::row128);
      if (has(s.what, "wgrad")) {
        ++wgrad;
        CHECK(f.b_scaling == Fp8Scaling::row128);
      } else {
        (has(s.what, "dgrad") ? dgrad : fwd)++;
        CHECK(f.b_scaling == Fp8Scaling::block128);
      }
    }
  CHECK(fwd == 2);
  CHECK(dgrad == 2);
  CHECK(wgrad == 2);
  // explain names the scales' blocks and layouts.
  const auto j = exec::program_json(*p, 3350);
  bool seen = false;
  for (const auto& st : j.at("forward"))
    if (st.contains("fp8") && st["fp8"].contains("a_scales")) {
      seen = true;
      CHECK(st["fp8"]["a_scales"]["blocks"] == "1x128");
      CHECK(st["fp8"]["b_scales"]["blocks"] == "128x128");
    }
  CHECK(seen);
}

TEST_CASE("fp8_block: inference casts row-major codes only", "[fp8_block][exec]") {
  const auto p = program(kMlp, {48, 128}, false);  // rows: a multiple of 16 is enough without a wgrad
  int casts = 0;
  for (const auto& s : p->forward)
    if (s.kind == exec::Step::Kind::kernel && s.kernel->spec.fp8 && s.kernel->spec.fp8->block) {
      ++casts;
      CHECK_FALSE(s.kernel->spec.fp8->colwise);
    }
  CHECK(casts == 4);
  for (const auto& b : p->buffers) CHECK(b.name.find("col") == std::string::npos);
}

TEST_CASE("fp8_block: sizes that are not whole blocks are refused with the op and what to do", "[fp8_block][exec]") {
  auto fails_with = [](const std::string& ops, const ops::Shape& shape, bool training, const std::string& text) {
    try {
      program(ops, shape, training);
      FAIL("compiled: " << ops);
    } catch (const Error& e) {
      INFO(e.what());
      CHECK(has(e.what(), text));
      CHECK(has(e.what(), "fp8_block"));
    }
  };
  fails_with(R"([{"op": "linear", "in_features": 64, "out_features": 128}])", {128, 64}, true, "in_features must be a multiple of 128");
  fails_with(R"([{"op": "linear", "in_features": 128, "out_features": 96}])", {128, 128}, true, "out_features must be a multiple of 128");
  fails_with(R"([{"op": "linear", "in_features": 128, "out_features": 128}])", {200, 128}, true, "the number of rows");
  fails_with(R"([{"op": "linear", "in_features": 128, "out_features": 128}])", {40, 128}, false, "the number of rows");
  // 200 rows in inference: whole 16-row groups are enough there (no wgrad).
  CHECK_NOTHROW(program(R"([{"op": "linear", "in_features": 128, "out_features": 128}])", {208, 128}, false));
}

TEST_CASE("fp8_block: GEMM calls cuBLASLt refuses are named before they run", "[fp8_block][cuda]") {
  cuda::GemmCall c;
  c.m = 256;
  c.n = 256;
  c.k = 256;
  c.dtype = ops::DType::bf16;
  alignas(16) static float scales[64];
  alignas(16) static unsigned char a[16], b[16], d[16];
  c.a = a;
  c.b = b;
  c.d = d;
  cuda::Fp8Gemm f;
  f.a_scale_inv = scales;
  f.b_scale_inv = scales + 16;
  f.fast_accum = false;
  f.a_scaling = cuda::Fp8Scaling::row128;
  f.b_scaling = cuda::Fp8Scaling::block128;
  c.fp8 = f;
  CHECK_NOTHROW(cuda::check_gemm_call(c));
  auto refused = [&](cuda::GemmCall bad, const std::string& text) {
    try {
      cuda::check_gemm_call(bad);
      FAIL("accepted");
    } catch (const Error& e) {
      INFO(e.what());
      CHECK(has(e.what(), text));
    }
  };
  auto x = c;
  x.fp8->a_scaling = cuda::Fp8Scaling::block128;
  refused(x, "128x128 x 128x128");
  x = c;
  x.fp8->b_scaling = cuda::Fp8Scaling::tensor;
  refused(x, "block scales on one operand need block scales on the other");
  x = c;
  x.k = 144;
  refused(x, "k to be a multiple of 128");
  x = c;
  x.fp8->fast_accum = true;
  refused(x, "fast accumulation");
  x = c;
  x.epilogue = cuda::Epilogue::bias;
  x.bias = d;
  refused(x, "no epilogue");
}

// Issue 44: the quantisation fused into its producer. Training: the layernorm runs as a statistics kernel
// (no output) and the block cast normalises in its tiles; bias + gelu run inside the next linear's cast;
// the backward of bias + gelu (with dbias) and of the last bias run inside the grad_output casts. No bf16
// copy of a linear's operand is written.
TEST_CASE("fp8_block: norms, activation chains and their backward fused into the block-scaled casts", "[fp8_block][exec]") {
  const auto p = program(kMlp, {256, 128}, true);
  std::vector<std::string> fwd, bwd;
  for (const auto& s : p->forward)
    if (s.kind == exec::Step::Kind::kernel) fwd.push_back(s.kernel->spec.label);
  for (const auto& s : p->backward)
    if (s.kind == exec::Step::Kind::kernel) bwd.push_back(s.kernel->spec.label);
  CHECK(fwd == std::vector<std::string>{"layernorm_stats", "layernorm_block_cast_transpose_1x128_e4m3",
                                        "block_cast_128x128_e4m3", "bias_gelu_block_cast_transpose_1x128_e4m3",
                                        "block_cast_128x128_e4m3", "bias_add_extra_input"});
  for (const auto& s : p->forward) {
    if (s.kind != exec::Step::Kind::kernel) continue;
    const auto& k = *s.kernel;
    INFO(k.spec.label);
    if (k.spec.label == "layernorm_stats") {
      REQUIRE(k.spec.norm);
      CHECK(k.spec.norm->stats_only);
      for (const auto& a : k.gen.args) CHECK(a.role != Arg::Role::out);  // statistics only
    }
    if (k.spec.label == "layernorm_block_cast_transpose_1x128_e4m3") {
      REQUIRE(k.spec.pre.size() == 1);
      CHECK(k.spec.pre[0].kind == codegen::Stage::Kind::normalize);
      CHECK(has(k.gen.source, "s0_rstd[r], jf_mu = s0_mean[r]"));
      CHECK(has(k.gen.source, "jf_block_cast_tile<JF_VEC, false, true>"));
    }
    if (k.spec.label == "bias_gelu_block_cast_transpose_1x128_e4m3") {
      CHECK(k.spec.pre.size() == 2);
      CHECK(k.spec.fp8->block == 1);
      bool saves = false;  // gelu's input saved for the backward, from the same kernel
      for (const auto& a : k.gen.args) saves |= a.role == Arg::Role::saved && a.writes;
      CHECK(saves);
    }
  }
  // bias + residual (dbias, dresidual) + cast, bias + gelu (dbias) + cast, the layernorm backward.
  CHECK(bwd == std::vector<std::string>{"bias_add_extra_input_block_cast_transpose_1x128_e4m3",
                                        "bias_gelu_block_cast_transpose_1x128_e4m3", "layernorm"});
  int partial_casts = 0;
  for (const auto& s : p->backward)
    if (s.kind == exec::Step::Kind::kernel && s.kernel->spec.fp8 && !s.kernel->spec.pre.empty()) {
      ++partial_casts;
      CHECK_FALSE(s.kernel->gen.launch.persistent);  // column sums: one partial row per 128-row tile
      CHECK(s.kernel->launch.vec.gy == 2);
      CHECK(s.kernel->launch.vec.parts == 2);
      CHECK(has(s.kernel->gen.source, "__launch_bounds__(512, 2)"));
      CHECK(!s.kernel->gen.finalize.empty());
    }
  CHECK(partial_casts == 2);
  // No bf16 tensor between the producers and the casts: no kernel writes a linear's input (act1, act4).
  for (const auto& s : p->forward)
    if (s.kind == exec::Step::Kind::kernel)
      for (size_t i = 0; i < s.kernel->args.size(); ++i) {
        const auto& a = s.kernel->gen.args.at(i);
        if (!a.writes || s.kernel->args[i].kind != exec::KArg::Kind::buffer) continue;
        const auto& b = p->buffers.at(static_cast<size_t>(s.kernel->args[i].buffer));
        INFO(s.kernel->spec.label << " writes " << b.name);
        CHECK(b.name != "act1");
        CHECK(b.name != "act4");
      }
}

TEST_CASE("fp8_block: a norm after a fork normalises its saved input, and inference keeps the bf16 norm", "[fp8_block][exec]") {
  const char* half = R"([{"op": "make_extra_output", "channel": "r"}, {"op": "rmsnorm"},
    {"op": "linear", "in_features": 256, "out_features": 1024}, {"op": "swiglu"},
    {"op": "linear", "in_features": 512, "out_features": 256}, {"op": "add_extra_input", "channel": "r"}])";
  const auto p = program(half, {256, 256}, true);
  const exec::Step* cast = nullptr;
  for (const auto& s : p->forward)
    if (s.kind == exec::Step::Kind::kernel && s.kernel->spec.label == "rmsnorm_block_cast_transpose_1x128_e4m3") cast = &s;
  REQUIRE(cast);
  CHECK(cast->kernel->spec.pre.at(0).norm_rms);
  CHECK_FALSE(has(cast->kernel->gen.source, "s1_mean"));  // rmsnorm: no mean, no beta
  const auto& k = *cast->kernel;
  REQUIRE(k.gen.args.at(0).role == Arg::Role::in);
  CHECK(p->buffers.at(static_cast<size_t>(k.args.at(0).buffer)).name == "op1.input");
  // swiglu -> linear: the gated forward runs in the cast (both halves of the up projection's output read,
  // the gate's input saved as the GEMM's output itself); its backward writes bf16 and a cast reads it.
  const exec::Step* gated = nullptr;
  for (const auto& s : p->forward)
    if (s.kind == exec::Step::Kind::kernel && s.kernel->spec.label == "swiglu_block_cast_transpose_1x128_e4m3") gated = &s;
  REQUIRE(gated);
  REQUIRE(gated->kernel->spec.gated);
  CHECK(has(gated->kernel->gen.source, "in + r * 1024 + 512 + c0"));
  bool alone = false;
  for (const auto& s : p->backward)
    alone |= s.kind == exec::Step::Kind::kernel && s.kernel->spec.label == "block_cast_transpose_1x128_e4m3";
  CHECK(alone);
  auto gated_bwd = gated->kernel->spec;  // codegen takes a gated op's forward only
  gated_bwd.dir = codegen::Direction::backward;
  CHECK_THROWS_AS(codegen::generate(gated_bwd), std::invalid_argument);

  const auto inf = program(kMlp, {48, 128}, false);
  std::vector<std::string> labels;
  for (const auto& s : inf->forward)
    if (s.kind == exec::Step::Kind::kernel) labels.push_back(s.kernel->spec.label);
  CHECK(labels.at(0) == "layernorm");
  CHECK(labels.at(1) == "block_cast_1x128_e4m3");
  CHECK(labels.at(3) == "bias_gelu_block_cast_1x128_e4m3");
}

// relu keeps its output for the backward; before a linear under an FP8 recipe the cast kernel that consumes
// it is the only kernel that sees it, so its stage saves it (fp8/linear.cpp save_chain_output).
TEST_CASE("fp8 recipes: relu last before a linear is saved by the fused cast kernel", "[fp8_block][exec]") {
  const char* seq = R"([{"op": "linear", "in_features": 128, "out_features": 256}, {"op": "bias"}, {"op": "relu"},
                        {"op": "linear", "in_features": 256, "out_features": 128}])";
  for (const char* recipe : {"fp8_block", "fp8_current", "fp8_delayed"}) {
    INFO(recipe);
    const auto p = program(seq, {256, 128}, true, recipe);
    bool saved = false;
    for (const auto& st : p->forward)
      if (st.kind == exec::Step::Kind::kernel)
        for (const auto& a : st.kernel->gen.args) saved |= a.role == Arg::Role::saved && a.writes && a.op == 2 && a.key == codegen::Key::output;
    CHECK(saved);
  }
}

// A user rule may pair fp8_cast with chains the block cast cannot run: the legality check names why, and
// the default plan stands (no codegen error at compile time).
TEST_CASE("fp8_block: fp8_cast windows the block cast cannot run are refused with the reason", "[fp8_block][exec]") {
  const std::string rules_text = R"({"format": "jitfuse.rules/1", "rules": [
    {"name": "u_norm_act_linear", "math": "user", "pass": "forward", "priority": 90,
     "pattern": ["layernorm", "gelu", "linear"], "conditions": {"recipes": ["fp8_block"]},
     "impl": {"kind": "generated", "skeleton": "fp8_cast"}},
    {"name": "u_add_gated_linear", "math": "user", "pass": "forward", "priority": 90,
     "pattern": ["add_extra_input", "swiglu", "linear"], "conditions": {"recipes": ["fp8_block"]},
     "impl": {"kind": "generated", "skeleton": "fp8_cast"}}]})";
  rules::RuleSet rs = rules::RuleSet::with_builtins();
  REQUIRE(rs.load_text(rules_text, "user.json", "").empty());
  auto plan_of = [&](const char* ops_json, const ops::Shape& shape) {
    const std::string text = std::string(R"({"format": "jitfuse.sequence/1", "name": "u", "ops": )") + ops_json + "}";
    auto def = ops::parse_sequence(text, "<user>", rs.registry());
    auto recipe = ops::parse_recipe("fp8_block");
    ops::apply_recipe(def, recipe);
    exec::CompileOptions o;
    o.arch = 90;
    o.training = true;
    return exec::compile(ops::infer(def, shape), "u", recipe, o, rs);
  };
  const auto p1 = plan_of(R"([{"op": "layernorm"}, {"op": "gelu"}, {"op": "linear", "in_features": 128, "out_features": 128}])",
                          {128, 128});
  const auto p2 = plan_of(R"([{"op": "add_extra_input"}, {"op": "swiglu"}, {"op": "linear", "in_features": 128, "out_features": 128}])",
                          {128, 256});
  for (const auto* p : {p1.get(), p2.get()})
    for (const auto& g : p->plan.forward) CHECK(g.rule.rfind("u_", 0) != 0);  // the user rules were not taken
  bool said = false;
  for (const auto& d : p1->plan.decisions)
    said |= d.rule == "u_norm_act_linear" && d.reason.find("must come right before the linear") != std::string::npos;
  CHECK(said);
}
