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
  for (const auto& op : ops) out["ops"].push_back({{"index", op.index}, {"op", op.kind}, {"in", op.in}, {"out", op.out}});
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
  return out;
}

}  // namespace jitfuse::fuser
