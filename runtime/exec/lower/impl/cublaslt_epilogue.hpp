// The base of the cuBLASLt epilogue implementations: the GEMM (and its epilogue) covers the first
// `epilogue_ops` ops of the window; a forward group may continue with a generated elementwise tail.
#pragma once
#include "exec/lower/impl/implementation.hpp"
#include "exec/lower/lowering.hpp"

namespace jitfuse::exec {

using Kinds = std::vector<std::vector<std::string>>;  // per window element: the op kinds allowed

class CublasEpilogue : public Implementation {
 public:
  rules::Impl::Kind kind() const override { return rules::Impl::Kind::cublaslt; }
  std::string covers_text() const override;
  std::optional<std::string> check(const std::vector<OpUse>& w, const rules::Impl& impl,
                                   rules::Pass pass) const override;
  void lower(Builder& b, const rules::Impl& impl) const override;

 protected:
  virtual rules::Pass pass() const = 0;
  virtual std::vector<Kinds> shapes() const = 0;  // the op runs it implements (one per epilogue_ops)
  // Attribute and shape conditions beyond the kinds (window: the GEMM's ops).
  virtual std::optional<std::string> extra(const std::vector<OpUse>&) const { return std::nullopt; }
  // Forward: the GEMM step of ops [begin, begin + epilogue_ops), writing `y`.
  virtual void forward(Builder&, int, int) const {}
  // Backward: the GEMM steps of the group (no tail in the backward).
  virtual void backward(Builder&) const {}
};

// The forward pass's saved copy of op `op`'s input, written by a GEMM epilogue (GELU_AUX*).
int epilogue_saved_input(Builder& b, int op);

// The shape condition of cuBLASLt's GELU epilogues for fp32/fp16/bf16 (cuBLASLt puts none on K or M, nor
// on the other epilogues jitfuse uses): the aux matrix (gelu's input, written by GELU_AUX*, read by DGELU_BGRAD) has the GEMM's D
// layout, and CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD "must be divisible by 8" (cublasLt.h). `ld` is that
// leading dimension (0: unknown, a pattern at load), `what` names it.
std::optional<std::string> gelu_aux_ld_problem(const std::string& epilogue, const char* role, int64_t ld,
                                               const char* what);

}  // namespace jitfuse::exec
