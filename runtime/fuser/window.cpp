// The sliding-window loop, written once: every rule of a pass at every start, optional elements longest
// first, then conditions and legality, then a deterministic conflict resolution over the surviving windows.
#include "fuser/window.hpp"

#include <algorithm>
#include <functional>
#include <map>
#include <set>
#include <tuple>

#include <fmt/format.h>

#include "common/log.hpp"

namespace jitfuse::fuser::detail {
namespace {

using rules::PatternElem;
using rules::Rule;

std::string join(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& s : v) out += (out.empty() ? "" : ", ") + s;
  return out;
}

std::optional<std::string> attr_mismatch(const PatternElem& e, const ops::Op& op) {
  for (const auto& [key, want] : e.attrs.items()) {
    if (!op.attrs.is_object() || !op.attrs.contains(key))
      return fmt::format("{} has no attribute {}; the rule needs {} = {}", op.label(), key, key, want.dump());
    const auto& have = op.attrs.at(key);
    // 1 and 1.0 are the same attribute value, whichever way the JSON spelled them.
    bool same = want.is_number() && have.is_number() ? want.get<double>() == have.get<double>() : want == have;
    if (!same) return fmt::format("{} has {} = {}; the rule needs {}", op.label(), key, have.dump(), want.dump());
  }
  return std::nullopt;
}

bool accepts(const PatternElem& e, const ops::Op& op) { return e.accepts(op.info, op.kind); }

// Every way the pattern can match from `start`, by window end: one left-to-right pass over the ops with the
// set of pattern states (element, ops it has taken) reachable so far, at most 8 x 17 of them, so a rule at one
// start costs O(window) whatever its repetitions. An end is attribute-clean if any assignment of ops to
// elements reaching it satisfies every attribute constraint; else it keeps the first reason met.
void enumerate(const Rule& r, int start, const std::vector<ops::Op>& ops,
               std::map<int, std::optional<std::string>>& by_end) {
  using State = std::pair<size_t, int>;  // (element, how many ops it has taken)
  using Reason = std::optional<std::string>;
  const size_t m = r.pattern.size();
  std::map<State, Reason> cur{{{0, 0}, std::nullopt}};
  auto merge = [](std::map<State, Reason>& into, State st, const Reason& why) {
    auto [it, fresh] = into.emplace(st, why);
    if (!fresh && !why) it->second.reset();  // a clean path wins; else the first reason stays
  };
  for (int pos = start;; ++pos) {
    // Close over elements that may end here (taken at least their minimum): move on to the next one.
    for (auto it = cur.begin(); it != cur.end(); ++it) {
      auto [el, k] = it->first;
      if (el < m && k >= r.pattern[el].min) merge(cur, {el + 1, 0}, it->second);  // (el+1, 0) sorts after: visited
    }
    if (auto it = cur.find({m, 0}); it != cur.end()) {
      auto [e, fresh] = by_end.emplace(pos, it->second);
      if (!fresh && !it->second) e->second.reset();
    }
    if (pos >= static_cast<int>(ops.size())) break;
    std::map<State, Reason> next;
    for (const auto& [st, why] : cur) {
      auto [el, k] = st;
      if (el == m || k >= r.pattern[el].max || !accepts(r.pattern[el], ops[pos])) continue;
      merge(next, {el, k + 1}, why ? why : attr_mismatch(r.pattern[el], ops[pos]));
    }
    if (next.empty()) break;
    cur = std::move(next);
  }
}

// Which element took which ops of ops[begin, end): earlier elements take as many ops as they can (greedy), an
// attribute-clean assignment preferred. Only asked for rules with a class or repeated element (explain).
std::vector<fuser::ElemMatch> assign(const Rule& r, const std::vector<ops::Op>& ops, int begin, int end) {
  const size_t m = r.pattern.size();
  std::vector<size_t> taken;  // element of each op, in order
  std::set<std::tuple<size_t, int, int>> dead;
  std::function<bool(size_t, int, int, bool)> go = [&](size_t el, int k, int pos, bool clean) -> bool {
    if (el == m) return pos == end;
    if (dead.count({el, k, pos})) return false;
    const PatternElem& e = r.pattern[el];
    if (pos < end && k < e.max && accepts(e, ops[pos]) && (!clean || !attr_mismatch(e, ops[pos]))) {
      taken.push_back(el);
      if (go(el, k + 1, pos + 1, clean)) return true;
      taken.pop_back();
    }
    if (k >= e.min && go(el + 1, 0, pos, clean)) return true;
    dead.insert({el, k, pos});
    return false;
  };
  if (!go(0, 0, begin, true)) {
    dead.clear();
    taken.clear();
    if (!go(0, 0, begin, false)) return {};
  }
  std::vector<fuser::ElemMatch> out;
  for (size_t el = 0, i = 0; el < m; ++el) {
    size_t j = i;
    while (j < taken.size() && taken[j] == el) ++j;
    out.push_back({r.pattern[el].text, begin + static_cast<int>(i), begin + static_cast<int>(j)});
    i = j;
  }
  return out;
}

bool shows_match(const Rule& r) {
  return std::any_of(r.pattern.begin(), r.pattern.end(),
                     [](const PatternElem& e) { return !e.classes.empty() || e.repeats(); });
}

// Product of all dims but the last, or -1 if it does not fit in 64 bits.
int64_t rows_checked(const ops::Shape& s) {
  int64_t r = 1;
  for (size_t i = 0; i + 1 < s.size(); ++i)
    if (__builtin_mul_overflow(r, s[i], &r)) return -1;
  return r;
}

struct Tried {
  const Rule* rule = nullptr;
  int begin = 0, end = 0;
  std::string reason;  // empty: a candidate (passed every check)
  bool taken = false;
};

}  // namespace

std::optional<std::string> check_conditions(const rules::Conditions& c, const std::vector<ops::Op>& ops, int begin,
                                            int end, const PlanInputs& in) {
  if (!c.recipes.empty() && std::find(c.recipes.begin(), c.recipes.end(), in.recipe) == c.recipes.end())
    return fmt::format("condition recipe in [{}] failed: recipe = {}", join(c.recipes), in.recipe);
  if (!c.dtypes.empty() && std::find(c.dtypes.begin(), c.dtypes.end(), in.dtype) == c.dtypes.end())
    return fmt::format("condition dtype in [{}] failed: dtype = {}", join(c.dtypes), in.dtype);
  if ((c.min_arch || c.max_arch) && in.arch == 0)
    return fmt::format("arch unknown; the rule needs {}: plan with the GPU's arch",
                       c.min_arch ? fmt::format("min_arch {}", c.min_arch) : fmt::format("max_arch {}", c.max_arch));
  if (c.min_arch && in.arch < c.min_arch) return fmt::format("arch sm_{} < min_arch {}", in.arch, c.min_arch);
  if (c.max_arch && in.arch > c.max_arch) return fmt::format("arch sm_{} > max_arch {}", in.arch, c.max_arch);
  for (const auto& d : c.divisible) {
    int64_t value = d.dim == "rows"       ? rows_checked(ops[begin].in)
                    : d.dim == "out_cols" ? ops::cols_of(ops[end - 1].out)
                                          : ops::cols_of(ops[begin].in);
    if (value < 0) return fmt::format("condition {} % {} == 0 failed: {} overflows 64 bits", d.dim, d.multiple_of, d.dim);
    if (d.multiple_of > 0 && value % d.multiple_of != 0)
      return fmt::format("condition {} % {} == 0 failed: {} = {}", d.dim, d.multiple_of, d.dim, value);
  }
  if (c.training && *c.training != in.training)
    return *c.training ? std::string("condition training failed: planning for inference (no backward)")
                       : std::string("condition inference-only failed: planning for training");
  return std::nullopt;
}

namespace {

// owner[i]: the index in `fixed` of the joint group holding op i, or -1.
std::vector<int> joint_owners(const std::vector<Group>& fixed, int n) {
  std::vector<int> owner(n, -1);
  for (size_t g = 0; g < fixed.size(); ++g)
    if (fixed[g].joint)
      for (int i = std::max(0, fixed[g].begin); i < std::min(n, fixed[g].end); ++i) owner[i] = static_cast<int>(g);
  return owner;
}

// Every window of every rule of the pass, in rule load order and by start: each refused with its reason
// (attributes, overlap with a joint group, conditions, legality) or a candidate. At a start, a rule's
// windows are tried longest first, and the first candidate ends the search there.
std::vector<Tried> try_windows(rules::Pass pass, const std::vector<ops::Op>& ops, const std::vector<Group>& fixed,
                               const std::vector<int>& owner, const PlanInputs& in, const rules::RuleSet& rules,
                               const LegalityFn& legal) {
  const int n = static_cast<int>(ops.size());
  std::vector<const Rule*> pass_rules;
  for (const auto& r : rules.rules())
    if (r.pass == pass) pass_rules.push_back(&r);
  std::sort(pass_rules.begin(), pass_rules.end(), [](const Rule* a, const Rule* b) { return a->order < b->order; });

  std::vector<Tried> tried;
  for (const Rule* rule : pass_rules) {
    for (int s = 0; s < n; ++s) {
      std::map<int, std::optional<std::string>> by_end;
      enumerate(*rule, s, ops, by_end);
      for (auto it = by_end.rbegin(); it != by_end.rend(); ++it) {  // longest window first
        const int e = it->first;
        if (e <= s) continue;
        std::optional<std::string> why = it->second;
        for (int i = s; !why && i < e; ++i)
          if (owner[i] >= 0) {
            const Group& g = fixed[owner[i]];
            why = fmt::format("overlaps joint group {} at ops [{}, {})", g.rule, g.begin, g.end);
          }
        if (!why) why = check_conditions(rule->conditions, ops, s, e, in);
        if (!why && legal) why = legal(*rule, ops, s, e, pass);
        if (why && why->empty()) why = "refused by the legality predicate";
        tried.push_back({rule, s, e, why.value_or(""), false});
        if (!why) break;  // this rule's window at s; shorter ones are not needed
      }
    }
  }
  return tried;
}

// Conflicts: priority, then longer window, then earlier rule, then earlier start. Total, so deterministic.
// Marks the winners taken and gives each loser the winner it overlaps; returns the taker of each op (-1).
std::vector<int> resolve_conflicts(std::vector<Tried>& tried, int n) {
  std::vector<size_t> cands;
  for (size_t i = 0; i < tried.size(); ++i)
    if (tried[i].reason.empty()) cands.push_back(i);
  std::sort(cands.begin(), cands.end(), [&](size_t a, size_t b) {
    const Tried &x = tried[a], &y = tried[b];
    if (x.rule->priority != y.rule->priority) return x.rule->priority > y.rule->priority;
    if (x.end - x.begin != y.end - y.begin) return x.end - x.begin > y.end - y.begin;
    if (x.rule->order != y.rule->order) return x.rule->order < y.rule->order;
    return x.begin < y.begin;
  });
  std::vector<int> taken_by(n, -1);
  for (size_t c : cands) {
    Tried& t = tried[c];
    int blocker = -1;
    for (int i = t.begin; i < t.end && blocker < 0; ++i) blocker = taken_by[i];
    if (blocker < 0) {
      t.taken = true;
      for (int i = t.begin; i < t.end; ++i) taken_by[i] = static_cast<int>(c);
      continue;
    }
    const Tried& w = tried[blocker];
    if (w.rule->priority > t.rule->priority) {
      t.reason = fmt::format("overlaps higher-priority rule {} at ops [{}, {})", w.rule->name, w.begin, w.end);
    } else {
      // The winner sorted first: with equal priority it is longer, or from an earlier rule, or starts earlier.
      const char* why = w.end - w.begin > t.end - t.begin ? "longer window"
                        : w.rule->order != t.rule->order    ? "earlier rule"
                                                            : "earlier start";
      t.reason = fmt::format("overlaps rule {} at ops [{}, {}) (same priority, {})", w.rule->name, w.begin, w.end, why);
    }
  }
  return taken_by;
}

// Decisions read best in op order: by start, then rule order, then longest first.
void record_decisions(rules::Pass pass, const std::vector<Tried>& tried, const std::vector<ops::Op>& ops,
                      std::vector<Decision>& decisions) {
  const std::string pname = rules::pass_name(pass);
  std::vector<size_t> idx(tried.size());
  for (size_t i = 0; i < idx.size(); ++i) idx[i] = i;
  std::sort(idx.begin(), idx.end(), [&](size_t a, size_t b) {
    const Tried &x = tried[a], &y = tried[b];
    if (x.begin != y.begin) return x.begin < y.begin;
    if (x.rule->order != y.rule->order) return x.rule->order < y.rule->order;
    return x.end > y.end;
  });
  for (size_t i : idx) {
    const Tried& t = tried[i];
    decisions.push_back({pass, t.rule->name, t.begin, t.end, t.rule->priority, t.taken, t.reason,
                         shows_match(*t.rule) ? assign(*t.rule, ops, t.begin, t.end) : std::vector<fuser::ElemMatch>{}});
    log().debug("{} pass: rule {} (priority {}) at ops [{}, {}): {}", pname, t.rule->name, t.rule->priority, t.begin,
                t.end, t.taken ? std::string("taken") : "not taken: " + t.reason);
  }
}

// The pass's groups in op order: the joint groups kept as they are, the windows taken, every other op alone.
std::vector<Group> groups_in_order(rules::Pass pass, const std::vector<Group>& fixed, const std::vector<int>& owner,
                                   const std::vector<Tried>& tried, const std::vector<int>& taken_by, int n) {
  std::vector<Group> out;
  for (int i = 0; i < n;) {
    if (owner[i] >= 0) {
      const Group& g = fixed[owner[i]];
      out.push_back(g);
      i = std::max(g.end, i + 1);
    } else if (taken_by[i] >= 0) {
      const Tried& t = tried[taken_by[i]];
      out.push_back({t.begin, t.end, t.rule->name, t.rule->priority, t.rule->impl, pass == rules::Pass::joint});
      i = t.end;
    } else {
      out.push_back({i, i + 1, "", 0, rules::Impl{}, false});
      ++i;
    }
  }
  return out;
}

}  // namespace

std::vector<Group> run_pass(rules::Pass pass, const std::vector<ops::Op>& ops, const std::vector<Group>& fixed,
                            const PlanInputs& in, const rules::RuleSet& rules, const LegalityFn& legal,
                            std::vector<Decision>& decisions) {
  const int n = static_cast<int>(ops.size());
  const std::vector<int> owner = joint_owners(fixed, n);
  std::vector<Tried> tried = try_windows(pass, ops, fixed, owner, in, rules, legal);
  const std::vector<int> taken_by = resolve_conflicts(tried, n);
  record_decisions(pass, tried, ops, decisions);
  return groups_in_order(pass, fixed, owner, tried, taken_by, n);
}

}  // namespace jitfuse::fuser::detail
