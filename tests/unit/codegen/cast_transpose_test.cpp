// The cast_transpose skeleton (codegen/src/cast_transpose.cpp) and the FP8 operand casts of the other
// skeletons: argument lists and roles, launch contract, update and finalize kernels, validation, and one
// golden source (tests/golden/sources/cast_transpose_*.cu; JITFUSE_UPDATE_GOLDEN=1 rewrites it).
#include <catch2/catch.hpp>

#include <fstream>
#include <sstream>
#include <stdexcept>

#include "cache/kernel_cache.hpp"
#include "common/env.hpp"
#include "exec/run/kernels.hpp"
#include "support/cast_transpose_cases.hpp"

using namespace jitfuse;
using codegen::Arg;
using codegen::Direction;
using test::CtCase;
using test::CtChain;
using test::CtScaling;

namespace {

using Role = Arg::Role;

struct Want {
  Role role;
  int op;
  std::string name;
  bool writes;
};

std::string describe(const std::vector<Arg>& args) {
  std::ostringstream s;
  for (const auto& a : args) s << static_cast<int>(a.role) << ":" << a.op << ":" << a.name << (a.writes ? ":w " : ":r ");
  return s.str();
}

void check_args(const codegen::Generated& g, const std::vector<Want>& want) {
  INFO("args: " << describe(g.args));
  REQUIRE(g.args.size() == want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    INFO("argument " << i);
    CHECK(g.args[i].role == want[i].role);
    CHECK(g.args[i].op == want[i].op);
    CHECK(g.args[i].name == want[i].name);
    CHECK(g.args[i].writes == want[i].writes);
  }
}

bool has(const std::string& source, const std::string& text) { return source.find(text) != std::string::npos; }

std::string read(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

}  // namespace

TEST_CASE("cast_transpose: forward, no stages (a bf16 tensor cast for an FP8 GEMM)", "[codegen][cast_transpose]") {
  const CtCase c{Direction::forward, CtChain::none, CtScaling::delayed, false, "bf16", 4096};
  const auto spec = test::cast_transpose_spec(c);
  const auto g = codegen::generate(spec);
  CHECK(g.kernel == "jf_cast_transpose_fwd");
  CHECK(g.scalar_kernel == "jf_cast_transpose_fwd_scalar");
  // in, out, the transposed codes, rows, then the operand's recipe state and its own scale_inv.
  check_args(g, {{Role::in, -1, "in", false},
                 {Role::out, -1, "out", true},
                 {Role::fp8_colwise, 5, "colwise_input", true},
                 {Role::rows, -1, "rows", false},
                 {Role::fp8_scale, 5, "scale_input", false},
                 {Role::fp8_amax, 5, "amax_input", true},
                 {Role::fp8_scale_inv, 5, "scale_inv_input", true}});
  // Block 8 x 32, 64 columns per block, 2 rows per thread = 64 rows per block iteration; one block per tile.
  CHECK(g.launch.bx == 8);
  CHECK(g.launch.by == 32);
  CHECK(g.launch.grid_x == 64);
  CHECK(g.launch.rows_per_thread_iter == 2);
  CHECK_FALSE(g.launch.persistent);
  CHECK(g.finalize.empty());
  CHECK(g.fp8_update == "jf_cast_transpose_fwd_fp8_update");
  CHECK(g.headers == std::vector<std::string>{"skeletons/common.cuh", "ops/fp8.cuh", "ops/fp8_operand.cuh",
                                              "skeletons/cast_transpose.cuh"});
  const std::string& s = g.source;
  CHECK(has(s, "unsigned char* __restrict__ out, unsigned char* __restrict__ q0_colwise, jf_i64 rows"));
  CHECK(has(s, "jf_cvt8_fp8<false>(v, jf_scale, jf_q[u]);"));
  CHECK(has(s, "jf_store8_codes<JF_VEC>(out + r * 4096 + c0, jf_q[u], n);"));
  CHECK(has(s, "jf_ct_store16<JF_VEC>(q0_colwise + (jf_i64)col * rows + r"));
  CHECK(has(s, "q0_scale_inv[0] = 1.f / jf_scale;"));  // the scale_inv this cast used, by one thread
  CHECK(has(s, "jf_amax_flush<JF_VEC>(jf_am, q0_amax);"));
  // The update kernel is the per-pass batch (one block per operand state), changes only the recipe state:
  // no scale_inv argument, E4M3's max.
  CHECK(has(s, "jf_cast_transpose_fwd_fp8_update(const JfFp8Batch b) {"));
  CHECK(has(s, "b.scale[t][0] = jf_fp8_scale_of<false>(m, 1.0f);"));
  CHECK_FALSE(has(s, "scale_inv[0] = 1.f / scale[0];"));
  // Both variants, one source; deterministic.
  CHECK(has(s, "#ifndef JF_SCALAR"));
  CHECK(g.source == codegen::generate(spec).source);
}

TEST_CASE("cast_transpose: forward bias + gelu saving gelu's input, E4M3", "[codegen][cast_transpose]") {
  const CtCase c{Direction::forward, CtChain::bias_gelu, CtScaling::delayed, false, "bf16", 4096};
  const auto g = codegen::generate(test::cast_transpose_spec(c));
  CHECK(g.kernel == "jf_bias_gelu_cast_transpose_fwd");
  check_args(g, {{Role::in, -1, "in", false},
                 {Role::out, -1, "out", true},
                 {Role::fp8_colwise, 5, "colwise_input", true},
                 {Role::rows, -1, "rows", false},
                 {Role::fp8_scale, 5, "scale_input", false},
                 {Role::fp8_amax, 5, "amax_input", true},
                 {Role::fp8_scale_inv, 5, "scale_inv_input", true},
                 {Role::param, 3, "bias", false},
                 {Role::saved, 4, "input", true}});
  CHECK_FALSE(g.launch.persistent);
  CHECK(g.finalize.empty());
  CHECK(has(g.source, "jf_store8<DT, JF_VEC>(s1_input + r * 4096 + c0, v, n);"));
  CHECK(has(g.source, "v[e] = jf_op_gelu_tanh::fwd(v[e]);"));
  CHECK(has(g.source, "// op 2 cast of the FP8 GEMM input: E4M3 codes of x * scale"));
}

TEST_CASE("cast_transpose: backward dgelu + dbias, E5M2 gradients", "[codegen][cast_transpose]") {
  const CtCase c{Direction::backward, CtChain::bias_gelu, CtScaling::delayed, true, "bf16", 4096};
  const auto g = codegen::generate(test::cast_transpose_spec(c));
  CHECK(g.kernel == "jf_bias_gelu_cast_transpose_bwd");
  check_args(g, {{Role::in, -1, "in", false},
                 {Role::out, -1, "out", true},
                 {Role::fp8_colwise, 5, "colwise_grad_output", true},
                 {Role::rows, -1, "rows", false},
                 {Role::fp8_scale, 5, "scale_grad_output", false},
                 {Role::fp8_amax, 5, "amax_grad_output", true},
                 {Role::fp8_scale_inv, 5, "scale_inv_grad_output", true},
                 {Role::saved, 4, "input", false},
                 {Role::partials, 3, "bias", true}});
  // Column sums: persistent, one partial row per blockIdx.y, and the finalize kernel.
  CHECK(g.launch.persistent);
  REQUIRE(g.finalize.size() == 1);
  CHECK(g.finalize[0].kernel == "jf_bias_gelu_cast_transpose_bwd_fin0_bias");
  CHECK(g.finalize[0].op == 3);
  CHECK(g.finalize[0].key == codegen::Key::bias);
  CHECK(g.finalize[0].cols == 4096);
  const std::string& s = g.source;
  CHECK(has(s, "gr[e] = jf_op_gelu_tanh::bwd(s[e], gr[e]);"));
  CHECK(has(s, "part0_bias[(jf_i64)(blockIdx.y) * 4096 + 0 + c] = t;"));
  CHECK(has(s, "jf_cvt8_fp8<true>(gr, jf_scale, jf_q[u]);"));
  CHECK(has(s, "b.scale[t][0] = jf_fp8_scale_of<true>(m, 1.0f);"));
  CHECK(has(s, "// op 2 cast of the FP8 GEMM grad_output: E5M2 codes of x * scale"));
}

TEST_CASE("cast_transpose: current scaling's two passes", "[codegen][cast_transpose]") {
  for (bool e5m2 : {false, true}) {
    INFO((e5m2 ? "E5M2" : "E4M3"));
    // The cast pass reads amax_history[0] and writes the state's scale and the tensor's scale_inv.
    const CtCase cast{Direction::forward, CtChain::none, CtScaling::current, e5m2, "bf16", 4096};
    const auto g = codegen::generate(test::cast_transpose_spec(cast));
    check_args(g, {{Role::in, -1, "in", false},
                   {Role::out, -1, "out", true},
                   {Role::fp8_colwise, 5, "colwise_input", true},
                   {Role::rows, -1, "rows", false},
                   {Role::fp8_amax, 5, "amax_input", false},
                   {Role::fp8_scale, 5, "scale_input", true},
                   {Role::fp8_scale_inv, 5, "scale_inv_input", true}});
    CHECK(g.fp8_update.empty());
    CHECK(has(g.source, std::string("const float jf_scale = jf_fp8_scale_of<") + (e5m2 ? "true" : "false") +
                            ">(q0_amax[0], 1.0f);"));
    // The amax pass stores nothing: no transposed tensor, no tile; its update kernel sets amax_history[0].
    const CtCase amax{Direction::forward, CtChain::none, CtScaling::amax_only, e5m2, "bf16", 4096};
    const auto ga = codegen::generate(test::cast_transpose_spec(amax));
    CHECK(ga.kernel == "jf_cast_transpose_amax_fwd");
    check_args(ga, {{Role::in, -1, "in", false},
                    {Role::out, -1, "out", true},
                    {Role::rows, -1, "rows", false},
                    {Role::fp8_amax, 5, "amax_input", true}});
    CHECK(ga.fp8_update == "jf_cast_transpose_amax_fwd_fp8_update");
    CHECK_FALSE(has(ga.source, "jf_tile"));
  }
  // A backward amax pass leaves the column sums to the cast pass.
  const CtCase bwd{Direction::backward, CtChain::bias_gelu, CtScaling::amax_only, true, "bf16", 4096};
  const auto gb = codegen::generate(test::cast_transpose_spec(bwd));
  check_args(gb, {{Role::in, -1, "in", false},
                  {Role::out, -1, "out", true},
                  {Role::rows, -1, "rows", false},
                  {Role::fp8_amax, 5, "amax_grad_output", true},
                  {Role::saved, 4, "input", false}});
  CHECK(gb.finalize.empty());
  CHECK_FALSE(gb.launch.persistent);
}

TEST_CASE("cast_transpose: launch geometry and the scalar-only shape", "[codegen][cast_transpose]") {
  const CtCase c{Direction::forward, CtChain::none, CtScaling::delayed, true, "fp16", 66};
  const auto spec = test::cast_transpose_spec(c);
  CHECK_FALSE(spec.vec);
  const auto g = codegen::generate(spec);
  CHECK_FALSE(g.vec);
  CHECK(g.launch.grid_x == 2);  // 66 columns: two tiles of 64
  CHECK(g.launch.by * g.launch.rows_per_thread_iter == 64);
  CHECK_FALSE(has(g.source, "#ifndef JF_SCALAR"));
  CHECK(has(g.source, "#define JF_VEC false"));
  CHECK(has(g.source, "jf_cast_transpose_fwd_scalar("));
}

TEST_CASE("cast_transpose: source independent of the ops' positions in the sequence", "[codegen][cast_transpose]") {
  const CtCase c{Direction::backward, CtChain::bias_gelu, CtScaling::delayed, true, "bf16", 4096};
  auto a = test::cast_transpose_spec(c);
  auto b = a;
  b.pre[0].op = 40;
  b.pre[1].op = 41;
  b.fp8->op = 42;
  const auto ga = codegen::generate(a), gb = codegen::generate(b);
  CHECK(ga.source == gb.source);
  CHECK(gb.args[2].op == 42);
  CHECK(gb.finalize[0].op == 40);
}

TEST_CASE("cast_transpose over codes: the transpose of a norm's FP8 output, nothing else", "[codegen][cast_transpose]") {
  const CtCase c{Direction::forward, CtChain::codes, CtScaling::delayed, false, "bf16", 4096};
  const auto spec = test::cast_transpose_spec(c);
  const auto g = codegen::generate(spec);
  CHECK(g.kernel == "jf_transpose_fwd");
  // The codes in, their transpose out; no recipe state (the norm kernel scaled, cast and reduced amax).
  check_args(g, {{Role::in, -1, "in", false}, {Role::fp8_colwise, 5, "colwise_input", true}, {Role::rows, -1, "rows", false}});
  CHECK(g.launch.bx == 8);
  CHECK(g.launch.by == 32);
  CHECK(g.launch.grid_x == 64);
  CHECK(g.launch.rows_per_thread_iter == 2);
  CHECK_FALSE(g.launch.persistent);
  CHECK(g.fp8_update.empty());
  CHECK_FALSE(g.fp8_batched);
  CHECK(g.finalize.empty());
  const std::string& s = g.source;
  CHECK(has(s, "const unsigned char* __restrict__ in, unsigned char* __restrict__ q0_colwise, jf_i64 rows"));
  CHECK(has(s, "jf_ct_load8<JF_VEC>(in + r * 4096 + c0, jf_q[u], n);"));
  CHECK(has(s, "jf_ct_store16<JF_VEC>(q0_colwise + (jf_i64)col * rows + r"));
  CHECK_FALSE(has(s, "jf_scale"));
  CHECK_FALSE(has(s, "jf_amax"));
  CHECK(has(s, "#ifndef JF_SCALAR"));
  // 66 columns: the scalar variant only.
  const auto odd = codegen::generate(test::cast_transpose_spec({Direction::forward, CtChain::codes, CtScaling::delayed, true, "bf16", 66}));
  CHECK_FALSE(has(odd.source, "#ifndef JF_SCALAR"));
  CHECK(odd.launch.grid_x == 2);
  // Refused: stages, an amax pass, or codes_in in another skeleton.
  auto staged = spec;
  staged.pre = test::cast_transpose_spec({Direction::forward, CtChain::bias_gelu, CtScaling::delayed, false, "bf16", 4096}).pre;
  CHECK_THROWS_AS(codegen::generate(staged), std::invalid_argument);
  auto amax = spec;
  amax.fp8->amax_only = true;
  CHECK_THROWS_AS(codegen::generate(amax), std::invalid_argument);
  auto elementwise = spec;
  elementwise.skeleton = codegen::Skeleton::elementwise;
  CHECK_THROWS_AS(codegen::generate(elementwise), std::invalid_argument);
}

TEST_CASE("cast_transpose: specs it cannot take are refused", "[codegen][cast_transpose]") {
  const CtCase c{Direction::forward, CtChain::bias_gelu, CtScaling::delayed, false, "bf16", 4096};
  auto no_fp8 = test::cast_transpose_spec(c);
  no_fp8.fp8.reset();
  CHECK_THROWS_AS(codegen::generate(no_fp8), std::invalid_argument);
  auto norm = test::cast_transpose_spec(c);
  norm.norm = codegen::NormSpec{};
  CHECK_THROWS_AS(codegen::generate(norm), std::invalid_argument);
  auto gated = test::cast_transpose_spec(c);
  gated.gated = codegen::GatedSpec{};
  CHECK_THROWS_AS(codegen::generate(gated), std::invalid_argument);
  auto post = test::cast_transpose_spec(c);
  post.post = post.pre;
  CHECK_THROWS_AS(codegen::generate(post), std::invalid_argument);
}

TEST_CASE("FP8 operand casts in the elementwise skeleton: E5M2, the tensor's own scale_inv", "[codegen][cast_transpose]") {
  CtCase c{Direction::forward, CtChain::bias_gelu, CtScaling::delayed, true, "bf16", 4096};
  auto spec = test::cast_transpose_spec(c);
  spec.skeleton = codegen::Skeleton::elementwise;
  spec.label = "bias_gelu_quantize";
  const auto g = codegen::generate(spec);
  CHECK(g.headers == std::vector<std::string>{"skeletons/common.cuh", "ops/activations.cuh", "ops/fp8.cuh",
                                              "ops/fp8_operand.cuh"});
  CHECK(has(g.source, "jf_store8_fp8<true, JF_VEC>(out + r * 4096 + c0, v, jf_scale, n);"));
  CHECK(has(g.source, "q2_scale_inv[0] = 1.f / jf_scale;"));
  bool colwise = false;
  for (const auto& a : g.args) colwise |= a.role == Role::fp8_colwise;
  CHECK_FALSE(colwise);
  // The quantize op's E4M3 cast: the same format-generic functions, its state's own argument names and the
  // single-state update kernel (its golden sources pin the rest).
  spec.fp8->tensor.clear();
  spec.fp8->e5m2 = false;
  const auto q = codegen::generate(spec);
  CHECK(q.headers == std::vector<std::string>{"skeletons/common.cuh", "ops/activations.cuh", "ops/fp8.cuh",
                                              "ops/fp8_operand.cuh"});
  CHECK(has(q.source, "// op 2 quantize: E4M3 codes of x * scale"));
  CHECK(has(q.source, "jf_store8_fp8<false, JF_VEC>(out + r * 4096 + c0, v, jf_scale, n);"));
  CHECK(has(q.source, "// fp8_delayed (E4M3): roll the amax history, record this call's amax, scale_inv = 1 / the scale used,"));
  CHECK(has(q.source, "scale_inv[0] = 1.f / scale[0];"));
  CHECK(has(q.source, "scale[0] = jf_fp8_scale_of<false>(m, 1.0f);"));
  CHECK_FALSE(has(q.source, "jf_store8_e4m3"));
  CHECK_FALSE(has(q.source, "jf_fp8_scale("));
  CHECK_FALSE(has(q.source, "${"));  // every value of the update kernel's template filled in
  CHECK_FALSE(has(q.source, "q2_scale_inv"));
  for (const auto& a : q.args)
    if (a.role == Role::fp8_scale || a.role == Role::fp8_amax) CHECK((a.name == "scale" || a.name == "amax"));
}

TEST_CASE("the golden source of a cast_transpose kernel", "[codegen][golden][cast_transpose]") {
  // The backward of bias + gelu cast to E5M2 under delayed scaling: stages, preloads, column sums, the tile,
  // the amax flush, the finalize and update kernels, both variants.
  const CtCase c{Direction::backward, CtChain::bias_gelu, CtScaling::delayed, true, "bf16", 4096};
  const auto spec = test::cast_transpose_spec(c);
  exec::TemplateStore templates;
  cache::KernelCache cache(cache::Config{});
  exec::KernelLibrary lib(cache, templates);
  const std::string source = lib.request(spec, exec::target_for_arch("sm_90a"), {}, true).source;
  const std::string path =
      std::string(JF_SOURCE_DIR) + "/tests/golden/sources/cast_transpose_bf16_4096_bias_gelu_e5m2_delayed_bwd_vec.cu";
  if (env::flag("JITFUSE_UPDATE_GOLDEN")) {
    std::ofstream(path, std::ios::binary) << source;
    WARN("golden source rewritten: " << path);
    return;
  }
  INFO("golden source " << path << " (JITFUSE_UPDATE_GOLDEN=1 rewrites it)");
  CHECK(read(path) == source);
}
