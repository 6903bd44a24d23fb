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
nlohmann::json groups_json(const std::vector<Group>& groups, const std::vector<ops::Op>& ops);
// {"ops": [...], "decisions": [...], "forward": [...], "backward": [...]}
nlohmann::json plan_json(const Plan& plan, const std::vector<ops::Op>& ops);

}  // namespace jitfuse::fuser
