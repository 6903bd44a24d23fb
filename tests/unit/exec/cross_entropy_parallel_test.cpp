// The vocab-parallel cross_entropy (issue 47; docs/parallel.md#vocab-parallel-loss), planned without GPUs: the head's
// linear split by vocabulary over the ranks ("tensor_parallel": "column"), the loss with "vocab_parallel": every
// chunk's (or the unfused op's) row statistics gathered over the group between the head GEMM and the loss kernel,
// dx summed by the column-parallel linear's backward all-reduce, the kernels told their columns of the vocabulary;
// the sequence errors when the two attributes do not go together; at world size 1 the plan of the plain loss.
#include <catch2/catch.hpp>

#include "common/error.hpp"
#include "exec/lower/compile.hpp"
#include "rules/rule.hpp"

using namespace jitfuse;

namespace {

const rules::RuleSet& builtins() {
  static const rules::RuleSet rs = rules::RuleSet::with_builtins();
  return rs;
}

std::string head(int64_t h, int64_t v, bool vp = true, const char* tp = "column", bool bias = false,
                 const char* reduction = "mean") {
  return fmt::format(R"({{"ops": [{{"op": "linear", "in_features": {}, "out_features": {}, "tensor_parallel": "{}"}}, {}
                         {{"op": "cross_entropy", "reduction": "{}"{}}}]}})",
                     h, v, tp, bias ? R"({"op": "bias"},)" : "", reduction, vp ? R"(, "vocab_parallel": true)" : "");
}

std::shared_ptr<const exec::Program> program_of(const std::string& text, const ops::Shape& shape, int world, int rank,
                                                bool training = true, bool fuse = true) {
  auto def = ops::parse_sequence(text, "<test>", builtins().registry());
  exec::CompileOptions o;
  o.arch = 90;
  o.training = training;
  o.disable_fusion = !fuse;
  ops::Parallel par;
  par.world_size = world;
  par.rank = rank;
  return exec::compile(ops::infer(def, shape, par), def.name, ops::parse_recipe("bf16"), o, builtins());
}

std::vector<std::string> kinds(const std::vector<exec::Step>& steps) {
  std::vector<std::string> out;
  for (const auto& s : steps)
    out.push_back(s.kind == exec::Step::Kind::kernel ? s.kernel->gen.kernel
                  : s.kind == exec::Step::Kind::comm ? std::string(exec::collective_name(s.comm.op))
                                                      : std::string(exec::step_kind_name(s.kind)));
  return out;
}

}  // namespace

TEST_CASE("vocab-parallel head: every chunk gathers its rows' statistics between the head GEMM and the loss kernel",
          "[exec][cross_entropy][parallel]") {
  // Llama-3's vocabulary over 4 ranks (32064 columns each), 8192 rows: the automatic 256 MiB of this rank's logits
  // is 4096 rows, two chunks.
  auto p = program_of(head(256, 128256), {8192, 256}, 4, 3);
  REQUIRE(p->plan.forward.size() == 2);  // the inserted all_reduce (dx in the backward), then the joint head
  CHECK(p->plan.forward[1].rule == "linear_cross_entropy_chunked");
  const std::vector<std::string> chunk = {"gemm", "jf_cross_entropy_stats_fwd", "all_gather",
                                          "jf_cross_entropy_fused_fwd", "gemm", "gemm"};
  std::vector<std::string> want = {"jf_cross_entropy_count_fwd"};
  for (int c = 0; c < 2; ++c) want.insert(want.end(), chunk.begin(), chunk.end());
  want.push_back("jf_cross_entropy_reduce_fwd");
  CHECK(kinds(p->forward) == want);
  for (const auto& s : p->forward) {
    if (s.kind == exec::Step::Kind::comm) {
      CHECK(s.comm.dtype == ops::DType::f32);
      CHECK(s.comm.count == 4096 * 4);  // 4 floats per row of the chunk
      CHECK(p->buffer(s.comm.recv).rows * p->buffer(s.comm.recv).cols == 4 * 4096 * 4);
    }
    if (s.kind != exec::Step::Kind::kernel) continue;
    const auto& ce = *s.kernel->spec.ce;
    if (ce.kernel != codegen::CrossEntropySpec::Kernel::fused && ce.kernel != codegen::CrossEntropySpec::Kernel::stats)
      continue;
    CHECK(ce.world == 4);
    CHECK(ce.vocab_start == 3 * 32064);
    CHECK(ce.vocab_total == 128256);
    CHECK(s.kernel->spec.cols == 32064);
    if (ce.kernel == codegen::CrossEntropySpec::Kernel::fused) {
      // Every rank's statistics merged; the loss's eps / V and the label range over the whole vocabulary.
      CHECK_THAT(s.kernel->gen.source, Catch::Contains("s0_stats + ((jf_i64)q * gridDim.x + lr) * 4"));
      CHECK_THAT(s.kernel->gen.source, Catch::Contains("y < 128256"));
      CHECK_THAT(s.kernel->gen.source, Catch::Contains("(y - 96192LL)"));
    }
  }
  // The head's weight is this rank's shard; dx is summed over the ranks by the column linear's all_reduce.
  bool weight = false;
  for (const auto& b : p->buffers)
    if (b.role == exec::BufferRole::param && b.key == "weight") weight = b.rows == 32064 && b.cols == 256;
  CHECK(weight);
  const auto bwd = kinds(p->backward);
  REQUIRE_FALSE(bwd.empty());
  CHECK(bwd.back() == "all_reduce");
}

TEST_CASE("vocab-parallel loss unfused: stats then all_gather then loss rows and a backward over its own columns",
          "[exec][cross_entropy][parallel]") {
  for (bool training : {true, false}) {
    auto p = program_of(head(64, 1000, true, "column", true), {7, 64}, 2, 1, training, false);
    const auto fwd = kinds(p->forward);
    INFO((training ? "training" : "inference"));
    // linear, bias, then the loss: this rank's row statistics, gathered, the rows' losses and the reduction.
    REQUIRE(fwd.size() >= 4);
    CHECK(std::vector<std::string>(fwd.end() - 4, fwd.end()) ==
          std::vector<std::string>{"jf_cross_entropy_stats_fwd", "all_gather", "jf_cross_entropy_fwd",
                                   "jf_cross_entropy_reduce_fwd"});
    if (!training) continue;
    const auto& bwd = p->backward.front();
    REQUIRE(bwd.kind == exec::Step::Kind::kernel);
    CHECK(bwd.kernel->gen.kernel == "jf_cross_entropy_bwd");
    CHECK(bwd.kernel->spec.ce->vocab_start == 500);
    CHECK_THAT(bwd.kernel->gen.source, Catch::Contains("(y - 500LL)"));
    CHECK_THAT(bwd.kernel->gen.source, Catch::Contains("y < 1000"));
  }
}

TEST_CASE("vocab-parallel head with a padded shard plans on every rank", "[exec][cross_entropy][parallel]") {
  // V = 1000 over 4 ranks: 250 columns each, padded to 256 for the GEMMs (the weight copied with zero rows; that
  // kernel's columns are the hidden size, not the vocabulary); the last rank's columns end at the vocabulary's end.
  for (int rank = 0; rank < 4; ++rank) {
    INFO("rank " << rank);
    auto p = program_of(head(256, 1000), {1032, 256}, 4, rank);
    int stats = 0;
    for (const auto& s : p->forward)
      if (s.kind == exec::Step::Kind::kernel && s.kernel->spec.ce->kernel == codegen::CrossEntropySpec::Kernel::stats) {
        ++stats;
        CHECK(s.kernel->spec.ce->vocab_start == 250 * rank);
      }
    CHECK(stats == 1);
  }
}

TEST_CASE("vocab-parallel at world size 1 plans the plain loss", "[exec][cross_entropy][parallel]") {
  auto vp = program_of(head(64, 1000), {300, 64}, 1, 0);
  auto plain = program_of(head(64, 1000, false, "none"), {300, 64}, 1, 0);
  CHECK(kinds(vp->forward) == kinds(plain->forward));
  for (size_t i = 0; i < vp->forward.size(); ++i)
    if (vp->forward[i].kind == exec::Step::Kind::kernel)
      CHECK(vp->forward[i].kernel->gen.source == plain->forward[i].kernel->gen.source);
}

TEST_CASE("vocab_parallel and a column-parallel head go together or the sequence is refused with the fix",
          "[exec][cross_entropy][parallel]") {
  auto parse = [](const std::string& text) { return ops::parse_sequence(text, "<test>", builtins().registry()); };
  CHECK_THROWS_WITH(parse(head(64, 1000, false)),
                    Catch::Contains("this rank's shard of the vocabulary; set \"vocab_parallel\": true"));
  CHECK_THROWS_WITH(parse(head(64, 1000, false, "column", true)), Catch::Contains("set \"vocab_parallel\": true"));
  CHECK_THROWS_WITH(parse(head(64, 1000, true, "none")),
                    Catch::Contains("\"vocab_parallel\": true needs its logits from a column-parallel linear"));
  CHECK_THROWS_WITH(parse(R"({"ops": [{"op": "cross_entropy", "vocab_parallel": true}]})"),
                    Catch::Contains("needs its logits from a column-parallel linear"));
  // A row-parallel head's logits are whole after its all_reduce: the plain loss reads them.
  CHECK_NOTHROW(parse(head(64, 1000, false, "row")));
  // Without vocab_parallel the attribute is not part of the op (plans and cache keys of before).
  const auto def = parse(head(64, 1000, false, "none"));
  CHECK_FALSE(def.ops.back().attrs.contains("vocab_parallel"));
}
