// `jitfuse warmup` compiles each distinct kernel once: a 64-layer model compiles exactly the kernels of one
// layer (forward and backward, the vector variant each: what a prepared plan loads), and they are the very
// kernels the single layer asks for; `--all-variants` adds their scalar fallbacks.
#include <chrono>
#include <filesystem>
#include <map>

#include "support/deep_model.hpp"
#include "unit/rules/rules_test_util.hpp"

using jf_test::run_cli;

namespace {

nlohmann::json warmup_json(const std::string& seq, const std::string& cache, double* wall_s = nullptr,
                           const std::string& extra = "") {
  auto t0 = std::chrono::steady_clock::now();
  auto r = run_cli("warmup '" + seq + "' --recipe bf16 --shape " + jitfuse::test::kLayerShape +
                       " --arch sm_90 --jobs 2 --json" + extra,
                   "JITFUSE_CACHE_DIR='" + cache + "'", true);
  if (wall_s) *wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  INFO(r.out);
  REQUIRE(r.status == 0);
  return nlohmann::json::parse(r.out);
}

size_t entries(const std::string& cache) {
  size_t n = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(cache))
    n += e.is_regular_file() && e.path().extension() == ".jfk";
  return n;
}

// Entries by their metadata's variant, as `jitfuse cache ls --json` lists them.
std::map<std::string, size_t> variants(const std::string& cache) {
  auto r = run_cli("cache ls --json --dir '" + cache + "'", "", true);
  INFO(r.out);
  REQUIRE(r.status == 0);
  std::map<std::string, size_t> out;
  for (const auto& e : nlohmann::json::parse(r.out)) ++out[e["meta"].value("variant", std::string("-"))];
  return out;
}

}  // namespace

TEST_CASE("warmup of a 64-layer model compiles the kernels of two layers, once each", "[cli][position]") {
  jf_test::TempDir dir;
  const std::string deep = dir.write("layers64.json", jitfuse::test::repeated_layers(64).dump(1));
  const std::string cache = dir.path() + "/cache";
  // The distinct kernels of one layer: what a prepared context loads for it, one program per kernel (its
  // vector variant; the scalar fallback only when a call needs it): 12, forward and backward. Two layers add
  // the kernel of their boundary (the residual add, the next fork and its rmsnorm: fork_norm); any depth
  // needs exactly those 13.
  using jitfuse::test::plan_layers;
  const size_t one_layer = jitfuse::exec::program_kernels(*plan_layers(1, "bf16", true).program).size();
  const size_t two_layers = jitfuse::exec::program_kernels(*plan_layers(2, "bf16", true).program).size();
  REQUIRE(one_layer == 12);
  REQUIRE(two_layers == 13);

  double wall = 0;
  nlohmann::json j = warmup_json(deep, cache, &wall);
  WARN("warmup of 960 ops (bf16 training, sm_90, --jobs 2): " << j["compiled"] << " compiled in " << wall << " s");
  CHECK(j["kernels"] == two_layers);
  CHECK(j["compiled"] == two_layers);
  CHECK(j["already_in_memory"] == 0);
  CHECK(entries(cache) == two_layers);

  // The single layer finds every kernel it needs on disk: the 64 layers compiled its kernels too.
  j = warmup_json(jitfuse::test::kLayerFile, cache);
  CHECK(j["kernels"] == one_layer);
  CHECK(j["compiled"] == 0);
  CHECK(j["loaded_from_disk"] == one_layer);
  CHECK(variants(cache) == std::map<std::string, size_t>{{"vector", two_layers}});

  // --all-variants: the scalar fallbacks too, each its own program and entry; then only the boundary
  // kernel's scalar program is left for the 64 layers to compile.
  j = warmup_json(jitfuse::test::kLayerFile, cache, nullptr, " --all-variants");
  CHECK(j["variants"] == "all");
  CHECK(j["kernels"] == 2 * one_layer);
  CHECK(j["compiled"] == one_layer);
  CHECK(j["loaded_from_disk"] == one_layer);
  CHECK(entries(cache) == two_layers + one_layer);
  CHECK(variants(cache) == std::map<std::string, size_t>{{"scalar", one_layer}, {"vector", two_layers}});
  j = warmup_json(deep, cache, nullptr, " --all-variants");
  CHECK(j["compiled"] == two_layers - one_layer);
  CHECK(j["loaded_from_disk"] == 2 * two_layers - (two_layers - one_layer));
}
