// Generated chains: the predicate shared by the three skeletons and their lowering.
#include "exec/lower/impl/generated_chain.hpp"

namespace jitfuse::exec {

std::optional<std::string> GeneratedChain::check(const std::vector<OpUse>& w, const rules::Impl&,
                                                 rules::Pass pass) const {
  if (pass == rules::Pass::joint) return "a generated skeleton runs in the forward or backward pass, not joint";
  codegen::Skeleton sk;
  if (auto p = chain_problem(w, 0, &sk)) return p;
  if (sk != sk_)
    return "the ops need the " + codegen::skeleton_name(sk) + " skeleton, the rule names " + codegen::skeleton_name(sk_);
  return std::nullopt;
}

void lower_generated_group(Builder& b, const ChainOptions& opt) {
  const auto& g = b.group();
  lower_chain(b, g.begin, g.end, opt, ops::rows_of(b.ops()[g.begin].in));
  if (b.forward()) b.boundary_saves(g.begin, g.end);
}

void GeneratedChain::lower(Builder& b, const rules::Impl&) const { lower_generated_group(b, chain_options(b)); }

}  // namespace jitfuse::exec
