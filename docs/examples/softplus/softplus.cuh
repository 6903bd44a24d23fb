// A user-declared pointwise op for jitfuse (declared in rules.json beside this file): softplus with sharpness beta.
// y = log(1 + exp(beta x)) / beta;  dy/dx = sigmoid(beta x). x is the op's input ("saves": "input").
#pragma once

struct jf_op_softplus {
  static __device__ __forceinline__ float fwd(float x, float beta) {
    const float z = beta * x;
    // log(1 + e^z) = max(z, 0) + log1p(e^-|z|): no overflow for large |z|.
    return (fmaxf(z, 0.f) + log1pf(__expf(-fabsf(z)))) / beta;
  }
  static __device__ __forceinline__ float bwd(float x, float dy, float beta) {
    return dy / (1.f + __expf(-beta * x));
  }
};
