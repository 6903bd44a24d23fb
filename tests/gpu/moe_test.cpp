// The moe skeleton's kernels (issue 43) on the GPU, launched directly: the routing (count, scan, scatter)
// against runtime/reference's moe_route exactly (dest, src, splits: the same stable order, the same
// capacity drops), the permutation both ways, and the combine with the routing probabilities (and its
// backward: dy and dprobs) against the float64 references at the storage dtype's rounding. Balanced and
// skewed routing (an expert with 4x the mean, empty experts), top-1/2/8, a capacity, int32 and int64 ids,
// more entries than one chunk of 1024; every output poisoned before the run.
#include <catch2/catch.hpp>

#include <cmath>
#include <random>

#include "cache/kernel_cache.hpp"
#include "common/error.hpp"
#include "cuda/nvrtc.hpp"
#include "exec/run/kernels.hpp"
#include "harness/device_tensor.hpp"
#include "reference/reference.hpp"
#include "gpu/gpu_check.hpp"
#include "support/check_close.hpp"
#include "support/dev_buf.hpp"
#include "support/gpu.hpp"
#include "support/moe_cases.hpp"

using namespace jitfuse;
namespace ref = jitfuse::reference;
using K = codegen::MoeSpec::Kernel;
using test::DevBuf;

namespace {

const cuda::Driver& drv() { return cuda::driver(); }


struct Case {
  int64_t tokens, experts, topk, hidden, capacity;
  bool skewed, idx_i64;
  const char* dtype;
};

// Distinct experts per token; skewed: expert 0 takes ~4x the mean and the last quarter of the experts none.
std::vector<int64_t> routing(const Case& c, std::mt19937_64& g) {
  std::vector<int64_t> idx(static_cast<size_t>(c.tokens * c.topk));
  const int64_t live = c.skewed ? std::max<int64_t>(c.topk + 1, c.experts * 3 / 4) : c.experts;
  std::uniform_int_distribution<int64_t> pick(0, live - 1);
  std::bernoulli_distribution hot(c.skewed ? 4.0 / static_cast<double>(live) : 0.0);
  for (int64_t t = 0; t < c.tokens; ++t)
    for (int64_t j = 0; j < c.topk; ++j) {
      int64_t e;
      bool dup;
      do {
        e = (j == 0 && hot(g)) ? 0 : pick(g);
        dup = false;
        for (int64_t i = 0; i < j; ++i) dup |= idx[static_cast<size_t>(t * c.topk + i)] == e;
      } while (dup);
      idx[static_cast<size_t>(t * c.topk + j)] = e;
    }
  return idx;
}

ref::Vec uniform(std::mt19937_64& g, size_t n, double lo, double hi) {
  std::uniform_real_distribution<double> u(lo, hi);
  ref::Vec v(n);
  for (auto& x : v) x = u(g);
  return v;
}

// Values a dtype holds (the kernels read storage): the reference starts from the same numbers.
ref::Vec rounded(const char* dtype, const ref::Vec& v) { return ref::decode(dtype, ref::encode(dtype, v)); }

void run_case(const Case& c, uint64_t seed) {
  INFO("T " << c.tokens << " E " << c.experts << " top-" << c.topk << " H " << c.hidden << " capacity " << c.capacity
            << (c.skewed ? " skewed" : " balanced") << (c.idx_i64 ? " int64" : " int32") << " " << c.dtype);
  std::mt19937_64 g(seed);
  const int64_t T = c.tokens, k = c.topk, E = c.experts, H = c.hidden, n = T * k;
  const std::vector<int64_t> idx = routing(c, g);
  const auto want = ref::moe_route(idx, T, k, E, c.capacity);
  const ref::Vec x = rounded(c.dtype, uniform(g, static_cast<size_t>(T * H), -2, 2));
  const ref::Vec probs = uniform(g, static_cast<size_t>(n), 0.05, 1.0);
  const ref::Vec yin = rounded(c.dtype, uniform(g, static_cast<size_t>(n * H), -2, 2));
  const ref::Vec dout = rounded(c.dtype, uniform(g, static_cast<size_t>(T * H), -2, 2));
  const size_t es = std::string(c.dtype) == "fp32" ? 4 : 2;

  // The device's context is made current here, before the first allocation.
  const exec::Target target = exec::target_for_arch(cuda::current_device().arch());

  DevBuf d_idx(static_cast<size_t>(n) * 8), route(static_cast<size_t>(codegen::moe_route_ints(T, k, E)) * 4);
  if (c.idx_i64) {
    d_idx.put(idx);
  } else {
    d_idx.put(std::vector<int32_t>(idx.begin(), idx.end()));
  }
  std::vector<float> pf(probs.begin(), probs.end());
  DevBuf d_probs(static_cast<size_t>(n) * 4), d_x(static_cast<size_t>(T * H) * es), d_y(static_cast<size_t>(n * H) * es);
  DevBuf d_yin(static_cast<size_t>(n * H) * es), d_out(static_cast<size_t>(T * H) * es), d_dout(static_cast<size_t>(T * H) * es);
  DevBuf d_dy(static_cast<size_t>(n * H) * es), d_dprobs(static_cast<size_t>(n) * 4), d_dx(static_cast<size_t>(T * H) * es);
  d_probs.put(pf);
  d_x.put(ref::encode(c.dtype, x));
  d_yin.put(ref::encode(c.dtype, yin));
  d_dout.put(ref::encode(c.dtype, dout));

  exec::TemplateStore templates;
  cache::KernelCache cache(cache::Config{});
  exec::KernelLibrary lib(cache, templates);
  auto launch = [&](K kernel, CUdeviceptr in, CUdeviceptr out) {
    codegen::KernelSpec spec = test::moe_spec(kernel, E, k, H, c.dtype, 1, 0);
    spec.moe->capacity = c.capacity;
    spec.moe->idx_i64 = c.idx_i64;
    const codegen::Generated gen = codegen::generate(spec);
    const exec::LoadedKernel& lk = lib.load(gen, spec, target, {}, true);
    int64_t rows_arg = T;
    std::vector<CUdeviceptr> ptrs;
    ptrs.reserve(gen.args.size());
    std::vector<void*> params;
    for (const auto& a : gen.args) {
      using R = codegen::Arg::Role;
      CUdeviceptr p = 0;
      switch (a.role) {
        case R::in: p = in; break;
        case R::out: p = out; break;
        case R::rows: params.push_back(&rows_arg); continue;
        case R::saved: p = a.key == codegen::Key::route ? route.p : d_yin.p; break;
        case R::extra_in: p = a.name == "idx" ? d_idx.p : d_probs.p; break;
        case R::grad_extra_in: p = d_dprobs.p; break;
        default: FAIL("unexpected argument " << a.name);
      }
      ptrs.push_back(p);
      params.push_back(&ptrs.back());
    }
    cuda::check(drv().cuLaunchKernel(lk.fn, static_cast<unsigned>(gen.launch.grid_x), 1, 1, gen.launch.bx, 1, 1, 0,
                                     nullptr, params.data(), nullptr),
                "cuLaunchKernel");
  };
  launch(K::count, 0, 0);
  launch(K::scan, 0, 0);
  launch(K::scatter, 0, 0);
  launch(K::permute, d_x.p, d_y.p);
  launch(K::unpermute, d_yin.p, d_out.p);
  launch(K::unpermute_bwd, d_dout.p, d_dy.p);
  cuda::check(drv().cuCtxSynchronize(), "cuCtxSynchronize");

  // The routing, exactly.
  const auto r = route.get<int32_t>(static_cast<size_t>(codegen::moe_route_ints(T, k, E)));
  const int64_t rows = want.rows();
  CHECK(std::vector<int64_t>(r.begin(), r.begin() + n) == want.dest);
  CHECK(std::vector<int64_t>(r.begin() + n, r.begin() + n + rows) == want.src);
  CHECK(std::vector<int64_t>(r.begin() + 2 * n, r.begin() + 2 * n + E) == want.splits);
  CHECK(r[static_cast<size_t>(2 * n + 2 * E)] == rows);  // starts[E]

  // Permute: the kept rows are the tokens' rows bit for bit, the rest zero.
  ref::Vec y_want = ref::moe_permute_fwd(x, want, H);
  y_want.resize(static_cast<size_t>(n * H), 0.0);
  CHECK(ref::decode(c.dtype, d_y.get<uint8_t>(static_cast<size_t>(n * H) * es)) == y_want);

  // Unpermute and its backward against float64, at the storage dtype's rounding (one rounding of an fp32 sum).
  const double rtol = std::string(c.dtype) == "fp32" ? 1e-5 : 1.0 / 128;
  ref::Vec yk(yin.begin(), yin.begin() + rows * H);
  test::check_close("unpermute", ref::decode(c.dtype, d_out.get<uint8_t>(static_cast<size_t>(T * H) * es)),
      ref::moe_unpermute_fwd(yk, probs, want, H), rtol);
  const auto b = ref::moe_unpermute_bwd(dout, yk, probs, want, H);
  ref::Vec dy_want = b.dy;
  dy_want.resize(static_cast<size_t>(n * H), 0.0);
  test::check_close("unpermute dy", ref::decode(c.dtype, d_dy.get<uint8_t>(static_cast<size_t>(n * H) * es)), dy_want, rtol);
  const auto dp = d_dprobs.get<float>(static_cast<size_t>(n));
  test::check_close("unpermute dprobs", ref::Vec(dp.begin(), dp.end()), b.dprobs, 1e-4);

  // Permute backward of the dy just computed (its kept rows): dx[t] = sum_j dy[dest(t, j)].
  launch(K::permute_bwd, d_dy.p, d_dx.p);
  cuda::check(drv().cuCtxSynchronize(), "cuCtxSynchronize");
  const ref::Vec dy_dev = ref::decode(c.dtype, d_dy.get<uint8_t>(static_cast<size_t>(n * H) * es));
  test::check_close("permute dx", ref::decode(c.dtype, d_dx.get<uint8_t>(static_cast<size_t>(T * H) * es)),
      ref::moe_permute_bwd(ref::Vec(dy_dev.begin(), dy_dev.begin() + rows * H), want, H), rtol);
}

}  // namespace

TEST_CASE("moe routing and permutation kernels against the float64 references", "[moe]") {
  const Case cases[] = {
      {300, 8, 2, 256, -1, false, true, "bf16"},    // Mixtral-like routing, one chunk
      {1500, 8, 2, 128, -1, true, false, "bf16"},   // 3000 entries: three chunks; skewed; int32 ids
      {700, 64, 8, 128, -1, true, true, "fp32"},    // OLMoE-like top-8, skewed (empty experts), exact dtype
      {900, 16, 1, 64, 40, false, true, "bf16"},    // top-1 with a capacity below the mean: drops
      {513, 128, 8, 64, 30, true, true, "bf16"},    // Qwen3-MoE-like, capacity, 4104 entries
  };
  uint64_t seed = 43;
  for (const auto& c : cases) run_case(c, seed++);
}

// The ops in sequences, through the C ABI and the harness (fresh random inputs and routing, outputs and every
// gradient poisoned, the float64 sequence reference, DESIGN's tolerances): dispatch and combine around
// expert-side ops, with dropping capacities, int32 and int64 indices, top-1/2/8, a residual channel around the
// block, misaligned tensors (the scalar variants) and inference.
TEST_CASE("moe_permute and moe_unpermute in sequences match the float64 reference", "[moe]") {
  using test::run_check;
  using test::seq_json;
  const std::string gelu_block = seq_json(R"([{"op": "moe_permute", "num_experts": 8, "top_k": 2},
      {"op": "gelu"}, {"op": "moe_unpermute"}])", "moe_gelu");
  for (const char* recipe : {"fp32", "bf16"}) {
    run_check(gelu_block, recipe, {300, 256});
    run_check(gelu_block, recipe, {300, 256}, false);             // inference: the routing in the arena
    run_check(gelu_block, recipe, {37, 64}, true, /*misalign=*/true);
  }
  // OLMoE-like top-8 of 64 with a capacity that drops rows, int32 indices.
  run_check(seq_json(R"([{"op": "moe_permute", "num_experts": 64, "top_k": 8, "capacity": 30,
      "index_dtype": "int32"}, {"op": "silu"}, {"op": "moe_unpermute"}])", "moe_top8"), "bf16", {513, 64});
  // Top-1 of 16, capacity below the mean (most experts drop), a scale between.
  run_check(seq_json(R"([{"op": "moe_permute", "num_experts": 16, "top_k": 1, "capacity": 10},
      {"op": "scale", "value": 0.5}, {"op": "moe_unpermute"}])", "moe_top1"), "fp32", {400, 128});
  // The block with its residual: fork, dispatch, experts' op, combine, add the residual back.
  run_check(seq_json(R"([{"op": "make_extra_output", "channel": "res"},
      {"op": "moe_permute", "num_experts": 128, "top_k": 8}, {"op": "gelu"}, {"op": "moe_unpermute"},
      {"op": "add_extra_input", "channel": "res"}])", "moe_residual"), "bf16", {257, 128});
}

// The whole expert block as one sequence (fork, norm, dispatch in the padded layout, grouped linears with a gated
// op between, combine, residual): balanced capacity (1.5x the mean: nothing drops but the skewed expert's extra rows)
// and a tight one (drops), fp32 and bf16, Mixtral-like top-2 of 8 and OLMoE-like top-8 of 64.
TEST_CASE("the expert block with padded routing and grouped linears matches the float64 reference", "[moe]") {
  using test::run_check;
  using test::seq_json;
  auto block = [](int e, int k, int cap, int h, int f) {
    return seq_json(fmt::format(R"([{{"op": "make_extra_output", "channel": "res"}}, {{"op": "rmsnorm"}},
        {{"op": "moe_permute", "num_experts": {0}, "top_k": {1}, "capacity": {2}, "layout": "padded"}},
        {{"op": "grouped_linear", "num_groups": {0}, "in_features": {3}, "out_features": {4}}}, {{"op": "swiglu"}},
        {{"op": "grouped_linear", "num_groups": {0}, "in_features": {5}, "out_features": {3}}},
        {{"op": "moe_unpermute"}}, {{"op": "add_extra_input", "channel": "res"}}])", e, k, cap, h, 2 * f, f),
                    "expert_block");
  };
  for (const char* recipe : {"fp32", "bf16"}) {
    run_check(block(8, 2, 120, 256, 384), recipe, {400, 256});  // mean 100 rows per expert
    run_check(block(8, 2, 60, 256, 384), recipe, {400, 256});   // drops
  }
  run_check(block(64, 8, 24, 128, 64), "bf16", {160, 128});  // mean 20
  run_check(block(8, 2, 120, 256, 384), "bf16", {400, 256}, false);  // inference
}

// The dropless block (a packed moe_permute: each expert's own rows, counted on the device and read on the host once
// per pass): skewed routing with empty experts (the harness's), top-2 of 8 and top-8 of 64, a packed capacity that
// drops rows (the rows past the kept ones zeroed by the last group), fp32 and bf16, misaligned tensors, inference.
TEST_CASE("the dropless expert block with grouped linears over each expert's rows matches the float64 reference",
          "[moe]") {
  using test::run_check;
  using test::seq_json;
  auto block = [](int e, int k, const char* cap, int h, int f) {
    return seq_json(fmt::format(R"([{{"op": "make_extra_output", "channel": "res"}}, {{"op": "rmsnorm"}},
        {{"op": "moe_permute", "num_experts": {0}, "top_k": {1}{2}}},
        {{"op": "grouped_linear", "num_groups": {0}, "in_features": {3}, "out_features": {4}}}, {{"op": "swiglu"}},
        {{"op": "grouped_linear", "num_groups": {0}, "in_features": {5}, "out_features": {3}}},
        {{"op": "moe_unpermute"}}, {{"op": "add_extra_input", "channel": "res"}}])", e, k, cap, h, 2 * f, f),
                    "dropless_block");
  };
  for (const char* recipe : {"fp32", "bf16"}) {
    run_check(block(8, 2, "", 256, 384), recipe, {397, 256});
    run_check(block(8, 2, R"(, "capacity": 60)", 256, 384), recipe, {400, 256});  // drops: a tail of zero rows
  }
  run_check(block(64, 8, "", 128, 64), "bf16", {161, 128});
  run_check(block(8, 2, "", 64, 96), "bf16", {45, 64}, true, /*misalign=*/true);
  run_check(block(8, 2, "", 256, 384), "bf16", {397, 256}, false);  // inference: the routing in the arena
}
