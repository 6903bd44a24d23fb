// The moe skeleton's kernel specs as the tests build them (unit codegen, nvrtc compile, the GPU test).
#pragma once
#include "jitfuse/codegen/kernel_spec.hpp"

namespace jitfuse::test {

inline codegen::KernelSpec moe_spec(codegen::MoeSpec::Kernel kernel, int64_t experts, int64_t topk, int64_t hidden,
                                    const char* dtype, int op = 3, int route_op = 1) {
  using K = codegen::MoeSpec::Kernel;
  codegen::KernelSpec s;
  s.skeleton = codegen::Skeleton::moe;
  s.dtype = dtype;
  s.cols = hidden;
  s.dir = kernel == K::permute_bwd || kernel == K::unpermute_bwd ? codegen::Direction::backward
                                                                 : codegen::Direction::forward;
  s.label = "moe";
  codegen::MoeSpec m;
  m.kernel = kernel;
  m.op = op;
  m.route_op = route_op;
  m.experts = experts;
  m.topk = topk;
  s.moe = m;
  return s;
}

}  // namespace jitfuse::test
