// Implementations: the "how" of a rule, one class per kind (a cuBLASLt epilogue, a generated skeleton, a
// joint strategy), one file each. Each answers the loader (can a pattern ever run?), the fuser (can this
// window run?) with one predicate, and lowers a group into program steps, forward and backward.
#pragma once
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "exec/lower/builder.hpp"
#include "fuser/plan.hpp"
#include "rules/rule.hpp"

namespace jitfuse::exec {

// One op of a window as an implementation sees it: its kind and attributes. From a rule's pattern (the
// loader: attrs are the element's constraints, op is null) or from a sequence (attrs are the op's own).
struct OpUse {
  const ops::OpKind* kind = nullptr;
  const nlohmann::json* attrs = nullptr;
  const ops::Op* op = nullptr;  // concrete windows only: shapes
  const ops::Op* next = nullptr;  // concrete windows only: the op after this one in the sequence (null at its end)
  const std::string& name() const { return kind->name; }
  ops::Family family() const { return kind->family; }
  // The attribute's value (or the pattern's constraint on it); `otherwise` when unknown.
  std::string str(const char* attr, const std::string& otherwise = "") const;
};

class Implementation {
 public:
  virtual ~Implementation() = default;
  virtual rules::Impl::Kind kind() const = 0;
  // As rules spell it: the skeleton, epilogue or strategy ("elementwise", "GELU_AUX_BIAS", "relu_bitmask").
  virtual std::string name() const = 0;
  // One line for errors and docs: the windows it implements.
  virtual std::string covers_text() const = 0;
  // The one legality predicate: nullopt when it can run `window` in `pass` as `impl` says, else why not.
  virtual std::optional<std::string> check(const std::vector<OpUse>& window, const rules::Impl& impl,
                                           rules::Pass pass) const = 0;
  // Under an FP8 recipe, for a window with a linear that check() accepted: nullopt when lower() runs the
  // linear on FP8 GEMMs (its GEMM steps come from linear_forward / linear_backward with no epilogue but
  // BIAS), else why not. Default: not (the planner then gives the window to another rule or unfused).
  virtual std::optional<std::string> check_fp8(const std::vector<OpUse>& window, const rules::Impl& impl,
                                               rules::Pass pass) const;
  // Appends the steps of the builder's current group (direction: b.forward()).
  virtual void lower(Builder& b, const rules::Impl& impl) const = 0;
};

// The fuser's legality predicate: the implementation a rule names, asked about the window; under an FP8
// recipe (`fp8`), also whether it runs the window's linear on FP8 GEMMs (Implementation::check_fp8); under
// fp8_block (`block`), on block-scaled FP8 GEMMs, which take no epilogue (a C operand at most).
fuser::LegalityFn legality(bool fp8 = false, bool block = false);
std::optional<std::string> check_legal(const rules::Rule& rule, const std::vector<ops::Op>& ops, int b, int e,
                                       rules::Pass pass, bool fp8 = false, bool block = false);

// The implementation a rule's impl names, or null.
const Implementation* find_implementation(const rules::Impl& impl);
const Implementation& implementation_for(const rules::Impl& impl);  // throws (internal) if unknown
std::vector<const Implementation*> implementations();

// Window helpers shared by the implementations.
std::vector<OpUse> window_of(const std::vector<ops::Op>& ops, int b, int e);
// "epilogue X implements [a b c], the window starts with [...]" unless window[from..] starts with `kinds`.
std::optional<std::string> expect_kinds(const std::vector<OpUse>& window, size_t from,
                                        const std::vector<std::vector<std::string>>& kinds, const std::string& who);
// Is window[from..] a chain one generated kernel can run? Sets *skeleton.
std::optional<std::string> chain_problem(const std::vector<OpUse>& window, size_t from, codegen::Skeleton* skeleton);
// The i-th op (0-based) of `family` in the builder's group: operands by role, never by offset.
int role(const Builder& b, ops::Family family, int nth = 0);
// "12.3 MiB": the memory a joint strategy's explain text reports.
std::string mib(double bytes);

}  // namespace jitfuse::exec
