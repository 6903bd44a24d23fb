// The moe ops' kernels as steps (moe.hpp). Every kernel of the moe skeleton has a fixed grid and reads the
// routing the moe_permute's kernels wrote on the device: no step depends on how many rows an expert got.
#include "exec/lower/impl/moe.hpp"

#include <fmt/format.h>

#include "exec/lower/impl/registrar.hpp"

namespace jitfuse::exec {
namespace {

using K = codegen::MoeSpec::Kernel;

const char* kernel_label(K k) {
  switch (k) {
    case K::count: return "count";
    case K::scan: return "scan";
    case K::scatter: return "scatter";
    case K::permute: return "permute";
    case K::permute_bwd: return "permute";
    case K::unpermute: return "unpermute";
    case K::unpermute_bwd: return "unpermute";
  }
  return "?";
}

codegen::KernelSpec spec_of(const Builder& b, int i, K kernel) {
  const ops::Op& op = b.ops().at(static_cast<size_t>(i));
  const int route = op.kind == "moe_permute" ? i : op.route_op;
  const ops::Op& perm = b.ops().at(static_cast<size_t>(route));
  codegen::KernelSpec s;
  s.skeleton = codegen::Skeleton::moe;
  s.dir = b.forward() ? codegen::Direction::forward : codegen::Direction::backward;
  s.dtype = ops::dtype_name(b.recipe().dtype);
  s.cols = ops::cols_of(op.in);  // permute: the tokens' hidden size; unpermute: the experts' output width
  s.vec = s.cols % 8 == 0;
  s.rule = b.group().rule;
  s.label = std::string("moe_") + kernel_label(kernel);
  codegen::MoeSpec m;
  m.kernel = kernel;
  m.op = i;
  m.route_op = route;
  m.experts = perm.attrs.at("num_experts").get<int64_t>();
  m.topk = perm.attrs.at("top_k").get<int64_t>();
  m.capacity = perm.attrs.at("capacity").get<int64_t>();
  m.idx_i64 = perm.str("index_dtype") == "int64";
  m.probs_f32 = true;
  m.padded = perm.str("layout") == "padded";
  s.moe = m;
  return s;
}

// Rule skeleton "moe" (fusion_rules/moe.json, moe_unpermute_residual): [moe_unpermute, add_extra_input] in the
// forward as one kernel, the residual (the add's extra input or channel) added to the combined rows as they are
// written. The backward runs unfused (the add's gradient passes through; the unpermute's as alone).
class GeneratedMoe final : public Implementation {
 public:
  rules::Impl::Kind kind() const override { return rules::Impl::Kind::generated; }
  std::string name() const override { return "moe"; }
  std::string covers_text() const override { return "forward [moe_unpermute, add_extra_input]"; }
  std::optional<std::string> check(const std::vector<OpUse>& w, const rules::Impl&, rules::Pass pass) const override {
    if (pass != rules::Pass::forward) return "the moe skeleton fuses in the forward pass";
    if (w.size() != 2 || w[0].name() != "moe_unpermute" || w[1].family() != ops::Family::add_extra_input)
      return "the moe skeleton implements " + covers_text();
    return std::nullopt;
  }
  void lower(Builder& b, const rules::Impl&) const override {
    const auto& g = b.group();
    const int un = g.begin, add = g.begin + 1;
    codegen::KernelSpec s = spec_of(b, un, K::unpermute);
    s.moe->residual = true;
    s.moe->residual_op = add;
    const std::string who = g.rule + ": " + b.ops()[static_cast<size_t>(un)].label();
    b.kernel(s, b.kernel_meta(un, "forward"), b.act(un), b.act(g.end),
             ops::rows_of(b.ops()[static_cast<size_t>(un)].out),
             who + ": y[t] = sum_j probs[t, j] x[dest(t, j)] + the residual of " + b.ops()[static_cast<size_t>(add)].label());
    b.boundary_saves(g.begin, g.end);
  }
};

const Registrar kRegistered(std::make_unique<GeneratedMoe>());

}  // namespace

void lower_moe(Builder& b, int i) {
  const ops::Op& op = b.ops().at(static_cast<size_t>(i));
  const std::string who = b.rule_or_unfused() + ": " + op.label();
  const nlohmann::json meta = b.kernel_meta(i, b.forward() ? "forward" : "backward");
  const bool permute = op.kind == "moe_permute";
  const int64_t tokens = ops::rows_of(permute ? op.in : op.out);
  if (!b.forward()) {
    b.kernel(spec_of(b, i, permute ? K::permute_bwd : K::unpermute_bwd), meta, b.grad_of(i + 1), b.grad_of(i), tokens,
             who + (permute ? ": dx[t] = sum over its slots of dy[dest(t, j)]"
                            : ": dx[dest(t, j)] = probs[t, j] dy[t], dprobs[t, j] = <dy[t], x[dest(t, j)]>"));
    return;
  }
  if (permute) {
    const int64_t k = op.attrs.at("top_k").get<int64_t>(), e = op.attrs.at("num_experts").get<int64_t>();
    const int64_t ints = codegen::moe_route_ints(tokens, k, e, ops::rows_of(op.out));
    const size_t bytes = static_cast<size_t>(ints) * 4;
    if (b.training()) {
      b.saved_new(i, Key::route, ops::DType::i32, 1, ints, bytes);
    } else {  // no backward: the routing lives as long as the unpermute that reads it
      b.provide_saved(i, Key::route, b.temp(fmt::format("routing op{}", i), ops::DType::i32, 1, ints, bytes));
    }
    b.kernel(spec_of(b, i, K::count), meta, -1, -1, tokens, who + ": tokens per expert, per chunk of 1024 slots");
    b.kernel(spec_of(b, i, K::scan), meta, -1, -1, tokens,
             who + (op.attrs.at("capacity").get<int64_t>() < 0 ? ": rows per expert and their starts"
                                                               : ": rows per expert (capped by the capacity), starts"));
    b.kernel(spec_of(b, i, K::scatter), meta, -1, -1, tokens, who + ": each slot's row (by expert, token, slot)");
    b.kernel(spec_of(b, i, K::permute), meta, b.act(i), b.act(i + 1), tokens,
             who + ": rows to expert order, zero past the kept rows");
  } else {
    b.kernel(spec_of(b, i, K::unpermute), meta, b.act(i), b.act(i + 1), tokens,
             who + ": y[t] = sum_j probs[t, j] x[dest(t, j)]");
  }
  b.boundary_saves(i, i + 1);
}

}  // namespace jitfuse::exec
