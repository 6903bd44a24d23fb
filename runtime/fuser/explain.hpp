// Rendering a Plan's decisions and groups as JSON and text: shared by `jitfuse explain`, the C ABI's
// jf_sequence_explain and the debug log.
#pragma once
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "fuser/plan.hpp"

namespace jitfuse::fuser {

std::string impl_text(const rules::Impl& impl);
std::string impl_text(const Group& g);
std::string group_ops(const Group& g, const std::vector<ops::Op>& ops);
// How an extra-tensor op is wired: "extra input 0", "-> channel 'residual'", "<- channel 'residual' (op 0)",
// "" for other ops. What explain prints beside each op; the JSON form is op_wiring_json.
std::string op_wiring(const ops::Op& op, const std::vector<ops::Op>& ops);
nlohmann::json op_wiring_json(const ops::Op& op);
// Adjacent ops that the final groups of `pass` keep apart, each with why: the reasons of the rules whose
// windows held both and were not taken, or that no rule of the pass matches a window holding both.
struct Apart {
  int left = 0;  // ops left and left + 1
  std::string why;
};
std::vector<Apart> kept_apart(const Plan& plan, const std::vector<ops::Op>& ops, rules::Pass pass);
nlohmann::json groups_json(const std::vector<Group>& groups, const std::vector<ops::Op>& ops);
// {"ops": [...], "decisions": [...], "forward": [...], "backward": [...]}
nlohmann::json plan_json(const Plan& plan, const std::vector<ops::Op>& ops);

}  // namespace jitfuse::fuser
