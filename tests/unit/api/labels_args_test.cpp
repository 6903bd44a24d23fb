// cross_entropy's labels at the C ABI: an extra input with its own dtype (the op's "label_dtype") and shape (one label
// per row), checked before any planning or device work with errors naming the tensor, what was expected and what came;
// in the backward they are read again and their gradient slot must be NULL.
#include <catch2/catch.hpp>
#include <string>

#include "jitfuse/jitfuse.h"

namespace {

std::string last() { return jf_last_error(); }

struct Tensor {
  int64_t shape[2] = {4, 8};
  int64_t strides[2] = {8, 1};
  DLTensor t{};
  alignas(16) char storage[64] = {};
  Tensor(int ndim, DLDataType dt) {
    t.device = {kDLCUDA, 0};
    t.ndim = ndim;
    t.shape = shape;
    t.dtype = dt;
    t.data = storage;  // never dereferenced: every case here fails before any
                       // device work
  }
};

constexpr DLDataType kBf16{kDLBfloat, 16, 1}, kI64{kDLInt, 64, 1}, kI32{kDLInt, 32, 1};

}  // namespace

TEST_CASE(
    "C ABI: cross_entropy labels are checked for count, dtype, shape, "
    "layout and device",
    "[api][untrusted]") {
  jf_context ctx = nullptr;
  REQUIRE(jf_context_create(&ctx) == JF_OK);
  jf_sequence s = nullptr;
  REQUIRE(jf_sequence_create(ctx, R"({"ops": [{"op": "cross_entropy"}]})", "bf16", &s) == JF_OK);
  Tensor in(2, kBf16), out(1, kBf16), labels(1, kI64);
  out.shape[0] = 1;
  labels.shape[0] = 4;
  const DLTensor* extras[1] = {&labels.t};
  jf_forward_args args{};
  args.input = &in.t;
  args.output = &out.t;
  args.extra_inputs = extras;
  auto fwd = [&](int n) {
    args.n_extra_inputs = n;
    return jf_forward(s, &args, nullptr, nullptr);
  };
  CHECK(fwd(0) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() ==
        "sequence 'sequence' takes 1 extra input(s) (the labels of "
        "cross_entropy), got 0");
  labels.t.dtype = {kDLFloat, 32, 1};
  CHECK(fwd(1) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() ==
        "tensor 'labels: extra input 0 (op 0)': expected dtype int64 "
        "for the labels (the op's \"label_dtype\"), "
        "got float32");
  labels.t.dtype = kI32;
  CHECK(fwd(1) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() ==
        "tensor 'labels: extra input 0 (op 0)': expected dtype int64 for the "
        "labels (the op's \"label_dtype\"), "
        "got int32; set \"label_dtype\": \"int32\" on the op to pass these");
  labels.t.dtype = kI64;
  labels.shape[0] = 8;
  CHECK(fwd(1) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() ==
        "tensor 'labels: extra input 0 (op 0)': expected shape 4 "
        "(one per row of the op's input), got 8");
  labels.t.ndim = 2;
  labels.shape[0] = 4;
  labels.shape[1] = 1;
  CHECK(fwd(1) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() ==
        "tensor 'labels: extra input 0 (op 0)': expected shape 4 "
        "(one per row of the op's input), got 4x1");
  labels.t.ndim = 1;
  labels.t.device = {kDLCPU, 0};
  CHECK(fwd(1) == JF_ERR_INVALID_ARGUMENT);
  CHECK_THAT(last(), Catch::StartsWith("tensor 'extra input 0' must be in CUDA device memory"));
  labels.t.device = {kDLCUDA, 1};
  CHECK(fwd(1) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() ==
        "tensor 'labels: extra input 0 (op 0)' is on device 2:1, the "
        "input on 2:0: pass them on one GPU");
  labels.t.device = {kDLCUDA, 0};
  labels.t.byte_offset = 4;
  CHECK(fwd(1) == JF_ERR_INVALID_ARGUMENT);
  CHECK_THAT(last(), Catch::StartsWith("tensor 'labels: extra input 0 (op 0)': data at 0x") &&
                         Catch::EndsWith("is not aligned to its 8-byte elements"));
  labels.t.byte_offset = 0;
  labels.strides[0] = 2;
  labels.t.strides = labels.strides;
  CHECK(fwd(1) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() ==
        "tensor 'labels: extra input 0 (op 0)' is not contiguous "
        "(stride 2 of dim 0); pass a contiguous tensor");
  labels.t.strides = nullptr;
  extras[0] = nullptr;
  CHECK(fwd(1) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() == "tensor 'extra input 0' is NULL");
  extras[0] = &labels.t;
  // Right labels get past their check: what fails next is the output written over them.
  out.t.data = labels.storage;
  CHECK(fwd(1) == JF_ERR_INVALID_ARGUMENT);
  CHECK_THAT(last(), Catch::Contains("'labels: extra input 0 (op 0)'") && Catch::Contains("'output'") &&
                         Catch::Contains("overlaps"));
  out.t.data = out.storage;
  jf_sequence_destroy(s);

  // int32 labels with "label_dtype": "int32"; the backward reads them again and takes no gradient for them.
  REQUIRE(jf_sequence_create(ctx, R"({"ops": [{"op": "cross_entropy", "reduction": "none", "label_dtype": "int32"}]})",
                             "bf16", &s) == JF_OK);
  Tensor l32(1, kI32), y(1, kBf16), dy(1, kBf16), dx(2, kBf16), bogus(1, kBf16);
  l32.shape[0] = y.shape[0] = dy.shape[0] = bogus.shape[0] = 4;
  const DLTensor* extras32[1] = {&l32.t};
  DLTensor* grad_extras[1] = {&bogus.t};
  jf_backward_args ba{};
  ba.input = &in.t;
  ba.extra_inputs = extras32;
  ba.n_extra_inputs = 1;
  ba.output = &y.t;
  ba.grad_output = &dy.t;
  ba.grad_input = &dx.t;
  ba.grad_extra_inputs = grad_extras;
  ba.n_grad_extra_inputs = 1;
  CHECK(jf_backward(s, &ba, nullptr) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() ==
        "grad extra input 0 must be NULL: extra input 0 holds "
        "integers (cross_entropy's labels, moe_permute's indices), which have no "
        "gradient");
  grad_extras[0] = nullptr;
  dx.t.data = l32.storage;  // past the labels' checks: the gradient written over them
  CHECK(jf_backward(s, &ba, nullptr) == JF_ERR_INVALID_ARGUMENT);
  CHECK_THAT(last(), Catch::Contains("'labels: extra input 0 (op 0)'") && Catch::Contains("'grad_input'"));
  l32.t.dtype = kI64;
  CHECK(jf_backward(s, &ba, nullptr) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() ==
        "tensor 'labels: extra input 0 (op 0)': expected dtype int32 for the "
        "labels (the op's \"label_dtype\"), "
        "got int64; set \"label_dtype\": \"int64\" on the op to pass these");
  jf_sequence_destroy(s);
  jf_context_destroy(ctx);
}

TEST_CASE("C ABI: moe indices and probabilities are checked and the probabilities take a gradient", "[api][untrusted]") {
  jf_context ctx = nullptr;
  REQUIRE(jf_context_create(&ctx) == JF_OK);
  jf_sequence s = nullptr;
  REQUIRE(jf_sequence_create(ctx, R"({"ops": [{"op": "moe_permute", "num_experts": 4, "top_k": 2},
      {"op": "moe_unpermute"}]})", "bf16", &s) == JF_OK);
  Tensor in(2, kBf16), out(2, kBf16), idx(2, kI64), probs(2, {kDLFloat, 32, 1});
  idx.shape[1] = probs.shape[1] = 2;
  const DLTensor* extras[2] = {&idx.t, &probs.t};
  jf_forward_args args{};
  args.input = &in.t;
  args.output = &out.t;
  args.extra_inputs = extras;
  args.n_extra_inputs = 1;
  CHECK(jf_forward(s, &args, nullptr, nullptr) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() == "sequence 'sequence' takes 2 extra input(s) (the routing indices and probabilities of moe_permute "
                  "/ moe_unpermute), got 1");
  args.n_extra_inputs = 2;
  idx.t.dtype = kI32;
  CHECK(jf_forward(s, &args, nullptr, nullptr) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() == "tensor 'extra input 0 (op 0)': expected dtype int64 for the indices (the op's \"index_dtype\"), got "
                  "int32; set \"index_dtype\": \"int32\" on the op to pass these");
  idx.t.dtype = kI64;
  probs.t.dtype = kBf16;
  CHECK(jf_forward(s, &args, nullptr, nullptr) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() == "tensor 'extra input 1 (op 1)': expected dtype fp32 for the probs, got bfloat16");
  probs.t.dtype = {kDLFloat, 32, 1};
  probs.shape[1] = 3;
  CHECK(jf_forward(s, &args, nullptr, nullptr) == JF_ERR_INVALID_ARGUMENT);
  CHECK_THAT(last(), Catch::StartsWith("tensor 'extra input 1 (op 1)': expected shape 4x2"));
  probs.shape[1] = 2;
  // The backward: NULL for the indices' gradient, an fp32 [T, k] tensor for the probabilities'.
  Tensor dy(2, kBf16), dx(2, kBf16), dprobs(2, {kDLFloat, 32, 1});
  dprobs.shape[1] = 2;
  DLTensor* grad_extras[2] = {nullptr, nullptr};
  jf_backward_args ba{};
  ba.input = &in.t;
  ba.extra_inputs = extras;
  ba.n_extra_inputs = 2;
  ba.output = &out.t;
  ba.grad_output = &dy.t;
  ba.grad_input = &dx.t;
  ba.grad_extra_inputs = grad_extras;
  ba.n_grad_extra_inputs = 2;
  CHECK(jf_backward(s, &ba, nullptr) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() == "tensor 'grad extra input 1' is NULL");
  grad_extras[0] = &dprobs.t;
  CHECK(jf_backward(s, &ba, nullptr) == JF_ERR_INVALID_ARGUMENT);
  CHECK_THAT(last(), Catch::StartsWith("grad extra input 0 must be NULL"));
  jf_sequence_destroy(s);
  jf_context_destroy(ctx);
}
