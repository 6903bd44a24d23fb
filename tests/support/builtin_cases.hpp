// The sequences that exercise every built-in rule (and every op alone), shared by the nvrtc tier (they
// all compile) and the golden-source test (their generated sources do not drift).
#pragma once
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "cache/kernel_cache.hpp"
#include "exec/lower/compile.hpp"
#include "exec/run/kernels.hpp"
#include "ops/recipe.hpp"
#include "ops/sequence.hpp"
#include "rules/rule.hpp"

namespace jitfuse::test {

// One sequence per built-in rule pattern, plus every op alone (the unfused kernels).
inline const std::vector<const char*>& builtin_sequences() {
  static const std::vector<const char*> v = {
      R"([{"op": "bias"}, {"op": "gelu"}])",
      R"([{"op": "bias"}, {"op": "gelu", "approximate": "none"}])",
      R"([{"op": "bias"}, {"op": "relu"}])",
      R"([{"op": "bias"}, {"op": "silu"}])",
      R"([{"op": "bias"}, {"op": "qgelu"}])",
      R"([{"op": "bias"}, {"op": "srelu"}])",
      R"([{"op": "bias"}, {"op": "swiglu"}])",
      R"([{"op": "bias"}, {"op": "geglu"}])",
      R"([{"op": "bias"}, {"op": "reglu"}])",
      R"([{"op": "swiglu"}, {"op": "scale", "value": 0.5}])",
      R"([{"op": "bias"}, {"op": "dropout", "p": 0.1}, {"op": "add_extra_input"}])",
      R"([{"op": "add_extra_input"}, {"op": "layernorm"}])",
      R"([{"op": "add_extra_input"}, {"op": "rmsnorm", "zero_centered_gamma": true}])",
      R"([{"op": "layernorm"}, {"op": "gelu"}, {"op": "scale", "value": 2.0}, {"op": "dropout", "p": 0.2}])",
      R"([{"op": "rmsnorm"}, {"op": "silu"}])",
      R"([{"op": "make_extra_output"}, {"op": "layernorm"}])",
      R"([{"op": "make_extra_output"}, {"op": "rmsnorm"}])",
      R"([{"op": "gelu"}, {"op": "scale", "value": 3.0}, {"op": "add_extra_input"}])",
      R"([{"op": "linear", "in_features": 64, "out_features": 64}, {"op": "bias"}, {"op": "gelu"}])",
      R"([{"op": "linear", "in_features": 64, "out_features": 64}, {"op": "bias"}, {"op": "relu"}])",
      R"([{"op": "linear", "in_features": 64, "out_features": 64}, {"op": "silu"}])",
      R"([{"op": "make_extra_output"}, {"op": "linear", "in_features": 64, "out_features": 64}, {"op": "scale", "value": 0.5}])",
      R"([{"op": "identity"}, {"op": "quantize"}, {"op": "reshape", "shape": [-1]}])",
      R"([{"op": "dropout", "p": 0.3, "training": false}])",
  };
  return v;
}

// Under the FP8 recipes (quantize is the E4M3 cast; current scaling adds an amax pass).
inline const std::vector<const char*>& builtin_fp8_sequences() {
  static const std::vector<const char*> v = {
      R"([{"op": "layernorm"}, {"op": "quantize"}])",
      R"([{"op": "rmsnorm"}, {"op": "quantize"}])",
      R"([{"op": "bias"}, {"op": "gelu"}, {"op": "quantize"}])",
      R"([{"op": "swiglu"}, {"op": "quantize"}])",
      R"([{"op": "add_extra_input"}, {"op": "dropout", "p": 0.1}, {"op": "quantize"}])",
      R"([{"op": "gelu"}, {"op": "scale", "value": 0.5}, {"op": "quantize"}])",
      R"([{"op": "bias"}, {"op": "gelu"}, {"op": "scale", "value": 0.5}, {"op": "quantize"}])",
      R"([{"op": "swiglu"}, {"op": "scale", "value": 0.5}, {"op": "quantize"}])",
  };
  return v;
}

// Runs of pointwise ops the repeated-class rules fuse in both passes (after the FP8 list, so the indices of
// the sequences above stay what the golden files name).
inline const std::vector<const char*>& builtin_chain_sequences() {
  static const std::vector<const char*> v = {
      R"([{"op": "gelu"}, {"op": "scale", "value": 2.0}, {"op": "silu"}, {"op": "relu"}, {"op": "qgelu"}, {"op": "srelu"}, {"op": "identity"}])",
      R"([{"op": "dropout", "p": 0.1}, {"op": "gelu"}, {"op": "add_extra_input"}, {"op": "scale", "value": 0.5}])",
      R"([{"op": "bias"}, {"op": "gelu"}, {"op": "scale", "value": 2.0}, {"op": "silu"}])",
      R"([{"op": "bias"}, {"op": "relu"}, {"op": "dropout", "p": 0.1}])",
      R"([{"op": "bias"}, {"op": "swiglu"}, {"op": "scale", "value": 0.5}, {"op": "gelu"}])",
      R"([{"op": "geglu"}, {"op": "relu"}, {"op": "scale", "value": 3.0}])",
      R"([{"op": "reglu"}, {"op": "srelu"}])",
  };
  return v;
}

// Whole blocks and named channels (after the chain list, for the same reason): the Llama- and GPT-2-style
// MLP blocks, and a channel's fan-out and returned forms, under bf16 and both FP8 recipes.
inline const std::vector<const char*>& builtin_block_sequences() {
  static const std::vector<const char*> v = {
      R"([{"op": "make_extra_output", "channel": "r"}, {"op": "rmsnorm"},
          {"op": "linear", "in_features": 64, "out_features": 128}, {"op": "swiglu"},
          {"op": "linear", "in_features": 64, "out_features": 64}, {"op": "add_extra_input", "channel": "r"}])",
      R"([{"op": "add_extra_input"}, {"op": "make_extra_output"}, {"op": "layernorm"},
          {"op": "linear", "in_features": 64, "out_features": 64}, {"op": "bias"}, {"op": "gelu"},
          {"op": "linear", "in_features": 64, "out_features": 64}, {"op": "bias"}, {"op": "add_extra_input"}])",
      R"([{"op": "make_extra_output", "channel": "r", "returned": true}, {"op": "gelu"},
          {"op": "add_extra_input", "channel": "r"}, {"op": "silu"}, {"op": "add_extra_input", "channel": "r"}])",
  };
  return v;
}

// Under fp8_block (issue 44; after the block list): linears of whole 128-wide blocks, the GPT-2 MLP with its
// residual, the Llama half-block with a channel, and a quantize (current scaling under fp8_block).
inline const std::vector<const char*>& builtin_fp8_block_sequences() {
  static const std::vector<const char*> v = {
      R"([{"op": "layernorm"}, {"op": "linear", "in_features": 128, "out_features": 256}, {"op": "bias"},
          {"op": "gelu"}, {"op": "linear", "in_features": 256, "out_features": 128}, {"op": "bias"},
          {"op": "add_extra_input"}])",
      R"([{"op": "make_extra_output", "channel": "r"}, {"op": "rmsnorm"},
          {"op": "linear", "in_features": 128, "out_features": 512}, {"op": "swiglu"},
          {"op": "linear", "in_features": 256, "out_features": 128}, {"op": "add_extra_input", "channel": "r"}])",
      R"([{"op": "layernorm"}, {"op": "quantize"}])",
  };
  return v;
}

// Tensor parallelism (after the fp8_block list): the all-reduce after a row-parallel layer, the residual and the next
// norm (allreduce_fork_norm), planned for rank 0 of 2 and of 4 ranks: the one-shot kernel over peer buffers.
inline const std::vector<const char*>& builtin_parallel_sequences() {
  static const std::vector<const char*> v = {
      R"([{"op": "all_reduce"}, {"op": "add_extra_input"}, {"op": "make_extra_output"}, {"op": "rmsnorm"}])",
      R"([{"op": "all_reduce"}, {"op": "make_extra_output"}, {"op": "layernorm"}])",
  };
  return v;
}

struct BuiltinCase {
  int seq = 0;  // index into builtin_sequences(), builtin_fp8_sequences(), builtin_chain_sequences(),
                // builtin_block_sequences(), builtin_fp8_block_sequences(), builtin_parallel_sequences(), then the
                // row-parallel linear
  std::string ops_json;
  std::string recipe;
  bool training = true;
  ops::Shape shape;
  int world = 1;  // the world size its program is planned for (rank 0)
  std::string id() const {
    return recipe + (training ? " train " : " infer ") + ops::shape_str(shape) + (world > 1 ? " W" + std::to_string(world) : "") +
           " " + ops_json;
  }
};

// Every (sequence, recipe, training, shape) the tiers cover; odd widths exercise the scalar paths and
// linear's in_features fixes its input width.
inline std::vector<BuiltinCase> builtin_cases() {
  std::vector<BuiltinCase> out;
  int seq = 0;
  auto add = [&](const char* ops_json, std::vector<const char*> recipes) {
    for (const char* recipe : recipes)
      for (bool training : {true, false})
        for (ops::Shape shape : {ops::Shape{16, 64}, ops::Shape{3, 66}}) {
          if (ops::cols_of(shape) != 64 && std::string(ops_json).find("linear") != std::string::npos) continue;
          out.push_back({seq, ops_json, recipe, training, shape});
        }
    ++seq;
  };
  for (const char* s : builtin_sequences()) add(s, {"fp32", "fp16", "bf16"});
  for (const char* s : builtin_fp8_sequences()) add(s, {"fp8_delayed", "fp8_current"});
  for (const char* s : builtin_chain_sequences()) add(s, {"fp32", "fp16", "bf16"});
  for (const char* s : builtin_block_sequences()) add(s, {"bf16", "fp8_delayed", "fp8_current"});
  for (const char* s : builtin_fp8_block_sequences()) {  // whole 128-row blocks (the wgrad's K)
    for (bool training : {true, false}) out.push_back({seq, s, "fp8_block", training, ops::Shape{256, 128}});
    ++seq;
  }
  for (const char* s : builtin_parallel_sequences()) {
    for (const char* recipe : {"fp32", "bf16"})
      for (bool training : {true, false})
        for (ops::Shape shape : {ops::Shape{16, 64}, ops::Shape{3, 66}})
          for (int world : {2, 4}) out.push_back({seq, s, recipe, training, shape, world});
    ++seq;
  }
  // The row-parallel linear of sequence parallelism: its reduce-scatter by copy engines, summed by a generated
  // kernel (joint_overlap_collective's copy mode); the input is this rank's 128 / W columns.
  // Under fp8_current its GEMM's row blocks read the codes of one cast (64 rows: 16 and more per rank).
  const char* row_sp =
      R"([{"op": "linear", "in_features": 128, "out_features": 64, "tensor_parallel": "row", "sequence_parallel": true}])";
  for (const char* recipe : {"fp32", "bf16", "fp8_current"})
    for (bool training : {true, false})
      for (int world : {2, 4})
        out.push_back({seq, row_sp, recipe, training, ops::Shape{std::string(recipe) == "fp8_current" ? 64 : 16, 128 / world},
                       world});
  ++seq;
  return out;
}

inline std::vector<ops::Op> case_ops(const BuiltinCase& c, const rules::RuleSet& rs) {
  std::string text = std::string(R"({"format": "jitfuse.sequence/1", "name": "n", "ops": )") + c.ops_json + "}";
  auto def = ops::parse_sequence(text, "<builtin case>", rs.registry());
  ops::Parallel par;
  par.world_size = c.world;
  return ops::infer(def, c.shape, par);
}

// The program of a case, planned and lowered as a context does (occupancy estimated: no GPU).
inline std::shared_ptr<const exec::Program> case_program(const BuiltinCase& c, const rules::RuleSet& rs,
                                                         int arch = 90) {
  exec::CompileOptions o;
  o.arch = arch;
  o.training = c.training;
  return exec::compile(case_ops(c, rs), "n", ops::parse_recipe(c.recipe), o, rs);
}

// The kernels (spec + cache metadata) a case's program launches, in step order (each source holds every
// variant its shape allows).
inline std::vector<std::pair<codegen::KernelSpec, nlohmann::json>> case_kernels(const BuiltinCase& c,
                                                                               const rules::RuleSet& rs,
                                                                               int arch = 90) {
  return exec::program_kernels(*case_program(c, rs, arch));
}

// What a context uses to turn a case's kernels into compile requests (built-in rules, embedded templates,
// an in-memory cache), and the requests already handed out, so that each distinct kernel is seen once.
struct KernelRig {
  rules::RuleSet rs = rules::RuleSet::with_builtins();
  exec::TemplateStore templates;
  cache::KernelCache cache{cache::Config{}};
  exec::KernelLibrary lib{cache, templates};
  std::set<std::string> seen;  // cache keys

  // fn(spec, generated, vector, request) for every variant of every kernel of case `c` on `arch` ("sm_90a")
  // not handed out before; returns how many.
  template <typename Fn>
  size_t each_new_request(const BuiltinCase& c, const char* arch, Fn&& fn) {
    const exec::Target target = exec::target_for_arch(arch);
    size_t n = 0;
    for (const auto& [spec, meta] : case_kernels(c, rs, arch[3] == '9' ? 90 : 80)) {
      const codegen::Generated g = codegen::generate(spec);
      for (bool vector : exec::variants_of(spec, exec::Variants::all)) {
        auto req = lib.request(g, spec, target, meta, vector);
        if (!seen.insert(cache::cache_key(req)).second) continue;
        fn(spec, g, vector, req);
        ++n;
      }
    }
    return n;
  }
};

}  // namespace jitfuse::test
