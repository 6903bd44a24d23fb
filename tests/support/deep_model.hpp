// A deep model as one sequence: tools/examples/transformer_layer.json's ops repeated, as a user hands in
// a 64-layer network. Shared by the planning test (tests/unit/exec) and the warmup test (tests/unit/cli).
#pragma once
#include <chrono>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "exec/lower/compile.hpp"
#include "ops/recipe.hpp"
#include "ops/sequence.hpp"
#include "rules/rule.hpp"

namespace jitfuse::test {

inline const char* kLayerFile = JF_SOURCE_DIR "/tools/examples/transformer_layer.json";
inline const char* kLayerShape = "4096x1024";  // the layer's linears take 1024 features

// The layer's sequence file repeated `layers` times. Each layer's dropout gets its own seed (as a real
// model's would): the seed is a kernel argument, so the layers still share one kernel.
inline nlohmann::json repeated_layers(int layers) {
  std::ifstream f(kLayerFile);
  REQUIRE(f);
  const nlohmann::json layer = nlohmann::json::parse(f);
  nlohmann::json seq = {{"format", layer.at("format")},
                        {"name", layer.at("name").get<std::string>() + "_x" + std::to_string(layers)},
                        {"ops", nlohmann::json::array()}};
  for (int l = 0; l < layers; ++l)
    for (nlohmann::json op : layer.at("ops")) {
      if (op.contains("seed")) op["seed"] = op["seed"].get<uint64_t>() + static_cast<uint64_t>(l);
      seq["ops"].push_back(op);
    }
  return seq;
}

struct Planned {
  std::vector<ops::Op> ops;
  std::shared_ptr<const exec::Program> program;
};

// What a context does before compiling: parse, infer shapes, plan, lower (sm_90, no GPU: occupancy
// estimated). `plan_ms`: the time of compile (plan + lower).
inline Planned plan_layers(int layers, const std::string& recipe, bool training, double* plan_ms = nullptr) {
  static const rules::RuleSet rs = rules::RuleSet::with_builtins();
  Planned p;
  p.ops = ops::infer(ops::parse_sequence(repeated_layers(layers).dump(), "<layers>", rs.registry()),
                     ops::parse_shape(kLayerShape));
  const ops::Recipe rc = ops::parse_recipe(recipe);
  exec::CompileOptions o;
  o.arch = 90;
  o.training = training;
  auto t0 = std::chrono::steady_clock::now();
  p.program = exec::compile(p.ops, "layers", rc, o, rs);
  if (plan_ms) *plan_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return p;
}

}  // namespace jitfuse::test
