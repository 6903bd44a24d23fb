// Op stages for the built-in pointwise ops: each a functor with fwd(x) and bwd(x, dy) = f'(x) * dy,
// where x is the op's input (relu also accepts its output: [x > 0] == [relu(x) > 0]).
#pragma once

__device__ __forceinline__ float jf_sigmoid(float x) { return 1.f / (1.f + __expf(-x)); }

// tanh through one exp: 1 - 2 / (e^{2u} + 1). Absolute error ~1e-7 (what 1 + tanh needs in GELU) at a
// fraction of tanhf's cost; saturates correctly when e^{2u} overflows or underflows.
__device__ __forceinline__ float jf_tanh(float u) { return 1.f - __fdividef(2.f, __expf(2.f * u) + 1.f); }

// y = x
struct jf_op_identity {
  static __device__ __forceinline__ float fwd(float x) { return x; }
  static __device__ __forceinline__ float bwd(float, float dy) { return dy; }
};

// y = c * x
struct jf_op_scale {
  static __device__ __forceinline__ float fwd(float x, float c) { return c * x; }
  static __device__ __forceinline__ float bwd(float, float dy, float c) { return c * dy; }
};

// y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
struct jf_op_gelu_tanh {
  static __device__ __forceinline__ float fwd(float x) {
    const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    return 0.5f * x * (1.f + jf_tanh(u));
  }
  static __device__ __forceinline__ float bwd(float x, float dy) {
    const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    const float t = jf_tanh(u);
    const float du = 0.7978845608028654f * (1.f + 3.f * 0.044715f * x * x);
    return dy * (0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * du);
  }
};

// y = x Phi(x) = 0.5 x (1 + erf(x / sqrt 2))
struct jf_op_gelu_erf {
  static __device__ __forceinline__ float fwd(float x) { return 0.5f * x * (1.f + erff(x * 0.7071067811865476f)); }
  static __device__ __forceinline__ float bwd(float x, float dy) {
    const float cdf = 0.5f * (1.f + erff(x * 0.7071067811865476f));
    const float pdf = 0.3989422804014327f * __expf(-0.5f * x * x);
    return dy * (cdf + x * pdf);
  }
};

// y = max(x, 0)
struct jf_op_relu {
  static __device__ __forceinline__ float fwd(float x) { return x > 0.f ? x : 0.f; }
  static __device__ __forceinline__ float bwd(float x, float dy) { return x > 0.f ? dy : 0.f; }
};

// y = x sigmoid(x)
struct jf_op_silu {
  static __device__ __forceinline__ float fwd(float x) { return x * jf_sigmoid(x); }
  static __device__ __forceinline__ float bwd(float x, float dy) {
    const float s = jf_sigmoid(x);
    return dy * s * (1.f + x * (1.f - s));
  }
};

// y = x sigmoid(1.702 x)
struct jf_op_qgelu {
  static __device__ __forceinline__ float fwd(float x) { return x * jf_sigmoid(1.702f * x); }
  static __device__ __forceinline__ float bwd(float x, float dy) {
    const float s = jf_sigmoid(1.702f * x);
    return dy * s * (1.f + 1.702f * x * (1.f - s));
  }
};

// y = max(x, 0)^2
struct jf_op_srelu {
  static __device__ __forceinline__ float fwd(float x) { return x > 0.f ? x * x : 0.f; }
  static __device__ __forceinline__ float bwd(float x, float dy) { return x > 0.f ? 2.f * x * dy : 0.f; }
};
