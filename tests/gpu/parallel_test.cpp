// Tensor parallelism on one GPU (docs/parallel.md): a world-size-1 communicator through NCCL. Every comm op
// and every parallel linear (column / row, with and without sequence parallelism) matches the float64
// reference and equals its non-parallel sequence bit for bit (fusion off: the same kernels and GEMMs, NCCL's
// one-rank collectives copy); a sequence with comm steps captured in a CUDA graph replays bit-identical to
// its eager calls; a host's own ncclComm_t wrapped; the communicator's argument errors.
#include <fstream>
#include <sstream>

#include "cuda/nccl.hpp"
#include "gpu/gpu_check.hpp"
#include "gpu/rig.hpp"

using namespace jitfuse;
using test::Rig;

namespace {

// One world-size-1 communicator for the test process (NCCL must load on the GPU machine).
jf_comm one_rank() {
  static jf_comm comm = [] {
    int version = 0;
    const jf_status st = jf_nccl_version(&version);
    INFO(jf_last_error());
    REQUIRE(st == JF_OK);
    uint8_t id[JF_COMM_ID_BYTES];
    REQUIRE(jf_comm_unique_id(id, sizeof id) == JF_OK);
    jf_comm c = nullptr;
    REQUIRE(jf_comm_create(id, sizeof id, 1, 0, &c) == JF_OK);
    return c;
  }();
  return comm;
}

std::string seq(const std::string& ops_json, const std::string& inputs = "") {
  return R"({"format": "jitfuse.sequence/1", "name": "tp", )" +
         (inputs.empty() ? std::string() : R"("input_channels": )" + inputs + ", ") + R"("ops": )" + ops_json + "}";
}

harness::CheckReport check(const std::string& json, const std::string& recipe, const ops::Shape& shape,
                             uint64_t seed = 1) {
  harness::CheckOptions o;
  o.recipe = recipe;
  o.shape = shape;
  o.seed = seed;
  o.comm = one_rank();
  auto rep = harness::check_sequence(test::shared_context(), test::builtin_registry(), json, o);
  INFO(json << " recipe " << recipe << " shape " << ops::shape_str(shape) << "\n" << rep.table());
  CHECK(rep.pass());
  return rep;
}

// The MLP blocks at test size: the linears parallel as `tp` says ("" : plain).
std::string llama(const char* col, const char* row, bool sp) {
  auto par = [&](const char* mode) {
    return *mode ? fmt::format(R"(, "tensor_parallel": "{}", "sequence_parallel": {})", mode, sp ? "true" : "false")
                 : std::string();
  };
  return seq(fmt::format(R"([{{"op": "make_extra_output", "channel": "residual"}}, {{"op": "rmsnorm"}},
    {{"op": "linear", "in_features": 64, "out_features": 192{}}}, {{"op": "swiglu"}},
    {{"op": "linear", "in_features": 96, "out_features": 64{}}}, {{"op": "add_extra_input", "channel": "residual"}}])",
                         par(col), par(row)));
}
std::string gpt2(const char* col, const char* row, bool sp) {
  auto par = [&](const char* mode) {
    return *mode ? fmt::format(R"(, "tensor_parallel": "{}", "sequence_parallel": {})", mode, sp ? "true" : "false")
                 : std::string();
  };
  return seq(fmt::format(R"([{{"op": "make_extra_output", "channel": "residual"}}, {{"op": "layernorm"}},
    {{"op": "linear", "in_features": 64, "out_features": 256{}}}, {{"op": "bias"}}, {{"op": "gelu", "approximate": "tanh"}},
    {{"op": "linear", "in_features": 256, "out_features": 64{}}}, {{"op": "bias"}}, {{"op": "dropout", "p": 0.1, "seed": 11}},
    {{"op": "add_extra_input", "channel": "residual"}}])",
                         par(col), par(row)));
}

// A training forward + backward of `json` on inputs drawn from `seed`: every tensor the calls write.
std::vector<std::vector<uint8_t>> run_once(const std::string& json, const ops::Shape& shape, uint64_t seed) {
  jf_sequence s = nullptr;
  REQUIRE(jf_sequence_create(test::shared_context(), json.c_str(), "bf16", &s) == JF_OK);
  if (!s->impl->def.group.empty()) REQUIRE(jf_sequence_set_comm(s, "tp", one_rank()) == JF_OK);
  CUstream st = nullptr;
  cuda::check(cuda::driver().cuStreamCreate(&st, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
  std::vector<std::vector<uint8_t>> out;
  {
    Rig rig(test::shared_context(), s, st, shape, seed);
    rig.set_rng(0x77, 5);
    rig.poison();
    const jf_status r = rig.enqueue();
    INFO(jf_last_error());
    REQUIRE(r == JF_OK);
    out = rig.results();
  }
  cuda::check(cuda::driver().cuStreamSynchronize(st), "cuStreamSynchronize");
  cuda::driver().cuStreamDestroy(st);
  jf_sequence_destroy(s);
  return out;
}

}  // namespace

TEST_CASE("every comm op on a one-rank communicator matches the float64 reference", "[parallel]") {
  const std::string cases[] = {
      seq(R"([{"op": "all_gather"}])"),
      seq(R"([{"op": "reduce_scatter"}])"),
      seq(R"([{"op": "all_reduce"}])"),
      seq(R"([{"op": "all_reduce", "direction": "backward"}])"),  // the output is the caller's: a copy
      seq(R"([{"op": "gelu"}, {"op": "all_reduce", "direction": "backward"}, {"op": "silu"}])"),  // aliased
      seq(R"([{"op": "all_reduce", "direction": "backward"}, {"op": "gelu"}, {"op": "all_reduce"}])"),
      seq(R"([{"op": "make_extra_output", "channel": "r"}, {"op": "all_gather"}, {"op": "gelu"}, {"op": "reduce_scatter"},
              {"op": "add_extra_input", "channel": "r"}])"),
  };
  for (const auto& c : cases)
    for (const char* recipe : {"fp32", "bf16"})
      for (ops::Shape shape : {ops::Shape{33, 64}, ops::Shape{4, 3, 24}}) check(c, recipe, shape);
}

// Expert parallelism on one rank (docs/parallel.md#expert-parallelism): moe_dispatch / moe_combine around the
// dropless expert block. At one rank every expert is this rank's, so the exchange copies each expert's rows into
// the expert-major rows and back: the block matches the float64 reference, also with a max_rows above the
// permuted rows (a tail of rows the exchange zeroes), in inference, and after a padded permute (fixed rows per
// rank and expert, drops). A max_rows below the rows the routing sends fails the call naming the op and the fix,
// and the context runs the next sequence.
TEST_CASE("the expert-parallel block on a one-rank communicator matches the float64 reference", "[parallel]") {
  auto block = [](const std::string& max_rows, int h, int f) {
    return seq(fmt::format(R"([{{"op": "make_extra_output", "channel": "res"}}, {{"op": "rmsnorm"}},
      {{"op": "moe_permute", "num_experts": 8, "top_k": 2}}, {{"op": "moe_dispatch"{0}}},
      {{"op": "grouped_linear", "num_groups": 8, "in_features": {1}, "out_features": {2}}}, {{"op": "swiglu"}},
      {{"op": "grouped_linear", "num_groups": 8, "in_features": {3}, "out_features": {1}}},
      {{"op": "moe_combine"}}, {{"op": "moe_unpermute"}}, {{"op": "add_extra_input", "channel": "res"}}])",
                           max_rows, h, 2 * f, f));
  };
  for (const char* recipe : {"fp32", "bf16"}) {
    check(block("", 128, 192), recipe, {97, 128});
    check(block(R"(, "max_rows": 300)", 128, 192), recipe, {97, 128}, 3);
  }
  harness::CheckOptions o;
  o.recipe = "bf16";
  o.shape = {97, 128};
  o.comm = one_rank();
  o.backward = false;
  CHECK(harness::check_sequence(test::shared_context(), test::builtin_registry(), block("", 128, 192), o).pass());
  o.backward = true;
  CHECK_THROWS_WITH(harness::check_sequence(test::shared_context(), test::builtin_registry(),
                                            block(R"(, "max_rows": 100)", 128, 192), o),
                    Catch::Contains("more than the moe_dispatch's \"max_rows\" on that rank (100): raise it"));
  check(block("", 64, 96), "bf16", {61, 64});
  // The padded layout (fixed rows per rank and expert, what a CUDA graph captures): a capacity that drops.
  std::string padded = block("", 128, 192);
  padded.replace(padded.find(R"("top_k": 2})"), 11, R"("top_k": 2, "layout": "padded", "capacity": 20})");
  for (const char* recipe : {"fp32", "bf16"}) check(padded, recipe, {97, 128});
}

TEST_CASE("parallel linears on one rank match the reference and their plain sequence bit for bit", "[parallel]") {
  struct Par {
    const char *col, *row;
    bool sp;
  } pars[] = {{"column", "row", true}, {"column", "row", false}, {"row", "column", false}, {"column", "", false}};
  for (const auto& p : pars) {
    INFO(p.col << " / " << p.row << (p.sp ? " + SP" : ""));
    for (const std::string& block : {llama(p.col, p.row, p.sp), gpt2(p.col, p.row, p.sp)}) {
      for (const char* recipe : {"fp32", "bf16"}) check(block, recipe, {33, 64});
      for (const char* recipe : {"fp8_delayed", "fp8_current"}) check(block, recipe, {48, 64});
    }
    // Fusion off, the plain and the parallel sequence run the same kernels and GEMMs; the collectives of
    // one rank copy: every tensor written is bit-identical.
    test::ScopedEnv off("JITFUSE_DISABLE_FUSION", "1");
    for (bool is_llama : {true, false}) {
      const std::string tp = is_llama ? llama(p.col, p.row, p.sp) : gpt2(p.col, p.row, p.sp);
      const std::string plain = is_llama ? llama("", "", false) : gpt2("", "", false);
      auto a = run_once(tp, {40, 64}, 9), b = run_once(plain, {40, 64}, 9);
      REQUIRE(a.size() == b.size());
      for (size_t t = 0; t < a.size(); ++t) {
        INFO("tensor " << t);
        CHECK(a[t] == b[t]);
      }
    }
  }
  // The examples of docs/parallel.md at one rank.
  for (const char* file : {"tp_mlp.json", "tp_attn_out.json"}) {
    std::ifstream f(std::string(JF_SOURCE_DIR) + "/tools/examples/" + file);
    std::stringstream ss;
    ss << f.rdbuf();
    check(ss.str(), "bf16", {64, 1024});
  }
}

TEST_CASE("a GEMM pipelined with its collective in row chunks matches the reference", "[parallel]") {
  // Rows divisible by 4: the SP blocks take all_gather_linear_overlap and linear_reduce_scatter_overlap
  // (4 chunks at one rank; broadcasts and reduces on the side stream, GEMM chunks on the caller's).
  for (const std::string& block : {llama("column", "row", true), gpt2("column", "row", true)}) {
    jf_sequence s = nullptr;
    REQUIRE(jf_sequence_create(test::shared_context(), block.c_str(), "bf16", &s) == JF_OK);
    const ops::Shape shape{64, 64};
    const char* js = nullptr;
    REQUIRE(jf_sequence_explain(s, shape.data(), 2, 1, 90, &js) == JF_OK);
    const std::string plan = js;
    jf_sequence_destroy(s);
    CHECK(plan.find("\"all_gather_linear_overlap\"") != std::string::npos);
    CHECK(plan.find("\"linear_reduce_scatter_overlap\"") != std::string::npos);
    for (const char* recipe : {"fp32", "bf16"})
      for (ops::Shape sh : {ops::Shape{64, 64}, ops::Shape{256, 64}, ops::Shape{1024, 64}}) check(block, recipe, sh);
  }
}

TEST_CASE("a sequence with comm steps replays from a CUDA graph bit-identical to its eager calls", "[parallel]") {
  cuda::current_device();
  jf_sequence s = nullptr;
  const std::string json = gpt2("column", "row", true);
  REQUIRE(jf_sequence_create(test::shared_context(), json.c_str(), "bf16", &s) == JF_OK);
  REQUIRE(jf_sequence_set_comm(s, "tp", one_rank()) == JF_OK);
  CUstream st = nullptr;
  cuda::check(cuda::driver().cuStreamCreate(&st, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
  const ops::Shape shape{64, 64};
  REQUIRE(jf_sequence_prepare(s, shape.data(), 2, 1, reinterpret_cast<jf_stream>(st)) == JF_OK);
  {
    Rig rig(test::shared_context(), s, st, shape, 5);
    rig.set_rng(0xabc, 7);
    rig.poison();
    REQUIRE(rig.enqueue() == JF_OK);
    auto eager = rig.results();
    CUgraph graph = nullptr;
    CUgraphExec exec = nullptr;
    cuda::check(cuda::driver().cuStreamBeginCapture(st, CU_STREAM_CAPTURE_MODE_GLOBAL), "cuStreamBeginCapture");
    const jf_status r = rig.enqueue();
    const std::string err = jf_last_error();
    cuda::check(cuda::driver().cuStreamEndCapture(st, &graph), "cuStreamEndCapture");
    INFO(err);
    REQUIRE(r == JF_OK);
    cuda::check(cuda::driver().cuGraphInstantiateWithFlags(&exec, graph, 0), "cuGraphInstantiate");
    for (int rep = 0; rep < 3; ++rep) {
      rig.set_rng(0xabc, 7);
      rig.poison();
      cuda::check(cuda::driver().cuGraphLaunch(exec, st), "cuGraphLaunch");
      auto got = rig.results();
      for (size_t t = 0; t < got.size(); ++t) {
        INFO("replay " << rep << " tensor " << t);
        CHECK(got[t] == eager[t]);
      }
    }
    cuda::driver().cuGraphExecDestroy(exec);
    cuda::driver().cuGraphDestroy(graph);
  }
  cuda::check(cuda::driver().cuStreamSynchronize(st), "cuStreamSynchronize");
  cuda::driver().cuStreamDestroy(st);
  jf_sequence_destroy(s);
}

TEST_CASE("a host's ncclComm_t is borrowed, and the communicator's misuse is named", "[parallel]") {
  const cuda::Nccl& n = cuda::nccl();
  cuda::current_device();
  ncclUniqueId id;
  cuda::check_nccl(n.ncclGetUniqueId(&id), "ncclGetUniqueId");
  ncclComm_t host = nullptr;
  cuda::check_nccl(n.ncclCommInitRank(&host, 1, id, 0), "ncclCommInitRank");
  jf_comm c = nullptr;
  REQUIRE(jf_comm_wrap(host, &c) == JF_OK);
  int world = 0, rank = -1, dev = -1;
  REQUIRE(jf_comm_info(c, &world, &rank, &dev) == JF_OK);
  CHECK(world == 1);
  CHECK(rank == 0);
  CHECK(dev == cuda::current_ordinal());
  const std::string json = llama("column", "row", false);
  jf_sequence s = nullptr;
  REQUIRE(jf_sequence_create(test::shared_context(), json.c_str(), "bf16", &s) == JF_OK);
  CHECK(jf_sequence_set_comm(s, "dp", c) == JF_ERR_INVALID_ARGUMENT);
  CHECK(std::string(jf_last_error()).find("runs on group 'tp', not 'dp'") != std::string::npos);
  REQUIRE(jf_sequence_set_comm(s, "tp", c) == JF_OK);
  REQUIRE(jf_comm_destroy(c) == JF_OK);  // the sequence keeps its reference
  const ops::Shape shape{16, 64};
  REQUIRE(jf_sequence_prepare(s, shape.data(), 2, 1, nullptr) == JF_OK);
  jf_comm again = nullptr;
  REQUIRE(jf_comm_wrap(host, &again) == JF_OK);
  CHECK(jf_sequence_set_comm(s, "tp", again) == JF_ERR_INVALID_ARGUMENT);  // after a prepare
  CHECK(std::string(jf_last_error()).find("before the first prepare") != std::string::npos);
  jf_comm_destroy(again);
  jf_sequence_destroy(s);
  // A plain sequence needs no communicator.
  REQUIRE(jf_sequence_create(test::shared_context(), llama("", "", false).c_str(), "bf16", &s) == JF_OK);
  REQUIRE(jf_comm_wrap(host, &again) == JF_OK);
  CHECK(jf_sequence_set_comm(s, "tp", again) == JF_ERR_INVALID_ARGUMENT);
  jf_comm_destroy(again);
  jf_sequence_destroy(s);
  cuda::check_nccl(n.ncclCommDestroy(host), "ncclCommDestroy");  // borrowed: jitfuse left it to the host
}
