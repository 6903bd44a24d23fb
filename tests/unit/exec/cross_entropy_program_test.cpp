// Programs with cross_entropy (runtime/exec/lower/impl/cross_entropy.cpp, joint_chunked_linear_cross_entropy.cpp): the
// unfused op's kernels and saved set; the joint rule over [linear, bias?, cross_entropy] — taken for mean and sum,
// refused with its reason for none and in inference — its chunk rule, its steps per chunk, and a saved set that holds
// dx and dW and never the logits.
#include <catch2/catch.hpp>

#include "exec/ir/program.hpp"
#include "support/builtin_cases.hpp"

using namespace jitfuse;

namespace {

std::shared_ptr<const exec::Program> program_of(const std::string& ops_json, ops::Shape shape, bool training = true,
                                                const char* recipe = "bf16", bool no_fusion = false) {
  static const rules::RuleSet rs = rules::RuleSet::with_builtins();
  test::BuiltinCase c{0, ops_json.c_str(), recipe, training, shape};
  exec::CompileOptions o;
  o.arch = 90;
  o.training = training;
  o.disable_fusion = no_fusion;
  return exec::compile(test::case_ops(c, rs), "n", ops::parse_recipe(recipe), o, rs);
}

std::string head(int64_t h, int64_t v, const char* ce = R"({"op": "cross_entropy"})", bool bias = false) {
  return fmt::format(R"([{{"op": "linear", "in_features": {}, "out_features": {}}}, {}{}])", h, v,
                     bias ? R"({"op": "bias"}, )" : "", ce);
}

int count(const std::vector<exec::Step>& steps, exec::Step::Kind kind, cuda::GemmKind gk = cuda::GemmKind::fwd) {
  int n = 0;
  for (const auto& s : steps) n += s.kind == kind && (kind != exec::Step::Kind::gemm || s.gemm.call.kind == gk);
  return n;
}

std::set<std::string> saved_names(const exec::Program& p) {
  std::set<std::string> out;
  for (int id : p.saved_set()) out.insert(p.buffer(id).name);
  return out;
}

}  // namespace

TEST_CASE(
    "unfused cross_entropy: a row kernel, a reduction, a backward row "
    "kernel, and saves logits and lse",
    "[exec][cross_entropy]") {
  auto p = program_of(R"([{"op": "cross_entropy", "label_smoothing": 0.1}])", {7, 50257});
  REQUIRE(p->forward.size() == 2);
  CHECK(p->forward[0].kernel->gen.kernel == "jf_cross_entropy_fwd");
  CHECK(p->forward[0].kernel->launch.vec.gx == 7);  // one block per row
  CHECK(p->forward[1].kernel->gen.kernel == "jf_cross_entropy_reduce_fwd");
  CHECK(p->forward[1].kernel->launch.vec.gx == 1);
  REQUIRE(p->backward.size() == 1);
  CHECK(p->backward[0].kernel->gen.kernel == "jf_cross_entropy_bwd");
  // The caller's logits and labels stay alive for the backward (it reads them from its own arguments).
  CHECK(saved_names(*p) == std::set<std::string>{"input", "extra_input[0]", "op0.lse", "op0.scale"});
  CHECK(p->saved_bytes == 512);  // 7 fp32 lse and the scale, 256-byte aligned
                                 // each; the logits are the caller's
  CHECK(p->buffer(p->extra_in.at(0)).dtype == ops::DType::i64);
  CHECK(p->buffer(p->extra_in.at(0)).bytes == 7 * 8);
  CHECK(p->grad_extra_in.empty());  // labels have no gradient

  auto none = program_of(R"([{"op": "cross_entropy", "reduction": "none", "label_dtype": "int32"}])", {7, 50257});
  CHECK(none->forward.size() == 1);
  CHECK(saved_names(*none) == std::set<std::string>{"input", "extra_input[0]", "op0.lse"});
  CHECK(none->buffer(none->extra_in.at(0)).dtype == ops::DType::i32);
  auto infer = program_of(R"([{"op": "cross_entropy"}])", {7, 50257}, false);
  CHECK(infer->forward.size() == 2);
  CHECK(infer->saved_set().empty());
  CHECK_FALSE(infer->forward[0].kernel->spec.ce->save);
}

TEST_CASE(
    "linear -> cross_entropy: the joint rule runs the head in chunks and "
    "saves dx and dW, not the logits",
    "[exec][cross_entropy]") {
  auto p = program_of(head(64, 50257), {7, 64});
  REQUIRE(p->plan.forward.size() == 1);
  CHECK(p->plan.forward[0].rule == "linear_cross_entropy_chunked");
  CHECK(p->plan.forward[0].begin == 0);
  CHECK(p->plan.forward[0].end == 2);
  REQUIRE(p->plan.backward.size() == 1);
  CHECK(p->plan.backward[0].rule == "linear_cross_entropy_chunked");
  // The weight padded to 50264 rows (an odd vocabulary); the scale from the labels; one chunk: head GEMM,
  // the fused kernel, dgrad, wgrad; then the reduction.
  REQUIRE(p->forward.size() == 7);
  CHECK(p->forward[0].kernel->gen.kernel == "jf_cross_entropy_pad_fwd");
  CHECK(p->forward[0].kernel->spec.ce->pad_from == 50257);
  CHECK(p->forward[1].kernel->gen.kernel == "jf_cross_entropy_count_fwd");
  CHECK(p->forward[2].gemm.call.kind == cuda::GemmKind::fwd);
  CHECK(p->forward[3].kernel->gen.kernel == "jf_cross_entropy_fused_fwd");
  CHECK(p->forward[3].kernel->spec.ce->prescaled);
  CHECK(p->forward[4].gemm.call.kind == cuda::GemmKind::dgrad);
  CHECK(p->forward[5].gemm.call.kind == cuda::GemmKind::wgrad);
  CHECK(p->forward[5].gemm.call.beta == 0.f);
  CHECK(p->forward[6].kernel->gen.kernel == "jf_cross_entropy_reduce_fwd");
  // The logits rows are padded to 8 elements: every GEMM reading or writing them says so; the head and the
  // dgrad run over the padded vocabulary (the padded weight), the wgrad over the real one.
  for (int i : {2, 4, 5}) CHECK(p->forward[static_cast<size_t>(i)].gemm.call.ldy == 50264);
  CHECK(p->forward[2].gemm.call.n == 50264);
  CHECK(p->forward[4].gemm.call.n == 50264);
  CHECK(p->forward[5].gemm.call.n == 50257);
  CHECK(p->buffer(p->forward[2].gemm.b).name == "weight padded");
  CHECK(p->buffer(p->forward[4].gemm.b).name == "weight padded");
  CHECK(p->forward[3].kernel->spec.ce->ld == 50264);
  // The backward only multiplies what the forward saved by the upstream gradient, and may do it in place.
  REQUIRE(p->backward.size() == 2);
  for (const auto& s : p->backward) CHECK(s.kernel->gen.kernel == "jf_cross_entropy_scale_bwd");
  REQUIRE(p->grad_aliases.size() == 2);
  CHECK(p->buffer(p->grad_aliases[0].grad).role == exec::BufferRole::grad_input);
  CHECK(p->buffer(p->grad_aliases[0].saved).name == "op0.dx");
  CHECK(p->buffer(p->grad_aliases[1].grad).role == exec::BufferRole::grad);
  CHECK(p->buffer(p->grad_aliases[1].saved).name == "op0.dW");
  CHECK(saved_names(*p) == std::set<std::string>{"op0.dx", "op0.dW"});  // the scale is applied in the forward
  for (int id : p->saved_set()) CHECK(p->buffer(id).cols != 50257);  // no logits, no lse
  CHECK(p->saved_bytes == (7 * 64 * 2 + 255) / 256 * 256 + (50257 * 64 * 2 + 255) / 256 * 256 + 256);

  // The unfused ops save the logits (the linear's output) beside the lse.
  auto u = program_of(head(64, 50257), {7, 64}, true, "bf16", true);
  CHECK(saved_names(*u) == std::set<std::string>{"input", "act1", "extra_input[0]", "op1.lse", "op1.scale"});
  CHECK(u->buffer(u->find(exec::BufferRole::activation, 1, "")).bytes == 7 * 50257 * 2);
}

TEST_CASE(
    "the joint head: chunks from the 256 MiB logits budget, steps per "
    "chunk, bias and accumulate_grad",
    "[exec][cross_entropy]") {
  // Llama-3-8B's head at 8192 tokens, bf16, chunk_mib 256: 1024 rows x 128256 x 2 B = 250.5 MiB per chunk,
  // 8 chunks. Automatic (no chunk_mib): 256 MiB but at least 2048 rows, 4 chunks.
  auto automatic = program_of(head(4096, 128256), {8192, 4096});
  CHECK(count(automatic->forward, exec::Step::Kind::gemm, cuda::GemmKind::fwd) == 4);
  auto p = program_of(head(4096, 128256, R"({"op": "cross_entropy", "chunk_mib": 256})"), {8192, 4096});
  CHECK(count(p->forward, exec::Step::Kind::gemm, cuda::GemmKind::fwd) == 8);
  CHECK(count(p->forward, exec::Step::Kind::gemm, cuda::GemmKind::dgrad) == 8);
  CHECK(count(p->forward, exec::Step::Kind::gemm, cuda::GemmKind::wgrad) == 8);
  CHECK(count(p->forward, exec::Step::Kind::kernel) == 10);  // the count, 8 chunk kernels, the reduction
  CHECK(p->forward.size() == 34);
  int64_t first = -1, c0 = 0;
  for (const auto& s : p->forward) {
    if (s.kind != exec::Step::Kind::gemm || s.gemm.call.kind != cuda::GemmKind::fwd) continue;
    if (first < 0) first = s.gemm.call.m;
    CHECK(s.gemm.a_offset == c0 * 4096);
    c0 += s.gemm.call.m;
  }
  CHECK(first == 1024);
  CHECK(c0 == 8192);
  bool chunk_found = false;
  for (const auto& b : p->buffers)
    if (b.name == "logits chunk") {
      chunk_found = true;
      CHECK(b.rows == 1024);
      CHECK(b.bytes <= 256u << 20);
    }
  CHECK(chunk_found);
  // wgrad accumulates from the second chunk on, reading chunk rows of x.
  int wg = 0;
  for (const auto& s : p->forward)
    if (s.kind == exec::Step::Kind::gemm && s.gemm.call.kind == cuda::GemmKind::wgrad) {
      CHECK(s.gemm.call.beta == (wg == 0 ? 0.f : 1.f));
      CHECK(s.gemm.b_offset == wg * 1024 * 4096);
      ++wg;
    }
  // The saved memory: dx and dW (1.0 GiB) instead of the logits (2.0 GiB).
  CHECK(p->saved_bytes < (int64_t{8192} * 4096 + int64_t{128256} * 4096) * 2 + 4096);
  // GPT-2's vocabulary with a bias: 2560-row chunks (a multiple of 128), the ones column, a column-sum GEMM each.
  auto q = program_of(head(768, 50257, R"({"op": "cross_entropy", "reduction": "sum"})", true), {8192, 768});
  CHECK(q->plan.forward.at(0).rule == "linear_cross_entropy_chunked");
  CHECK(q->plan.forward.at(0).end == 3);
  CHECK(count(q->forward, exec::Step::Kind::gemm, cuda::GemmKind::fwd) == 4);
  CHECK(count(q->forward, exec::Step::Kind::gemm, cuda::GemmKind::wgrad) == 8);  // dW and db per chunk
  CHECK(q->forward.at(0).kernel->gen.kernel == "jf_cross_entropy_pad_fwd");  // the weight
  CHECK(q->forward.at(1).kernel->gen.kernel == "jf_cross_entropy_pad_fwd");  // the bias
  CHECK(q->forward.at(2).kernel->gen.kernel == "jf_cross_entropy_count_fwd");
  CHECK(q->forward.at(3).kernel->gen.kernel == "jf_cross_entropy_ones_fwd");
  CHECK(q->grad_aliases.size() == 3);  // dx, dW, db
  CHECK(saved_names(*q).count("op1.db") == 1);
  CHECK(q->backward.size() == 3);
  // accumulate_grad: the backward adds g scale dW into the weight's gradient.
  auto a = program_of(
      R"([{"op": "linear", "in_features": 64, "out_features": 100, "accumulate_grad": true},
                         {"op": "cross_entropy"}])",
      {5, 64});
  REQUIRE(a->backward.size() == 2);
  CHECK(a->backward[1].kernel->spec.ce->accumulate);
  CHECK_FALSE(a->backward[0].kernel->spec.ce->accumulate);
  REQUIRE(a->grad_aliases.size() == 1);  // dx only: an accumulating gradient never sits over the saved dW
  CHECK(a->buffer(a->grad_aliases[0].grad).role == exec::BufferRole::grad_input);
  // chunk_mib sets the budget: 16 MiB of 128256-wide bf16 logits is 65 rows, below one 128-row tile.
  auto c = program_of(head(64, 128256, R"({"op": "cross_entropy", "chunk_mib": 16})"), {300, 64});
  CHECK(count(c->forward, exec::Step::Kind::gemm, cuda::GemmKind::fwd) == 5);  // 65-row chunks: 4 x 65 + 40
}

TEST_CASE(
    "the joint head is refused with its reason for reduction none and "
    "not planned for inference",
    "[exec][cross_entropy]") {
  auto p = program_of(head(64, 1000, R"({"op": "cross_entropy", "reduction": "none"})"), {7, 64});
  CHECK(p->plan.forward.size() == 2);  // linear, cross_entropy apart
  bool refused = false;
  for (const auto& d : p->plan.decisions)
    if (d.rule == "linear_cross_entropy_chunked") {
      refused = !d.taken;
      CHECK_THAT(d.reason, Catch::Contains("reduction none: the backward's per-row "
                                           "upstream gradients are not known"));
    }
  CHECK(refused);
  auto inf = program_of(head(64, 1000), {7, 64}, false);
  for (const auto& g : inf->plan.forward) CHECK(g.rule != "linear_cross_entropy_chunked");
  CHECK(inf->forward.size() == 3);  // GEMM, row kernel, reduction: the logits whole, in the arena
}

TEST_CASE("tools/examples/lm_head.json: a norm, then the head and its loss as the joint group", "[exec][cross_entropy]") {
  static const rules::RuleSet rs = rules::RuleSet::with_builtins();
  auto def = ops::parse_sequence_file(std::string(JF_SOURCE_DIR) + "/tools/examples/lm_head.json", rs.registry());
  exec::CompileOptions o;
  o.arch = 90;
  auto p = exec::compile(def, ops::parse_recipe("bf16"), {8192, 4096}, o, rs);
  REQUIRE(p->plan.forward.size() == 2);
  CHECK(p->plan.forward[1].rule == "linear_cross_entropy_chunked");
  CHECK(count(p->forward, exec::Step::Kind::gemm, cuda::GemmKind::fwd) == 4);  // automatic chunks: 2048 rows
  // The norm's output is the head's x: the wgrad of every chunk reads it, so it lives through the last chunk.
  const auto& x = p->buffer(p->values.at(1));
  CHECK(x.last >= static_cast<int>(p->forward.size()) - 3);
}
