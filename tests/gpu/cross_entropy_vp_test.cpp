// The vocab-parallel cross_entropy kernels (issue 47) on one GPU, launched directly: W ranks simulated by W shards of
// the logits. Each rank's stats kernel writes its rows' statistics straight into its place of the gathered buffer
// (what the all_gather leaves on every rank); then each rank's fused kernel (loss per row, dlogits in place for
// g = 1), its unfused rows_fwd (loss and lse per row) and rows_bwd (dlogits for per-row upstream gradients) read the
// gathered statistics and their own columns. Against the float64 reference of the whole vocabulary: the same loss
// on every rank, each rank's columns of dlogits. Labels hit every rank's columns; a fifth of the rows ignored;
// label smoothing, z-loss, soft-capping; fp32 and bf16; V/W not a multiple of 8 (scalar heads and tails).
#include <catch2/catch.hpp>

#include <cmath>
#include <random>

#include "cache/kernel_cache.hpp"
#include "common/error.hpp"
#include "exec/run/kernels.hpp"
#include "reference/reference.hpp"
#include "support/check_close.hpp"
#include "support/dev_buf.hpp"
#include "support/gpu.hpp"

using namespace jitfuse;
namespace ref = jitfuse::reference;
using K = codegen::CrossEntropySpec::Kernel;
using test::DevBuf;

namespace {

struct VpCase {
  int world;
  int64_t rows, vocab;
  const char* dtype;
  ref::CrossEntropyAttrs attrs;
};

void run_case(const VpCase& c, uint64_t seed) {
  INFO("W " << c.world << " rows " << c.rows << " V " << c.vocab << " " << c.dtype << " eps "
            << c.attrs.label_smoothing << " z_loss " << c.attrs.z_loss << " softcap " << c.attrs.softcap);
  const exec::Target target = exec::target_for_arch(cuda::current_device().arch());  // the context, first
  std::mt19937_64 g(seed);
  const int64_t R = c.rows, V = c.vocab, W = c.world, S = V / W;
  const size_t es = std::string(c.dtype) == "fp32" ? 4 : 2;
  std::uniform_real_distribution<double> u(-4, 4);
  ref::Vec x(static_cast<size_t>(R * V));
  for (auto& v : x) v = u(g);
  x = ref::decode(c.dtype, ref::encode(c.dtype, x));
  std::vector<int64_t> labels(static_cast<size_t>(R));
  std::uniform_int_distribution<int64_t> pick(0, V - 1);
  for (int64_t r = 0; r < R; ++r) labels[static_cast<size_t>(r)] = r % 5 == 3 ? c.attrs.ignore_index : pick(g);
  ref::Vec dy(static_cast<size_t>(R));
  for (auto& v : dy) v = 0.5 + std::fabs(u(g)) / 4;
  dy = ref::decode(c.dtype, ref::encode(c.dtype, dy));

  ref::CrossEntropyAttrs none = c.attrs;
  none.reduction = "none";
  const auto fwd = ref::cross_entropy_fwd(x, labels, R, V, none);
  const ref::Vec dx_g1 = ref::cross_entropy_bwd(x, labels, ref::Vec(static_cast<size_t>(R), 1.0), R, V, none);
  const ref::Vec dx_dy = ref::cross_entropy_bwd(x, labels, dy, R, V, none);
  auto shard = [&](const ref::Vec& full, int r) {
    ref::Vec s(static_cast<size_t>(R * S));
    for (int64_t i = 0; i < R; ++i)
      for (int64_t j = 0; j < S; ++j) s[static_cast<size_t>(i * S + j)] = full[static_cast<size_t>(i * V + r * S + j)];
    return s;
  };

  DevBuf d_labels(static_cast<size_t>(R) * 8), gathered(static_cast<size_t>(W * R * 4) * 4), d_dy(static_cast<size_t>(R) * es);
  d_labels.put(labels);
  d_dy.put(ref::encode(c.dtype, dy));
  exec::TemplateStore templates;
  cache::KernelCache cache(cache::Config{});
  exec::KernelLibrary lib(cache, templates);
  auto spec_of = [&](K kernel, int r) {
    codegen::KernelSpec s;
    s.skeleton = codegen::Skeleton::cross_entropy;
    s.dir = kernel == K::rows_bwd ? codegen::Direction::backward : codegen::Direction::forward;
    s.dtype = c.dtype;
    s.cols = S;
    s.vec = true;
    codegen::CrossEntropySpec ce;
    ce.kernel = kernel;
    ce.op = 0;
    ce.reduction = kernel == K::rows_bwd ? "none" : "mean";
    ce.ignore_index = c.attrs.ignore_index;
    ce.label_smoothing = c.attrs.label_smoothing;
    ce.z_loss = c.attrs.z_loss;
    ce.softcap = c.attrs.softcap;
    ce.save = kernel == K::rows_fwd;
    ce.grid_rows = R;
    ce.world = static_cast<int>(W);
    ce.vocab_start = r * S;
    ce.vocab_total = V;
    s.ce = ce;
    return s;
  };
  // One launch of `kernel` for rank r: in / out / the saved logits, lse and the gathered statistics bound by role.
  auto launch = [&](K kernel, int r, CUdeviceptr in, CUdeviceptr out, CUdeviceptr logits, CUdeviceptr lse) {
    const codegen::KernelSpec spec = spec_of(kernel, r);
    const codegen::Generated gen = codegen::generate(spec);
    const exec::LoadedKernel& lk = lib.load(gen, spec, target, {}, true);
    int64_t rows_arg = R;
    std::vector<CUdeviceptr> ptrs;
    ptrs.reserve(gen.args.size());
    std::vector<void*> params;
    for (const auto& a : gen.args) {
      using Role = codegen::Arg::Role;
      CUdeviceptr p = 0;
      if (a.role == Role::rows) {
        params.push_back(&rows_arg);
        continue;
      }
      if (a.role == Role::in) p = in;
      else if (a.role == Role::out) p = out;
      else if (a.role == Role::extra_in) p = d_labels.p;
      else if (a.role == Role::saved && a.key == codegen::Key::stats) p = gathered.p;
      else if (a.role == Role::saved && a.key == codegen::Key::lse) p = lse;
      else if (a.role == Role::saved && a.key == codegen::Key::input) p = logits;
      else FAIL("unexpected argument " << a.name);
      ptrs.push_back(p);
      params.push_back(&ptrs.back());
    }
    cuda::check(cuda::driver().cuLaunchKernel(lk.fn, static_cast<unsigned>(gen.launch.grid_x), 1, 1, gen.launch.bx, 1,
                                              1, 0, nullptr, params.data(), nullptr),
                "cuLaunchKernel");
  };

  std::vector<std::unique_ptr<DevBuf>> logits;
  for (int r = 0; r < W; ++r) {
    logits.push_back(std::make_unique<DevBuf>(static_cast<size_t>(R * S) * es));
    logits.back()->put(ref::encode(c.dtype, shard(x, r)));
    launch(K::stats, r, logits.back()->p, gathered.p + static_cast<CUdeviceptr>(r * R * 4 * 4), 0, 0);
  }
  const double rtol = es == 4 ? 1e-5 : 1e-2;
  for (int r = 0; r < W; ++r) {
    INFO("rank " << r);
    DevBuf loss(static_cast<size_t>(R) * 4), lse(static_cast<size_t>(R) * 4), dx(static_cast<size_t>(R * S) * es);
    DevBuf fused_rows(static_cast<size_t>(R * S) * es), fused_loss(static_cast<size_t>(R) * 4);
    cuda::check(cuda::driver().cuMemcpyDtoDAsync(fused_rows.p, logits[r]->p, fused_rows.bytes, nullptr), "cuMemcpyDtoDAsync");
    launch(K::rows_fwd, r, logits[r]->p, loss.p, 0, lse.p);
    launch(K::rows_bwd, r, d_dy.p, dx.p, logits[r]->p, lse.p);
    launch(K::fused, r, fused_rows.p, fused_loss.p, 0, 0);
    cuda::check(cuda::driver().cuCtxSynchronize(), "cuCtxSynchronize");
    const auto l = loss.get<float>(static_cast<size_t>(R)), fl = fused_loss.get<float>(static_cast<size_t>(R));
    const auto ls = lse.get<float>(static_cast<size_t>(R));
    test::check_close("rows_fwd loss", ref::Vec(l.begin(), l.end()), fwd.loss, 1e-4);
    test::check_close("fused loss", ref::Vec(fl.begin(), fl.end()), fwd.loss, 1e-4);
    ref::Vec lse_want = fwd.lse;
    for (int64_t i = 0; i < R; ++i)  // ignored rows: the kernel's lse is 0 as the reference's
      if (labels[static_cast<size_t>(i)] == c.attrs.ignore_index) lse_want[static_cast<size_t>(i)] = 0;
    test::check_close("lse", ref::Vec(ls.begin(), ls.end()), lse_want, 1e-4);
    test::check_close("rows_bwd dlogits", ref::decode(c.dtype, dx.get<uint8_t>(dx.bytes)), shard(dx_dy, r), rtol);
    test::check_close("fused dlogits", ref::decode(c.dtype, fused_rows.get<uint8_t>(fused_rows.bytes)), shard(dx_g1, r), rtol);
  }
}

}  // namespace

TEST_CASE("vocab-parallel cross_entropy kernels over simulated ranks match the whole vocabulary's reference",
          "[cross_entropy]") {
  ref::CrossEntropyAttrs plain, all;
  all.label_smoothing = 0.1;
  all.z_loss = 1e-3;
  all.softcap = 3;
  ref::CrossEntropyAttrs cap_only;
  cap_only.softcap = 30;
  const VpCase cases[] = {
      {2, 37, 1000, "fp32", plain}, {4, 37, 1000, "fp32", all},  {2, 29, 50258, "bf16", all},
      {4, 13, 4004, "bf16", cap_only}, {8, 9, 128256, "bf16", plain},
  };
  uint64_t seed = 47;
  for (const auto& c : cases) run_case(c, seed++);
}
