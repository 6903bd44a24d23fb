// Golden generated sources: every kernel of every built-in rule case (tests/support/builtin_cases.hpp),
// hashed into tests/golden/sources/manifest.txt, plus the complete text of a representative set. "vec":
// a source with both variants (the 16-byte vector one, and the scalar one under -DJF_SCALAR); "scalar": a
// shape that allows only the scalar one (odd widths). A refactor of lowering or codegen must leave them byte-identical; a deliberate
// change regenerates them with JITFUSE_UPDATE_GOLDEN=1 and shows up in review.
#include <catch2/catch.hpp>

#include <algorithm>
#include <fstream>
#include <map>
#include <sstream>

#include "cache/sha256.hpp"
#include "common/env.hpp"
#include "exec/run/kernels.hpp"
#include "support/builtin_cases.hpp"

using namespace jitfuse;

namespace {

const std::string kDir = std::string(JF_SOURCE_DIR) + "/tests/golden/sources";

// Kernels whose whole source is checked in (one per skeleton, direction, dtype family and feature).
bool representative(const std::string& name) {
  static const char* kNames[] = {
      "s0 fp32 train 16x64 bias_gelu fwd vec",       "s0 bf16 train 16x64 bias_gelu bwd vec",
      "s0 bf16 train 3x66 bias_gelu fwd scalar",     "s6 bf16 train 16x64 bias_swiglu fwd vec",
      "s6 bf16 train 16x64 bias_swiglu bwd vec",     "s11 fp16 train 16x64 add_extra_input_layernorm fwd vec",
      "s11 fp16 train 16x64 layernorm bwd vec", "s14 bf16 train 16x64 rmsnorm_silu fwd vec",
      "s10 bf16 train 16x64 bias_dropout_add_extra_input fwd vec",
      "s10 bf16 train 16x64 bias_dropout_add_extra_input bwd vec",
      "s24 fp8_current train 16x64 layernorm_quantize_amax fwd vec",
      "s24 fp8_delayed train 16x64 layernorm_quantize fwd vec",
      "s42 fp8_block train 256x128 bias_gelu_block_cast_transpose_1x128_e4m3 bwd vec",
      "s45 bf16 train 16x64 W2 allreduce_add_extra_input_make_extra_output_rmsnorm fwd vec",
      "s47 bf16 train 16x32 W4 peer_sum fwd vec",
  };
  for (auto* n : kNames)
    if (name == n) return true;
  return false;
}

std::string file_name(std::string name) {
  for (auto& c : name)
    if (c == ' ') c = '_';
  return name + ".cu";
}

std::string read(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

}  // namespace

TEST_CASE("generated sources of the built-in rules match the golden files", "[codegen][golden]") {
  rules::RuleSet rs = rules::RuleSet::with_builtins();
  exec::TemplateStore templates;
  cache::KernelCache cache(cache::Config{});
  exec::KernelLibrary lib(cache, templates);
  const exec::Target target = exec::target_for_arch("sm_90a");
  std::map<std::string, std::string> manifest;  // kernel name -> sha256 of its stitched source
  std::map<std::string, std::string> full;
  for (const auto& c : test::builtin_cases()) {
    std::map<std::string, std::vector<std::string>> in_case;  // name -> the distinct sources this case gave it
    for (const auto& [spec, meta] : test::case_kernels(c, rs)) {
      {
        const bool vec = spec.vec;
        const std::string source = lib.request(spec, target, meta, vec).source;  // one source, both variants
        std::string name = "s" + std::to_string(c.seq) + " " + c.recipe + (c.training ? " train " : " infer ") +
                           ops::shape_str(c.shape) + (c.world > 1 ? " W" + std::to_string(c.world) : "") + " " +
                           spec.label + (spec.dir == codegen::Direction::forward ? " fwd" : " bwd") +
                           (vec ? " vec" : " scalar");
        const std::string hash = cache::to_hex(cache::sha256(source));
        // A case with two kernels of one label (a block's two linears' casts): numbered in step order.
        auto& seen = in_case[name];
        size_t k = std::find(seen.begin(), seen.end(), hash) - seen.begin();
        if (k == seen.size()) seen.push_back(hash);
        if (k > 0) name += " #" + std::to_string(k + 1);
        auto [it, fresh] = manifest.emplace(name, hash);
        INFO(name << " from case " << c.id());
        CHECK(it->second == hash);  // one name, one source, whatever case produced it
        if (fresh && representative(name)) full[name] = source;
      }
    }
  }
  std::ostringstream text;
  for (const auto& [name, hash] : manifest) text << hash << "  " << name << "\n";
  CHECK(full.size() == 15);
  if (env::flag("JITFUSE_UPDATE_GOLDEN")) {
    std::ofstream(kDir + "/manifest.txt", std::ios::binary) << text.str();
    for (const auto& [name, src] : full) std::ofstream(kDir + "/" + file_name(name), std::ios::binary) << src;
    WARN("golden sources rewritten in " << kDir);
    return;
  }
  const std::string golden = read(kDir + "/manifest.txt");
  REQUIRE_FALSE(golden.empty());
  if (golden != text.str()) {
    // Name the kernels that changed, appeared or disappeared.
    std::istringstream g(golden);
    std::map<std::string, std::string> want;
    for (std::string line; std::getline(g, line);)
      if (line.size() > 66) want[line.substr(66)] = line.substr(0, 64);
    for (const auto& [name, hash] : manifest) {
      INFO("kernel " << name);
      CHECK(want.count(name) == 1);
      if (want.count(name)) CHECK(want[name] == hash);
    }
    for (const auto& [name, hash] : want) {
      INFO("golden kernel " << name << " is no longer generated");
      CHECK(manifest.count(name) == 1);
    }
  }
  CHECK(golden == text.str());
  for (const auto& [name, src] : full) {
    INFO("golden source " << file_name(name));
    CHECK(read(kDir + "/" + file_name(name)) == src);
  }
}
