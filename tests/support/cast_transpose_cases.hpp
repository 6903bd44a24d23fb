// KernelSpecs of the cast_transpose skeleton built by hand, shared by the unit tier (argument lists, golden
// source), the nvrtc tier (every variant compiles) and the gpu tier (every variant against the reference).
#pragma once
#include <string>
#include <vector>

#include "jitfuse/codegen/kernel_spec.hpp"

namespace jitfuse::test {

enum class CtChain {
  none,       // a plain cast + transpose + amax (forward: an input; backward: a gradient)
  bias_gelu,  // forward: bias, gelu(tanh) saving its input; backward: dgelu, then dbias (column sums)
  codes,      // Fp8Spec::codes_in: the transpose of codes a norm kernel wrote (no stages, scale or amax)
};
enum class CtScaling { delayed, current, amax_only };  // amax_only: fp8_current's first pass

struct CtCase {
  codegen::Direction dir = codegen::Direction::forward;
  CtChain chain = CtChain::none;
  CtScaling scaling = CtScaling::delayed;
  bool e5m2 = false;
  std::string dtype = "bf16";
  int64_t cols = 64;
  std::string name() const {
    return std::string(dir == codegen::Direction::forward ? "fwd" : "bwd") +
           (chain == CtChain::none ? " plain" : chain == CtChain::bias_gelu ? " bias_gelu" : " codes") +
           (scaling == CtScaling::delayed ? " delayed" : scaling == CtScaling::current ? " current" : " amax_only") +
           (e5m2 ? " e5m2 " : " e4m3 ") + dtype + " cols " + std::to_string(cols);
  }
};

// Ops at sequence indices 3 (bias) and 4 (gelu), the FP8 GEMM operand of linear 5, as a layer deep in a
// sequence would have them (generate() numbers them 0, 1, 2 in the source).
inline codegen::KernelSpec cast_transpose_spec(const CtCase& c) {
  using namespace codegen;
  const bool fwd = c.dir == Direction::forward;
  KernelSpec s;
  s.skeleton = Skeleton::cast_transpose;
  s.dir = c.dir;
  s.dtype = c.dtype;
  s.cols = c.cols;
  s.vec = c.cols % 8 == 0;
  if (c.chain == CtChain::bias_gelu) {
    Stage bias;
    bias.kind = Stage::Kind::bias;
    bias.op = 3;
    bias.op_kind = "bias";
    bias.math = "y = x + b; db = sum_rows dy";
    Stage gelu;
    gelu.kind = Stage::Kind::unary;
    gelu.op = 4;
    gelu.op_kind = "gelu";
    gelu.math = "y = x * Phi(x) (tanh approximation)";
    gelu.functor = "jf_op_gelu_tanh";
    gelu.save_input = fwd && c.scaling != CtScaling::amax_only;
    s.pre = {bias, gelu};
    s.headers["ops/activations.cuh"] = "";
  }
  Fp8Spec q;
  q.op = 5;
  q.tensor = fwd ? "input" : "grad_output";
  q.e5m2 = c.e5m2;
  q.delayed = c.scaling == CtScaling::delayed;
  q.amax_only = c.scaling == CtScaling::amax_only;
  q.codes_in = c.chain == CtChain::codes;
  s.fp8 = q;
  s.label = (c.chain == CtChain::none        ? std::string("cast_transpose")
             : c.chain == CtChain::bias_gelu ? std::string("bias_gelu_cast_transpose")
                                             : std::string("transpose")) +
            (q.amax_only ? "_amax" : "");
  s.rule = "test";
  return s;
}

// Every variant: direction x chain x scaling x format, bf16 and fp16, a width with the vector path (4096)
// and one without (66: the scalar variant only).
inline std::vector<CtCase> cast_transpose_cases() {
  std::vector<CtCase> out;
  for (auto dir : {codegen::Direction::forward, codegen::Direction::backward})
    for (auto chain : {CtChain::none, CtChain::bias_gelu})
      for (auto scaling : {CtScaling::delayed, CtScaling::current, CtScaling::amax_only})
        for (bool e5m2 : {false, true})
          for (const char* dtype : {"bf16", "fp16"})
            for (int64_t cols : {4096, 66}) out.push_back({dir, chain, scaling, e5m2, dtype, cols});
  for (bool e5m2 : {false, true})  // the codes' transpose: no scaling, the storage dtype unused
    for (int64_t cols : {4096, 66})
      out.push_back({codegen::Direction::forward, CtChain::codes, CtScaling::delayed, e5m2, "bf16", cols});
  return out;
}

}  // namespace jitfuse::test
