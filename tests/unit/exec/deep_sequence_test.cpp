// Position-independent kernels (issue 14): a 64-layer model as one sequence plans in milliseconds and needs
// exactly the distinct kernels of two layers (one layer's and a boundary's), each kernel shared by the groups
// of every layer.
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <map>
#include <set>

#include "support/deep_model.hpp"

using namespace jitfuse;

namespace {

using test::plan_layers;
using test::Planned;

std::set<std::string> sources(const exec::Program& p) {
  std::set<std::string> out;
  for (const auto& [spec, meta] : exec::program_kernels(p)) out.insert(codegen::generate(spec).source);
  return out;
}

size_t kernel_steps(const exec::Program& p) {
  size_t n = 0;
  for (const auto* steps : {&p.forward, &p.backward})
    n += static_cast<size_t>(std::count_if(steps->begin(), steps->end(),
                                           [](const exec::Step& s) { return s.kind == exec::Step::Kind::kernel; }));
  return n;
}

}  // namespace

TEST_CASE("64 layers need exactly the distinct kernels of two layers", "[exec][position]") {
  // A layer ends in a residual add and begins with a fork and a norm: across a boundary the three run as
  // one kernel (fork_norm), which one layer alone does not have. Two layers hold every kernel of any depth.
  for (const char* recipe : {"bf16", "fp8_current"})
    for (bool training : {true, false}) {
      INFO(recipe << (training ? " training" : " inference"));
      const Planned one = plan_layers(1, recipe, training), two = plan_layers(2, recipe, training),
                    deep = plan_layers(64, recipe, training);
      REQUIRE(deep.ops.size() == 64 * one.ops.size());
      const auto two_kernels = exec::program_kernels(*two.program), deep_kernels = exec::program_kernels(*deep.program);
      // Every layer launches its kernels, but they are the two layers' kernels, listed once.
      const size_t per_layer = kernel_steps(*two.program) - kernel_steps(*one.program);
      CHECK(kernel_steps(*deep.program) == kernel_steps(*one.program) + 63 * per_layer);
      CHECK(deep_kernels.size() == two_kernels.size());
      CHECK(sources(*deep.program) == sources(*two.program));
    }
}

TEST_CASE("a kernel shared by several layers binds each layer's own tensors", "[exec][position]") {
  const Planned deep = plan_layers(3, "bf16", true);
  const auto& p = *deep.program;
  struct Use {
    const exec::KernelStep* k;
    fuser::Group g;
  };
  std::map<std::string, std::vector<Use>> by_source;
  for (bool fwd : {true, false})
    for (const auto& s : fwd ? p.forward : p.backward)
      if (s.kind == exec::Step::Kind::kernel)
        by_source[s.kernel->gen.source].push_back(
            {s.kernel.get(), (fwd ? p.plan.forward : p.plan.backward).at(static_cast<size_t>(s.group))});
  std::set<uint64_t> seeds;
  for (const auto& [source, uses] : by_source) {
    INFO(uses.front().k->gen.kernel);
    // Every layer runs it, or every boundary between two (fork_norm), or only the first or last layer.
    CHECK(uses.size() >= 1);
    CHECK(uses.size() <= 3);
    std::set<std::vector<int>> bindings;
    for (const auto& [k, g] : uses) {
      std::vector<int> ids;
      for (size_t i = 0; i < k->args.size(); ++i) {
        const auto& arg = k->gen.args[i];
        if (k->args[i].kind == exec::KArg::Kind::buffer) ids.push_back(k->args[i].buffer);
        if (arg.role == codegen::Arg::Role::seed) seeds.insert(k->args[i].value);
        // Arg::op is the sequence op the argument binds to: one of this step's group.
        if (arg.op >= 0) CHECK((arg.op >= g.begin && arg.op < g.end));
      }
      // Finalize kernels are found by name in the shared module: the same name at every depth.
      for (size_t f = 0; f < k->finalize.size(); ++f) {
        CHECK(k->finalize[f].key == uses.front().k->finalize[f].key);
        CHECK(k->finalize[f].key.rfind(k->gen.kernel + "_fin", 0) == 0);
        ids.push_back(k->finalize[f].grad);
      }
      bindings.insert(ids);
    }
    CHECK(bindings.size() == uses.size());  // no two layers share a tensor
  }
  CHECK(seeds == std::set<uint64_t>{1234, 1235, 1236});  // each layer's dropout keeps its own seed
}

TEST_CASE("a 960-op sequence plans in milliseconds", "[exec][position][timing]") {
  // Measured median on the 2-core development VM (Release): see docs/cache.md. The bound is 10x the
  // 50 ms target: timed tests share a loaded 2-core CI machine with the other tiers.
  std::vector<double> ms;
  for (int run = 0; run < 5; ++run) {
    double t = 0;
    const Planned deep = plan_layers(64, "bf16", true, &t);
    REQUIRE(deep.ops.size() == 960);
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  const double median = ms[ms.size() / 2];
  WARN("make_plan + make_program of 960 ops (bf16, training): median " << median << " ms of 5 (min " << ms.front()
                                                                         << ", max " << ms.back() << ")");
  CHECK(median <= 500.0);
}
