// The implementations jitfuse knows (each file registers its own) and the questions asked of them: the
// fuser's legality predicate and the rule loader's "can this rule ever run?" (rules/implementable.hpp).
#include <algorithm>
#include <functional>
#include <map>

#include <fmt/format.h>

#include "common/error.hpp"
#include "exec/lower/impl/implementation.hpp"
#include "exec/lower/impl/registrar.hpp"
#include "rules/implementable.hpp"

namespace jitfuse::exec {
namespace {

using Table = std::map<std::pair<int, std::string>, std::unique_ptr<Implementation>>;
Table& table() {
  static Table t;
  return t;
}

}  // namespace

Registrar::Registrar(std::unique_ptr<Implementation> impl) {
  auto key = std::make_pair(static_cast<int>(impl->kind()), impl->name());
  table()[key] = std::move(impl);
}

const Implementation* find_implementation(const rules::Impl& impl) {
  const std::string& name = impl.kind == rules::Impl::Kind::generated  ? impl.skeleton
                            : impl.kind == rules::Impl::Kind::cublaslt ? impl.epilogue
                            : impl.kind == rules::Impl::Kind::joint    ? impl.strategy
                                                                       : std::string("unfused");
  auto it = table().find({static_cast<int>(impl.kind), name});
  return it == table().end() ? nullptr : it->second.get();
}

const Implementation& implementation_for(const rules::Impl& impl) {
  if (const auto* i = find_implementation(impl)) return *i;
  fail(Status::internal, "no implementation for impl '{}{}{}'", impl.skeleton, impl.epilogue, impl.strategy);
}

std::vector<const Implementation*> implementations() {
  std::vector<const Implementation*> out;
  for (const auto& [k, v] : table()) out.push_back(v.get());
  return out;
}

namespace {

// The shapes FP8 GEMMs take (cuda::Fp8Gemm; check_fp8_linear refuses the others at lowering): cuBLASLt's
// FP8 kernels need 16-byte aligned leading dimensions of the E4M3/E5M2 operands, so in_features and
// out_features are multiples of 16, and so are the rows that the wgrad contracts over (the backward pass
// exists only in training; a forward is not told whether it trains, and its lowering says it then).
// The first size of a window's linears that is not a multiple of `multiple`: in_features, out_features and,
// in the backward (training), the rows the wgrad contracts over.
struct BadDim {
  const ops::Op* op;
  const char* name;
  int64_t value;
  bool rows;
};
std::optional<BadDim> first_bad_dim(const std::vector<OpUse>& window, rules::Pass pass, int64_t multiple) {
  for (const auto& u : window) {
    if (u.family() != ops::Family::linear || !u.op) continue;
    const BadDim dims[] = {{u.op, "in_features", ops::cols_of(u.op->in), false},
                           {u.op, "out_features", ops::cols_of(u.op->out), false},
                           {u.op, "rows", ops::rows_of(u.op->in), true}};
    for (int i = 0; i < (pass == rules::Pass::backward ? 3 : 2); ++i)
      if (dims[i].value % multiple != 0) return dims[i];
  }
  return std::nullopt;
}

std::optional<std::string> fp8_shape_problem(const std::vector<OpUse>& window, rules::Pass pass) {
  const auto d = first_bad_dim(window, pass, 16);
  if (!d) return std::nullopt;
  return fmt::format("FP8 GEMMs need {0} to be a multiple of 16 (cuBLASLt's FP8 kernels need 16-byte aligned "
                     "leading dimensions{1}): {2} has {0} = {3}", d->name,
                     d->rows ? "; the wgrad GEMM contracts over the rows" : "", d->op->label(), d->value);
}

// fp8_block: its GEMMs take no epilogue (cuda::Fp8Scaling), so of the implementations that lower a linear
// under FP8 only those without one: a C operand accumulated with beta = 1 (RESIDUAL without a bias, and
// DGRAD_ACCUMULATE), and fp8_cast where the forward GEMM has nothing after it but a residual add as its C
// (the chain, elementwise, gated or a norm, fused into the block-scaled cast). Whole 1x128 blocks along each
// K, 128x128 weight blocks.
std::optional<std::string> block_problem(const Implementation& impl, const std::vector<OpUse>& window,
                                         rules::Pass pass) {
  const bool bias = std::any_of(window.begin(), window.end(), [](const OpUse& u) { return u.family() == ops::Family::bias; });
  if (impl.name() == "fp8_cast") {
    // The block-scaled cast takes the elementwise chain that produces the operand: the ops before the
    // linear (forward; nothing after it: no epilogue), or the backward of the ops after it.
    const auto lin = std::find_if(window.begin(), window.end(), [](const OpUse& u) { return u.family() == ops::Family::linear; });
    // A residual add right after it is the GEMM's C (beta = 1), as the RESIDUAL rule does.
    const bool residual_c = lin + 2 == window.end() && (lin + 1)->family() == ops::Family::add_extra_input;
    if (pass == rules::Pass::forward && lin + 1 != window.end() && !residual_c)
      return fmt::format("under fp8_block a linear's GEMM takes no epilogue, so fp8_cast's forward window ends with "
                         "the linear or a residual add (the GEMM's C): {} after it runs as its own kernel",
                         (lin + 1)->name());
    // What the cast kernel can run before the linear: a norm right before it (its statistics kernel runs
    // the ops before the norm; the cast normalises), or a gated op whose chain reads no other tensor.
    const bool gated = std::any_of(window.begin(), lin, [](const OpUse& u) { return u.family() == ops::Family::gated; });
    for (auto it = window.begin(); it != lin; ++it) {
      if (it->family() == ops::Family::norm && it + 1 != lin)
        return fmt::format("under fp8_block a norm fused into the block cast must come right before the linear "
                           "(the cast normalises and quantises; {} after the norm has no place in it)",
                           (it + 1)->name());
      if (gated && it->family() == ops::Family::add_extra_input)
        return std::string("under fp8_block a gated op's forward in the block cast reads its input's two halves and "
                           "nothing else: an add_extra_input in the same chain runs as its own kernel");
    }
  } else if (impl.name() != "unfused" && impl.name() != "DGRAD_ACCUMULATE" && !(impl.name() == "RESIDUAL" && !bias)) {
    return fmt::format("under fp8_block a linear runs on block-scaled FP8 GEMMs, which take no epilogue here; {} "
                       "does not lower to them (the unfused linear and a separate kernel for what follows do)",
                       impl.name());
  }
  const auto d = first_bad_dim(window, pass, 128);
  if (!d) return std::nullopt;
  return fmt::format("fp8_block needs {0} to be a multiple of 128 (whole 1x128 blocks along each GEMM's K, "
                     "128x128 weight blocks): {1} has {0} = {2}", d->name, d->op->label(), d->value);
}

}  // namespace

std::optional<std::string> check_legal(const rules::Rule& rule, const std::vector<ops::Op>& ops, int b, int e,
                                       rules::Pass pass, bool fp8, bool block) {
  const Implementation* impl = find_implementation(rule.impl);
  if (!impl) return "no implementation named by the rule";
  const auto window = window_of(ops, b, e);
  if (auto why = impl->check(window, rule.impl, pass)) return why;
  for (const auto& u : window)
    if (u.family() == ops::Family::linear && u.op && u.op->split_weight())
      return fmt::format("{} runs as two GEMMs over its outputs' halves (split_weight), with no epilogue; {} does not "
                         "lower to them (the unfused linear does)", u.op->label(), impl->name());
  const bool linear = std::any_of(window.begin(), window.end(), [](const OpUse& u) { return u.family() == ops::Family::linear; });
  if (!fp8 || !linear) return std::nullopt;
  if (auto why = impl->check_fp8(window, rule.impl, pass)) return why;
  if (block) return block_problem(*impl, window, pass);
  return fp8_shape_problem(window, pass);
}

fuser::LegalityFn legality(bool fp8, bool block) {
  return [fp8, block](const rules::Rule& rule, const std::vector<ops::Op>& ops, int b, int e, rules::Pass pass) {
    return check_legal(rule, ops, b, e, pass, fp8 || block, block);
  };
}

std::optional<std::string> Implementation::check_fp8(const std::vector<OpUse>&, const rules::Impl& impl,
                                                     rules::Pass) const {
  const char* what = impl.kind == rules::Impl::Kind::cublaslt ? "cuBLASLt epilogue"
                     : impl.kind == rules::Impl::Kind::joint  ? "joint strategy"
                                                              : "skeleton";
  return fmt::format("under an FP8 recipe a linear runs on FP8 GEMMs (E4M3/E5M2 operands, a BIAS epilogue at most), "
                     "which {} {} does not lower to; the fp8 rules or the unfused linear take it", what, name());
}

namespace {

const std::string& impl_name(const rules::Impl& impl) {
  return impl.kind == rules::Impl::Kind::generated  ? impl.skeleton
         : impl.kind == rules::Impl::Kind::cublaslt ? impl.epilogue
                                                    : impl.strategy;
}

// A rule naming an implementation jitfuse does not have: the ones of its kind it does have.
rules::Refusal unknown_implementation(const rules::Impl& impl, const char* field) {
  std::string known;
  for (const auto* i : implementations())
    if (i->kind() == impl.kind) known += (known.empty() ? "" : ", ") + i->name();
  const char* what = impl.kind == rules::Impl::Kind::generated  ? "skeleton"
                     : impl.kind == rules::Impl::Kind::cublaslt ? "cuBLASLt epilogue"
                                                                : "joint strategy";
  return rules::Refusal{field, fmt::format("unknown {} '{}'; known: {}", what, impl_name(impl), known)};
}

// The rule loader's question (rules/implementable.hpp), answered by the implementations registered above.
class ImplementationsAnswer final : public rules::Implementability {
 public:
  // Every expansion of the pattern (each optional element present or not, each alternative kind, each
  // class member, repeated elements at representative counts), until one can be implemented; the reason
  // of the first one otherwise.
  std::optional<rules::Refusal> refuse(const rules::Impl& impl, const std::vector<rules::PatternElem>& pattern,
                                       rules::Pass pass, const ops::Registry& reg) const override {
    const Implementation* im = find_implementation(impl);
    const char* field = impl.kind == rules::Impl::Kind::generated  ? "skeleton"
                        : impl.kind == rules::Impl::Kind::cublaslt ? "epilogue"
                                                                   : "strategy";
    if (!im) return unknown_implementation(impl, field);
    std::vector<OpUse> window;
    std::optional<std::string> first;
    size_t leaves = 0;
    constexpr size_t kMaxExpansions = 4096;
    std::function<bool(size_t)> expand = [&](size_t i) -> bool {
      if (i == pattern.size()) {
        ++leaves;
        if (window.empty()) return false;
        auto why = im->check(window, impl, pass);
        if (!why) return true;
        if (!first) first = why;
        return false;
      }
      if (leaves >= kMaxExpansions) return false;
      const auto& el = pattern[i];
      // A repeated element is checked at representative counts (its minimum, one more, and two), not at
      // all kMaxRepeat^kinds of them: the skeletons' predicates look at which kinds occur and in what
      // order, which those counts already show.
      std::vector<int> counts;
      for (int c : {el.min, el.min + 1, 2})
        if (c <= el.max && std::find(counts.begin(), counts.end(), c) == counts.end()) counts.push_back(c);
      std::function<bool(int)> take = [&](int left) -> bool {
        if (left == 0) return expand(i + 1);
        for (const auto& k : el.kinds) {
          const ops::OpKind* kind = reg.find(k);
          if (!kind) continue;
          window.push_back({kind, &el.attrs, nullptr});
          bool ok = take(left - 1);
          window.pop_back();
          if (ok) return true;
          if (leaves >= kMaxExpansions) return false;
        }
        return false;
      };
      for (int c : counts)
        if (take(c)) return true;
      return false;
    };
    if (expand(0)) return std::nullopt;
    std::string why = first ? *first : "the pattern matches no op kind";
    if (leaves >= kMaxExpansions)
      why += fmt::format(" (checked the first {} expansions of the pattern; split the rule)", kMaxExpansions);
    // The covered windows once: a predicate's reason may already be exactly that.
    if (why.find(im->covers_text()) == std::string::npos) why += "; it implements " + im->covers_text();
    return rules::Refusal{field, im->name() + " cannot run any window this pattern matches: " + why};
  }
};

// Registered before main, so every RuleSet the library loads asks the implementations.
const ImplementationsAnswer kAnswer;
[[maybe_unused]] const bool kAnswerRegistered = (rules::set_implementability(&kAnswer), true);

}  // namespace

}  // namespace jitfuse::exec
