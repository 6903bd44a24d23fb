// The cast_transpose skeleton on the GPU, launched directly: row-major and transposed FP8 codes against the
// float64 reference encoders, amax partials and the update kernels, the operand's scale_inv, the stages'
// saved input and dbias; E4M3 / E5M2, delayed / current scaling, forward / backward, vector / scalar
// variants, partial row and column tiles, blocks looping over several tiles; and the transpose of codes a
// norm wrote (Fp8Spec::codes_in), exact.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <functional>
#include <random>

#include "cache/kernel_cache.hpp"
#include "common/error.hpp"
#include "cuda/nvrtc.hpp"
#include "exec/run/kernels.hpp"
#include "harness/device_tensor.hpp"
#include "reference/reference.hpp"
#include "support/cast_transpose_cases.hpp"
#include "support/dev_buf.hpp"
#include "support/gpu.hpp"

using namespace jitfuse;
namespace ref = jitfuse::reference;
using test::CtCase;
using test::CtChain;
using test::CtScaling;
using test::DevBuf;

namespace {

const cuda::Driver& drv() { return cuda::driver(); }


uint8_t fp8_bits(bool e5m2, double v) { return e5m2 ? ref::e5m2_bits(v) : ref::e4m3_bits(v); }
double fp8_value(bool e5m2, uint8_t b) { return e5m2 ? ref::e5m2_value(b) : ref::e4m3_value(b); }

// Codes equal (plain casts: the device multiplies and converts exactly as the reference), or values within
// one step of the format plus a small absolute margin (stages computed with device math; tiny gradients
// of gelu's flat tail differ most in absolute terms).
bool close_codes(bool e5m2, uint8_t dev, uint8_t want, bool exact) {
  if (dev == want) return true;
  const double a = fp8_value(e5m2, dev), b = fp8_value(e5m2, want);
  if (exact) return a == b;  // +0 and -0
  const double step = e5m2 ? 0.25 : 0.125, fmax = e5m2 ? 57344.0 : 448.0;
  return std::fabs(a - b) <= step * std::fabs(b) + 1e-4 * fmax;
}

struct Data {
  std::vector<double> in, bias, saved;  // in the storage dtype's values
};

// The device's own arch (sm_90a on Hopper: the cvt.satfinite conversions), or PTX for compute_80 that the
// driver compiles for the device: __CUDA_ARCH__ 800, the integer conversions.
exec::Target target_of(bool integer_path) {
  if (!integer_path) return exec::target_for_arch(cuda::current_device().arch());
  return {"compute_80", cuda::NvrtcTarget{"sm_80", true}.options(), cuda::nvrtc_version()};
}

// Runs the kernels of one case (and for current scaling its amax pass first); `gy_cap` limits grid.y so
// blocks loop over tiles (persistent launches).
void run_case(const CtCase& c, int64_t rows, bool vector, int gy_cap, uint64_t seed, bool integer_path) {
  const bool fwd = c.dir == codegen::Direction::forward, stages = c.chain == CtChain::bias_gelu;
  const int64_t cols = c.cols, n = rows * cols;
  const float fmax = c.e5m2 ? 57344.f : 448.f;
  INFO(c.name() << " rows " << rows << (vector ? " vector" : " scalar") << " grid.y cap " << gy_cap
               << (integer_path ? " compute_80 (integer conversions)" : ""));

  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd(0.0, 1.0);
  Data d;
  d.in.resize(static_cast<size_t>(n));
  // Wide enough that some E4M3 codes saturate at scale 0.75 (|x| > 597); dbias stays finite in fp16.
  for (auto& v : d.in) v = ref::round_to(c.dtype, nd(rng) * (c.e5m2 ? 300.0 : 200.0));
  d.bias.resize(static_cast<size_t>(cols));
  for (auto& v : d.bias) v = ref::round_to(c.dtype, nd(rng));
  d.saved.resize(static_cast<size_t>(n));
  for (auto& v : d.saved) v = ref::round_to(c.dtype, nd(rng) * 2);

  // Host model: the values before scaling (float math where the device's is exact), saved input, dbias.
  std::vector<double> pre(static_cast<size_t>(n)), saved_ref(static_cast<size_t>(n)), dbias(static_cast<size_t>(cols), 0.0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < cols; ++j) {
      const size_t i = static_cast<size_t>(r * cols + j);
      if (!stages) {
        pre[i] = static_cast<float>(d.in[i]);
      } else if (fwd) {
        const float h = static_cast<float>(d.in[i]) + static_cast<float>(d.bias[static_cast<size_t>(j)]);
        saved_ref[i] = ref::round_to(c.dtype, h);
        pre[i] = ref::act_fwd("gelu_tanh", h);
      } else {
        pre[i] = ref::act_bwd("gelu_tanh", d.saved[i], d.in[i]);
        dbias[static_cast<size_t>(j)] += pre[i];
      }
    }
  double amax = 0;
  for (double v : pre) amax = std::max(amax, std::fabs(v));

  exec::TemplateStore templates;
  cache::KernelCache cache(cache::Config{});
  exec::KernelLibrary lib(cache, templates);
  const exec::Target target = target_of(integer_path);

  DevBuf in(static_cast<size_t>(n) * 2), out(static_cast<size_t>(n)), colwise(static_cast<size_t>(n));
  DevBuf bias(static_cast<size_t>(cols) * 2), saved(static_cast<size_t>(n) * 2), grad_bias(static_cast<size_t>(cols) * 2);
  DevBuf scale(4), scale_inv(4), hist(16);
  in.put(ref::encode(c.dtype, d.in));
  bias.put(ref::encode(c.dtype, d.bias));
  saved.put(ref::encode(c.dtype, d.saved));
  const std::vector<float> hist0 = {3.f, 700.f, 5.f, 9000.f};  // 9000 is the oldest: rolled out
  hist.put(hist0);
  scale.put(std::vector<float>{0.75f});

  auto launch = [&](const CtCase& k) {
    const codegen::KernelSpec spec = test::cast_transpose_spec(k);
    const codegen::Generated g = codegen::generate(spec);
    const exec::LoadedKernel& lk = lib.load(g, spec, target, {}, vector && spec.vec);
    const unsigned gx = static_cast<unsigned>(g.launch.grid_x);
    const int64_t slab = int64_t{g.launch.by} * g.launch.rows_per_thread_iter;
    unsigned gy = static_cast<unsigned>((rows + slab - 1) / slab);
    if (g.launch.persistent) gy = std::min<unsigned>(gy, static_cast<unsigned>(gy_cap));
    DevBuf amax_part(size_t{gx} * gy * 4), part(size_t{gy} * static_cast<size_t>(cols) * 4);
    std::vector<CUdeviceptr> ptrs;
    ptrs.reserve(g.args.size());
    int64_t rows_arg = rows;
    std::vector<void*> params;
    for (const auto& a : g.args) {
      using R = codegen::Arg::Role;
      CUdeviceptr p = 0;
      switch (a.role) {
        case R::in: p = in.p; break;
        case R::out: p = out.p; break;
        case R::fp8_colwise: p = colwise.p; break;
        case R::rows: params.push_back(&rows_arg); continue;
        case R::fp8_scale: p = scale.p; break;
        case R::fp8_scale_inv: p = scale_inv.p; break;
        case R::fp8_amax: p = a.writes ? amax_part.p : hist.p; break;
        case R::param: p = bias.p; break;
        case R::saved: p = saved.p; break;
        case R::partials: p = part.p; break;
        default: FAIL("unexpected argument " << a.name);
      }
      ptrs.push_back(p);
      params.push_back(&ptrs.back());
    }
    cuda::check(drv().cuLaunchKernel(lk.fn, gx, gy, 1, g.launch.bx, g.launch.by, 1, 0, nullptr, params.data(), nullptr),
                "cuLaunchKernel");
    for (size_t fi = 0; fi < g.finalize.size(); ++fi) {
      const auto& f = g.finalize[fi];
      int parts = static_cast<int>(gy), acc = 0;
      void* fp[] = {&part.p, &grad_bias.p, &parts, &acc};
      using F = codegen::Finalize;
      cuda::check(drv().cuLaunchKernel(lk.finalize.at(fi), static_cast<unsigned>((f.cols + F::kCols - 1) / F::kCols),
                                       1, 1, F::kThreads, 1, 1, 0, nullptr, fp, nullptr),
                  "cuLaunchKernel(finalize)");
    }
    if (lk.fp8_update && g.fp8_batched) {  // the per-pass batch update, with this one state
      codegen::Fp8BatchParams b{};
      b.part[0] = static_cast<const float*>(reinterpret_cast<void*>(amax_part.p));
      b.hist[0] = static_cast<float*>(reinterpret_cast<void*>(hist.p));
      b.scale[0] = static_cast<float*>(reinterpret_cast<void*>(scale.p));
      b.count[0] = static_cast<int>(gx * gy);
      b.n = 1;
      b.len = 4;
      void* up[] = {&b};
      cuda::check(drv().cuLaunchKernel(lk.fp8_update, 1, 1, 1, 1024, 1, 1, 0, nullptr, up, nullptr), "cuLaunchKernel(update)");
    } else if (lk.fp8_update) {
      int count = static_cast<int>(gx * gy), len = 4;
      void* up[] = {&amax_part.p, &count, &hist.p, &len, &scale.p};
      cuda::check(drv().cuLaunchKernel(lk.fp8_update, 1, 1, 1, 1024, 1, 1, 0, nullptr, up, nullptr), "cuLaunchKernel(update)");
    }
    cuda::check(drv().cuCtxSynchronize(), "cuCtxSynchronize");
  };

  float used_scale = 0.75f;
  if (c.scaling == CtScaling::current) {
    CtCase pass = c;
    pass.scaling = CtScaling::amax_only;
    launch(pass);
    const float h0 = hist.get<float>(1)[0];
    CHECK(h0 == Approx(amax).epsilon(stages ? 2e-3 : 0));
    used_scale = fmax / h0;
  }
  launch(c);

  const auto codes = out.get<uint8_t>(static_cast<size_t>(n));
  const auto codes_t = colwise.get<uint8_t>(static_cast<size_t>(n));
  size_t bad = 0, transposed_bad = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < cols; ++j) {
      const size_t i = static_cast<size_t>(r * cols + j);
      const uint8_t want = fp8_bits(c.e5m2, static_cast<float>(static_cast<float>(pre[i]) * used_scale));
      if (!close_codes(c.e5m2, codes[i], want, !stages) && bad++ < 5)
        WARN("(" << r << ", " << j << "): code " << int(codes[i]) << ", reference " << int(want) << " ("
                 << pre[i] * used_scale << ")");
      if (codes_t[static_cast<size_t>(j * rows + r)] != codes[i]) ++transposed_bad;
    }
  CHECK(bad == 0);
  CHECK(transposed_bad == 0);  // exactly the transpose of the row-major codes

  const float si = scale_inv.get<float>(1)[0];
  CHECK(si == 1.f / used_scale);  // the operand's own scale_inv: 1 / the scale this cast used
  const auto h = hist.get<float>(4);
  if (c.scaling == CtScaling::delayed) {
    CHECK(h[0] == Approx(amax).epsilon(stages ? 2e-3 : 0));
    CHECK(h[1] == hist0[0]);
    CHECK(h[2] == hist0[1]);
    CHECK(h[3] == hist0[2]);
    const float m = std::max({h[0], hist0[0], hist0[1], hist0[2]});
    CHECK(scale.get<float>(1)[0] == fmax / m / 1.f);
  } else {
    CHECK(scale.get<float>(1)[0] == used_scale);
  }
  if (stages && fwd) {
    const auto s = ref::decode(c.dtype, saved.get<uint8_t>(static_cast<size_t>(n) * 2));
    size_t saved_bad = 0;
    for (size_t i = 0; i < static_cast<size_t>(n); ++i) saved_bad += s[i] != saved_ref[i];
    CHECK(saved_bad == 0);
  }
  if (stages && !fwd) {
    const auto db = ref::decode(c.dtype, grad_bias.get<uint8_t>(static_cast<size_t>(cols) * 2));
    for (int64_t j = 0; j < cols; ++j) {
      INFO("dbias column " << j);
      CHECK(db[static_cast<size_t>(j)] == Approx(dbias[static_cast<size_t>(j)]).epsilon(1e-2).margin(1.0));
    }
  }
}

// Fp8Spec::codes_in: random codes (every byte value) in, exactly their transpose out, and nothing written
// past the [cols, rows] tensor (poisoned guard bytes after it stay as they were).
void run_codes_case(bool e5m2, int64_t rows, int64_t cols, bool vector, uint64_t seed) {
  INFO("codes transpose " << (e5m2 ? "E5M2" : "E4M3") << " " << rows << "x" << cols << (vector ? " vector" : " scalar"));
  const CtCase c{codegen::Direction::forward, CtChain::codes, CtScaling::delayed, e5m2, "bf16", cols};
  const size_t n = static_cast<size_t>(rows * cols), guard = 64;
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> codes(n);
  for (auto& b : codes) b = static_cast<uint8_t>(rng());
  exec::TemplateStore templates;
  cache::KernelCache cache(cache::Config{});
  exec::KernelLibrary lib(cache, templates);
  const codegen::KernelSpec spec = test::cast_transpose_spec(c);
  const codegen::Generated g = codegen::generate(spec);
  const exec::LoadedKernel& lk = lib.load(g, spec, exec::target_for_arch(cuda::current_device().arch()), {}, vector && spec.vec);
  DevBuf in(n), colwise(n + guard);  // colwise poisoned with 0xCD
  in.put(codes);
  int64_t rows_arg = rows;
  std::vector<void*> params;
  for (const auto& a : g.args) {
    using R = codegen::Arg::Role;
    switch (a.role) {
      case R::in: params.push_back(&in.p); break;
      case R::fp8_colwise: params.push_back(&colwise.p); break;
      case R::rows: params.push_back(&rows_arg); break;
      default: FAIL("unexpected argument " << a.name);
    }
  }
  const int64_t slab = int64_t{g.launch.by} * g.launch.rows_per_thread_iter;
  cuda::check(drv().cuLaunchKernel(lk.fn, static_cast<unsigned>(g.launch.grid_x), static_cast<unsigned>((rows + slab - 1) / slab),
                                   1, g.launch.bx, g.launch.by, 1, 0, nullptr, params.data(), nullptr),
              "cuLaunchKernel");
  const auto t = colwise.get<uint8_t>(n + guard);
  size_t bad = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < cols; ++j) bad += t[static_cast<size_t>(j * rows + r)] != codes[static_cast<size_t>(r * cols + j)];
  CHECK(bad == 0);
  size_t overrun = 0;
  for (size_t i = n; i < n + guard; ++i) overrun += t[i] != 0xCD;
  CHECK(overrun == 0);
}

}  // namespace

TEST_CASE("cast_transpose kernels on the GPU against the reference", "[fp8][cast_transpose]") {
  uint64_t seed = 1;
  for (bool integer_path : {false, true})
    for (auto dir : {codegen::Direction::forward, codegen::Direction::backward})
      for (auto chain : {CtChain::none, CtChain::bias_gelu})
        for (auto scaling : {CtScaling::delayed, CtScaling::current})
          for (bool e5m2 : {false, true}) {
            const char* dtype = e5m2 ? "fp16" : "bf16";
            // 328 columns: five full column tiles and one of 8; 208 rows: three full row tiles and one of 16.
            const CtCase vec{dir, chain, scaling, e5m2, dtype, 328};
            run_case(vec, 208, true, 1 << 30, seed++, integer_path);
            run_case(vec, 208, false, 1 << 30, seed++, integer_path);
            run_case(vec, 208, true, 2, seed++, integer_path);  // persistent (dbias): 2 blocks per column, 2 tiles each
            // Any width and rows: the scalar variant only.
            const CtCase odd{dir, chain, scaling, e5m2, dtype, 66};
            run_case(odd, 37, false, 1 << 30, seed++, integer_path);
          }
  for (bool e5m2 : {false, true}) {
    run_codes_case(e5m2, 208, 328, true, seed++);   // full and partial tiles both ways, vector
    run_codes_case(e5m2, 208, 328, false, seed++);
    run_codes_case(e5m2, 37, 66, false, seed++);    // any shape: scalar
    run_codes_case(e5m2, 1024, 4096, true, seed++);
  }
}

// By hand (hidden tag): time the vector kernels at a GEMM-sized shape against a device-to-device copy.
TEST_CASE("cast_transpose bandwidth", "[.][cast_transpose_bench]") {
  const int64_t rows = 8192, cols = 8192, n = rows * cols;
  exec::TemplateStore templates;
  cache::KernelCache cache(cache::Config{});
  exec::KernelLibrary lib(cache, templates);
  const auto dev = cuda::current_device();
  const exec::Target target = exec::target_for_arch(dev.arch());
  DevBuf in(static_cast<size_t>(n) * 2), out(static_cast<size_t>(n)), colwise(static_cast<size_t>(n)),
      saved(static_cast<size_t>(n) * 2), copy(static_cast<size_t>(n) * 2), scale(4), scale_inv(4), hist(64);
  scale.put(std::vector<float>{1.f});
  CUevent e0, e1;
  cuda::check(drv().cuEventCreate(&e0, 0), "cuEventCreate");
  cuda::check(drv().cuEventCreate(&e1, 0), "cuEventCreate");
  auto time_ms = [&](const std::function<void()>& f) {
    for (int i = 0; i < 3; ++i) f();
    cuda::check(drv().cuEventRecord(e0, nullptr), "cuEventRecord");
    for (int i = 0; i < 20; ++i) f();
    cuda::check(drv().cuEventRecord(e1, nullptr), "cuEventRecord");
    cuda::check(drv().cuEventSynchronize(e1), "cuEventSynchronize");
    float ms = 0;
    cuda::check(drv().cuEventElapsedTime(&ms, e0, e1), "cuEventElapsedTime");
    return ms / 20;
  };
  const double copy_ms = time_ms([&] { drv().cuMemcpyDtoDAsync(copy.p, in.p, static_cast<size_t>(n) * 2, nullptr); });
  const double copy_gbs = 2.0 * n * 2 / copy_ms / 1e6;
  std::printf("%s: copy %.3f ms (%.0f GB/s read + written)\n", dev.name.c_str(), copy_ms, copy_gbs);
  for (auto chain : {CtChain::none, CtChain::bias_gelu, CtChain::codes})
    for (auto dir : {codegen::Direction::forward, codegen::Direction::backward}) {
      if (chain == CtChain::codes && dir == codegen::Direction::backward) continue;
      const CtCase c{dir, chain, CtScaling::delayed, dir == codegen::Direction::backward, "bf16", cols};
      const auto spec = test::cast_transpose_spec(c);
      const auto g = codegen::generate(spec);
      const auto& lk = lib.load(g, spec, target, {}, true);
      const unsigned gx = static_cast<unsigned>(g.launch.grid_x);
      unsigned gy = static_cast<unsigned>(rows / 64);
      if (g.launch.persistent)
        gy = std::min<unsigned>(gy, static_cast<unsigned>(dev.sm_count * lk.blocks_per_sm / static_cast<int>(gx)));
      DevBuf amax_part(size_t{gx} * gy * 4), part(size_t{gy} * static_cast<size_t>(cols) * 4), bias(cols * 2);
      int64_t rows_arg = rows;
      std::vector<CUdeviceptr> ptrs;
      ptrs.reserve(g.args.size());
      std::vector<void*> params;
      for (const auto& a : g.args) {
        using R = codegen::Arg::Role;
        if (a.role == R::rows) {
          params.push_back(&rows_arg);
          continue;
        }
        ptrs.push_back(a.role == R::in ? in.p : a.role == R::out ? out.p : a.role == R::fp8_colwise ? colwise.p
                       : a.role == R::fp8_scale ? scale.p : a.role == R::fp8_scale_inv ? scale_inv.p
                       : a.role == R::fp8_amax ? amax_part.p : a.role == R::param ? bias.p
                       : a.role == R::saved ? saved.p : part.p);
        params.push_back(&ptrs.back());
      }
      const double ms = time_ms([&] {
        drv().cuLaunchKernel(lk.fn, gx, gy, 1, g.launch.bx, g.launch.by, 1, 0, nullptr, params.data(), nullptr);
      });
      // bytes: the input (and gelu's saved input: written forward, read backward) at 2 B, the codes twice at 1 B;
      // the transpose of codes: 1 B read, 1 B written
      const double bytes = chain == CtChain::codes ? n * 2.0 : n * (2.0 + 2.0 + (chain == CtChain::bias_gelu ? 2.0 : 0.0));
      std::printf("%-40s %.3f ms  %.0f GB/s  %.0f %% of copy  (grid %u x %u, %d blocks/SM)\n", c.name().c_str(), ms,
                  bytes / ms / 1e6, 100 * bytes / ms / 1e6 / copy_gbs, gx, gy, lk.blocks_per_sm);
    }
}
