// Rule skeleton "allreduce_rownorm" (fusion_rules/forward_norm.json, allreduce_fork_norm): a forward
// [all_reduce, add_extra_input?, make_extra_output, layernorm|rmsnorm] — a row-parallel layer's partial sums, the
// residual, the new residual and the next norm (vLLM's all-reduce + residual + RMSNorm) — as ONE generated rownorm
// kernel whose input is the sum over the ranks' buffers, read over NVLink from the communicator's peer workspace
// (cuda/peers.hpp; the one-shot all-reduce of templates/skeletons/peer.cuh). The group keeps NCCL's way beside it
// (the all-reduce as a comm step, then the fork_norm kernel): prepare picks one (Step::peer_path), so a group whose
// ranks cannot map each other's buffers, or JITFUSE_PEER_ALLREDUCE=0, runs as before. Inputs larger than the staging
// regions (codegen::peer_rows_fit) take NCCL's way alone; at world size 1 the all-reduce is the identity.
// The backward runs as the ops' own (the all-reduce's is the identity).
#include "common/error.hpp"
#include "exec/lower/impl/comm.hpp"
#include "exec/lower/impl/generated_chain.hpp"
#include "exec/lower/impl/registrar.hpp"

namespace jitfuse::exec {
namespace {

class GeneratedAllReduceNorm final : public Implementation {
 public:
  rules::Impl::Kind kind() const override { return rules::Impl::Kind::generated; }
  std::string name() const override { return "allreduce_rownorm"; }
  std::string covers_text() const override {
    return "forward [all_reduce, add_extra_input?, make_extra_output, layernorm|rmsnorm]";
  }
  std::optional<std::string> check(const std::vector<OpUse>& w, const rules::Impl&, rules::Pass pass) const override {
    if (pass != rules::Pass::forward) return "the allreduce_rownorm skeleton fuses in the forward pass";
    if (w.size() < 3 || w[0].name() != "all_reduce") return "the allreduce_rownorm skeleton implements " + covers_text();
    if (w[0].str("direction", "forward") != "forward")
      return "its all_reduce must sum in the forward (\"direction\": \"forward\"); a backward all-reduce is the "
             "identity here";
    if (w.back().family() != ops::Family::norm || w[w.size() - 2].family() != ops::Family::make_extra_output)
      return "the allreduce_rownorm skeleton implements " + covers_text();
    codegen::Skeleton sk;
    if (auto p = chain_problem(w, 1, &sk)) return p;
    return std::nullopt;
  }

  void lower(Builder& b, const rules::Impl&) const override {
    const auto& g = b.group();
    const int ar = g.begin, e = g.end;
    const ops::Op& op = b.ops()[static_cast<size_t>(ar)];
    const int64_t rows = ops::rows_of(op.in), cols = ops::cols_of(op.in);
    const int world = b.world_size();
    const ChainOptions opt = chain_options(b);
    if (world == 1) {  // the sum over one rank: the norm chain reads the all-reduce's input
      lower_chain(b, ar + 1, e, opt, rows, b.act(ar));
      b.boundary_saves(ar, e);
      return;
    }
    const int64_t row_bytes = cols * ops::dtype_bytes(b.recipe().dtype);
    const bool peers = world <= codegen::kMaxPeers && codegen::peer_rows_fit(rows, row_bytes);
    if (peers) {
      const size_t from = b.steps();
      ChainOptions o = opt;
      o.vec = chain_vectorizable(b.ops(), ar, e);
      codegen::KernelSpec spec = chain_spec(b.ops(), ar + 1, e, o);
      spec.peers = world;
      spec.label = "allreduce_" + spec.label;
      b.kernel(spec, b.kernel_meta(ar, "forward"), b.act(ar), b.act(e), rows,
               fmt::format("{}: generated rownorm, one kernel: the all-reduce over {} ranks' buffers (one-shot, "
                           "peer-mapped over NVLink), then the ops after it", g.rule, world));
      b.mark_peer_path(from, 1);
    }
    const size_t from = b.steps();
    lower_comm(b, ar);
    lower_chain(b, ar + 1, e, opt, rows, b.act(ar + 1));
    if (peers) {
      b.note_last("the NCCL path, where the ranks cannot map each other's buffers");
      b.mark_peer_path(from, -1);
    } else {
      b.note_last(fmt::format("{} rows of {} bytes: more than the one-shot all-reduce stages ({} blocks of {} bytes), "
                              "NCCL's all-reduce first", rows, row_bytes, codegen::kPeerMaxBlocks, codegen::kPeerBlockBytes));
    }
    b.boundary_saves(ar, e);
  }
};

const Registrar kRegistered(std::make_unique<GeneratedAllReduceNorm>());

}  // namespace
}  // namespace jitfuse::exec
