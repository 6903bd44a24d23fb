// codegen::generate: picks the skeleton emitter, and numbers the kernel's ops by their position in the
// kernel so that its source never depends on where its group sits in a sequence.
#include <algorithm>
#include <stdexcept>

#include "jitfuse/codegen/kernel_spec.hpp"

namespace jitfuse::codegen::detail {

Generated generate_rownorm(const KernelSpec& spec);
Generated generate_elementwise(const KernelSpec& spec);
Generated generate_cast_transpose(const KernelSpec& spec);
Generated generate_block_cast(const KernelSpec& spec);
Generated generate_cross_entropy(const KernelSpec& spec);
Generated generate_moe(const KernelSpec& spec);

namespace {

// The spec with every op index replaced by the op's position in the kernel (0, 1, ... in stage order:
// pre stages, the anchor, post stages, the FP8 cast); `seq[pos]` keeps the index in the sequence.
// Emitters name arguments, locals, comments and finalize kernels after these positions, so the same
// computation at layer 1 and at layer 64 is the same source: one cache key, one compile, one module.
KernelSpec by_position(const KernelSpec& spec, std::vector<int>& seq) {
  KernelSpec local = spec;
  auto renumber = [&](int& op) {
    if (op < 0) return;  // a spec built by hand without op indices keeps -1
    auto it = std::find(seq.begin(), seq.end(), op);
    if (it == seq.end()) it = seq.insert(seq.end(), op);
    op = static_cast<int>(it - seq.begin());
  };
  for (auto& s : local.pre) renumber(s.op);
  if (local.norm) renumber(local.norm->op);
  if (local.gated) renumber(local.gated->op);
  for (auto& s : local.post) renumber(s.op);
  if (local.fp8) renumber(local.fp8->op);
  if (local.ce) {
    renumber(local.ce->op);
    renumber(local.ce->src_op);
  }
  if (local.moe) {
    renumber(local.moe->op);
    renumber(local.moe->route_op);
    if (local.moe->residual_op >= 0) renumber(local.moe->residual_op);
  }
  return local;
}

}  // namespace
}  // namespace jitfuse::codegen::detail

namespace jitfuse::codegen {

Generated generate(const KernelSpec& spec) {
  if (spec.skeleton == Skeleton::rownorm && !spec.norm) throw std::invalid_argument("codegen: rownorm spec without a norm");
  if (spec.skeleton == Skeleton::gated && !spec.gated) throw std::invalid_argument("codegen: gated spec without a gate");
  if (spec.skeleton == Skeleton::cast_transpose) {
    if (!spec.fp8) throw std::invalid_argument("codegen: cast_transpose spec without an FP8 cast (KernelSpec::fp8)");
    if (spec.norm || (spec.gated && !spec.fp8->block))
      throw std::invalid_argument("codegen: a cast_transpose spec has no norm or gated anchor (its stages are all pre "
                                  "stages; a block-scaled cast alone takes a gated op's forward)");
    if (!spec.post.empty()) throw std::invalid_argument("codegen: a cast_transpose spec has no post stages (no anchor)");
    if (spec.fp8->codes_in && (!spec.pre.empty() || spec.fp8->amax_only))
      throw std::invalid_argument("codegen: a cast_transpose spec over codes (Fp8Spec::codes_in) has no stages and no amax pass");
  } else if (spec.fp8 && spec.fp8->block) {
    throw std::invalid_argument("codegen: a block-scaled cast (Fp8Spec::block) belongs to the cast_transpose skeleton");
  } else if (spec.fp8 && spec.fp8->codes_in) {
    throw std::invalid_argument("codegen: Fp8Spec::codes_in belongs to the cast_transpose skeleton");
  }
  if ((spec.skeleton == Skeleton::cross_entropy) != spec.ce.has_value())
    throw std::invalid_argument("codegen: a cross_entropy spec (KernelSpec::ce) belongs to the cross_entropy skeleton");
  if ((spec.skeleton == Skeleton::moe) != spec.moe.has_value())
    throw std::invalid_argument("codegen: a moe spec (KernelSpec::moe) belongs to the moe skeleton");
  if (spec.peers != 0 && spec.skeleton != Skeleton::rownorm)
    throw std::invalid_argument("codegen: a reduction over peers (KernelSpec::peers) belongs to the rownorm skeleton");
  std::vector<int> seq;
  const KernelSpec local = detail::by_position(spec, seq);
  Generated g = spec.skeleton == Skeleton::rownorm          ? detail::generate_rownorm(local)
                : spec.skeleton == Skeleton::cast_transpose ? (spec.fp8->block ? detail::generate_block_cast(local)
                                                                                : detail::generate_cast_transpose(local))
                : spec.skeleton == Skeleton::cross_entropy  ? detail::generate_cross_entropy(local)
                : spec.skeleton == Skeleton::moe            ? detail::generate_moe(local)
                                                            : detail::generate_elementwise(local);
  // Back to sequence indices: what the Builder binds each argument and each finalize kernel's gradient to.
  auto to_sequence = [&](int& op) {
    if (op >= 0) op = seq.at(static_cast<size_t>(op));
  };
  for (auto& a : g.args) to_sequence(a.op);
  for (auto& f : g.finalize) to_sequence(f.op);
  return g;
}

}  // namespace jitfuse::codegen
