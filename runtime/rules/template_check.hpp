// `rules validate`'s compile check of user-declared ops: each op's functor is compiled with NVRTC in a
// small harness (no GPU needed), and compiler errors in a template are mapped back to its file:line.
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "rules/rule.hpp"

namespace jitfuse::rules {

// Compiles every user-declared op of `rs` whose declaration lies in a file `selected` accepts (all if
// empty) for `arch` ("sm_90a"). Returns one LoadError per op that does not compile, located at the op's
// declaration, its message naming "template.cuh:line: <error>" and quoting that line.
std::vector<LoadError> compile_user_ops(const RuleSet& rs, const std::string& arch,
                                        const std::function<bool(const std::string& file)>& selected = {});

// Rewrites an NVRTC log: a line "<key>(N): error: ..." about user template `key` (e.g. "user/x.cuh")
// becomes "<path>:N: error: ..." followed by "    N | <that line of the template>". Other lines stay.
std::string map_template_log(const std::string& log, const std::string& key, const std::string& path,
                             const std::string& template_text);

}  // namespace jitfuse::rules
