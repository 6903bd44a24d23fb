// Window helpers shared by every implementation: op uses from patterns or sequences, kind matching, the
// generated-chain predicate, and operands by role.
#include <algorithm>

#include <fmt/format.h>

#include "common/error.hpp"
#include "exec/lower/impl/implementation.hpp"

namespace jitfuse::exec {

using ops::Family;

std::string OpUse::str(const char* attr, const std::string& otherwise) const {
  if (!attrs || !attrs->is_object()) return otherwise;
  auto it = attrs->find(attr);
  return it != attrs->end() && it->is_string() ? it->get<std::string>() : otherwise;
}

std::vector<OpUse> window_of(const std::vector<ops::Op>& ops, int b, int e) {
  std::vector<OpUse> w;
  for (int i = b; i < e; ++i)
    w.push_back({ops[i].info, &ops[i].attrs, &ops[i], i + 1 < static_cast<int>(ops.size()) ? &ops[i + 1] : nullptr});
  return w;
}

std::optional<std::string> expect_kinds(const std::vector<OpUse>& w, size_t from,
                                        const std::vector<std::vector<std::string>>& kinds, const std::string& who) {
  bool ok = w.size() >= from + kinds.size();
  std::string want, got;
  for (size_t i = 0; i < kinds.size(); ++i) {
    std::string alt;
    for (const auto& k : kinds[i]) alt += (alt.empty() ? "" : "|") + k;
    want += (want.empty() ? "" : " ") + alt;
    const bool have = from + i < w.size();
    got += (got.empty() ? "" : " ") + (have ? w[from + i].name() : std::string("<end>"));
    if (have && std::find(kinds[i].begin(), kinds[i].end(), w[from + i].name()) == kinds[i].end()) ok = false;
  }
  if (ok) return std::nullopt;
  return who + " implements [" + want + "], the window starts with [" + got + "]";
}

std::optional<std::string> chain_problem(const std::vector<OpUse>& w, size_t from, codegen::Skeleton* skeleton) {
  using codegen::Skeleton;
  Skeleton sk = Skeleton::elementwise;
  int anchor = -1;
  const int n = static_cast<int>(w.size());
  for (int i = static_cast<int>(from); i < n; ++i) {
    const OpUse& u = w[i];
    if (u.family() == Family::linear) return "a generated kernel cannot run linear";
    if (u.family() == Family::comm) return "a collective runs on NCCL (a comm step), not in a generated kernel";
    if (u.family() == Family::loss) return u.name() + " runs as kernels of its own (the cross_entropy skeleton)";
    if (u.name() == "reshape" && n - static_cast<int>(from) > 1) return "reshape changes the column layout and runs alone";
    if (u.family() == Family::norm || u.family() == Family::gated) {
      if (anchor >= 0) return "two anchors (" + w[anchor].name() + ", " + u.name() + ") in one kernel";
      anchor = i;
      sk = u.family() == Family::norm ? Skeleton::rownorm : Skeleton::gated;
    }
  }
  for (int i = static_cast<int>(from); i < n; ++i)  // one kernel's pointers are __restrict__: never alias
    for (int j = i + 1; j < n && w[i].op && !w[i].op->channel.empty(); ++j)
      if (w[j].op && w[j].op->channel == w[i].op->channel)
        return "ops " + std::to_string(w[i].op->index) + " and " + std::to_string(w[j].op->index) + " use channel '" +
               w[i].op->channel + "': one kernel does not both write and read a channel (they run apart)";
  for (int i = static_cast<int>(from); i < n; ++i) {
    if (sk == Skeleton::rownorm && w[i].family() == Family::bias) return "a rownorm kernel holds no bias stage";
    if (sk == Skeleton::gated && i < anchor && w[i].family() == Family::dropout)
      return "dropout before a gated op would split mask bytes";
  }
  if (skeleton) *skeleton = sk;
  return std::nullopt;
}

std::string mib(double bytes) { return fmt::format("{:.1f} MiB", bytes / (1024.0 * 1024.0)); }

int role(const Builder& b, Family family, int nth) {
  const auto& g = b.group();
  for (int i = g.begin; i < g.end; ++i)
    if (b.ops()[i].family == family && nth-- == 0) return i;
  fail(Status::internal, "group [{}, {}) of rule '{}' has no {} operand", g.begin, g.end, g.rule,
       ops::family_name(family));
}

}  // namespace jitfuse::exec
