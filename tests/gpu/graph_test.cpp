// ABI 2 on the GPU: prepared programs captured in CUDA graphs (replays bit-identical to eager calls with
// the same Philox state, new dropout masks per replay, nothing allocated), a capture whose misaligned
// tensors make it compile and load scalar variants, one prepared sequence run from 8 threads at once with
// different tensors, and a capture of an unprepared shape refused cleanly.
#include <atomic>
#include <cmath>
#include <cstring>
#include <deque>
#include <fstream>
#include <optional>
#include <random>
#include <sstream>
#include <thread>

#include "api/handles.hpp"
#include "gpu/gpu_check.hpp"
#include "ops/sequence.hpp"
#include "harness/device_tensor.hpp"
#include "gpu/rig.hpp"

using namespace jitfuse;
using harness::DeviceTensor;
using test::Rig;

namespace {

const auto& drv() { return cuda::driver(); }
void ck(CUresult r, const char* what) { cuda::check(r, what); }

std::string example(const char* name) {
  std::ifstream f(std::string(JF_SOURCE_DIR) + "/tools/examples/" + name);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Norm, bias, activation, dropout and residual: generated kernels only (no GEMM).
const char* kNormDropout = R"([{"op": "make_extra_output"}, {"op": "layernorm"}, {"op": "bias"},
  {"op": "gelu", "approximate": "tanh"}, {"op": "dropout", "p": 0.1, "seed": 7}, {"op": "add_extra_input"}])";

// The MLP block with its residual dropout (bias, dropout, add), at test-sized features.
const char* kMlpDropout = R"([{"op": "layernorm"}, {"op": "linear", "in_features": 256, "out_features": 1024},
  {"op": "bias"}, {"op": "gelu", "approximate": "tanh"}, {"op": "linear", "in_features": 1024, "out_features": 256},
  {"op": "bias"}, {"op": "dropout", "p": 0.1, "seed": 7}, {"op": "add_extra_input"}])";

struct Counter {
  std::atomic<int> allocs{0}, frees{0};
};
void* count_alloc(size_t bytes, jf_stream s, void* user) {
  static_cast<Counter*>(user)->allocs++;
  CUdeviceptr p = 0;
  drv().cuMemAllocAsync(&p, bytes, reinterpret_cast<CUstream>(s));
  return reinterpret_cast<void*>(p);
}
void count_free(void* p, size_t, jf_stream s, void* user) {
  static_cast<Counter*>(user)->frees++;
  drv().cuMemFreeAsync(reinterpret_cast<CUdeviceptr>(p), reinterpret_cast<CUstream>(s));
}

// `misaligned`: every tensor one element past a 16-byte boundary, and the capture comes first, so the call
// that selects the scalar variants, and compiles and loads them (a context with an empty disk cache), is
// the captured one.
void graph_case(const std::string& json, const ops::Shape& shape, bool misaligned = false, const char* recipe = "bf16") {
  cuda::current_device();  // the device's primary context current (the test creates streams itself)
  std::optional<test::FreshContext> fresh;
  jf_context ctx = nullptr;
  if (misaligned)
    ctx = fresh.emplace().ctx;
  else
    REQUIRE(jf_context_create(&ctx) == JF_OK);
  Counter counter;
  jf_allocator alloc{count_alloc, count_free, &counter};
  REQUIRE(jf_context_set_allocator(ctx, &alloc) == JF_OK);
  jf_sequence seq = nullptr;
  REQUIRE(jf_sequence_create(ctx, json.c_str(), recipe, &seq) == JF_OK);
  CUstream s = nullptr;
  ck(drv().cuStreamCreate(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
  REQUIRE(jf_sequence_prepare(seq, shape.data(), static_cast<int>(shape.size()), 1, reinterpret_cast<jf_stream>(s)) ==
          JF_OK);
  {
    Rig rig(ctx, seq, s, shape, 42, misaligned);
    REQUIRE(rig.info.uses_rng == 1);
    REQUIRE(rig.info.rng_offset_advance == 1);
    const uint64_t seed = 0x1234abcdULL;
    const uint64_t prepared = fresh ? fresh->compiled() : 0;
    // The calls captured once (replayed ten times below with the state rewritten before each replay).
    CUgraph graph = nullptr;
    CUgraphExec exec = nullptr;
    auto capture = [&] {
      ck(drv().cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL), "cuStreamBeginCapture");
      jf_status st = rig.enqueue();
      const std::string err = jf_last_error();
      ck(drv().cuStreamEndCapture(s, &graph), "cuStreamEndCapture");  // fails if jitfuse invalidated the capture
      INFO(err);
      REQUIRE(st == JF_OK);
    };
    if (misaligned) {
      capture();
      // The scalar variants were compiled (and loaded) inside the capture, which recorded only launches.
      CHECK(fresh->compiled() > prepared);
    }
    // Ten eager calls, the Philox offset advanced by the documented step between them.
    std::vector<std::vector<std::vector<uint8_t>>> eager;
    const uint64_t compiled = fresh ? fresh->compiled() : 0;
    for (uint64_t r = 0; r < 10; ++r) {
      rig.set_rng(seed, 100 + r * rig.info.rng_offset_advance);
      rig.poison();
      REQUIRE(rig.enqueue() == JF_OK);
      ck(drv().cuStreamSynchronize(s), "cuStreamSynchronize");
      eager.push_back(rig.results());
    }
    if (fresh) CHECK(fresh->compiled() == compiled);  // compiled once, by the first call that needed them
    if (!misaligned) capture();
    ck(drv().cuGraphInstantiateWithFlags(&exec, graph, 0), "cuGraphInstantiate");
    for (uint64_t r = 0; r < 10; ++r) {
      rig.set_rng(seed, 100 + r * rig.info.rng_offset_advance);
      rig.poison();
      ck(drv().cuGraphLaunch(exec, s), "cuGraphLaunch");
      ck(drv().cuStreamSynchronize(s), "cuStreamSynchronize");
      auto got = rig.results();
      for (size_t t = 0; t < got.size(); ++t) {
        INFO("replay " << r << " tensor " << t);
        CHECK(got[t] == eager[r][t]);  // bit-identical, every element written (the poison is gone)
      }
    }
    // Dropout draws new masks per offset: the output and the input gradient change between replays.
    for (uint64_t r = 0; r + 1 < 10; ++r) CHECK(eager[r][rig.y_at] != eager[r + 1][rig.y_at]);
    CHECK(counter.allocs.load() == 0);  // host memory everywhere: jitfuse allocated nothing, eager or replayed
    CHECK(counter.frees.load() == 0);
    drv().cuGraphExecDestroy(exec);
    drv().cuGraphDestroy(graph);
  }
  // The allocator path still works (and is what a host without its own buffers gets).
  jf_program_info info{};
  REQUIRE(jf_sequence_info(seq, shape.data(), static_cast<int>(shape.size()), 1, &info) == JF_OK);
  CHECK(info.saved_bytes > 0);
  CHECK(info.n_saved > 0);
  CHECK(info.n_params > 0);
  CHECK(info.outputs[0].ndim == static_cast<int>(shape.size()));
  ck(drv().cuStreamSynchronize(s), "cuStreamSynchronize");
  drv().cuStreamDestroy(s);
  jf_sequence_destroy(seq);
  if (!fresh) jf_context_destroy(ctx);
  fresh.reset();  // before `counter`, which the context's allocator points to, goes
}

}  // namespace

TEST_CASE("a prepared MLP (with dropout) forward+backward captured in a CUDA graph replays bit-identically",
          "[graph]") {
  graph_case(test::seq_json(kMlpDropout, "mlp_dropout"), {64, 256});
}

TEST_CASE("the MLP under fp8_block (block-scaled casts and GEMMs) captured in a CUDA graph replays bit-identically",
          "[graph][fp8_block]") {
  graph_case(test::seq_json(kMlpDropout, "mlp_block"), {128, 256}, false, "fp8_block");
}

TEST_CASE("the transformer layer forward+backward captured in a CUDA graph replays bit-identically", "[graph]") {
  graph_case(example("transformer_layer.json"), {128, 1024});
}

TEST_CASE("a capture whose first call has misaligned tensors compiles the scalar variants inside it and replays "
          "bit-identically", "[graph]") {
  graph_case(test::seq_json(kNormDropout, "norm_dropout"), {64, 256}, /*misaligned=*/true);
  graph_case(test::seq_json(kNormDropout, "norm_dropout"), {64, 256});  // aligned: the vector path, as before
}

TEST_CASE("8 threads run one prepared sequence at once with their own tensors and match their single runs",
          "[graph]") {
  jf_context ctx = test::shared_context();
  jf_sequence seq = nullptr;
  REQUIRE(jf_sequence_create(ctx, test::seq_json(kMlpDropout, "mlp_threads").c_str(), "bf16", &seq) == JF_OK);
  const ops::Shape shape{96, 256};
  REQUIRE(jf_sequence_prepare(seq, shape.data(), 2, 1, nullptr) == JF_OK);
  constexpr int kThreads = 8;
  std::vector<std::unique_ptr<Rig>> rigs;
  std::vector<CUstream> streams(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    ck(drv().cuStreamCreate(&streams[t], CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    rigs.push_back(std::make_unique<Rig>(ctx, seq, streams[t], shape, 1000 + t));
    rigs.back()->set_rng(77, 5 + t);
  }
  // Single-threaded first.
  std::vector<std::vector<std::vector<uint8_t>>> single(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    rigs[t]->poison();
    REQUIRE(rigs[t]->enqueue() == JF_OK);
    single[t] = rigs[t]->results();
    rigs[t]->poison();
  }
  ck(drv().cuCtxSynchronize(), "cuCtxSynchronize");
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  CUcontext cu = nullptr;
  drv().cuCtxGetCurrent(&cu);
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      drv().cuCtxSetCurrent(cu);
      for (int rep = 0; rep < 3; ++rep)
        if (rigs[t]->enqueue() != JF_OK) failures++;
      drv().cuStreamSynchronize(streams[t]);
    });
  for (auto& th : threads) th.join();
  CHECK(failures.load() == 0);
  for (int t = 0; t < kThreads; ++t) {
    auto got = rigs[t]->results();
    for (size_t i = 0; i < got.size(); ++i) {
      INFO("thread " << t << " tensor " << i);
      CHECK(got[i] == single[t][i]);
    }
  }
  for (auto s : streams) drv().cuStreamDestroy(s);
  rigs.clear();
  jf_sequence_destroy(seq);
}

// A jf_program handle (no lookup per call) runs the very program jf_forward / jf_backward do: eager and
// captured results bit-identical to the sequence's calls (which the float64 checks of the fusion tests
// verify), every output written (poisoned before each run), after its sequence is destroyed too; its own
// argument checks name what is wrong.
TEST_CASE("a jf_program handle runs the sequence's program bit-identically, eager and in a CUDA graph", "[graph]") {
  jf_context ctx = test::shared_context();
  jf_sequence seq = nullptr;
  REQUIRE(jf_sequence_create(ctx, test::seq_json(kMlpDropout, "mlp_handle").c_str(), "bf16", &seq) == JF_OK);
  const ops::Shape shape{37, 256};  // odd rows
  CUstream s = nullptr;
  ck(drv().cuStreamCreate(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
  const auto js = reinterpret_cast<jf_stream>(s);
  jf_program train = nullptr, infer = nullptr;
  REQUIRE(jf_program_open(seq, shape.data(), 2, 1, js, &train) == JF_OK);
  REQUIRE(jf_program_open(seq, shape.data(), 2, 0, js, &infer) == JF_OK);
  {
    Rig rig(ctx, seq, s, shape, 91);
    jf_program_info info{};
    REQUIRE(jf_program_get_info(train, &info) == JF_OK);
    CHECK(info.saved_bytes == rig.info.saved_bytes);
    CHECK(info.forward_workspace_bytes == rig.info.forward_workspace_bytes);
    CHECK(info.backward_workspace_bytes == rig.info.backward_workspace_bytes);
    auto run = [&](jf_program p) {
      rig.prog = p;
      rig.set_rng(0xfeed, 3);
      rig.poison();
      REQUIRE(rig.enqueue() == JF_OK);
      ck(drv().cuStreamSynchronize(s), "cuStreamSynchronize");
      return rig.results();
    };
    const auto by_sequence = run(nullptr);
    CHECK(run(train) == by_sequence);
    // Captured through the handle, replayed: the same bytes.
    CUgraph graph = nullptr;
    CUgraphExec exec = nullptr;
    rig.prog = train;
    ck(drv().cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL), "cuStreamBeginCapture");
    const jf_status st = rig.enqueue();
    ck(drv().cuStreamEndCapture(s, &graph), "cuStreamEndCapture");
    REQUIRE(st == JF_OK);
    ck(drv().cuGraphInstantiateWithFlags(&exec, graph, 0), "cuGraphInstantiate");
    rig.set_rng(0xfeed, 3);
    rig.poison();
    ck(drv().cuGraphLaunch(exec, s), "cuGraphLaunch");
    ck(drv().cuStreamSynchronize(s), "cuStreamSynchronize");
    CHECK(rig.results() == by_sequence);
    drv().cuGraphExecDestroy(exec);
    drv().cuGraphDestroy(graph);

    // The handle's own checks: a training call on an inference handle, another input shape.
    rig.prog = infer;
    CHECK(rig.enqueue() == JF_ERR_INVALID_ARGUMENT);
    CHECK_THAT(jf_last_error(), Catch::Contains("a training forward needs a jf_program opened with training = 1"));
    Rig other(ctx, seq, s, {38, 256}, 92);
    other.prog = train;
    CHECK(other.enqueue() == JF_ERR_INVALID_ARGUMENT);
    CHECK_THAT(jf_last_error(), Catch::Contains("prepared for input shape 37x256, got 38x256"));
    jf_forward_args none{};
    CHECK(jf_program_forward(train, nullptr, nullptr, js) == JF_ERR_INVALID_ARGUMENT);
    CHECK(jf_program_forward(train, &none, nullptr, js) == JF_ERR_INVALID_ARGUMENT);

    // The handle keeps its sequence alive: destroyed first, the handle still runs the same program.
    jf_sequence_destroy(seq);
    seq = nullptr;
    CHECK(run(train) == by_sequence);
    rig.prog = nullptr;
  }
  CHECK(jf_program_close(train) == JF_OK);
  CHECK(jf_program_close(infer) == JF_OK);
  CHECK(jf_program_close(nullptr) == JF_OK);
  drv().cuStreamDestroy(s);
}

TEST_CASE("a capture of an unprepared shape fails with JF_ERR_NOT_PREPARED and leaves the stream usable",
          "[graph]") {
  jf_context ctx = test::shared_context();
  jf_sequence seq = nullptr;
  REQUIRE(jf_sequence_create(ctx, test::seq_json(kMlpDropout, "mlp_unprepared").c_str(), "bf16", &seq) == JF_OK);
  const ops::Shape shape{40, 256};
  CUstream s = nullptr;
  ck(drv().cuStreamCreate(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
  {
    Rig rig(ctx, seq, s, {48, 256}, 3);  // prepares {48, 256} (info), not {40, 256}
    rig.keep.push_back(std::make_unique<DeviceTensor>(shape, "bf16"));
    DeviceTensor* x40 = rig.keep.back().get();
    rig.keep.push_back(std::make_unique<DeviceTensor>(shape, "bf16"));
    DeviceTensor* y40 = rig.keep.back().get();
    rig.keep.push_back(std::make_unique<DeviceTensor>(shape, "bf16"));
    DeviceTensor* e40 = rig.keep.back().get();
    const DLTensor* ein[1] = {e40->dl()};
    jf_forward_args f{};
    f.input = x40->dl();
    f.output = y40->dl();
    f.extra_inputs = ein;
    f.n_extra_inputs = 1;
    f.params = rig.params.data();
    f.n_params = static_cast<int>(rig.params.size());
    ck(drv().cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL), "cuStreamBeginCapture");
    jf_status st = jf_forward(seq, &f, nullptr, reinterpret_cast<jf_stream>(s));
    const std::string msg = jf_last_error();
    CUgraph graph = nullptr;
    CHECK(drv().cuStreamEndCapture(s, &graph) == CUDA_SUCCESS);  // the capture was not invalidated
    if (graph) drv().cuGraphDestroy(graph);
    CHECK(st == JF_ERR_NOT_PREPARED);
    CHECK_THAT(msg, Catch::Contains("40x256") && Catch::Contains("jf_sequence_prepare"));
    // The stream works, and the same call outside a capture prepares on first use.
    y40->poison(s);
    CHECK(jf_forward(seq, &f, nullptr, reinterpret_cast<jf_stream>(s)) == JF_OK);
    auto y = y40->download_values(s);
    int nan = 0;
    for (double v : y) nan += std::isnan(v);
    CHECK(nan == 0);
  }
  drv().cuStreamDestroy(s);
  jf_sequence_destroy(seq);
}
