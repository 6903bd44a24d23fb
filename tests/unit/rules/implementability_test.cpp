// The rule loader asks "can this rule's implementation ever run?" through rules/implementable.hpp only: the
// library registers the implementations' answer, and the loader uses whichever answer is registered.
#include <catch2/catch.hpp>

#include "rules/implementable.hpp"

using namespace jitfuse::rules;

namespace {

// An elementwise rule over `pattern` (JSON array elements).
std::string rule_over(const std::string& pattern) {
  return R"J({"format": "jitfuse.rules/1", "rules": [{"name": "r", "math": "y = f(x)", "pass": "forward", "pattern": [)J" +
         pattern + R"J(], "impl": {"kind": "generated", "skeleton": "elementwise"}}]})J";
}
const std::string kRunnable = rule_over(R"("bias", "gelu")");
const std::string kNeverRuns = rule_over(R"("bias", "layernorm")");  // valid syntax; no skeleton holds it

// Registers an answer for the scope of a test, then puts the library's back.
class Swap {
 public:
  explicit Swap(const Implementability* answer) : previous_(set_implementability(answer)) {}
  ~Swap() { set_implementability(previous_); }
  Swap(const Swap&) = delete;
  Swap& operator=(const Swap&) = delete;

 private:
  const Implementability* previous_;
};

struct RefuseAll final : Implementability {
  mutable int asked = 0;
  std::optional<Refusal> refuse(const Impl& impl, const std::vector<PatternElem>& pattern, Pass pass,
                                const jitfuse::ops::Registry&) const override {
    ++asked;
    CHECK(impl.skeleton == "elementwise");
    CHECK(pattern.size() == 2);
    CHECK(pass == Pass::forward);
    return Refusal{"skeleton", "the stub refuses every rule"};
  }
};

}  // namespace

TEST_CASE("the library registers the implementations' answer to the rule loader", "[rules]") {
  REQUIRE(implementability() != nullptr);
  RuleSet rs;
  CHECK(rs.load_text(kRunnable, "t.json", "").empty());
  auto errs = rs.load_text(kNeverRuns, "u.json", "");
  REQUIRE(errs.size() == 1);
  CHECK_THAT(errs[0].message, Catch::Contains("elementwise cannot run any window this pattern matches"));
}

TEST_CASE("the rule loader asks whichever answer is registered", "[rules]") {
  RefuseAll stub;
  {
    Swap swap(&stub);
    RuleSet rs;
    auto errs = rs.load_text(kRunnable, "t.json", "");
    CHECK(stub.asked == 1);
    REQUIRE(errs.size() == 1);
    CHECK(errs[0].rule == "r");
    CHECK_THAT(errs[0].message, Catch::Contains("the stub refuses every rule"));
    CHECK(rs.rules().empty());
  }
  {
    // With none registered the loader checks syntax and ops only: a rule no implementation can run loads.
    Swap swap(nullptr);
    RuleSet rs;
    CHECK(rs.load_text(kNeverRuns, "t.json", "").empty());
    CHECK(rs.rules().size() == 1);
  }
  CHECK(implementability() != nullptr);
}
