// cuda::operand_alignment (runtime/cuda/cublaslt.hpp): the MIN_ALIGNMENT preferences Blas gives cuBLASLt
// count the leading dimension, so an odd in_features asks for an algorithm that loads 2-byte aligned rows.
#include <catch2/catch.hpp>

#include "cuda/cublaslt.hpp"

using jitfuse::cuda::operand_alignment;

namespace {
const void* P(uintptr_t v) { return reinterpret_cast<const void*>(v); }
}  // namespace

TEST_CASE("operand_alignment: the pointer's alignment, capped by the leading dimension's bytes", "[cuda]") {
  // The pointer alone (ld 0), capped at 16.
  CHECK(operand_alignment(P(256), 0, 2) == 16);
  CHECK(operand_alignment(P(256 + 8), 0, 2) == 8);
  CHECK(operand_alignment(P(256 + 2), 0, 2) == 2);
  CHECK(operand_alignment(nullptr, 0, 2) == 16);
  // Leading dimensions that keep every row 16-byte aligned: bf16 K = 64, fp32 K = 4, FP8 K = 16.
  CHECK(operand_alignment(P(256), 64, 2) == 16);
  CHECK(operand_alignment(P(256), 4, 4) == 16);
  CHECK(operand_alignment(P(256), 16, 1) == 16);
  // Odd K: bf16 rows at 2-byte offsets, fp32 rows at 4-byte offsets; K = 100 in bf16 is 200 bytes (8).
  for (int64_t k : {1, 5, 7, 13}) {
    INFO("K = " << k);
    CHECK(operand_alignment(P(256), k, 2) == 2);
    CHECK(operand_alignment(P(256), k, 4) == 4);
  }
  CHECK(operand_alignment(P(256), 100, 2) == 8);
  CHECK(operand_alignment(P(256), 100, 4) == 16);
  CHECK(operand_alignment(P(256), 6, 2) == 4);
  // The lesser of the two.
  CHECK(operand_alignment(P(256 + 4), 64, 2) == 4);
  CHECK(operand_alignment(P(256 + 8), 2, 2) == 4);
}
