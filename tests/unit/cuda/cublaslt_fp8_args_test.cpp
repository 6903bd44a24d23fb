// The FP8 GEMM primitive's argument rules (cuda::check_gemm_call, runtime/cuda/cublaslt.hpp): every
// refusal is an invalid_argument naming the problem's dims and the rule; no GPU needed.
#include <catch2/catch.hpp>

#include <string>

#include "common/error.hpp"
#include "cuda/cublaslt.hpp"

using namespace jitfuse;
using cuda::GemmCall;
using ops::DType;

namespace {

// Device-looking pointers (never dereferenced here), 16-byte aligned.
const void* P(uintptr_t v) { return reinterpret_cast<const void*>(v); }
const float* F(uintptr_t v) { return reinterpret_cast<const float*>(v); }

GemmCall good() {
  GemmCall c;
  c.m = 3;
  c.n = 32;
  c.k = 48;
  c.dtype = DType::bf16;
  c.a = P(0x10000);
  c.b = P(0x20000);
  c.d = const_cast<void*>(P(0x30000));
  c.fp8 = cuda::Fp8Gemm{};
  c.fp8->a_scale_inv = F(0x40000);
  c.fp8->b_scale_inv = F(0x40010);
  return c;
}

// The message of the invalid_argument `c` is refused with ("" if accepted).
std::string refusal(const GemmCall& c) {
  try {
    cuda::check_gemm_call(c);
  } catch (const Error& e) {
    CHECK(e.status() == Status::invalid_argument);
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("FP8 GEMM: legal calls pass the argument check", "[cublaslt]") {
  CHECK(refusal(good()) == "");
  GemmCall c = good();
  c.fp8->b = DType::e5m2;  // E4M3 x E5M2
  c.dtype = DType::f32;
  CHECK(refusal(c) == "");
  c.fp8->a = DType::e5m2;  // E5M2 x E4M3, fp32 out, bf16 bias
  c.fp8->b = DType::e4m3;
  c.epilogue = cuda::Epilogue::bias;
  c.bias = P(0x50000);
  CHECK(refusal(c) == "");
  c.dtype = DType::e5m2;  // FP8 output: E5M2 allowed with an E5M2 operand
  c.fp8->d_scale = F(0x40020);
  c.fp8->d_amax = const_cast<float*>(F(0x40030));
  CHECK(refusal(c) == "");
  c = good();
  c.m = 1;  // m is free
  CHECK(refusal(c) == "");
  c.m = 17;
  CHECK(refusal(c) == "");
  GemmCall plain;  // plain calls are not checked here (unchanged behaviour)
  plain.kind = cuda::GemmKind::dgrad;
  plain.m = 3;
  plain.n = 5;
  plain.k = 7;
  CHECK(refusal(plain) == "");
}

TEST_CASE("FP8 GEMM: refused calls say which rule and the problem's dims", "[cublaslt]") {
  using Catch::Matchers::Contains;
  auto refused = [](GemmCall c, const char* says) {
    const std::string msg = refusal(c);
    INFO(msg);
    CHECK_THAT(msg, Contains("FP8 GEMM m=" + std::to_string(c.m) + " n=" + std::to_string(c.n) +
                             " k=" + std::to_string(c.k)));
    CHECK_THAT(msg, Contains(says));
  };
  GemmCall c = good();
  c.fp8->a = c.fp8->b = DType::e5m2;
  refused(c, "E5M2 x E5M2 is not supported");
  c = good();
  c.fp8->b = DType::bf16;
  refused(c, "both operands must be e4m3 or e5m2");
  c = good();
  c.k = 40;
  refused(c, "k must be a multiple of 16");
  c = good();
  c.n = 24;
  refused(c, "n must be a multiple of 16");
  c = good();
  c.m = 0;
  refused(c, "every dimension must be positive");
  c = good();
  c.kind = cuda::GemmKind::dgrad;
  refused(c, "TN layout only: a dgrad GEMM");
  c = good();
  c.kind = cuda::GemmKind::wgrad;
  refused(c, "transposed FP8 copies");
  c = good();
  c.a = P(0x10008);
  refused(c, "A must be 16-byte aligned");
  c = good();
  c.d = const_cast<void*>(P(0x30004));
  refused(c, "D must be 16-byte aligned");
  c = good();
  c.fp8->b_scale_inv = nullptr;
  refused(c, "a_scale_inv and b_scale_inv are required");
  // cuBLASLt returns NOT_SUPPORTED for a scale pointer off a 16-byte boundary (H100 run #13): refused here.
  c = good();
  c.fp8->b_scale_inv = F(0x40004);
  refused(c, "b_scale_inv must be 16-byte aligned");
  c = good();
  c.dtype = DType::e4m3;
  c.fp8->d_scale = F(0x40020);
  c.fp8->d_amax = const_cast<float*>(F(0x40028));
  refused(c, "d_amax must be 16-byte aligned");
  c = good();
  c.dtype = DType::e4m3;
  refused(c, "FP8 output needs d_scale");
  c.fp8->d_scale = F(0x40020);
  c.beta = 1.f;
  refused(c, "beta != 0");
  c = good();
  c.dtype = DType::e5m2;
  c.fp8->d_scale = F(0x40020);
  refused(c, "E5M2 output only when an operand is E5M2");
  c = good();
  c.fp8->d_amax = const_cast<float*>(F(0x40030));
  refused(c, "d_scale and d_amax apply to FP8 output only");
  c = good();
  c.epilogue = cuda::Epilogue::gelu_bias;
  c.bias = P(0x50000);
  refused(c, "epilogue GELU_BIAS is not supported with FP8");
  c = good();
  c.epilogue = cuda::Epilogue::bias;
  c.bias = P(0x50000);
  c.fp8->bias = DType::f32;
  refused(c, "takes a bf16 bias with bf16 output");
  c.dtype = DType::f16;
  c.fp8->bias = DType::bf16;
  refused(c, "takes a fp16 bias with fp16 output");
  c = good();
  c.epilogue = cuda::Epilogue::bias;
  refused(c, "without a bias pointer");
}
