// JSON and text forms of fusion decisions.
#include "fuser/explain.hpp"

#include <fmt/format.h>

namespace jitfuse::fuser {

std::string impl_text(const Group& g) { return impl_text(g.impl); }

std::string impl_text(const rules::Impl& i) {
  switch (i.kind) {
    case rules::Impl::Kind::unfused: return "unfused";
    case rules::Impl::Kind::generated: return "generated " + i.skeleton;
    case rules::Impl::Kind::cublaslt:
      return fmt::format("cublaslt {} ({} ops){}", i.epilogue, i.epilogue_ops, i.tail.empty() ? "" : " + " + i.tail + " tail");
    case rules::Impl::Kind::joint: {
      std::string saves;
      for (const auto& s : i.saves) saves += (saves.empty() ? "" : ", ") + s;
      return fmt::format("joint {} (saves {})", i.strategy, saves.empty() ? "nothing" : saves);
    }
  }
  return "?";
}

std::string group_ops(const Group& g, const std::vector<ops::Op>& ops) {
  std::string out;
  for (int i = g.begin; i < g.end; ++i) out += (out.empty() ? "" : " ") + ops[i].kind;
  return out;
}

namespace {
// A parallel linear's shards and a comm op's collectives (docs/parallel.md).
std::string parallel_text(const ops::Op& op) {
  if (op.kind == "moe_dispatch" || op.kind == "moe_combine") {
    const int64_t experts = op.kind == "moe_dispatch" ? op.route_experts : op.route_experts * op.world_size;
    return fmt::format("{} the rows of {} experts {} the ranks owning them ({} each, all_to_all over group '{}' of {}; "
                       "backward: the other way){}",
                       op.kind == "moe_dispatch" ? "sends" : "brings back", experts,
                       op.kind == "moe_dispatch" ? "to" : "from", experts / op.world_size, op.str("group"),
                       op.world_size, op.kind == "moe_dispatch" ? fmt::format(", at most {} rows received",
                                                                             ops::rows_of(op.out)) : "");
  }
  if (op.family == ops::Family::comm) {
    std::string what = op.kind == "all_gather"       ? "gathers dim 0 (backward: reduce-scatters)"
                       : op.kind == "reduce_scatter" ? "reduce-scatters dim 0 (backward: gathers)"
                       : op.str("direction") == "forward" ? "sums over ranks (backward: identity)"
                                                          : "identity (backward: sums over ranks)";
    return fmt::format("{} over group '{}' of {}{}", what, op.str("group"), op.world_size,
                       op.inserted_for >= 0 ? fmt::format(", inserted for op {}", op.inserted_for) : "");
  }
  if (op.family != ops::Family::linear || !op.attrs.contains("tensor_parallel")) return "";
  return fmt::format("{}-parallel{}, group '{}', weight shard {}", op.str("tensor_parallel"),
                     op.flag("sequence_parallel") ? " + sequence-parallel" : "", op.str("group"),
                     ops::shape_str(op.params.at(0).shape));
}
}  // namespace

std::string op_wiring(const ops::Op& op, const std::vector<ops::Op>& ops) {
  if (std::string par = parallel_text(op); !par.empty()) return par;
  if (op.extra_input) {  // an op's own extra input (cross_entropy's labels, moe's indices and probabilities)
    std::string route = op.route_op >= 0 ? fmt::format(", the routing of op {}", op.route_op) : "";
    return fmt::format("<- {}: extra input {} ({} {}, {}{})", op.extra_input->name, op.extra_slot,
                       ops::dtype_name(op.extra_input->dtype), ops::shape_str(op.extra_input->shape),
                       op.info && op.info->extra_input_grad ? "with a gradient" : "no gradient", route);
  }
  const bool fork = op.family == ops::Family::make_extra_output, reader = op.family == ops::Family::add_extra_input;
  if (!fork && !reader) return "";
  const std::string slot = op.extra_slot < 0 ? ""
                           : fmt::format("{} {}", fork ? "extra output" : "extra input", op.extra_slot);
  if (op.channel.empty()) return slot;
  if (fork) return fmt::format("-> channel '{}'{}", op.channel, slot.empty() ? " (hidden)" : ", also " + slot);
  const ops::Op& src = ops.at(static_cast<size_t>(op.channel_src));
  std::string from = src.family == ops::Family::make_extra_output ? fmt::format("from op {}", src.index)
                                                                  : fmt::format("extra input {}", src.extra_slot);
  return fmt::format("<- channel '{}' ({}{})", op.channel, from, op.grad_accumulate ? "; backward adds its gradient" : "");
}

nlohmann::json op_wiring_json(const ops::Op& op) {
  nlohmann::json j = nlohmann::json::object();
  if (op.family == ops::Family::comm || (op.family == ops::Family::linear && op.attrs.contains("tensor_parallel"))) {
    j["group"] = op.str("group");
    j["world_size"] = op.world_size;
    j["rank"] = op.rank;
    if (op.inserted_for >= 0) j["inserted_for"] = op.inserted_for;
  }
  if (op.extra_slot >= 0) j["extra_slot"] = op.extra_slot;
  if (op.channel.empty()) return j;
  j["channel"] = op.channel;
  if (op.family == ops::Family::make_extra_output) j["returned"] = op.returned;
  if (op.family == ops::Family::add_extra_input) {
    j["source"] = op.channel_src;
    j["grad_accumulate"] = op.grad_accumulate;
  }
  return j;
}

std::vector<Apart> kept_apart(const Plan& plan, const std::vector<ops::Op>& ops, rules::Pass pass) {
  const auto& groups = pass == rules::Pass::backward ? plan.backward : plan.forward;
  std::vector<Apart> out;
  for (const auto& g : groups) {
    const int i = g.end - 1;  // the last op of a group and the first of the next
    if (i + 1 >= static_cast<int>(ops.size())) continue;
    std::string why;
    for (const auto& d : plan.decisions)
      if ((d.pass == pass || d.pass == rules::Pass::joint) && !d.taken && d.begin <= i && d.end > i + 1) {
        const std::string one = d.rule + ": " + d.reason;
        if (why.find(one) == std::string::npos) why += (why.empty() ? "" : "; ") + one;
      }
    if (why.empty())
      why = fmt::format("no rule of the {} pass matches a window holding both", rules::pass_name(pass));
    out.push_back({i, why});
  }
  return out;
}

nlohmann::json groups_json(const std::vector<Group>& groups, const std::vector<ops::Op>& ops) {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& g : groups) {
    nlohmann::json kinds = nlohmann::json::array();
    for (int i = g.begin; i < g.end; ++i) kinds.push_back(ops[i].kind);
    out.push_back({{"begin", g.begin}, {"end", g.end}, {"ops", kinds}, {"rule", g.rule}, {"priority", g.priority},
                   {"impl", impl_text(g)}, {"joint", g.joint}});
  }
  return out;
}

nlohmann::json plan_json(const Plan& p, const std::vector<ops::Op>& ops) {
  nlohmann::json out;
  out["ops"] = nlohmann::json::array();
  for (const auto& op : ops) {
    nlohmann::json j = {{"index", op.index}, {"op", op.kind}, {"in", op.in}, {"out", op.out}};
    j.update(op_wiring_json(op));
    out["ops"].push_back(std::move(j));
  }
  out["decisions"] = nlohmann::json::array();
  for (const auto& d : p.decisions) {
    nlohmann::json j = {{"pass", rules::pass_name(d.pass)}, {"rule", d.rule}, {"begin", d.begin},
                        {"end", d.end}, {"priority", d.priority}, {"taken", d.taken}, {"reason", d.reason}};
    if (!d.match.empty()) {  // rules with a class or repeated element: which element took which ops
      j["match"] = nlohmann::json::array();
      for (const auto& m : d.match) {
        nlohmann::json kinds = nlohmann::json::array();
        for (int i = m.begin; i < m.end; ++i) kinds.push_back(ops[i].kind);
        j["match"].push_back({{"element", m.element}, {"begin", m.begin}, {"end", m.end}, {"ops", kinds}});
      }
    }
    out["decisions"].push_back(j);
  }
  out["forward"] = groups_json(p.forward, ops);
  out["backward"] = groups_json(p.backward, ops);
  for (auto pass : {rules::Pass::forward, rules::Pass::backward}) {
    nlohmann::json apart = nlohmann::json::array();
    for (const auto& a : kept_apart(p, ops, pass))
      apart.push_back({{"ops", {a.left, a.left + 1}}, {"why", a.why}});
    out[rules::pass_name(pass) + "_apart"] = apart;
  }
  return out;
}

}  // namespace jitfuse::fuser
