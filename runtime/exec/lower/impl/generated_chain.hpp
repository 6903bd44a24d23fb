// The base of the generated-skeleton implementations (elementwise, gated, rownorm): a chain of non-GEMM
// ops in one generated kernel, in the forward or the backward pass.
#pragma once
#include "exec/lower/impl/implementation.hpp"
#include "exec/lower/lowering.hpp"

namespace jitfuse::exec {

class GeneratedChain : public Implementation {
 public:
  explicit GeneratedChain(codegen::Skeleton sk) : sk_(sk) {}
  rules::Impl::Kind kind() const override { return rules::Impl::Kind::generated; }
  std::string name() const override { return codegen::skeleton_name(sk_); }
  std::optional<std::string> check(const std::vector<OpUse>& w, const rules::Impl& impl,
                                   rules::Pass pass) const override;
  void lower(Builder& b, const rules::Impl& impl) const override;

 private:
  codegen::Skeleton sk_;
};

// The builder's whole group as one generated chain with `opt` (also how unfused non-GEMM ops and joint
// chains lower): the forward saves what the group's ops save at its boundaries.
void lower_generated_group(Builder& b, const ChainOptions& opt);

}  // namespace jitfuse::exec
