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

std::shared_ptr<const exec::Program> program(const std::string& ops_json, const ops::Shape& shape, bool training) {
  const std::string text = std::string(R"({"format": "jitfuse.sequence/1", "name": "b", "ops": )") + ops_json + "}";
  auto def = ops::parse_sequence(text, "<fp8_block test>", builtins().registry());
  exec::CompileOptions o;
  o.arch = 90;
  o.training = training;
  auto recipe = ops::parse_recipe("fp8_block");
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
  auto staged = cast_spec(1, true, 256);
  codegen::Stage st;
  st.op = 1;
  st.functor = "jf_op_gelu";
  staged.pre.push_back(st);
  CHECK_THROWS_AS(codegen::generate(staged), std::invalid_argument);
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
