// Kernel variants (issue 14, cold start): a kernel's 16-byte vector and scalar variants are one source and
// two NVRTC programs (the scalar one under -DJF_SCALAR), so preparing or warming up a plan that can take the
// vector path compiles only the vector programs; the scalar fallback is compiled when a call first needs it
// (a misaligned tensor), once, within the partial-sum buffers prepare sized.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <mutex>
#include <set>
#include <thread>

#include <fmt/format.h>

#include "cache/kernel_cache.hpp"
#include "common/error.hpp"
#include "exec/run/kernels.hpp"
#include "exec/run/prepare.hpp"
#include "support/builtin_cases.hpp"
#include "support/deep_model.hpp"

using namespace jitfuse;

namespace {

// The text of the kernel whose signature declares `name`, from the `#define JF_VEC` before it to its
// `#undef JF_VEC` (or, for a scalar-only source, to the comment before a follow-up kernel).
std::string variant_text(const std::string& source, const std::string& name) {
  const size_t sig = source.find(" " + name + "(");
  REQUIRE(sig != std::string::npos);
  const size_t begin = source.rfind("#define JF_VEC", sig);
  REQUIRE(begin != std::string::npos);
  const size_t body = source.find('\n', begin) + 1;
  size_t end = source.find("#undef JF_VEC", body);
  if (end == std::string::npos) end = source.find("\n// ", body);
  if (end == std::string::npos) end = source.size();
  return source.substr(body, end - body);
}

size_t count(const std::string& s, const std::string& what) {
  size_t n = 0;
  for (size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + 1)) ++n;
  return n;
}

const exec::Target kTarget{"sm_90a", {"--gpu-architecture=sm_90a"}, "13.0"};

// A compile function that records what it was asked for (from several cache threads at once) and returns a
// stand-in CUBIN, so tests count compiles without NVRTC.
struct Recorder {
  std::mutex mu;
  std::vector<cache::KernelRequest> compiled;
  cache::CompileFn fn() {
    return [this](const cache::KernelRequest& r) {
      std::lock_guard<std::mutex> lock(mu);
      compiled.push_back(r);
      return cache::CompileResult{"fake cubin of " + r.meta.value("kernel", std::string()), "", 1.0};
    };
  }
  size_t scalar() {
    std::lock_guard<std::mutex> lock(mu);
    size_t n = 0;
    for (const auto& r : compiled) n += r.meta["variant"] == "scalar";
    return n;
  }
};

bool has_scalar_option(const cache::KernelRequest& r) {
  return std::find(r.options.begin(), r.options.end(), codegen::kScalarOption) != r.options.end();
}

codegen::KernelSpec odd_width_gelu() {
  codegen::KernelSpec spec;
  spec.dtype = "bf16";
  spec.cols = 66;  // not a multiple of 8
  spec.vec = false;
  codegen::Stage st;
  st.op = 0;
  st.op_kind = "gelu";
  st.functor = "jf_op_gelu_tanh";
  spec.pre.push_back(st);
  spec.headers["ops/activations.cuh"] = "";
  spec.label = "gelu";
  return spec;
}

}  // namespace

TEST_CASE("each kernel of the transformer layer is one source with a program per variant", "[exec][variants]") {
  const test::Planned layer = test::plan_layers(1, "bf16", true);
  const auto kernels = exec::program_kernels(*layer.program);
  CHECK(kernels.size() == 12);  // forward and backward: 12 distinct kernels
  exec::TemplateStore templates;
  cache::KernelCache cache(cache::Config{});
  exec::KernelLibrary lib(cache, templates);
  std::set<std::string> keys;
  for (const auto& [spec, meta] : kernels) {
    const codegen::Generated g = codegen::generate(spec);
    INFO(g.kernel);
    REQUIRE(spec.vec);  // 1024 columns: every kernel may take the vector path
    CHECK(g.vec);
    CHECK(g.scalar_kernel == g.kernel + "_scalar");
    CHECK(g.entry(true) == g.kernel);
    CHECK(g.entry(false) == g.scalar_kernel);
    CHECK(count(g.source, "#ifndef JF_SCALAR\n") == 1);
    CHECK(count(g.source, " " + g.kernel + "(") == 1);
    CHECK(count(g.source, " " + g.scalar_kernel + "(") == 1);
    CHECK(count(g.source, "#define JF_VEC true\n") == 1);
    CHECK(count(g.source, "#define JF_VEC false\n") == 1);
    // The same kernel text under both names: only JF_VEC tells them apart, so each variant compiles to
    // what it compiled to as a program of its own.
    std::string scalar = variant_text(g.source, g.scalar_kernel);
    scalar.replace(scalar.find(" " + g.scalar_kernel + "("), g.scalar_kernel.size() + 2, " " + g.kernel + "(");
    CHECK(variant_text(g.source, g.kernel) == scalar);
    // Follow-up kernels are written once, outside the variants: both programs have them.
    for (const auto& f : g.finalize) CHECK(count(g.source, " " + f.kernel + "(") == 1);

    // Two requests of the one source: the vector program as the target compiles it, the scalar one with
    // -DJF_SCALAR; two keys, two cache entries, each listing its own entry points.
    const auto vec = lib.request(g, spec, kTarget, meta, true), sca = lib.request(g, spec, kTarget, meta, false);
    CHECK(vec.source == sca.source);
    CHECK(vec.options == kTarget.options);
    std::vector<std::string> with = kTarget.options;
    with.push_back("-DJF_SCALAR");
    CHECK(sca.options == with);
    CHECK(vec.meta["variant"] == "vector");
    CHECK(sca.meta["variant"] == "scalar");
    for (bool vector : {true, false}) {
      std::vector<std::string> want = {g.entry(vector)};
      for (const auto& f : g.finalize)
        if (f.slot == 0) want.push_back(f.kernel);  // a layernorm's dgamma and dbeta share one finalize
      if (!g.fp8_update.empty()) want.push_back(g.fp8_update);
      CHECK((vector ? vec : sca).meta["functions"] == nlohmann::json(want));
    }
    // The request from the spec alone (what warmup and prefetch build) is the same request.
    CHECK(cache::cache_key(lib.request(spec, kTarget, meta, true)) == cache::cache_key(vec));
    keys.insert(cache::cache_key(vec));
    keys.insert(cache::cache_key(sca));
  }
  CHECK(keys.size() == 24);
}

TEST_CASE("a shape without a vector path has only the scalar variant", "[exec][variants]") {
  const codegen::KernelSpec spec = odd_width_gelu();
  const codegen::Generated g = codegen::generate(spec);
  CHECK_FALSE(g.vec);
  CHECK(count(g.source, " " + g.kernel + "(") == 0);
  CHECK(count(g.source, " " + g.scalar_kernel + "(") == 1);
  CHECK(count(g.source, "JF_SCALAR") == 0);
  CHECK(count(g.source, "#define JF_VEC true") == 0);
  CHECK(count(g.source, "#define JF_VEC false\n") == 1);
  CHECK(exec::variants_of(spec, exec::Variants::needed) == std::vector<bool>{false});
  CHECK(exec::variants_of(spec, exec::Variants::all) == std::vector<bool>{false});

  exec::TemplateStore templates;
  cache::KernelCache cache(cache::Config{});
  exec::KernelLibrary lib(cache, templates);
  const auto req = lib.request(g, spec, kTarget, {}, false);
  CHECK(req.meta["functions"] == nlohmann::json::array({g.scalar_kernel}));
  CHECK(has_scalar_option(req));
  CHECK_THROWS_AS(lib.request(g, spec, kTarget, {}, true), Error);
}

TEST_CASE("prefetch of a vector-capable plan compiles only its vector programs, and Variants::all the scalar ones too",
          "[exec][variants]") {
  const test::Planned layer = test::plan_layers(1, "bf16", true);
  const auto kernels = exec::program_kernels(*layer.program);
  exec::TemplateStore templates;
  cache::KernelCache cache(cache::Config{});  // memory only
  Recorder rec;
  exec::KernelLibrary lib(cache, templates, rec.fn());

  lib.prefetch(kernels, kTarget, 2, exec::Variants::needed);  // what prepare and `warmup` do by default
  CHECK(rec.compiled.size() == 12);
  CHECK(rec.scalar() == 0);
  for (const auto& r : rec.compiled) {
    CHECK_FALSE(has_scalar_option(r));
    CHECK(r.meta["variant"] == "vector");
  }

  lib.prefetch(kernels, kTarget, 2, exec::Variants::all);  // JITFUSE_ALL_VARIANTS, `warmup --all-variants`
  CHECK(rec.compiled.size() == 24);  // the 12 scalar programs; the vector ones are in memory
  CHECK(rec.scalar() == 12);
  for (size_t i = 12; i < 24; ++i) CHECK(has_scalar_option(rec.compiled[i]));
  CHECK(cache.stats().compiled == 24);

  lib.prefetch(kernels, kTarget, 2, exec::Variants::all);
  CHECK(rec.compiled.size() == 24);

  // A plan without a vector path compiles its scalar programs eagerly, and only them.
  static const rules::RuleSet rs = rules::RuleSet::with_builtins();
  const test::BuiltinCase odd{0, R"([{"op": "bias"}, {"op": "gelu", "approximate": "tanh"}])", "bf16", true, {3, 66}};
  const auto odd_kernels = exec::program_kernels(*test::case_program(odd, rs));
  REQUIRE(odd_kernels.size() == 2);  // forward and backward
  Recorder rec2;
  exec::KernelLibrary lib2(cache, templates, rec2.fn());
  lib2.prefetch(odd_kernels, kTarget, 2, exec::Variants::needed);
  CHECK(rec2.compiled.size() == 2);
  CHECK(rec2.scalar() == 2);
  lib2.prefetch(odd_kernels, kTarget, 2, exec::Variants::all);
  CHECK(rec2.compiled.size() == 2);
}

TEST_CASE("the scalar variant of a step is compiled once, for the first of the calls that select it",
          "[exec][variants]") {
  // Every step running the kernel asks the library for its scalar entry: one compile, then memory hits.
  const test::Planned layer = test::plan_layers(4, "bf16", true);
  exec::TemplateStore templates;
  cache::KernelCache cache(cache::Config{});
  Recorder rec;
  exec::KernelLibrary lib(cache, templates, rec.fn());
  lib.prefetch(exec::program_kernels(*layer.program), kTarget, 2, exec::Variants::needed);
  // One layer's 12 kernels and the one a layer boundary adds (add -> fork -> rmsnorm: fork_norm).
  REQUIRE(rec.compiled.size() == 13);
  size_t steps = 0;
  for (const auto* pass : {&layer.program->forward, &layer.program->backward})
    for (const auto& s : *pass) {
      if (s.kind != exec::Step::Kind::kernel || s.kernel->gen.kernel != "jf_make_extra_output_layernorm_fwd") continue;
      ++steps;
      REQUIRE(lib.entry(s.kernel->gen, s.kernel->spec, kTarget, s.kernel->meta, false));
    }
  CHECK(steps == 4);  // one per layer
  CHECK(rec.compiled.size() == 14);
  CHECK(rec.scalar() == 1);

  // Within a step, the late variant is made by one thread and then shared by every call, however many
  // threads select it at once.
  exec::LateVariant late;
  std::atomic<int> made{0};
  std::vector<const exec::Variant*> got(8);
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t)
    threads.emplace_back([&, t] {
      got[static_cast<size_t>(t)] = &late.get([&] {
        ++made;
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        exec::Variant v;
        v.launch.gx = 7;
        return v;
      });
    });
  for (auto& th : threads) th.join();
  CHECK(made.load() == 1);
  for (auto* v : got) CHECK(v == got[0]);
  CHECK(got[0]->launch.gx == 7);

  // A failure (a compile error) publishes nothing: the call gets the error, the next call tries again.
  exec::LateVariant bad;
  CHECK_THROWS_AS(bad.get([]() -> exec::Variant { fail(Status::compile_error, "nvrtc said no"); }), Error);
  CHECK(bad.ready() == nullptr);
  CHECK(bad.get([] { return exec::Variant{}; }).kernel == nullptr);
  CHECK(bad.ready() != nullptr);
}

TEST_CASE("a late scalar variant launches within the partial-sum buffers prepared for the vector variant",
          "[exec][variants]") {
  static const rules::RuleSet rs = rules::RuleSet::with_builtins();
  // bias + gelu backward (column sums: a persistent kernel with per-block partials) and the layernorm
  // backward (dgamma/dbeta partials), at enough rows that the grids are capped by the device's residency.
  for (const char* ops : {R"([{"op": "bias"}, {"op": "gelu", "approximate": "tanh"}])",
                          R"([{"op": "layernorm"}])"}) {
    INFO(ops);
    const test::BuiltinCase c{0, ops, "bf16", true, {65536, 1024}};
    auto p = test::case_program(c, rs);
    const exec::KernelStep* k = nullptr;
    size_t at = 0;
    for (size_t i = 0; i < p->backward.size(); ++i)
      if (p->backward[i].kind == exec::Step::Kind::kernel && !p->backward[i].kernel->finalize.empty()) {
        k = p->backward[i].kernel.get();
        at = i;
      }
    REQUIRE(k);
    REQUIRE(k->spec.vec);
    REQUIRE(k->gen.launch.persistent);
    exec::DeviceModel dev;
    dev.sm_count = 132;
    dev.estimated = false;
    // Blocks per SM of the loaded variants of step `at` (vector 2, scalar 4; 0: not loaded).
    auto loaded = [&](int vec, int scalar) {
      return [=](bool fwd, size_t i) { return !fwd && i == at ? exec::Occupancy{vec, scalar} : exec::Occupancy{}; };
    };

    // Prepared with the vector variant only: the partials are sized for it.
    const exec::Layout one = exec::lay_out(*p, dev, loaded(2, 0));
    const int parts = static_cast<int>(one.buffer(k->finalize[0].partials).rows);
    CHECK(parts == one.backward[at].vec.parts);
    CHECK(one.backward[at].scalar.parts <= parts);
    // The scalar variant loaded later: a higher occupancy is clamped to the partials there are, a lower one
    // keeps its own grid.
    const exec::KernelLaunch hi = exec::late_scalar_launch(one, *k, dev.sm_count, 4);
    CHECK(hi.parts == parts);
    CHECK((k->spec.skeleton == codegen::Skeleton::rownorm ? hi.gx : hi.gy) == static_cast<unsigned>(parts));
    const exec::KernelLaunch lo = exec::late_scalar_launch(one, *k, dev.sm_count, 1);
    CHECK(lo.parts < parts);
    CHECK(lo.parts > 0);

    // Prepared with both (JITFUSE_ALL_VARIANTS): sized for the larger grid, as before.
    const exec::Layout both = exec::lay_out(*p, dev, loaded(2, 4));
    CHECK(both.buffer(k->finalize[0].partials).rows == both.backward[at].scalar.parts);
    CHECK(both.backward[at].scalar.parts > parts);
    CHECK(both.bwd_arena >= one.bwd_arena);
    // Laying out never writes the Program: its estimate is what explain prints, unchanged.
    CHECK(p->buffer(k->finalize[0].partials).rows == exec::lay_out(*p, dev).buffer(k->finalize[0].partials).rows);
  }
}

TEST_CASE("the gradients of one width finalize in one launch: a layernorm's dgamma and dbeta", "[exec][finalize]") {
  static const rules::RuleSet rs = rules::RuleSet::with_builtins();
  struct Want {
    const char* ops;
    std::vector<std::string> grads;  // in slot order
  };
  for (const Want& w : {Want{R"([{"op": "layernorm"}])", {"weight", "bias"}}, Want{R"([{"op": "rmsnorm"}])", {"weight"}},
                        Want{R"([{"op": "bias"}, {"op": "gelu"}])", {"bias"}}})
    for (const char* dtype : {"bf16", "fp32"}) {
      INFO(w.ops << " " << dtype);
      const test::BuiltinCase c{0, w.ops, dtype, true, {1000, 24}};
      auto p = test::case_program(c, rs);
      const exec::KernelStep* k = nullptr;
      for (const auto& s : p->backward)
        if (s.kind == exec::Step::Kind::kernel && !s.kernel->finalize.empty()) k = s.kernel.get();
      REQUIRE(k);
      REQUIRE(k->finalize.size() == w.grads.size());
      REQUIRE(k->gen.finalize.size() == w.grads.size());
      std::set<int> grads;
      for (size_t i = 0; i < w.grads.size(); ++i) {
        const auto& f = k->finalize[i];
        const auto& g = k->gen.finalize[i];
        CHECK(codegen::key_name(g.key) == w.grads[i]);
        CHECK(f.key == k->finalize[0].key);  // one kernel
        CHECK(f.slot == static_cast<int>(i));
        CHECK(f.count == static_cast<int>(w.grads.size()));
        CHECK(g.slot == f.slot);
        CHECK(f.cols == 24);
        grads.insert(f.grad);
      }
      CHECK(grads.size() == w.grads.size());  // each slot writes its own gradient
      // The source declares the kernel once, with one (partials, grad) pair per gradient and grid.y picking.
      const std::string& src = k->gen.source;
      CHECK(count(src, " " + k->finalize[0].key + "(") == 1);
      if (w.grads.size() == 1) {
        CHECK(count(src, "const float* __restrict__ part, ST* __restrict__ grad, int parts") == 1);
        CHECK(count(src, "blockIdx.y ==") == 0);
      } else {
        for (size_t i = 0; i < w.grads.size(); ++i)
          CHECK(count(src, fmt::format("const float* __restrict__ part{0}, ST* __restrict__ grad{0}, ", i)) == 1);
        CHECK(count(src, "// launch: grid.y " + std::to_string(w.grads.size())) == 1);
      }
      // One finalize step (a launch, not one per gradient) right after its kernel step, which explain shows.
      const auto j = exec::program_json(*p, 0);
      int at = -1, launches = 0;
      for (size_t i = 0; i < j["backward"].size(); ++i) {
        const auto& s = j["backward"][i];
        if (s.value("kernel", "") == k->gen.kernel) at = static_cast<int>(i);
        if (s["kind"] == "finalize" && s["after_step"] == at) {
          ++launches;
          CHECK(static_cast<int>(i) == at + 1);
          CHECK(s["kernel"] == k->finalize[0].key);
          CHECK(s["grid"][1] == w.grads.size());
          CHECK(s["args"].size() == 2 * w.grads.size());
        }
      }
      CHECK(launches == 1);
    }
}
